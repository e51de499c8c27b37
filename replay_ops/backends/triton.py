"""The `triton` backend: the launchers of `replay_ops.triton_kernels` (gate.py, permute.py,
unpermute.py), which live next to their kernels.

CUDA tensors run compiled kernels. CPU tensors run only under TRITON_INTERPRET=1 (Triton's
numpy interpreter), which is how CI checks these kernels on a machine without a GPU.
No launcher reads device memory on the host: the whole path is sync-free.
"""
from __future__ import annotations

import os
import re

import torch

from ..triton_kernels import gate as _gate
from ..triton_kernels import gate_dense as _gate_dense
from ..triton_kernels.gate import MAX_TOPK
from ..triton_kernels.permute import permute_bwd, permute_fwd
from ..triton_kernels.unpermute import unpermute_bwd, unpermute_fwd
from .protocol import FUSED_OPS, YES, Support

NAME = "triton"
__all__ = ["NAME", "available", "supports", "describe", "gate_fwd", "gate_bwd", "permute_fwd",
           "permute_bwd", "unpermute_fwd", "unpermute_bwd", "gate_dense_fwd", "gate_dense_bwd",
           "permute_probs_fwd", "permute_probs_bwd"]


# The oldest Triton the kernels are checked with (pyproject.toml's [tool.replay_ops] triton;
# `make test` compiles them and runs their tests under it and under the installed Triton).
MIN_TRITON = (3, 6)


def _triton_too_old() -> str | None:
    import triton

    parts = [int(p) for p in re.findall(r"\d+", triton.__version__)[:2]]
    if tuple(parts) < MIN_TRITON:
        return (f"Triton {triton.__version__} is older than "
                f"{'.'.join(map(str, MIN_TRITON))}, the oldest this package supports")
    return None


def available(device_type: str) -> Support:
    old = _triton_too_old()
    if old:
        return Support(False, old)
    if device_type == "cuda":
        return YES if torch.cuda.is_available() else Support(False, "no CUDA device is present")
    if device_type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            return YES
        return Support(False, "Triton runs on CPU tensors only under TRITON_INTERPRET=1")
    return Support(False, f"no Triton kernels for {device_type} tensors")


def supports(op, device_type, shape, dtype) -> Support:
    if op in FUSED_OPS:
        return Support(False, "the Triton kernels have no fused gate + permute yet (the op "
                              "runs the gate and the permute kernels in turn)")
    # the gate features (OpShape.features: the model's own selection of flagged rows, the
    # agreement outputs) are implemented in the gate kernels (triton_kernels/select.py)
    if op in ("gate_fwd", "gate_bwd", "gate_dense_fwd", "gate_dense_bwd",
              "permute_probs_bwd") and shape.K > MAX_TOPK:
        return Support(False, f"K={shape.K} slots is above the Triton gate kernels' limit "
                              f"of {MAX_TOPK} (their per-row sums take at most {MAX_TOPK})")
    return YES


def describe() -> dict:
    import triton

    return {"version": triton.__version__,
            "interpreter": os.environ.get("TRITON_INTERPRET", "0") == "1",
            "limits": {"triton_gate_max_top_k": MAX_TOPK}}


# The gate launchers take the options flat (tools/triton_compile_check.py and the tests
# call them so); the backend's gate kernels take the options value.
def gate_fwd(logits, expert_indices, replay_mask, opts):
    return _gate.gate_fwd(logits, expert_indices, opts.score_func, opts.normalize,
                          opts.scaling_factor, opts.align, replay_mask=replay_mask,
                          pad_select=opts.padding == "select", selection=opts.selection,
                          return_agreement=bool(opts.return_agreement),
                          weights_dtype=opts.weights_dtype)


def gate_bwd(grad_weights, logits, idx, opts, grad_set_logprob=None):
    return _gate.gate_bwd(grad_weights, logits, idx, opts.score_func, opts.normalize,
                          opts.scaling_factor, grad_set_logprob)


# Dense mode (triton_kernels/gate_dense.py).
from ..triton_kernels.gate_dense import permute_probs_bwd, permute_probs_fwd  # noqa: E402,F401


def gate_dense_fwd(logits, expert_indices, replay_mask, fallback, opts):
    return _gate_dense.gate_dense_fwd(
        logits, expert_indices, replay_mask, fallback, opts.score_func, opts.normalize,
        opts.scaling_factor, opts.padding, opts.ep_size, opts.spread_offset,
        opts.underflow_guard, opts.align, opts.with_plan, selection=opts.selection,
        return_agreement=bool(opts.return_agreement))


def gate_dense_bwd(grad_probs, logits, idx, opts, grad_set_logprob=None):
    return _gate_dense.gate_dense_bwd(grad_probs, logits, idx, opts.score_func,
                                      opts.normalize, opts.scaling_factor, grad_set_logprob)
