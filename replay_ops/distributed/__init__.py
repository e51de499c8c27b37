"""Expert parallelism over torch.distributed, driven by a replayed `RoutingPlan`.

    from replay_ops import distributed as ep

    plan = ep.gate(logits, recorded, group=g, align=16)   # replay_ops.gate, checks deferred
    x_local, handle = ep.dispatch(hidden, plan, g)        # rows to the ranks owning experts
    y_local = my_grouped_mlp(x_local, handle.local_offsets)
    out = ep.combine(y_local, handle)                     # back, weighted by the gates

An expert-parallel group of W ranks holds E experts (E % W == 0; rank r owns experts
r*E/W .. (r+1)*E/W - 1, global logical ids). One host sync per dispatch (the receive
counts), none in combine or in the backward passes. Outputs and gradients are bitwise
identical run after run: received rows are ordered by (source rank, token, slot), never
by arrival, and no step uses floating-point atomics. Bad input on any rank raises
`DistributedInputError` on every rank. See docs/distributed.md.

The Hugging Face integration's expert-parallel MoE forward is built on these
(`replay_ops.integrations.hf.ep`; `replay_ops.integrations.hf.patch_model(model, mode,
ep_group=g)`); nothing here imports it.
"""
from __future__ import annotations

from .ep import (
    CheckedRoutingPlan,
    DispatchHandle,
    DistributedInputError,
    combine,
    dispatch,
    gate,
    group_info,
    local_expert_range,
    report_failure,
)

__all__ = [
    "CheckedRoutingPlan",
    "DispatchHandle",
    "DistributedInputError",
    "combine",
    "dispatch",
    "gate",
    "group_info",
    "local_expert_range",
    "report_failure",
]
