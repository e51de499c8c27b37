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
   each rank runs its E/W experts (one SwiGLU per expert segment), and
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

Host reads per MoE block forward: the dispatch's one, plus one in the expert loop (the
per-expert row counts, to slice the segments; a grouped GEMM on `handle.local_offsets`
would not need it).
"""
from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn.functional as F

import replay_ops
from replay_ops.router_replay import ReplayAction

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


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


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


def _route(patch, lid, block, logits, native_w, native_idx):
    """The plan for this block, as the single-device patch computes it; native routing
    (the router's own indices and weights) where the replay object returns none.
    Returns (plan, record) where `record` says whether this is a routed, non-recompute
    forward (whose indices `patch.last_routing()` reports)."""
    replay = patch.replay
    spec = patch.layout.spec
    gate = block.gate

    def topk_fn(lg: torch.Tensor) -> torch.Tensor:
        if lg.shape == logits.shape and lg.data_ptr() == logits.data_ptr():
            return native_idx
        return spec.topk(gate, lg)

    opts = dict(score_func=spec.score_func, normalize=spec.normalize(gate),
                scaling_factor=spec.scaling_factor(gate))
    action = replay.action
    plan, record = None, False
    if replay.enabled and action is not None:
        recompute = patch.auto_recompute and action in (
            ReplayAction.REPLAY_FORWARD, ReplayAction.RECORD) and _in_backward()
        if recompute and action is ReplayAction.RECORD:
            with torch.no_grad():
                idx = topk_fn(logits.detach())
            plan = replay_ops.gate(logits, idx, validate=replay.config.validate, **opts)
        elif recompute:
            replay.set_action(ReplayAction.REPLAY_BACKWARD)
            try:
                plan = replay.route(lid, logits, topk_fn=topk_fn, **opts)
            finally:
                replay.set_action(action)
        else:
            plan = replay.route(lid, logits, topk_fn=topk_fn, **opts)
        record = plan is not None and not recompute
    if plan is None:
        # Native routing: the router's own choice and weights, as the unpatched block.
        plan = replay_ops.gate(logits, native_idx, validate=False, **opts)
        plan = plan._replace(weights=native_w.to(plan.weights.dtype))
    return plan, record


def _ep_forward(block: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    patch, lid = block._replay_ops_layer
    st: EPState = block._replay_ops_ep
    spec = patch.layout.spec
    try:
        if spec.jitter and block.training and block.jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - block.jitter_noise, 1.0 + block.jitter_noise)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits, native_w, native_idx = block.gate(x)
        if spec.weights_fp32:
            logits = logits.float()
        plan, record = _route(patch, lid, block, logits, native_w, native_idx)
    except Exception as exc:  # every rank raises, none waits in the exchange
        ep.report_failure(exc, st.group)
    if record and isinstance(getattr(patch, "_last", None), dict):
        patch._last[lid] = plan.expert_indices
    x_local, handle = ep.dispatch(x, plan, st.group)
    y_local = _local_experts(block.experts, x_local, handle, st)
    routed = ep.combine(y_local, handle)
    if spec.add_shared is not None:
        out = spec.add_shared(block, x, hidden_states, routed)
    else:
        out = routed
    return out.reshape(hidden_states.shape)


def _local_experts(experts, x_local: torch.Tensor, handle: ep.DispatchHandle,
                   st: EPState) -> torch.Tensor:
    """One SwiGLU per local expert segment (align 1: the segments tile the buffer)."""
    counts = handle.tokens_per_local_expert.tolist()  # the expert loop's host read
    apply_gate = getattr(experts, "_apply_gate", None)
    outs, start = [], 0
    for j, n in enumerate(counts):
        if n == 0:
            continue
        e = j if st.sharded else st.local_experts[j]
        seg = x_local[start:start + n]
        start += n
        gate_up = F.linear(seg, experts.gate_up_proj[e])
        if apply_gate is not None:
            h = apply_gate(gate_up)
        else:
            g, u = gate_up.chunk(2, dim=-1)
            h = experts.act_fn(g) * u
        outs.append(F.linear(h, experts.down_proj[e]))
    # No rows: the (empty) input itself, still attached to the graph.
    return torch.cat(outs, dim=0) if outs else x_local
