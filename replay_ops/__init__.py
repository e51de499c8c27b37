"""replay_ops: fused replayed top-k gating for Mixture-of-Experts router replay.

    plan = replay_ops.gate(logits, recorded_indices)          # weights + dispatch plan
    x = replay_ops.permute(hidden, plan)                      # expert-major rows
    y = replay_ops.unpermute(expert_mlp(x), plan)             # weighted combine per token

Importing the package registers `torch.ops.replay.{gate, permute, unpermute}` and their
backward ops. `replay_ops.reference` holds the pure-PyTorch oracle of the same three
functions; `replay_ops.backends()` says which implementation serves each device.
"""
from __future__ import annotations

import torch

from . import ops as _ops  # registers torch.ops.replay.*
from . import reference
from .backend import backends
from .plan import RoutingPlan

__all__ = ["gate", "permute", "unpermute", "RoutingPlan", "reference", "backends"]
__version__ = "0.1.0"


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
    the scores. See the README for the exact semantics of every argument.
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
    zero for padding rows. It has `plan.expert_offsets[E]` rows (a host sync), or the
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
    than `plan.max_rows` rows)."""
    if validate and expert_out.dim() == 2:
        _check_rows("unpermute", f"expert_out with {expert_out.shape[0]} rows", expert_out.shape[0], plan)
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
