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
zeroed by its caller) for device "cpu".

DeepSeek-V2/V3's attention picks its forward method per attention backend
(sglang/srt/models/deepseek_common/attention_backend_handler.py); `torch_native` has no
entry there, so it gets the Triton handler (`get_handler`, :54), which sends a prefill
without a cached prefix to the MHA path (`handle_attention_triton`). That path runs
`torch_native`'s attention with the MLA latent cache's shapes and fails ("Expected size for
first two dimensions of batch2 tensor to be: [2, 16] but got: [2, 24]",
torch_native_backend.py:160). When that module is imported, this hook gives every backend
without its own handler (Triton's included: the CPU engine never runs Triton attention)
SGLang's own absorbed-MLA dispatch (`_dispatch_mla_subtype`), the path that SGLang's
decode steps take anyway.

Nothing is imported before SGLang imports it.
"""
import importlib.abc
import importlib.util
import os
import sys

_POOL = "sglang.srt.mem_cache.pool_host.common"
_DEEPSEEK_ATTN = "sglang.srt.models.deepseek_common.attention_backend_handler"


def _plain_cpu_alloc(dims, dtype, device, pin_memory=False, allocator=None,
                     registration_granularity_bytes=None):
    import torch

    return torch.zeros(dims, dtype=dtype, device="cpu")


def _patch(module) -> None:
    if module.__name__ == _POOL:
        module.ALLOC_MEMORY_FUNCS["cpu"] = _plain_cpu_alloc
    elif module.__name__ == _DEEPSEEK_ATTN:
        registry, dispatch = module.AttentionBackendRegistry, module._dispatch_mla_subtype
        handlers = {k: v for k, v in registry._handlers.items() if k != "triton"}

        def get_handler(backend_name):
            return handlers.get(backend_name, dispatch)

        registry.get_handler = staticmethod(get_handler)


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
        if name not in (_POOL, _DEEPSEEK_ATTN):
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
