"""Op registration: `torch.ops.replay.*`, with fake kernels and autograd.

Forward ops:   replay::gate, replay::permute, replay::unpermute, replay::gate_dense,
               replay::permute_probs, replay::gate_permute
Backward ops:  replay::gate_backward, replay::permute_backward, replay::unpermute_backward,
               replay::gate_dense_backward, replay::permute_probs_backward,
               replay::gate_permute_backward

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
    check_dense_inputs,
    check_gate_inputs,
    check_gate_padding,
    check_hidden,
    check_index_values,
    check_plan_tensors,
    check_row_flags,
    check_selection,
    check_weights_dtype,
)
from .backends import OpShape, select
from .backends.protocol import AGREEMENT, SELECT
from .options import BACKWARD_FIELDS, DENSE_FIELDS, GATE_FIELDS, GateOptions
from .plan import plan_capacity
from .scores import compute_dtype

LIB = "replay"
# Every op this module registers as torch.ops.replay.<name>: the one list the package, its
# backends' docs and the tests name them from (a new op is added here first).
FORWARD_OPS = ("gate", "permute", "unpermute", "gate_dense", "permute_probs", "gate_permute")
OPS = FORWARD_OPS + tuple(f"{name}_backward" for name in FORWARD_OPS)


# ----------------------------------------------------------------------------- gate
def _features(replay_mask, padding: str, return_agreement: bool) -> frozenset:
    """What a gate call needs beyond the plain replayed gate (backends.protocol.FEATURES):
    the in-kernel selection when a row may be flagged (a replay_mask, padding="select"),
    and the agreement outputs."""
    f = set()
    if replay_mask is not None or padding == "select":
        f.add(SELECT)
    if return_agreement:
        f.add(AGREEMENT)
    return frozenset(f)


def _select_list(opts, K: int, features: frozenset) -> int:
    """OpShape.select_list of a gate forward: the longest ranked list its selection keeps
    (K; with groups also group_topk and the group score's n), 0 without a feature."""
    if not features:
        return 0
    sel = opts.selection
    if not sel.grouped:
        return K
    return max(K, sel.group_topk, sel.group_topn(K))


def _check_selection(op, logits, K, score_func, sel_flat) -> None:
    check_selection(op, logits, K, score_func, *sel_flat)


def _agreement_like(T, logits, present):
    """Fake (agreement bool [T], set_logprob [T] in the compute dtype), sized 0 when absent."""
    n = T if present else 0
    return (torch.empty(n, dtype=torch.bool, device=logits.device),
            torch.empty(n, dtype=compute_dtype(logits.dtype), device=logits.device))


@torch.library.custom_op(f"{LIB}::gate", mutates_args=())
def gate(
    logits: Tensor,
    expert_indices: Tensor,
    replay_mask: Tensor | None,
    score_func: str,
    normalize: bool,
    scaling_factor: float,
    align: int,
    padding: str,
    selection_source: str,
    expert_bias: Tensor | None,
    round_scores: bool,
    num_groups: int,
    group_topk: int,
    group_score_topn: int,
    return_agreement: bool,
    weights_dtype: torch.dtype | None,
    validate: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(weights, expert_indices int32, tokens_per_expert, expert_offsets, row_id_map,
    sorted_slots, agreement, set_logprob); the last two sized 0 unless return_agreement.
    See replay_ops.gate."""
    opts, shape = _gate_prologue(logits, expert_indices, replay_mask, (
        score_func, normalize, scaling_factor, align, padding, selection_source, expert_bias,
        round_scores, num_groups, group_topk, group_score_topn, return_agreement,
        weights_dtype), validate)
    impl = select("gate_fwd", logits.device.type, shape, logits.dtype, backend)
    return impl.gate_fwd(logits, expert_indices, replay_mask, opts)


def _check_gate(logits, expert_indices, replay_mask, score_func, align, padding, sel,
                weights_dtype=None):
    check_gate_inputs(logits, expert_indices, replay_mask, score_func, align)
    check_gate_padding(padding)
    _check_selection("gate", logits, expert_indices.shape[1], score_func, sel)
    check_weights_dtype("gate", logits, weights_dtype)


def _gate_prologue(logits, expert_indices, replay_mask, flat: tuple, validate: bool,
                   hidden: Tensor | None = None, num_rows: int = 0):
    """The first part of replay::gate and replay::gate_permute: the checks (with `hidden`,
    its own after the gate's), the index values when `validate`, and the call's options
    (`flat`: the GATE_FIELDS values) and OpShape. Returns (opts, shape)."""
    score_func, align, padding, sel, wdt = flat[0], flat[3], flat[4], flat[5:11], flat[12]
    if hidden is None:
        _check_gate(logits, expert_indices, replay_mask, score_func, align, padding, sel, wdt)
    else:
        _check_gate_permute(logits, expert_indices, replay_mask, score_func, align, padding,
                            sel, hidden, num_rows, wdt)
    if validate:
        check_index_values(expert_indices, logits.shape[1], replay_mask,
                           repeats=padding != "select")
    opts = GateOptions.from_flat(GATE_FIELDS, flat)
    (T, E), K = logits.shape, expert_indices.shape[1]
    H = 0 if hidden is None else hidden.shape[1]
    features = _features(replay_mask, padding, opts.return_agreement)
    return opts, OpShape(T, E, K, H, features, _select_list(opts, K, features))


@gate.register_fake
def _(logits, expert_indices, replay_mask, score_func, normalize, scaling_factor, align, padding,
      selection_source, expert_bias, round_scores, num_groups, group_topk, group_score_topn,
      return_agreement, weights_dtype, validate, backend):
    sel = (selection_source, expert_bias, round_scores, num_groups, group_topk,
           group_score_topn)
    _check_gate(logits, expert_indices, replay_mask, score_func, align, padding, sel,
                weights_dtype)
    T, E = logits.shape
    K = expert_indices.shape[1]
    return (logits.new_empty(T, K, dtype=weights_dtype or logits.dtype),
            torch.empty(T, K, dtype=PLAN_DTYPE, device=logits.device),
            *_fake_plan(T, K, E, align, logits.device),
            *_agreement_like(T, logits, return_agreement))


def _fake_plan(T, K, E, align, device, present=True):
    """The plan's four outputs of a gate op (counts [E], offsets [E + 1], row_id_map [T, K],
    sorted_slots [capacity]), as empty tensors; sized 0 (row_id_map [0, K]) when the op
    does not build the plan."""
    i32 = dict(dtype=PLAN_DTYPE, device=device)
    if not present:
        return (torch.empty(0, **i32), torch.empty(0, **i32), torch.empty(0, K, **i32),
                torch.empty(0, **i32))
    return (torch.empty(E, **i32), torch.empty(E + 1, **i32), torch.empty(T, K, **i32),
            torch.empty(plan_capacity(T, K, E, align), **i32))


def _logit_grad(kernel: str, grad: Tensor, logits: Tensor, expert_indices: Tensor,
                flat_opts: tuple, grad_set_logprob: Tensor | None, backend: str) -> Tensor:
    """The backward ops' body: the backend's `kernel` ("gate_bwd" or "gate_dense_bwd") for
    this shape and dtype, with the flat backward options as one GateOptions, and the
    gradient of set_logprob when there is one."""
    (T, E), K = logits.shape, expert_indices.shape[1]
    opts = GateOptions.from_flat(BACKWARD_FIELDS, flat_opts)
    if grad_set_logprob is None:
        impl = select(kernel, logits.device.type, OpShape(T, E, K), logits.dtype, backend)
        return getattr(impl, kernel)(grad, logits, expert_indices, opts)
    _check_set_logprob_grad(grad_set_logprob, logits)
    shape = OpShape(T, E, K, 0, frozenset((AGREEMENT,)))
    impl = select(kernel, logits.device.type, shape, logits.dtype, backend)
    return getattr(impl, kernel)(grad, logits, expert_indices, opts,
                                 grad_set_logprob.to(compute_dtype(logits.dtype)))


def _check_set_logprob_grad(g, logits):
    if g.shape != (logits.shape[0],) or not g.is_floating_point() or g.device != logits.device:
        raise ValueError(f"replay_ops: the set_logprob gradient must be a float [T]="
                         f"({logits.shape[0]},) tensor on {logits.device}, got {g.dtype} "
                         f"{tuple(g.shape)} on {g.device}")


def _gate_setup(ctx, inputs, output):
    logits, score_func, normalize, scaling_factor = inputs[0], inputs[3], inputs[4], inputs[5]
    ctx.save_for_backward(logits, output[1])
    ctx.opts = (score_func, normalize, scaling_factor)
    ctx.backend = inputs[-1]
    ctx.agreement = inputs[14]  # return_agreement: set_logprob is an output
    # The integer outputs have no gradient: do not make autograd fill zeros for them.
    ctx.set_materialize_grads(False)


def _gate_backward(ctx, grad_weights, _idx, _counts, _offsets, _rid, _slots, _agree,
                   grad_set_logprob):
    logits, idx = ctx.saved_tensors
    if not ctx.agreement:  # the size-0 placeholder (a traced graph may hand it zeros)
        grad_set_logprob = None
    grad = None
    if ctx.needs_input_grad[0] and (grad_weights is not None or grad_set_logprob is not None):
        if grad_weights is None:
            grad_weights = torch.zeros(idx.shape, dtype=logits.dtype, device=logits.device)
        grad = gate_backward(grad_weights.contiguous(), logits, idx, *ctx.opts,
                             grad_set_logprob, ctx.backend)
    return (grad,) + (None,) * 17


gate.register_autograd(_gate_backward, setup_context=_gate_setup)


@torch.library.custom_op(f"{LIB}::gate_backward", mutates_args=())
def gate_backward(
    grad_weights: Tensor,
    logits: Tensor,
    expert_indices: Tensor,
    score_func: str,
    normalize: bool,
    scaling_factor: float,
    grad_set_logprob: Tensor | None,
    backend: str,
) -> Tensor:
    """Dense [T, E] gradient of the logits, given the gradient of the [T, K] weights (and of
    the [T] set_logprob, when given)."""
    return _logit_grad("gate_bwd", grad_weights, logits, expert_indices,
                       (score_func, normalize, scaling_factor), grad_set_logprob, backend)


@gate_backward.register_fake
def _(grad_weights, logits, expert_indices, score_func, normalize, scaling_factor,
      grad_set_logprob, backend):
    if grad_set_logprob is not None:
        _check_set_logprob_grad(grad_set_logprob, logits)
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
    expert_out: Tensor, row_id_map: Tensor, sorted_slots: Tensor, weights: Tensor | None,
    backend: str
) -> Tensor:
    """[T, H]: out[t] = sum_k weights[t, k] * expert_out[row_id_map[t, k]] (fp32 accumulation,
    column order); with weights None, the plain sum (the weights were applied before)."""
    _check_unpermute(expert_out, row_id_map, sorted_slots, weights)
    shape = _row_shape(row_id_map, expert_out)
    if weights is None:  # the unweighted gather-sum is the permute backward kernel
        impl = select("permute_bwd", expert_out.device.type, shape, expert_out.dtype, backend)
        return impl.permute_bwd(expert_out, row_id_map)
    impl = select("unpermute_fwd", expert_out.device.type, shape, expert_out.dtype, backend)
    return impl.unpermute_fwd(expert_out, row_id_map, weights)


def _check_unpermute(expert_out, row_id_map, sorted_slots, weights):
    check_plan_tensors("unpermute", row_id_map, sorted_slots)
    check_hidden("unpermute", "expert_out", expert_out, None, "rows", row_id_map.device)
    if weights is None:
        return
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
    # Unweighted, the backward needs no expert_out (nor keeps it alive).
    ctx.save_for_backward(None if weights is None else expert_out, row_id_map, sorted_slots,
                          weights)
    ctx.rows = expert_out.shape[0]
    ctx.backend = backend


def _unpermute_backward(ctx, grad_out):
    expert_out, row_id_map, sorted_slots, weights = ctx.saved_tensors
    if weights is None:
        # grad_x[r] = grad_out[s // K] for the slot s of row r: the permute forward. No
        # weight gradient, so the dot-product kernel does not run.
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = permute(grad_out.contiguous(), sorted_slots, row_id_map, ctx.rows,
                             ctx.backend)
        return grad_x, None, None, None, None
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


# ----------------------------------------------------------------------- dense gate
@torch.library.custom_op(f"{LIB}::gate_dense", mutates_args=())
def gate_dense(
    logits: Tensor,
    expert_indices: Tensor,
    replay_mask: Tensor | None,
    fallback: Tensor | None,
    score_func: str,
    normalize: bool,
    scaling_factor: float,
    padding: str,
    ep_size: int,
    spread_offset: int,
    underflow_guard: bool,
    align: int,
    with_plan: bool,
    selection_source: str,
    expert_bias: Tensor | None,
    round_scores: bool,
    num_groups: int,
    group_topk: int,
    group_score_topn: int,
    return_agreement: bool,
    validate: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(probs [T, E], routing_map [T, E] bool, row_flags [T] uint8, expert_indices int32,
    tokens_per_expert, expert_offsets, row_id_map, sorted_slots, agreement, set_logprob);
    see replay_ops.gate_dense."""
    sel = (selection_source, expert_bias, round_scores, num_groups, group_topk,
           group_score_topn)
    _check_dense(logits, expert_indices, replay_mask, fallback, score_func, align, padding,
                 ep_size, spread_offset, sel)
    (T, E), K = logits.shape, expert_indices.shape[1]
    opts = GateOptions.from_flat(DENSE_FIELDS, (
        score_func, normalize, scaling_factor, padding, ep_size, spread_offset % max(E, 1),
        underflow_guard, align, with_plan, *sel, return_agreement))
    features = _features(None, padding, return_agreement)
    impl = select("gate_dense_fwd", logits.device.type,
                  OpShape(T, E, K, 0, features, _select_list(opts, K, features)),
                  logits.dtype, backend)
    out = impl.gate_dense_fwd(logits, expert_indices, replay_mask, fallback, opts)
    if validate:
        check_row_flags(out[2], expert_indices, E, replay_mask, padding)
    return out


def _check_dense(logits, expert_indices, replay_mask, fallback, score_func, align, padding,
                 ep_size, spread_offset, sel):
    check_dense_inputs(logits, expert_indices, replay_mask, fallback, score_func, align,
                       padding, ep_size, spread_offset)
    _check_selection("gate_dense", logits, expert_indices.shape[1], score_func, sel)


@gate_dense.register_fake
def _(logits, expert_indices, replay_mask, fallback, score_func, normalize, scaling_factor,
      padding, ep_size, spread_offset, underflow_guard, align, with_plan, selection_source,
      expert_bias, round_scores, num_groups, group_topk, group_score_topn, return_agreement,
      validate, backend):
    sel = (selection_source, expert_bias, round_scores, num_groups, group_topk,
           group_score_topn)
    _check_dense(logits, expert_indices, replay_mask, fallback, score_func, align, padding,
                 ep_size, spread_offset, sel)
    T, E = logits.shape
    K = expert_indices.shape[1]
    dev = logits.device
    return (logits.new_empty(T, E), torch.empty(T, E, dtype=torch.bool, device=dev),
            torch.empty(T, dtype=torch.uint8, device=dev),
            torch.empty(T, K, dtype=PLAN_DTYPE, device=dev),
            *_fake_plan(T, K, E, align, dev, with_plan),
            *_agreement_like(T, logits, return_agreement))


def _gate_dense_setup(ctx, inputs, output):
    logits, _, _, _, score_func, normalize, scaling_factor = inputs[:7]
    ctx.save_for_backward(logits, output[3])
    ctx.opts = (score_func, normalize, scaling_factor)
    ctx.backend = inputs[-1]
    ctx.agreement = inputs[-3]  # return_agreement: set_logprob is an output
    ctx.set_materialize_grads(False)  # only probs and set_logprob have gradients


def _gate_dense_backward(ctx, grad_probs, *other):
    logits, idx = ctx.saved_tensors
    grad_set_logprob = other[-1] if ctx.agreement else None
    grad = None
    if ctx.needs_input_grad[0] and (grad_probs is not None or grad_set_logprob is not None):
        if grad_probs is None:
            grad_probs = torch.zeros_like(logits)
        grad = gate_dense_backward(grad_probs, logits, idx, *ctx.opts, grad_set_logprob,
                                   ctx.backend)
    return (grad,) + (None,) * 21


gate_dense.register_autograd(_gate_dense_backward, setup_context=_gate_dense_setup)


@torch.library.custom_op(f"{LIB}::gate_dense_backward", mutates_args=())
def gate_dense_backward(
    grad_probs: Tensor,
    logits: Tensor,
    expert_indices: Tensor,
    score_func: str,
    normalize: bool,
    scaling_factor: float,
    grad_set_logprob: Tensor | None,
    backend: str,
) -> Tensor:
    """Dense [T, E] gradient of the logits given the gradient of the dense [T, E] probs (read
    at the routed experts inside the kernel; any strides), and of the [T] set_logprob when
    given."""
    return _logit_grad("gate_dense_bwd", grad_probs.to(logits.dtype), logits, expert_indices,
                       (score_func, normalize, scaling_factor), grad_set_logprob, backend)


@gate_dense_backward.register_fake
def _(grad_probs, logits, expert_indices, score_func, normalize, scaling_factor,
      grad_set_logprob, backend):
    if grad_set_logprob is not None:
        _check_set_logprob_grad(grad_set_logprob, logits)
    return torch.empty_like(logits)


# ------------------------------------------------------------- permute with probs
@torch.library.custom_op(f"{LIB}::permute_probs", mutates_args=())
def permute_probs(
    hidden: Tensor,
    probs: Tensor,
    sorted_slots: Tensor,
    row_id_map: Tensor,
    expert_indices: Tensor,
    num_rows: int,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """([num_rows, H] rows of hidden, [num_rows] probs): row r takes token t = s // K of its
    slot s = sorted_slots[r] and probs[t, expert_indices[t, s % K]]; zero for padding rows."""
    _check_permute_probs(hidden, probs, sorted_slots, row_id_map, expert_indices, num_rows)
    shape = _row_shape(row_id_map, hidden)
    dev = hidden.device.type
    out = select("permute_fwd", dev, shape, hidden.dtype, backend).permute_fwd(
        hidden, sorted_slots, row_id_map, num_rows)
    pshape = OpShape(row_id_map.shape[0], probs.shape[1], row_id_map.shape[1], 1)
    out_probs = select("permute_probs_fwd", dev, pshape, probs.dtype, backend).permute_probs_fwd(
        probs, sorted_slots, expert_indices, num_rows)
    return out, out_probs


def _check_permute_probs(hidden, probs, sorted_slots, row_id_map, expert_indices, num_rows):
    _check_permute(hidden, sorted_slots, row_id_map, num_rows)
    T, K = row_id_map.shape
    if probs.dim() != 2 or probs.shape[0] != T or not probs.is_floating_point():
        raise ValueError(
            f"replay_ops.permute: probs must be a float [T, E] tensor with T={T} rows (the "
            f"dense probs of the routing), got {probs.dtype} {tuple(probs.shape)}")
    if expert_indices.dtype != PLAN_DTYPE or tuple(expert_indices.shape) != (T, K):
        raise ValueError(
            f"replay_ops.permute: expert_indices must be the plan's int32 [T, K] = ({T}, {K}), "
            f"got {expert_indices.dtype} {tuple(expert_indices.shape)}")
    for name, t in (("probs", probs), ("expert_indices", expert_indices)):
        if t.device != row_id_map.device:
            raise ValueError(f"replay_ops.permute: tensors on different devices: {name} on "
                             f"{t.device}, the plan on {row_id_map.device}")


@permute_probs.register_fake
def _(hidden, probs, sorted_slots, row_id_map, expert_indices, num_rows, backend):
    _check_permute_probs(hidden, probs, sorted_slots, row_id_map, expert_indices, num_rows)
    return hidden.new_empty(num_rows, hidden.shape[1]), probs.new_empty(num_rows)


def _permute_probs_setup(ctx, inputs, output):
    _, probs, _, row_id_map, expert_indices, _, backend = inputs
    ctx.save_for_backward(row_id_map, expert_indices)
    ctx.num_experts = probs.shape[1]
    ctx.backend = backend
    ctx.set_materialize_grads(False)


def _permute_probs_backward(ctx, grad_out, grad_probs):
    row_id_map, expert_indices = ctx.saved_tensors
    gh = gp = None
    if ctx.needs_input_grad[0] and grad_out is not None:
        gh = permute_backward(grad_out.contiguous(), row_id_map, ctx.backend)
    if ctx.needs_input_grad[1] and grad_probs is not None:
        gp = permute_probs_backward(grad_probs.contiguous(), row_id_map, expert_indices,
                                    ctx.num_experts, ctx.backend)
    return gh, gp, None, None, None, None, None


permute_probs.register_autograd(_permute_probs_backward, setup_context=_permute_probs_setup)


@torch.library.custom_op(f"{LIB}::permute_probs_backward", mutates_args=())
def permute_probs_backward(
    grad: Tensor, row_id_map: Tensor, expert_indices: Tensor, num_experts: int, backend: str
) -> Tensor:
    """Dense [T, E]: grad[row_id_map[t, k]] at (t, expert_indices[t, k]), 0 elsewhere; each
    token row is written by one program (no memset, no scatter, no atomics)."""
    T, K = row_id_map.shape
    impl = select("permute_probs_bwd", grad.device.type, OpShape(T, num_experts, K, 1),
                  grad.dtype, backend)
    return impl.permute_probs_bwd(grad, row_id_map, expert_indices, num_experts)


@permute_probs_backward.register_fake
def _(grad, row_id_map, expert_indices, num_experts, backend):
    return grad.new_empty(row_id_map.shape[0], num_experts)


# ---------------------------------------------------------------- gate with permute
def _fused(kernel: str, device_type: str, shape: OpShape, dtype, backend: str):
    """The backend that runs the gate (`gate_fwd`) or its backward (`gate_bwd`) for this
    call, and its fused kernel `kernel` ("gate_permute_fwd" / "gate_permute_bwd") when it
    has one that takes the call (protocol.FUSED_OPS), else None: the op then runs the gate
    and the permute kernels one after the other, with the same results."""
    impl = select(kernel.replace("_permute", ""), device_type, shape, dtype, backend)
    fn = getattr(impl, kernel, None)
    if fn is not None and impl.supports(kernel, device_type, shape, dtype):
        return impl, fn
    return impl, None


@torch.library.custom_op(f"{LIB}::gate_permute", mutates_args=())
def gate_permute(
    logits: Tensor,
    expert_indices: Tensor,
    replay_mask: Tensor | None,
    score_func: str,
    normalize: bool,
    scaling_factor: float,
    align: int,
    padding: str,
    selection_source: str,
    expert_bias: Tensor | None,
    round_scores: bool,
    num_groups: int,
    group_topk: int,
    group_score_topn: int,
    return_agreement: bool,
    weights_dtype: torch.dtype | None,
    hidden: Tensor,
    num_rows: int,
    validate: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """replay::gate's eight outputs, then `rows` [num_rows, H]: the expert-major copy of
    `hidden` [T, H] for that plan (replay::permute's output). See replay_ops.gate(hidden=)."""
    opts, shape = _gate_prologue(logits, expert_indices, replay_mask, (
        score_func, normalize, scaling_factor, align, padding, selection_source, expert_bias,
        round_scores, num_groups, group_topk, group_score_topn, return_agreement,
        weights_dtype), validate, hidden, num_rows)
    impl, fused = _fused("gate_permute_fwd", logits.device.type, shape, logits.dtype, backend)
    if fused is not None:
        return tuple(fused(logits, expert_indices, replay_mask, opts, hidden, num_rows))
    out = impl.gate_fwd(logits, expert_indices, replay_mask, opts)
    rid, slots = out[4], out[5]
    rows = select("permute_fwd", hidden.device.type, _row_shape(rid, hidden), hidden.dtype,
                  backend).permute_fwd(hidden, slots, rid, num_rows)
    return (*out, rows)


def _check_gate_permute(logits, expert_indices, replay_mask, score_func, align, padding, sel,
                        hidden, num_rows, weights_dtype=None):
    _check_gate(logits, expert_indices, replay_mask, score_func, align, padding, sel,
                weights_dtype)
    check_hidden("gate", "hidden", hidden, logits.shape[0], "T tokens", logits.device)
    if num_rows < 0:
        raise ValueError(f"replay_ops.gate: num_rows must be >= 0, got {num_rows}")


@gate_permute.register_fake
def _(logits, expert_indices, replay_mask, score_func, normalize, scaling_factor, align, padding,
      selection_source, expert_bias, round_scores, num_groups, group_topk, group_score_topn,
      return_agreement, weights_dtype, hidden, num_rows, validate, backend):
    sel = (selection_source, expert_bias, round_scores, num_groups, group_topk,
           group_score_topn)
    _check_gate_permute(logits, expert_indices, replay_mask, score_func, align, padding, sel,
                        hidden, num_rows, weights_dtype)
    T, E = logits.shape
    K = expert_indices.shape[1]
    return (logits.new_empty(T, K, dtype=weights_dtype or logits.dtype),
            torch.empty(T, K, dtype=PLAN_DTYPE, device=logits.device),
            *_fake_plan(T, K, E, align, logits.device),
            *_agreement_like(T, logits, return_agreement),
            hidden.new_empty(num_rows, hidden.shape[1]))


def _gate_permute_setup(ctx, inputs, output):
    logits, score_func, normalize, scaling_factor = inputs[0], inputs[3], inputs[4], inputs[5]
    ctx.save_for_backward(logits, output[1], output[4])
    ctx.opts = (score_func, normalize, scaling_factor)
    ctx.backend = inputs[-1]
    ctx.agreement = inputs[14]  # return_agreement: set_logprob is an output
    ctx.set_materialize_grads(False)


def _gate_permute_backward(ctx, grad_weights, _idx, _counts, _offsets, _rid, _slots, _agree,
                           grad_set_logprob, grad_rows):
    logits, idx, rid = ctx.saved_tensors
    if not ctx.agreement:  # the size-0 placeholder (a traced graph may hand it zeros)
        grad_set_logprob = None
    want_logits = ctx.needs_input_grad[0] and (grad_weights is not None
                                               or grad_set_logprob is not None)
    want_hidden = ctx.needs_input_grad[16] and grad_rows is not None
    if want_logits and grad_weights is None:
        grad_weights = torch.zeros(idx.shape, dtype=logits.dtype, device=logits.device)
    grad_logits = grad_hidden = None
    if want_logits and want_hidden:  # one op for both
        grad_logits, grad_hidden = gate_permute_backward(
            grad_weights.contiguous(), grad_rows.contiguous(), logits, idx, rid, *ctx.opts,
            grad_set_logprob, ctx.backend)
    elif want_logits:
        grad_logits = gate_backward(grad_weights.contiguous(), logits, idx, *ctx.opts,
                                    grad_set_logprob, ctx.backend)
    elif want_hidden:
        grad_hidden = permute_backward(grad_rows.contiguous(), rid, ctx.backend)
    return (grad_logits,) + (None,) * 15 + (grad_hidden,) + (None,) * 3


gate_permute.register_autograd(_gate_permute_backward, setup_context=_gate_permute_setup)


@torch.library.custom_op(f"{LIB}::gate_permute_backward", mutates_args=())
def gate_permute_backward(
    grad_weights: Tensor,
    grad_rows: Tensor,
    logits: Tensor,
    expert_indices: Tensor,
    row_id_map: Tensor,
    score_func: str,
    normalize: bool,
    scaling_factor: float,
    grad_set_logprob: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """(grad_logits [T, E], grad_hidden [T, H]): replay::gate_backward's and
    replay::permute_backward's outputs (grad_hidden[t] = sum_k grad_rows[row_id_map[t, k]],
    in slot order, no atomics), in one op."""
    (T, E), K = logits.shape, expert_indices.shape[1]
    feats = frozenset() if grad_set_logprob is None else frozenset((AGREEMENT,))
    if grad_set_logprob is not None:
        _check_set_logprob_grad(grad_set_logprob, logits)
    shape = OpShape(T, E, K, grad_rows.shape[1], feats)
    _, fused = _fused("gate_permute_bwd", logits.device.type, shape, logits.dtype, backend)
    if fused is not None:
        opts = GateOptions.from_flat(BACKWARD_FIELDS, (score_func, normalize, scaling_factor))
        gsl = (None if grad_set_logprob is None
               else grad_set_logprob.to(compute_dtype(logits.dtype)))
        return tuple(fused(grad_weights, grad_rows, logits, expert_indices, row_id_map, opts,
                           gsl))
    grad_logits = _logit_grad("gate_bwd", grad_weights, logits, expert_indices,
                              (score_func, normalize, scaling_factor), grad_set_logprob,
                              backend)
    impl = select("permute_bwd", grad_rows.device.type, _row_shape(row_id_map, grad_rows),
                  grad_rows.dtype, backend)
    return grad_logits, impl.permute_bwd(grad_rows, row_id_map)


@gate_permute_backward.register_fake
def _(grad_weights, grad_rows, logits, expert_indices, row_id_map, score_func, normalize,
      scaling_factor, grad_set_logprob, backend):
    if grad_set_logprob is not None:
        _check_set_logprob_grad(grad_set_logprob, logits)
    return torch.empty_like(logits), grad_rows.new_empty(row_id_map.shape[0],
                                                         grad_rows.shape[1])
