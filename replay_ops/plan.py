"""`RoutingPlan`: the gate weights plus the dispatch plan for one MoE layer.

Layout of the permuted ("expert-major") buffer that `permute` fills:

* Expert `e` owns rows `expert_offsets[e] : expert_offsets[e+1]`.
* Inside that segment, the expert's valid slots come first, in ascending flat-slot order
  (`t*K + k`), so tokens are ascending and, for one token, columns are ascending. Then come
  padding rows, up to a multiple of `align`.
* `expert_offsets[E]` is the number of used rows `R`. `sorted_slots` has a fixed
  length, the plan's capacity `T*K + E*(align-1)` (`plan_capacity`: an upper bound on `R`
  that does not depend on the data); entries `>= R` are -1.

Empty slots (index -1, and with `validate=False` any index outside `[0, E)`) have
`weights == 0`, `expert_indices == -1`, `row_id_map == -1`, and take no row.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

# The plan's int32 tensors index rows and slots: the capacity must stay below 2**31.
PLAN_INDEX_LIMIT = 2**31


def plan_capacity(T, K, E, align, op: str = "gate"):
    """Rows of the plan's `sorted_slots`: `T*K + E*(align-1)`, the most rows a plan can use.
    Raises when it does not fit the int32 plan tensors. (The C++ kernels check the same
    bound once, in csrc/bindings/native_checks.h.)"""
    n = T * K + E * (align - 1)
    if n >= PLAN_INDEX_LIMIT:
        raise ValueError(
            f"replay_ops.{op}: the plan needs T*K + E*(align-1) = {n} rows (T={T}, K={K}, "
            f"E={E}, align={align}), which does not fit its int32 tensors (at most "
            f"{PLAN_INDEX_LIMIT - 1}); split the batch or lower align"
        )
    return n


class RoutingPlan(NamedTuple):
    weights: torch.Tensor  # [T, K], logits dtype
    # [T, K] int32, indices used (a flagged row: the model's own selection); -1 = empty
    expert_indices: torch.Tensor
    tokens_per_expert: torch.Tensor  # [E] int32, valid slots per expert
    expert_offsets: torch.Tensor  # [E+1] int32, exclusive prefix sum of aligned counts
    row_id_map: torch.Tensor  # [T, K] int32, destination row of slot (t, k); -1 = empty
    sorted_slots: torch.Tensor  # [plan_capacity] int32, flat slot per row; -1 = none
    # with return_agreement=True (else None): bool [T], the row's set of experts used equals
    # the set the model's selection picks from these logits; and float32 [T] (float64 for
    # float64 logits), the log of the router's probability mass on that set (differentiable)
    agreement: torch.Tensor | None = None
    set_logprob: torch.Tensor | None = None
    # with gate(..., hidden=x) (else None): [num_rows, H], the expert-major rows of x for this
    # plan, exactly permute(x, plan, num_rows); differentiable into x
    rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.expert_indices.shape[0]

    @property
    def top_k(self) -> int:
        return self.expert_indices.shape[1]

    @property
    def num_experts(self) -> int:
        return self.tokens_per_expert.shape[0]

    @property
    def max_rows(self) -> int:
        """Static upper bound on the permuted rows (the length of `sorted_slots`)."""
        return self.sorted_slots.shape[0]

    @property
    def align(self) -> int:
        T, K, E = self.num_tokens, self.top_k, self.num_experts
        return 1 if E == 0 else (self.max_rows - T * K) // E + 1

    def num_rows(self) -> int:
        """Rows actually used, `expert_offsets[E]` (a host sync on CUDA)."""
        return int(self.expert_offsets[-1])

    def to_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron-Core's format: probs `[T, E]` (logits dtype) and a bool routing map."""
        T, E = self.num_tokens, self.num_experts
        valid = self.expert_indices >= 0
        idx = self.expert_indices.clamp_min(0).long()
        # Empty slots add an exact 0 at expert 0, so the float sums are order-independent;
        # in-place into fresh zeros (differentiable in the weights), no [T, E] temporaries.
        probs = torch.zeros(T, E, dtype=self.weights.dtype, device=self.weights.device)
        probs.scatter_add_(1, idx, torch.where(valid, self.weights, 0))
        hits = torch.zeros(T, E, dtype=torch.uint8, device=idx.device)
        routing_map = hits.scatter_add_(1, idx, valid.to(torch.uint8)).bool()
        return probs, routing_map


# ----------------------------------------------------------------------------- dense mode
# Bits of `DenseRouting.row_flags` (uint8 [T]): what the gate found in each recorded row.
# A row with any bit set is a padding row, filled by the padding mode (see `gate_dense`).
ROW_EMPTY_SLOT = 1  # a slot holds -1
ROW_OUT_OF_RANGE = 2  # a slot holds an id outside [-1, E)
ROW_REPEAT = 4  # an expert id in [0, E) appears twice
ROW_MASKED = 8  # replay_mask is False for the row (its recorded ids are not looked at)
ROW_FLAG_NAMES = {ROW_EMPTY_SLOT: "a -1 slot", ROW_OUT_OF_RANGE: "an id outside [-1, E)",
                  ROW_REPEAT: "a repeated expert", ROW_MASKED: "replay_mask False"}
# How the dense gate fills a padding row (`gate_dense(padding=...)`); the codes are the
# native kernels' (csrc/include/replay_math.h: kPadEmpty, kPadSpread, kPadFallback,
# kPadSelect). "empty" and "select" serve replay_ops.gate too.
PADDING_MODES = {"empty": 0, "spread": 1, "fallback": 2, "select": 3}


def describe_row_flags(flags: int) -> str:
    """'a -1 slot, a repeated expert' for flags 5."""
    return ", ".join(name for bit, name in ROW_FLAG_NAMES.items() if flags & bit) or "none"


# The rotation of padding="spread": W(c) = ((c * _SPREAD_HASH) mod 2^32) * E // 2^32.
_SPREAD_HASH = 2654435769


def spread_rows(T: int, E: int, K: int, ep_size: int, offset: int, device) -> torch.Tensor:
    """int64 [T, K]: the experts of every row under padding="spread" (the formula of
    replay_ops.reference.spread_expert), computed for all rows at once, no host read."""
    s = torch.arange(T, device=device, dtype=torch.long)[:, None] * K
    c = torch.div(s, E, rounding_mode="floor")
    w = torch.bitwise_right_shift((c * _SPREAD_HASH) % (1 << 32) * E, 32)
    i = (offset % E + s + torch.arange(K, device=device) + w) % E
    local = E // ep_size
    return (i % ep_size) * local + torch.div(i, ep_size, rounding_mode="floor")


class DenseRouting(NamedTuple):
    """The result of `replay_ops.gate_dense`: Megatron-Core's routing contract plus the
    per-row flags and the dispatch plan of the same routing."""

    probs: torch.Tensor  # [T, E], logits dtype: the gate weight of each routed expert, else 0
    routing_map: torch.Tensor  # [T, E] bool: the experts each token is routed to
    row_flags: torch.Tensor  # [T] uint8: ROW_* bits of the recorded row (before filling)
    expert_indices: torch.Tensor  # [T, K] int32: the routed experts in slot order, -1 empty
    plan: "RoutingPlan | None"  # the dispatch plan of that routing (weights=None), or None
    # with return_agreement=True (else None): as RoutingPlan.agreement and .set_logprob
    agreement: torch.Tensor | None = None
    set_logprob: torch.Tensor | None = None
