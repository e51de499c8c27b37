"""Start-up hook for vLLM processes on a CPU machine without Triton's CPU backend.

This folder is put on PYTHONPATH only for the vLLM processes that `replay_ops.demo.vllm_engine`
launches on a CPU (the demo's `--engine vllm` and the engine tests); replay_ops never imports
it, and a GPU machine's vLLM runs without it.

vLLM 0.32's CPU build returns routed experts only through Model Runner V2, which needs
Triton, and it accepts Triton on a CPU only when `triton.backends` has a "cpu" entry
(vllm/triton_utils/importing.py). triton-cpu is not on the package index. This hook
registers a stand-in "cpu" entry whose driver is never active; with TRITON_INTERPRET=1 (set
by the launcher in these processes' environment) Model Runner V2's Triton kernels run in
Triton's interpreter on CPU tensors. That is slow (generation measured 3.6x slower than vLLM
without routing, on a 3-layer model) but exact, and it is for CPU machines only.
"""
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton.backends as _backends
    except Exception:  # no Triton: vLLM reports what it needs
        _backends = None
    if _backends is not None and "cpu" not in _backends.backends:

        class _InactiveCpuDriver:
            """A driver that is never active: Triton never selects it."""

            @staticmethod
            def is_active():
                return False

        _backends.backends["cpu"] = _backends.Backend(compiler=None, driver=_InactiveCpuDriver)
