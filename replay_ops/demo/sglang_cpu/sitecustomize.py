"""Start-up hook for SGLang's CPU engine processes on a machine without CUDA.

This folder is put on PYTHONPATH only for the SGLang processes that
`replay_ops.demo.sglang_engine` launches on a CPU (the demo's `--engine sglang` and the
engine tests); replay_ops never imports it, and a GPU machine's SGLang runs without it.
With it come `sgl_kernel/` (a stand-in for the CUDA-only kernel package) and this hook.

`--enable-return-routed-experts` keeps the routing's host buffer
(sglang/srt/state_capturer/base.py `BaseHostCache`) in pinned memory, registered through a
CUDA call that fails without a driver ("Found no NVIDIA driver"). The buffer is only read
and written by the CPU here: when `sglang.srt.mem_cache.pool_host.common` is imported, this
hook gives its allocator table a plain CPU allocator (zero-filled, as the pinned one is
zeroed by its caller) for device "cpu". Nothing is imported before SGLang imports it.
"""
import importlib.abc
import importlib.util
import os
import sys

_TARGET = "sglang.srt.mem_cache.pool_host.common"


def _plain_cpu_alloc(dims, dtype, device, pin_memory=False, allocator=None,
                     registration_granularity_bytes=None):
    import torch

    return torch.zeros(dims, dtype=dtype, device="cpu")


def _patch(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _plain_cpu_alloc


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and not any(
        isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
