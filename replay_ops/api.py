"""The public Python API: `gate`, `permute`, `unpermute` (thin wrappers of the registered
`torch.ops.replay.*` ops, which hold the checks, the autograd and the fake kernels).

Host synchronisation (a read of device memory by the host, which stalls a CUDA stream):

    gate(..., validate=True)        one read: the index checks (range, duplicates)
    gate(..., validate=False)       none (the model's own selection of the rows without a
                                    route runs inside the gate kernel)
    gate_dense(..., validate=True)  one read: the row flags the kernel wrote
    gate_dense(..., validate=False) none
    permute(hidden, plan)           one read: the rows used, plan.expert_offsets[E]
    permute(hidden, plan, num_rows) none (with validate=True, one read when num_rows is
                                    below plan.max_rows, to check it is large enough)
    unpermute(expert_out, plan)     none, except with validate=True when expert_out has fewer
                                    rows than plan.max_rows (one read, to check them)
    the backward ops                none
"""
from __future__ import annotations

import torch

from .options import (
    DENSE_FIELDS,
    DENSE_OPTIONS,
    GATE_FIELDS,
    GATE_OPTIONS,
    GateOptions,
    Selection,
    options_one_way,
    resolve,
)
from .plan import DenseRouting, RoutingPlan, plan_capacity


@options_one_way("gate", GATE_OPTIONS)
def gate(
    logits: torch.Tensor,
    expert_indices: torch.Tensor,
    *,
    score_func: str = "softmax",
    normalize: bool = True,
    scaling_factor: float = 1.0,
    align: int = 1,
    replay_mask: torch.Tensor | None = None,
    padding: str = "empty",
    selection: Selection | None = None,
    return_agreement: bool = False,
    weights_dtype: torch.dtype | None = None,
    hidden: torch.Tensor | None = None,
    num_rows: int | None = None,
    validate: bool = True,
    backend: str | None = None,
    options: GateOptions | None = None,
) -> RoutingPlan:
    """Gate weights from the current `logits` [T, E] at recorded `expert_indices` [T, K]
    (-1 = empty slot), plus the expert-major dispatch plan. Top-k is never recomputed for a
    replayed row. A row without a usable route gets the model's own choice, computed inside
    the gate kernel from the logits row it reads (`selection`, a replay_ops.Selection: top-k
    of the scores when None, the default; expert bias, group limits): every row where `replay_mask` is
    False, and with `padding="select"` every row with a -1 slot, an id outside [0, E) or a
    repeated expert (with the default `padding="empty"` a -1 slot is an empty slot, weight
    0). With `validate=False` the index values are not checked and a value outside [0, E)
    is an empty slot (or flags its row, with padding="select"). `plan.expert_indices` holds
    the experts used.

    `return_agreement=True` also gives `plan.agreement` (bool [T]: the row's set of experts
    is the set `selection` picks from these logits) and `plan.set_logprob` (float32 [T]:
    the log of the router's probability mass on that set, differentiable).
    See docs/ops.md for the exact semantics.

    `weights_dtype`: the weights' dtype, the logits' dtype when None; the logits' compute
    dtype (torch.float32 for half and bfloat16 logits) gives the weights as computed,
    unrounded, from the same kernel (as a router that keeps its weights in fp32 does:
    `softmax(logits, dtype=torch.float)`), with no cast of the logits or of their gradient.

    `hidden` [T, H] (the tokens' hidden states) also gives `plan.rows`: the expert-major
    rows of `hidden` for this plan, exactly `permute(hidden, plan, num_rows)`, written by the
    same op (one op forward, and one backward op for the gradients of both the logits and
    `hidden`). `num_rows` defaults to `plan.max_rows` (static: no host read); with
    `validate=True` a smaller `num_rows` is checked to hold every row used (one host read).

    The options may come as one `options=replay_ops.GateOptions(...)` instead of the option
    keywords (score_func, normalize, scaling_factor, align, padding, selection,
    return_agreement, weights_dtype), never both: a call that gives `options=` and any of these keywords,
    even at its default value, raises ValueError naming the keyword.
    """
    opts = resolve(options, "gate", GATE_OPTIONS, score_func=score_func, normalize=normalize,
                   scaling_factor=scaling_factor, align=align, padding=padding,
                   selection=selection, return_agreement=return_agreement,
                   weights_dtype=weights_dtype)
    if hidden is None:
        if num_rows is not None:
            raise ValueError("replay_ops.gate: num_rows is the size of plan.rows and needs "
                             "hidden= (the hidden states to permute)")
        out = torch.ops.replay.gate(logits, expert_indices, replay_mask,
                                    *opts.flat(GATE_FIELDS), bool(validate),
                                    backend or "auto")
        rows = None
    else:
        capacity = None
        if num_rows is None:
            T, E = logits.shape if logits.dim() == 2 else (0, 0)
            K = expert_indices.shape[1] if expert_indices.dim() == 2 else 0
            a = opts.align if isinstance(opts.align, int) and opts.align >= 1 else 1
            num_rows = capacity = plan_capacity(T, K, E, a)  # (the op checks align)
        out = torch.ops.replay.gate_permute(logits, expert_indices, replay_mask,
                                            *opts.flat(GATE_FIELDS), hidden, int(num_rows),
                                            bool(validate), backend or "auto")
        rows = out[8]
    agree = out[6:8] if opts.return_agreement else (None, None)
    plan = RoutingPlan(*out[:6], *agree, rows)
    if rows is not None and validate and capacity is None:
        _check_rows("gate", f"num_rows={num_rows}", int(num_rows), plan)
    return plan


@options_one_way("gate_dense", DENSE_OPTIONS)
def gate_dense(
    logits: torch.Tensor,
    expert_indices: torch.Tensor,
    *,
    score_func: str = "softmax",
    normalize: bool = True,
    scaling_factor: float = 1.0,
    replay_mask: torch.Tensor | None = None,
    padding: str = "empty",
    fallback: torch.Tensor | None = None,
    ep_size: int = 1,
    spread_offset: int = 0,
    underflow_guard: bool = False,
    align: int = 1,
    with_plan: bool = True,
    selection: Selection | None = None,
    return_agreement: bool = False,
    validate: bool = True,
    backend: str | None = None,
    options: GateOptions | None = None,
) -> DenseRouting:
    """Megatron-Core's routing contract written by the gate kernel itself: dense `probs`
    [T, E] (logits dtype) and a bool `routing_map` [T, E], with per-row flags and the
    dispatch plan of the same routing, in one kernel call.

    Weights are those of `gate` (same score functions and options). Each row's flags
    (`DenseRouting.row_flags`, bits of replay_ops.plan: 1 a -1 slot, 2 an id outside
    [-1, E), 4 a repeated expert, 8 replay_mask False) describe its recorded ids; a row
    with any flag is a padding row and is routed by `padding`:

    * "empty": its ids in [0, E) (nothing for a masked row); a repeated expert's weights
      add up in probs;
    * "spread": K distinct experts spread over `ep_size` expert-parallel ranks, by a
      per-row formula (replay_ops.reference.spread_expert) rotated by `spread_offset`;
    * "fallback": the row of `fallback` [T, K];
    * "select": the model's own choice (`selection`), computed inside the kernel from the
      row's logits.

    A masked row (replay_mask False) takes its `fallback` row whenever `fallback` is given.
    With `underflow_guard`, a routed probability that rounds to exactly 0 becomes the
    dtype's smallest normal value (so index recovery from probs, e.g. Megatron's flex
    dispatcher, keeps it); its gradient passes through. The plan (`with_plan`) has
    weights=None: the dispatcher applies probs itself. The backward reads the gradient of
    probs at the routed experts inside the kernel. `return_agreement` gives
    `DenseRouting.agreement` and `.set_logprob`, as `gate` does.

    `validate=True` reads the row flags once and raises for an id outside [-1, E), and with
    padding="empty" for a repeated expert; `validate=False` reads nothing.

    The options may come as one `options=replay_ops.GateOptions(...)` instead of the option
    keywords (those of `gate`, and padding, ep_size, spread_offset, underflow_guard,
    with_plan), never both: a call that gives `options=` and any of these keywords, even at
    its default value, raises ValueError naming the keyword."""
    opts = resolve(options, "gate_dense", DENSE_OPTIONS, score_func=score_func,
                   normalize=normalize, scaling_factor=scaling_factor, padding=padding,
                   ep_size=ep_size, spread_offset=spread_offset,
                   underflow_guard=underflow_guard, align=align, with_plan=with_plan,
                   selection=selection, return_agreement=return_agreement)
    out = torch.ops.replay.gate_dense(logits, expert_indices, replay_mask, fallback,
                                      *opts.flat(DENSE_FIELDS), bool(validate),
                                      backend or "auto")
    probs, rmap, flags, idx = out[:4]
    plan = RoutingPlan(None, idx, *out[4:8]) if opts.with_plan else None
    if opts.return_agreement:
        return DenseRouting(probs, rmap, flags, idx, plan, out[8], out[9])
    return DenseRouting(probs, rmap, flags, idx, plan)


def selects_in_kernel(op: str, device_type: str, num_tokens: int, num_experts: int,
                      top_k: int, dtype: torch.dtype, backend: str | None = None) -> bool:
    """True when the backend that runs the plain gate `op` ("gate" or "gate_dense") for
    these sizes also computes the model's own selection of flagged rows inside its kernel
    (a call with a replay mask, padding="select" or return_agreement then runs on the same
    backend). Every backend does within its limits (the native CPU and CUDA kernels, the
    Triton kernels, the torch backend): the native CUDA kernels select for K <= MAX_TOPK,
    and hand a selecting call with a larger K to the next backend (docs/ops.md,
    "Backends")."""
    from .backends import OpShape, explain
    from .backends.protocol import SELECT

    kernel = {"gate": "gate_fwd", "gate_dense": "gate_dense_fwd"}[op]
    plain = explain(kernel, device_type, OpShape(num_tokens, num_experts, top_k, 0), dtype,
                    backend)[0]
    sel = explain(kernel, device_type,
                  OpShape(num_tokens, num_experts, top_k, 0, frozenset({SELECT})), dtype,
                  backend)[0]
    return plain == sel


def permute(
    hidden: torch.Tensor,
    plan: RoutingPlan,
    num_rows: int | None = None,
    *,
    probs: torch.Tensor | None = None,
    validate: bool = True,
    backend: str | None = None,
):
    """Expert-major copy of `hidden` [T, H]: row r is hidden[plan.sorted_slots[r] // K],
    zero for padding rows. It has `plan.expert_offsets[E]` rows (a host read), or the
    static `num_rows` (for CUDA graphs and torch.compile; `plan.max_rows` always fits).

    With the dense `probs` [T, E] of the same routing, returns `(rows, row_probs)`: also
    the probability of each row, probs[t, e] of its token and expert (0 for padding rows),
    differentiable into `probs` (its backward writes the dense [T, E] gradient row by row)."""
    if num_rows is None:
        num_rows = plan.num_rows()
    elif validate:
        _check_rows("permute", f"num_rows={num_rows}", num_rows, plan)
    if probs is not None:
        return torch.ops.replay.permute_probs(
            hidden, probs, plan.sorted_slots, plan.row_id_map, plan.expert_indices, num_rows,
            backend or "auto")
    return torch.ops.replay.permute(
        hidden, plan.sorted_slots, plan.row_id_map, num_rows, backend or "auto"
    )


def unpermute(
    expert_out: torch.Tensor,
    plan: RoutingPlan,
    *,
    validate: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """[T, H]: out[t] = sum_k plan.weights[t, k] * expert_out[plan.row_id_map[t, k]],
    accumulated in fp32 in the recorded column order. Differentiable with respect to
    `expert_out` and, through `plan.weights`, the logits. With `plan.weights` None (the
    plan of `gate_dense`, or `plan._replace(weights=None)`: the experts applied the
    probs), the plain sum, and the backward skips the weight-gradient kernel. With `validate`, an `expert_out`
    with fewer rows than the plan uses is an error (a host read, only when it has fewer
    than `plan.max_rows` rows); without it, rows past its end count as empty slots."""
    if validate and expert_out.dim() == 2:
        _check_rows("unpermute", f"expert_out with {expert_out.shape[0]} rows",
                    expert_out.shape[0], plan)
    return torch.ops.replay.unpermute(
        expert_out, plan.row_id_map, plan.sorted_slots, plan.weights, backend or "auto"
    )


def _check_rows(op: str, what: str, rows: int, plan: RoutingPlan) -> None:
    """`rows` must hold every row the plan uses (expert_offsets[E]); plan.max_rows always
    does, so the host read happens only below it."""
    if rows >= plan.max_rows:
        return
    used = plan.num_rows()
    if rows < used:
        raise ValueError(
            f"replay_ops.{op}: {what} is too small: the plan uses {used} rows "
            f"(expert_offsets[E]); rows past {rows} would be dropped. plan.max_rows = "
            f"{plan.max_rows} always fits"
        )
