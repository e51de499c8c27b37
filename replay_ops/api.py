"""The public Python API: `gate`, `permute`, `unpermute` (thin wrappers of the registered
`torch.ops.replay.*` ops, which hold the checks, the autograd and the fake kernels).

Host synchronisation (a read of device memory by the host, which stalls a CUDA stream):

    gate(..., validate=True)        one read: the index checks (range, duplicates); with a
                                    replay_mask one more, finding the fallback rows
    gate(..., validate=False)       none (the fallback top-k then runs on every row)
    permute(hidden, plan)           one read: the rows used, plan.expert_offsets[E]
    permute(hidden, plan, num_rows) none (with validate=True, one read when num_rows is
                                    below plan.max_rows, to check it is large enough)
    unpermute(expert_out, plan)     none, except with validate=True when expert_out has fewer
                                    rows than plan.max_rows (one read, to check them)
    the backward ops                none
"""
from __future__ import annotations

import torch

from .plan import RoutingPlan


def gate(
    logits: torch.Tensor,
    expert_indices: torch.Tensor,
    *,
    score_func: str = "softmax",
    normalize: bool = True,
    scaling_factor: float = 1.0,
    align: int = 1,
    replay_mask: torch.Tensor | None = None,
    validate: bool = True,
    backend: str | None = None,
) -> RoutingPlan:
    """Gate weights from the current `logits` [T, E] at recorded `expert_indices` [T, K]
    (-1 = empty slot), plus the expert-major dispatch plan. Top-k is never recomputed,
    except for rows where `replay_mask` is False, which fall back to the native top-k of
    the scores. With `validate=False` the index values are not checked and a value
    outside [0, E) is an empty slot. See the README for the exact semantics.
    """
    out = torch.ops.replay.gate(
        logits,
        expert_indices,
        replay_mask,
        score_func,
        bool(normalize),
        float(scaling_factor),
        align,
        bool(validate),
        backend or "auto",
    )
    return RoutingPlan(*out)


def permute(
    hidden: torch.Tensor,
    plan: RoutingPlan,
    num_rows: int | None = None,
    *,
    validate: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Expert-major copy of `hidden` [T, H]: row r is hidden[plan.sorted_slots[r] // K],
    zero for padding rows. It has `plan.expert_offsets[E]` rows (a host read), or the
    static `num_rows` (for CUDA graphs and torch.compile; `plan.max_rows` always fits)."""
    if num_rows is None:
        num_rows = plan.num_rows()
    elif validate:
        _check_rows("permute", f"num_rows={num_rows}", num_rows, plan)
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
    `expert_out` and, through `plan.weights`, the logits. With `validate`, an `expert_out`
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
