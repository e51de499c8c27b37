"""Op registration: `torch.ops.replay.*`, with fake kernels and autograd.

Forward ops:   replay::gate, replay::permute, replay::unpermute
Backward ops:  replay::gate_backward, replay::permute_backward, replay::unpermute_backward

Each op runs the backend that `backends.select` picks for the op, the input's device and
sizes. The ops are opaque to `torch.compile` (their fake kernels give static output shapes),
so a compiled graph holds them without breaks. Shape/dtype/device checks run in both the
real and the fake kernels; data checks run in the real kernel when `validate` is True.
The backward ops have no autograd of their own (no double backward).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._validate import (
    PLAN_DTYPE,
    check_gate_inputs,
    check_hidden,
    check_index_values,
    check_plan_tensors,
)
from .backends import OpShape, select
from .fallback import resolve_indices
from .plan import plan_capacity

LIB = "replay"


# ----------------------------------------------------------------------------- gate
@torch.library.custom_op(f"{LIB}::gate", mutates_args=())
def gate(
    logits: Tensor,
    expert_indices: Tensor,
    replay_mask: Tensor | None,
    score_func: str,
    normalize: bool,
    scaling_factor: float,
    align: int,
    validate: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(weights, expert_indices int32, tokens_per_expert, expert_offsets, row_id_map,
    sorted_slots); see replay_ops.gate."""
    check_gate_inputs(logits, expert_indices, replay_mask, score_func, align)
    if validate:
        check_index_values(expert_indices, logits.shape[1], replay_mask)
    if replay_mask is not None:
        expert_indices = resolve_indices(
            logits.detach(), expert_indices, replay_mask, score_func, sync_free=not validate
        )
    (T, E), K = logits.shape, expert_indices.shape[1]
    impl = select("gate_fwd", logits.device.type, OpShape(T, E, K), logits.dtype, backend)
    return impl.gate_fwd(logits, expert_indices, score_func, normalize, scaling_factor, align)


@gate.register_fake
def _(logits, expert_indices, replay_mask, score_func, normalize, scaling_factor, align,
      validate, backend):
    check_gate_inputs(logits, expert_indices, replay_mask, score_func, align)
    T, E = logits.shape
    K = expert_indices.shape[1]
    i32 = dict(dtype=PLAN_DTYPE, device=logits.device)
    return (
        logits.new_empty(T, K),
        torch.empty(T, K, **i32),
        torch.empty(E, **i32),
        torch.empty(E + 1, **i32),
        torch.empty(T, K, **i32),
        torch.empty(plan_capacity(T, K, E, align), **i32),
    )


def _gate_setup(ctx, inputs, output):
    logits, _, _, score_func, normalize, scaling_factor, _, _, backend = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.opts = (score_func, normalize, scaling_factor, backend)


def _gate_backward(ctx, grad_weights, *_int_grads):
    logits, idx = ctx.saved_tensors
    score_func, normalize, scaling_factor, backend = ctx.opts
    grad = None
    if ctx.needs_input_grad[0]:
        grad = gate_backward(
            grad_weights.contiguous(), logits, idx, score_func, normalize, scaling_factor, backend
        )
    return grad, None, None, None, None, None, None, None, None


gate.register_autograd(_gate_backward, setup_context=_gate_setup)


@torch.library.custom_op(f"{LIB}::gate_backward", mutates_args=())
def gate_backward(
    grad_weights: Tensor,
    logits: Tensor,
    expert_indices: Tensor,
    score_func: str,
    normalize: bool,
    scaling_factor: float,
    backend: str,
) -> Tensor:
    """Dense [T, E] gradient of the logits, given the gradient of the [T, K] weights."""
    (T, E), K = logits.shape, expert_indices.shape[1]
    impl = select("gate_bwd", logits.device.type, OpShape(T, E, K), logits.dtype, backend)
    return impl.gate_bwd(grad_weights, logits, expert_indices, score_func, normalize,
                         scaling_factor)


@gate_backward.register_fake
def _(grad_weights, logits, expert_indices, score_func, normalize, scaling_factor, backend):
    return torch.empty_like(logits)


# -------------------------------------------------------------------------- permute
def _row_shape(row_id_map: Tensor, rows: Tensor) -> OpShape:
    return OpShape(row_id_map.shape[0], 0, row_id_map.shape[1], rows.shape[1])



@torch.library.custom_op(f"{LIB}::permute", mutates_args=())
def permute(
    hidden: Tensor, sorted_slots: Tensor, row_id_map: Tensor, num_rows: int, backend: str
) -> Tensor:
    """[num_rows, H]: row r = hidden[sorted_slots[r] // K], zero for padding rows."""
    _check_permute(hidden, sorted_slots, row_id_map, num_rows)
    impl = select("permute_fwd", hidden.device.type, _row_shape(row_id_map, hidden),
                  hidden.dtype, backend)
    return impl.permute_fwd(hidden, sorted_slots, row_id_map, num_rows)


def _check_permute(hidden, sorted_slots, row_id_map, num_rows):
    check_plan_tensors("permute", row_id_map, sorted_slots)
    check_hidden("permute", "hidden", hidden, row_id_map.shape[0], "T tokens", row_id_map.device)
    if num_rows < 0:
        raise ValueError(f"replay_ops.permute: num_rows must be >= 0, got {num_rows}")


@permute.register_fake
def _(hidden, sorted_slots, row_id_map, num_rows, backend):
    _check_permute(hidden, sorted_slots, row_id_map, num_rows)
    return hidden.new_empty(num_rows, hidden.shape[1])


def _permute_setup(ctx, inputs, output):
    _, _, row_id_map, _, backend = inputs
    ctx.save_for_backward(row_id_map)
    ctx.backend = backend


def _permute_backward(ctx, grad_out):
    (row_id_map,) = ctx.saved_tensors
    grad = None
    if ctx.needs_input_grad[0]:
        grad = permute_backward(grad_out.contiguous(), row_id_map, ctx.backend)
    return grad, None, None, None, None


permute.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op(f"{LIB}::permute_backward", mutates_args=())
def permute_backward(grad_out: Tensor, row_id_map: Tensor, backend: str) -> Tensor:
    """[T, H]: grad_hidden[t] = sum_k grad_out[row_id_map[t, k]] (a gather-sum, no atomics)."""
    impl = select("permute_bwd", grad_out.device.type, _row_shape(row_id_map, grad_out),
                  grad_out.dtype, backend)
    return impl.permute_bwd(grad_out, row_id_map)


@permute_backward.register_fake
def _(grad_out, row_id_map, backend):
    return grad_out.new_empty(row_id_map.shape[0], grad_out.shape[1])


# ------------------------------------------------------------------------ unpermute
@torch.library.custom_op(f"{LIB}::unpermute", mutates_args=())
def unpermute(
    expert_out: Tensor, row_id_map: Tensor, sorted_slots: Tensor, weights: Tensor, backend: str
) -> Tensor:
    """[T, H]: out[t] = sum_k weights[t, k] * expert_out[row_id_map[t, k]] (fp32 accumulation,
    column order)."""
    _check_unpermute(expert_out, row_id_map, sorted_slots, weights)
    impl = select("unpermute_fwd", expert_out.device.type, _row_shape(row_id_map, expert_out),
                  expert_out.dtype, backend)
    return impl.unpermute_fwd(expert_out, row_id_map, weights)


def _check_unpermute(expert_out, row_id_map, sorted_slots, weights):
    check_plan_tensors("unpermute", row_id_map, sorted_slots)
    check_hidden("unpermute", "expert_out", expert_out, None, "rows", row_id_map.device)
    if weights.shape != row_id_map.shape or not weights.is_floating_point():
        raise ValueError(
            f"replay_ops.unpermute: weights must be a float [T, K] tensor like row_id_map "
            f"{tuple(row_id_map.shape)}, got {weights.dtype} {tuple(weights.shape)}"
        )
    if weights.device != row_id_map.device:
        raise ValueError(
            f"replay_ops.unpermute: tensors on different devices: weights on {weights.device}, "
            f"row_id_map on {row_id_map.device}"
        )


@unpermute.register_fake
def _(expert_out, row_id_map, sorted_slots, weights, backend):
    _check_unpermute(expert_out, row_id_map, sorted_slots, weights)
    return expert_out.new_empty(row_id_map.shape[0], expert_out.shape[1])


def _unpermute_setup(ctx, inputs, output):
    expert_out, row_id_map, sorted_slots, weights, backend = inputs
    ctx.save_for_backward(expert_out, row_id_map, sorted_slots, weights)
    ctx.backend = backend


def _unpermute_backward(ctx, grad_out):
    expert_out, row_id_map, sorted_slots, weights = ctx.saved_tensors
    grad_x, grad_w = unpermute_backward(
        grad_out.contiguous(), expert_out, row_id_map, sorted_slots, weights, ctx.backend
    )
    return (
        grad_x if ctx.needs_input_grad[0] else None,
        None,
        None,
        grad_w if ctx.needs_input_grad[3] else None,
        None,
    )


unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


@torch.library.custom_op(f"{LIB}::unpermute_backward", mutates_args=())
def unpermute_backward(
    grad_out: Tensor,
    expert_out: Tensor,
    row_id_map: Tensor,
    sorted_slots: Tensor,
    weights: Tensor,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """(grad_expert_out [R, H], grad_weights [T, K]); both are gathers, no atomics."""
    impl = select("unpermute_bwd", grad_out.device.type, _row_shape(row_id_map, expert_out),
                  expert_out.dtype, backend)
    return impl.unpermute_bwd(grad_out, expert_out, row_id_map, sorted_slots, weights)


@unpermute_backward.register_fake
def _(grad_out, expert_out, row_id_map, sorted_slots, weights, backend):
    return torch.empty_like(expert_out), torch.empty_like(weights)
