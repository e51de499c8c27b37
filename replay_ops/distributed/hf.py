"""Expert parallelism for the Hugging Face integration.

    from replay_ops.integrations import hf
    patch = hf.patch_model(model, "R3", ep_group=group)   # every rank, same model and group

`patch_model(..., ep_group=g)` patches the model as usual and then calls
`enable_expert_parallel(patch, g)`, which gives every MoE block a forward that

1. runs the block's router on this rank's tokens and asks the `RouterReplay` for the plan
   exactly as the single-device patch does (RECORD, REPLAY_FORWARD, the recompute queue);
   with replay disabled or no action set it routes natively: the router's own indices
   and weights, so a disabled patch computes the unpatched model's MoE;
2. `replay_ops.distributed.dispatch` sends the rows to the ranks owning their experts,
   each rank runs its E/W experts (a grouped GEMM over its expert segments), and
   `replay_ops.distributed.combine` brings the results back, weighted by the gates;
3. adds the shared experts where the architecture has them (replicated on every rank).

With `shard_weights=True` (the default) each block keeps only its own experts' weights:
`experts.gate_up_proj` and `experts.down_proj` become `[E/W, ...]` parameters holding
experts `rank*E/W .. (rank+1)*E/W - 1`, and their gradients are this rank's experts'
gradients. Everything else (attention, routers, shared experts) stays replicated; as in
data parallelism, average or sum its gradients over the group yourself. Sharding cannot be
undone: after `patch.remove()` calling the experts module raises instead of computing
with the wrong experts. With `shard_weights=False` the full weights stay and only the
compute is sharded.

A rank whose routing fails (for example an out-of-range recorded expert under
`validate=True`) reports the error through the dispatch header exchange, so every rank
raises `DistributedInputError` naming it; none is left waiting.

The experts run through the same function as on one device
(`replay_ops.integrations.hf_block.rows_experts`, the implementation the config names):
with "grouped_mm" a grouped GEMM over the received rows and `handle.local_offsets`.

Host reads per MoE block forward: the dispatch's one (the split sizes of the exchange); the
experts add none with "grouped_mm" (its fallback op and "eager" read what they read
unpatched).
"""
from __future__ import annotations

import dataclasses
import types

import torch

import replay_ops
from replay_ops.integrations.hf_block import block_forward, route_block, rows_experts

from . import ep

__all__ = ["enable_expert_parallel", "EPState"]


@dataclasses.dataclass
class EPState:
    """Per-block expert-parallel state (`block._replay_ops_ep`)."""

    group: object | None
    rank: int
    world_size: int
    local_experts: range
    sharded: bool


def _sharded_experts_forward(experts, *args, **kwargs):
    raise RuntimeError(
        "replay_ops.distributed.hf: this experts module holds only this rank's experts "
        f"(shape {tuple(experts.gate_up_proj.shape)}, sharded by enable_expert_parallel); it "
        "runs only through the expert-parallel patched forward, not the original one"
    )


def enable_expert_parallel(patch, group=None, *, shard_weights: bool = True):
    """Run every MoE block of `patch` (a `ReplayPatch` from
    `replay_ops.integrations.hf.patch_model`) with its experts sharded over `group`.
    Every rank of the group must call it on the same model. Returns `patch`."""
    group, rank, world = ep.group_info(group)
    lay = patch.layout
    E = lay.num_experts
    if E % world:
        raise ep.DistributedInputError(
            f"replay_ops.distributed.hf: the model has num_experts E={E}, not divisible by "
            f"the expert-parallel group size W={world} (rank {rank})"
        )
    n = E // world
    local = range(rank * n, (rank + 1) * n)
    for lid, block in lay.blocks.items():
        if getattr(block, "_replay_ops_ep", None) is not None:
            raise RuntimeError(f"replay_ops.distributed.hf: layer {lid} is already expert "
                               f"parallel")
        experts = block.experts
        if shard_weights:
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(experts, name)
                part = torch.nn.Parameter(full.detach()[local.start:local.stop].clone(),
                                          requires_grad=full.requires_grad)
                setattr(experts, name, part)
            experts.forward = types.MethodType(_sharded_experts_forward, experts)
        block._replay_ops_ep = EPState(group, rank, world, local, shard_weights)
        block.forward = types.MethodType(_ep_forward, block)
    patch.ep_group = group
    return patch


def _ep_forward(block: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    layer = block.__dict__.get("_replay_ops_layer")
    if layer is None:  # removed, but called through a wrapper installed after patching
        return type(block).forward(block, hidden_states)  # sharded experts raise there
    patch, lid = layer
    st: EPState = block._replay_ops_ep
    spec = patch.layout.spec
    try:
        # routed exactly as the single-device patch routes (RECORD, REPLAY_FORWARD, the
        # recompute queue)
        r = route_block(patch, lid, block, hidden_states)
        plan = r.plan
        if plan is None:
            # Native routing: the router's own choice and weights, as the unpatched block.
            plan = replay_ops.gate(r.logits, r.native_indices, validate=False,
                                   score_func=spec.score_func,
                                   normalize=spec.normalize(block.gate),
                                   scaling_factor=spec.scaling_factor(block.gate))
            plan = plan._replace(weights=r.native_weights.to(plan.weights.dtype))
    except Exception as exc:  # every rank raises, none waits in the exchange
        ep.report_failure(exc, st.group)
    if r.plan is not None and not r.recompute:
        patch._last[lid] = plan.expert_indices

    def run_experts(experts, x, plan):
        # dispatch -> this rank's experts over the rows it received -> combine
        x_local, handle = ep.dispatch(x, plan, st.group)
        y_local = rows_experts(experts, x_local, handle.local_plan, st.local_experts,
                               st.sharded)
        return ep.combine(y_local, handle)

    return block_forward(block, dataclasses.replace(r, plan=plan), spec, run_experts)


_ep_forward._replay_ops_forward = True  # unpatching removes it
