"""The `native` backend: the C++ CPU kernels and, when compiled in, the CUDA kernels of
`replay_ops._C` (sources in csrc/, see docs/native.md).

The extension registers internal ops `torch.ops.replay.native_*`; this module adapts them
to the backend interface of `_torch_backend.py`. Importing it raises ImportError when the
extension was not built, and the backend registry then moves on to the next backend.
"""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (registers torch.ops.replay.native_*)

NAME = "native"
WITH_CUDA = bool(getattr(_C, "WITH_CUDA", 0))
_ops = torch.ops.replay


def cpu_isa() -> str:
    """The x86 vector ISA of the CPU row kernels ("baseline", "avx2" or "avx512"): the best
    the CPU supports, or the cap set by REPLAY_OPS_CPU_ISA. Every ISA gives the same bits."""
    return _ops.native_cpu_isa("")


def available(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    if device_type == "cuda":
        return WITH_CUDA and torch.cuda.is_available()
    return False


# Limits of the CUDA gate kernels (shared-memory histograms; one lane per slot in the
# backward), mirrored from csrc/cuda/replay_cuda.h. Larger CUDA problems run on the next
# backend in the CUDA order (Triton, else eager PyTorch).
CUDA_MAX_EXPERTS = 1024
CUDA_MAX_TOPK = 32


def _cuda_fallback():
    from . import backend

    for name in ("triton", "torch"):
        mod = backend._load(name)
        if mod is not None and mod.available("cuda"):
            return mod
    return backend._load("torch")


def gate_fwd(logits, expert_indices, score_func, normalize, scaling_factor, align):
    if logits.is_cuda and logits.shape[1] > CUDA_MAX_EXPERTS:
        return _cuda_fallback().gate_fwd(
            logits, expert_indices, score_func, normalize, scaling_factor, align
        )
    return tuple(
        _ops.native_gate_fwd(
            logits, expert_indices, score_func, bool(normalize), float(scaling_factor), int(align)
        )
    )


def gate_bwd(grad_weights, logits, idx, score_func, normalize, scaling_factor):
    if logits.is_cuda and (logits.shape[1] > CUDA_MAX_EXPERTS or idx.shape[1] > CUDA_MAX_TOPK):
        return _cuda_fallback().gate_bwd(
            grad_weights, logits, idx, score_func, normalize, scaling_factor
        )
    return _ops.native_gate_bwd(
        grad_weights, logits, idx, score_func, bool(normalize), float(scaling_factor)
    )


def permute_fwd(hidden, sorted_slots, row_id_map, num_rows):
    return _ops.native_permute_fwd(hidden, sorted_slots, row_id_map, int(num_rows))


def permute_bwd(grad_out, row_id_map):
    return _ops.native_permute_bwd(grad_out, row_id_map)


def unpermute_fwd(expert_out, row_id_map, weights):
    return _ops.native_unpermute_fwd(expert_out, row_id_map, weights)


def unpermute_bwd(grad_out, expert_out, row_id_map, sorted_slots, weights):
    return tuple(
        _ops.native_unpermute_bwd(grad_out, expert_out, row_id_map, sorted_slots, weights)
    )
