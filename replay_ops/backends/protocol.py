"""The contract every backend module fulfils.

A backend is a module (`replay_ops.backends.torch`, `.triton`, `.native`) that defines
`NAME`, `available(device_type) -> Support`, `supports(op, device_type, shape, dtype) ->
Support`, and the ten kernels below. The registry (`replay_ops.backends`) checks the
contract when it loads a module: a module that lacks one of them is a programming error and
raises `BackendContractError` at once, instead of being reported as "unavailable".

The ops (`replay_ops/ops.py`) have already checked every input (shapes, dtypes, devices,
options, and with `validate=True` the index values) and applied the `replay_mask` fallback
before a kernel is called. Index semantics every kernel shares: a value outside `[0, E)`
is an empty slot (weight 0, `expert_indices` -1, `row_id_map` -1, no row, not counted).

Kernel signatures (T tokens, E experts, K slots, H hidden size, R permuted rows; `opts`
is the calls' `replay_ops.GateOptions`, replay_ops/options.py: the gate kernels read its
score_func, normalize, scaling_factor and align, the dense ones also its padding, ep_size,
spread_offset (already reduced modulo E), underflow_guard and with_plan):

    gate_fwd(logits [T,E], expert_indices [T,K] int16/32/64 any strides, opts)
        -> (weights [T,K], expert_indices int32 [T,K], tokens_per_expert int32 [E],
            expert_offsets int32 [E+1], row_id_map int32 [T,K],
            sorted_slots int32 [plan_capacity])
    gate_bwd(grad_weights [T,K], logits [T,E], expert_indices int32 [T,K], opts)
        -> grad_logits [T,E]
    permute_fwd(hidden [T,H], sorted_slots, row_id_map, num_rows: int) -> [num_rows, H]
    permute_bwd(grad_out [R,H], row_id_map) -> grad_hidden [T,H]
    unpermute_fwd(expert_out [R,H], row_id_map, weights [T,K]) -> [T,H]
    unpermute_bwd(grad_out [T,H], expert_out, row_id_map, sorted_slots, weights)
        -> (grad_expert_out [R,H], grad_weights [T,K])

Dense mode (Megatron-Core's contract; replay_ops.gate_dense):

    gate_dense_fwd(logits [T,E], expert_indices [T,K] int16/32/64 any strides,
                   replay_mask [T] bool or None, fallback [T,K] int or None, opts)
        -> (probs [T,E] logits dtype, routing_map [T,E] bool, row_flags [T] uint8,
            expert_indices int32 [T,K], tokens_per_expert, expert_offsets, row_id_map,
            sorted_slots)   (the four plan tensors have size 0 with with_plan=False)
    gate_dense_bwd(grad_probs [T,E] logits dtype any strides, logits, expert_indices int32,
                   opts) -> grad_logits [T,E]
    permute_probs_fwd(probs [T,E], sorted_slots, expert_indices int32 [T,K], num_rows)
        -> [num_rows]: probs[s // K, expert_indices[s]] for the slot s of each row, else 0
    permute_probs_bwd(grad [R], row_id_map, expert_indices int32, num_experts)
        -> [T,E] in grad's dtype: grad[row_id_map[t,k]] at (t, expert_indices[t,k]), else 0
"""
from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch

# The ops a backend serves, by the name `supports` is asked with.
OPS = ("gate_fwd", "gate_bwd", "permute_fwd", "permute_bwd", "unpermute_fwd", "unpermute_bwd",
       "gate_dense_fwd", "gate_dense_bwd", "permute_probs_fwd", "permute_probs_bwd")
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


class OpShape(NamedTuple):
    """The sizes `supports` decides on: tokens T, experts E (0 where the op does not know
    them), slots per token K, hidden size H (0 for the gate)."""

    T: int
    E: int
    K: int
    H: int = 0


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
