"""Expert parallelism for the Hugging Face integration.

    from replay_ops.integrations import hf
    patch = hf.patch_model(model, "R3", ep_group=group)   # every rank, same model and group

`patch_model(..., ep_group=g)` patches the model as usual and then calls
`enable_expert_parallel(patch, g)`, which gives every MoE block an expert-parallel state
(`EPState`) that the one patched forward (`block.patched_forward`) runs the experts
through. Each block forward then

1. runs the block's router on this rank's tokens and asks the `RouterReplay` for the plan
   exactly as the single-device patch does (RECORD, REPLAY_FORWARD, the recompute queue);
   with replay disabled or no action set it takes the model's own routing: the router's
   own indices and weights, so a disabled patch computes the unpatched model's MoE;
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
(`replay_ops.integrations.hf.block.rows_experts`, the implementation the config names):
with "grouped_mm" a grouped GEMM over the received rows and `handle.local_offsets`. The
whole exchange runs inside the experts module's own call (`block.call_experts`), so its
hooks run around it as on one device.

Host reads per MoE block forward: the dispatch's one (the split sizes of the exchange); the
experts add none with "grouped_mm" (its fallback op and "eager" read what they read
unpatched).

The exchange itself is `replay_ops.distributed` (dispatch, combine, the failure report);
this module imports it, never the other way round.
"""
from __future__ import annotations

import dataclasses

import torch

from replay_ops.distributed import ep

from .block import rows_experts

__all__ = ["enable_expert_parallel", "EPState"]


@dataclasses.dataclass
class EPState:
    """Per-block expert-parallel state (`block._replay_ops_ep`): the `ExpertsRunner` the
    patched forward runs the experts through."""

    group: object | None
    rank: int
    world_size: int
    local_experts: range
    sharded: bool

    def run_experts(self, experts: torch.nn.Module, x: torch.Tensor, plan) -> torch.Tensor:
        """dispatch -> this rank's experts over the rows it received -> combine."""
        x_local, handle = ep.dispatch(x, plan, self.group)
        y_local = rows_experts(experts, x_local, handle.local_plan, self.local_experts,
                               self.sharded)
        return ep.combine(y_local, handle)

    def report_failure(self, exc: BaseException):
        ep.report_failure(exc, self.group)


def enable_expert_parallel(patch, group=None, *, shard_weights: bool = True):
    """Run every MoE block of `patch` (a `ReplayPatch` from
    `replay_ops.integrations.hf.patch_model`) with its experts sharded over `group`.
    Every rank of the group must call it on the same model. Returns `patch`."""
    group, rank, world = ep.group_info(group)
    lay = patch.moe
    E = lay.num_experts
    if E % world:
        raise ep.DistributedInputError(
            f"replay_ops.integrations.hf.ep: the model has num_experts E={E}, not divisible "
            f"by the expert-parallel group size W={world} (rank {rank})"
        )
    for lid, block in lay.blocks.items():
        if getattr(block, "_replay_ops_ep", None) is not None:
            raise RuntimeError(f"replay_ops.integrations.hf.ep: layer {lid} is already expert "
                               f"parallel")
        if block.__dict__.get("_replay_ops_layer") is None:
            raise RuntimeError(f"replay_ops.integrations.hf.ep: layer {lid} is not patched "
                               f"(the patch was removed); patch the model again")
    n = E // world
    local = range(rank * n, (rank + 1) * n)
    for lid, block in lay.blocks.items():
        experts = block.experts
        if shard_weights:
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(experts, name)
                part = torch.nn.Parameter(full.detach()[local.start:local.stop].clone(),
                                          requires_grad=full.requires_grad)
                setattr(experts, name, part)
            # the experts forward patch_model installed (block.experts_forward) now refuses
            # to run as the unpatched block calls it; it stays after patch.remove()
            experts._replay_ops_sharded = True
        block._replay_ops_ep = EPState(group, rank, world, local, shard_weights)
    patch.ep_group = group
    return patch
