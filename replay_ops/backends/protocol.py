"""The contract every backend module fulfils.

A backend is a module (`replay_ops.backends.torch`, `.triton`, `.native`) that defines
`NAME`, `available(device_type) -> Support`, `supports(op, device_type, shape, dtype) ->
Support`, and the ten kernels below. The registry (`replay_ops.backends`) checks the
contract when it loads a module: a module that lacks one of them is a programming error and
raises `BackendContractError` at once, instead of being reported as "unavailable".

The ops (`replay_ops/ops.py`) have already checked every input (shapes, dtypes, devices,
options, the selection's sizes, and with `validate=True` the index values) before a kernel
is called. Index semantics every kernel shares: a value outside `[0, E)` is an empty slot
(weight 0, `expert_indices` -1, `row_id_map` -1, no row, not counted), unless its row is
flagged and selected (below).

Kernel signatures (T tokens, E experts, K slots, H hidden size, R permuted rows; `opts`
is the call's `replay_ops.GateOptions`, replay_ops/options.py: the gate kernels read its
score_func, normalize, scaling_factor, align, padding, selection and return_agreement, the
dense ones also its ep_size, spread_offset (already reduced modulo E), underflow_guard and
with_plan):

    gate_fwd(logits [T,E], expert_indices [T,K] int16/32/64 any strides,
             replay_mask [T] bool or None, opts)
        -> (weights [T,K], expert_indices int32 [T,K], tokens_per_expert int32 [E],
            expert_offsets int32 [E+1], row_id_map int32 [T,K],
            sorted_slots int32 [plan_capacity], agreement bool [T], set_logprob [T])
           (agreement and set_logprob have size 0 unless opts.return_agreement;
            set_logprob is in the compute dtype: float32, float64 for float64 logits)
    gate_bwd(grad_weights [T,K], logits [T,E], expert_indices int32 [T,K], opts,
             grad_set_logprob [T] compute dtype or None)
        -> grad_logits [T,E]
    permute_fwd(hidden [T,H], sorted_slots, row_id_map, num_rows: int) -> [num_rows, H]
    permute_bwd(grad_out [R,H], row_id_map) -> grad_hidden [T,H]
    unpermute_fwd(expert_out [R,H], row_id_map, weights [T,K]) -> [T,H]
    unpermute_bwd(grad_out [T,H], expert_out, row_id_map, sorted_slots, weights)
        -> (grad_expert_out [R,H], grad_weights [T,K])

Optional fused kernels (FUSED_OPS; replay_ops.gate(..., hidden=)). A backend may define
them; one that does not, or whose `supports` refuses them, gets gate_fwd then permute_fwd
(gate_bwd then permute_bwd) called one after the other by the op, with the same results:

    gate_permute_fwd(logits, expert_indices, replay_mask, opts, hidden [T,H], num_rows)
        -> gate_fwd's eight outputs, then rows [num_rows, H] (permute_fwd's output for
           that plan), bitwise as the two kernels in turn
    gate_permute_bwd(grad_weights [T,K], grad_rows [R,H], logits, expert_indices int32,
                     row_id_map, opts, grad_set_logprob or None)
        -> (gate_bwd's grad_logits, permute_bwd's grad_hidden [T,H]), bitwise as those two

Today the torch backend and the native CPU kernels define them.

Dense mode (Megatron-Core's contract; replay_ops.gate_dense):

    gate_dense_fwd(logits [T,E], expert_indices [T,K] int16/32/64 any strides,
                   replay_mask [T] bool or None, fallback [T,K] int or None, opts)
        -> (probs [T,E] logits dtype, routing_map [T,E] bool, row_flags [T] uint8,
            expert_indices int32 [T,K], tokens_per_expert, expert_offsets, row_id_map,
            sorted_slots, agreement, set_logprob)   (the four plan tensors have size 0
            with with_plan=False; agreement and set_logprob as in gate_fwd)
    gate_dense_bwd(grad_probs [T,E] logits dtype any strides, logits, expert_indices int32,
                   opts, grad_set_logprob [T] or None) -> grad_logits [T,E]
    permute_probs_fwd(probs [T,E], sorted_slots, expert_indices int32 [T,K], num_rows)
        -> [num_rows]: probs[s // K, expert_indices[s]] for the slot s of each row, else 0
    permute_probs_bwd(grad [R], row_id_map, expert_indices int32, num_experts)
        -> [T,E] in grad's dtype: grad[row_id_map[t,k]] at (t, expert_indices[t,k]), else 0

Features (`OpShape.features`, a subset of FEATURES). A gate call may need, beyond the
plain replayed gate:

    SELECT     (gate_fwd with a replay_mask or opts.padding == "select"; gate_dense_fwd with
               opts.padding == "select"): the model's own selection of the flagged rows,
               computed inside the gate kernel from the logits row it reads;
    AGREEMENT  (gate_fwd / gate_dense_fwd with opts.return_agreement; gate_bwd /
               gate_dense_bwd given a grad_set_logprob): the agreement outputs, or the set
               log-prob gradient.

A backend whose kernels lack a feature answers `supports(...)` with
`Support(False, reason)` when `shape.features` holds it, and the registry runs the next
backend in the device's order (the torch backend implements both). Today every backend
implements both (the native CUDA kernels for K <= MAX_TOPK).
A backend that implements them follows the rules below exactly (the reference,
`replay_ops.reference`, is the oracle; integer outputs must match it exactly).

Flagged rows. `gate_fwd`: row t is flagged when replay_mask[t] is False, or, with
padding == "select", when its recorded ids hold a -1, an id outside [0, E) (tested on the
full-width value) or an id twice (`reference.padding_row`). `gate_dense_fwd`: with
padding == "select", a row with any row flag (ROW_* bits) is selected, except a masked row
when `fallback` is given (it takes its fallback row, as in every padding mode). A flagged
row's used experts (`expert_indices[t]`) are the selection of row t, in its rank order;
its weights are computed from them like any row's. Unflagged rows are untouched: their
cost must not change, and the selection must cost time only on flagged rows (no pass over
every row, no extra launch, no host read).

The selection of row t (replay_ops.Selection; csrc/include/replay_select.h implements it
framework-free, `__host__ __device__`-ready):

  1. values. If `selection.ranks_logits` (no expert_bias, and source "logits", or source
     "scores" without round_scores or groups): v_j = x_j, the logit in the compute dtype.
     Otherwise u_j = x_j (source "logits") or the score of x_j in the compute dtype
     (softmax: exp(x_j - m) / s with m the row max and s the sum of exp(x - m) over all E;
     sigmoid; sqrt-softplus, scores.py); with round_scores u_j is rounded to the logits
     dtype and widened back; v_j = u_j + float(expert_bias[j]) when there is a bias.
  2. rank order: (a, i) before (b, j) when a > b, or a == b and i < j; NaN before every
     number, NaNs in ascending id (torch.sort(descending=True, stable=True)).
  3. without groups: the K first experts in rank order.
     With groups (num_groups G > 0, group_topk > 0): size = E / G; the score of group g is
     the sum, in the compute dtype, of the n first values of experts [g*size, (g+1)*size)
     in rank order, added largest first, with n = group_score_topn or K // group_topk
     (`Selection.group_topn(K)`); the group_topk first groups in rank order (by group
     score, then group id) are kept; the K first experts of the kept groups in rank order.
  4. the K experts are written in rank order.
  The ops guarantee: K <= E; with groups E % G == 0, 1 <= group_topk <= G,
  1 <= n <= size and K <= group_topk * size; expert_bias is float [E] on the logits'
  device.

Agreement outputs (opts.return_agreement), per row t, with S the set of row t's distinct
used experts (its ids in [0, E) after the flagged-row selection, each counted once):

    agreement[t]   = the K used entries are exactly the K experts the selection picks
                     (a permutation of them: no -1, no repeat). A selected row agrees.
    set_logprob[t] = softmax: logsumexp(x[S]) - logsumexp(x) (all E);
                     sigmoid / sqrt-softplus: log(sum_S f(x_e)) - log(sum_E f(x_j));
                     -inf when S is empty, when max x[S] is -inf, or when the mass is 0.
                     It never depends on normalize, scaling_factor or the selection.
    gradient (gate_bwd / gate_dense_bwd add it to the weights' gradient, in the same
    kernel that writes the row; no atomics), for g = grad_set_logprob[t]:
        softmax:      g * ([j in S] exp(x_j - lse_S) - exp(x_j - lse)),
        element-wise: g * f'(x_j) * ([j in S] / mass_S - 1 / mass_E),
        and 0 for the whole row where set_logprob[t] is -inf.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch

# The ops a backend serves, by the name `supports` is asked with.
OPS = ("gate_fwd", "gate_bwd", "permute_fwd", "permute_bwd", "unpermute_fwd", "unpermute_bwd",
       "gate_dense_fwd", "gate_dense_bwd", "permute_probs_fwd", "permute_probs_bwd")
# Kernels a backend may define (see above); the op composes them from OPS otherwise.
FUSED_OPS = ("gate_permute_fwd", "gate_permute_bwd")
# Everything the registry requires of a backend module.
REQUIRED = ("NAME", "available", "supports") + OPS


class Support(NamedTuple):
    """Whether a backend serves a call, and why not when it does not."""

    ok: bool
    reason: str = ""
    # A fault the user should hear of when automatic selection passes the backend over (an
    # extension built for another torch, no kernel image for the GPU), as opposed to a
    # choice or a plain absence (not built, not installed, a size limit).
    loud: bool = False

    def __bool__(self) -> bool:  # `if backend.supports(...)` reads naturally
        return self.ok


YES = Support(True)


# The features a gate call may need beyond the plain replayed gate (OpShape.features).
SELECT = "select"  # the model's own selection of flagged rows, inside the kernel
AGREEMENT = "agreement"  # the agreement outputs (forward) or the set log-prob gradient
FEATURES = (SELECT, AGREEMENT)


class OpShape(NamedTuple):
    """The sizes `supports` decides on: tokens T, experts E (0 where the op does not know
    them), slots per token K, hidden size H (0 for the gate), the `features` of the call
    that a backend may lack (a subset of FEATURES; empty for every op but the gates), and
    `select_list`: with a feature in a gate's forward, the longest ranked list its
    selection keeps, max(K, group_topk, the group score's n) (replay_ops.Selection); 0
    where not given, which reads as K."""

    T: int
    E: int
    K: int
    H: int = 0
    features: frozenset = frozenset()
    select_list: int = 0


class BackendContractError(TypeError):
    """A backend module that does not fulfil the contract (a missing kernel or predicate)."""


@runtime_checkable
class Backend(Protocol):
    NAME: str

    def available(self, device_type: str) -> Support: ...

    def supports(self, op: str, device_type: str, shape: OpShape, dtype: torch.dtype) -> Support:
        ...

    def gate_fwd(self, logits, expert_indices, opts): ...

    def gate_bwd(self, grad_weights, logits, expert_indices, opts): ...

    def permute_fwd(self, hidden, sorted_slots, row_id_map, num_rows): ...

    def permute_bwd(self, grad_out, row_id_map): ...

    def unpermute_fwd(self, expert_out, row_id_map, weights): ...

    def unpermute_bwd(self, grad_out, expert_out, row_id_map, sorted_slots, weights): ...

    def gate_dense_fwd(self, logits, expert_indices, replay_mask, fallback, opts): ...

    def gate_dense_bwd(self, grad_probs, logits, expert_indices, opts): ...

    def permute_probs_fwd(self, probs, sorted_slots, expert_indices, num_rows): ...

    def permute_probs_bwd(self, grad, row_id_map, expert_indices, num_experts): ...


def check_contract(module) -> None:
    """Raise BackendContractError naming every member of the contract the module lacks."""
    missing = [name for name in REQUIRED if not hasattr(module, name)]
    not_callable = [name for name in REQUIRED[1:] if hasattr(module, name)
                    and not callable(getattr(module, name))]
    if missing or not_callable:
        raise BackendContractError(
            f"replay_ops backend module {module.__name__!r} does not fulfil the backend "
            f"contract (replay_ops/backends/protocol.py): missing {missing}, not callable "
            f"{not_callable}"
        )
