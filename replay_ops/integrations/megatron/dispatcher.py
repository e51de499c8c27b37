"""A Megatron all-to-all dispatcher that permutes with the router's `RoutingPlan`.

Megatron's `MoEAlltoAllTokenDispatcher` permutes tokens expert-major by transposing the
`[T, E]` routing map and masked-selecting token ids (`moe_utils.permute`), and restores
them with a scatter-add (`moe_utils.unpermute`). The replay router already has that
order: `plan.sorted_slots` lists the slots expert-major with tokens ascending, which is
exactly Megatron's order. `PlanAlltoAllTokenDispatcher` uses it:

* permutation 1 (before the EP all-to-all): `replay_ops.permute(hidden, plan,
  num_rows=T*K)`, and the permuted probs are gathered from the dense probs the router
  returned (so the aux-loss hook attached to them still fires);
* un-permutation 1 (after the combine all-to-all): `replay_ops.unpermute` with unit
  weights (Megatron's experts already applied the probs): a per-token gather-sum in fp32,
  in the recorded column order, with no scatter and no atomics.

Everything else (splits, the all-to-alls, the sort by local expert, TP gathers) is
Megatron's code. Only the all-to-all dispatcher can take this path: the all-gather
dispatcher permutes after gathering every rank's tokens (a plan of the local tokens does
not describe them), and the flex dispatcher permutes inside DeepEP/HybridEP.

Whether it pays is measured by `bench/bench_megatron.py` (see docs/megatron.md): it is
off by default; `enable_plan_dispatch(model)` turns it on.
"""
from __future__ import annotations

import torch

import replay_ops
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from .router import ReplayTopKRouter, UnsupportedConfigError

__all__ = ["PlanAlltoAllTokenDispatcher", "enable_plan_dispatch", "check_plan_dispatch_config"]


def check_plan_dispatch_config(config, *, where: str = "enable_plan_dispatch") -> None:
    """Raise UnsupportedConfigError naming the flag for settings whose routing map is
    changed after the gate (so the plan no longer describes it) or that permute elsewhere."""
    checks = [
        ("moe_token_dispatcher_type", config.moe_token_dispatcher_type != "alltoall",
         "only the all-to-all dispatcher permutes the local tokens before communication"),
        ("moe_expert_capacity_factor", config.moe_expert_capacity_factor is not None,
         "token dropping changes the routing map after the gate"),
        ("moe_pad_expert_input_to_capacity", bool(config.moe_pad_expert_input_to_capacity),
         "padding to capacity changes the routing map after the gate"),
        ("moe_router_padding_for_quantization",
         bool(getattr(config, "moe_router_padding_for_quantization", False)),
         "the dispatcher pads the routing map for FP8/FP4"),
        ("moe_permute_fusion", bool(config.moe_permute_fusion),
         "TransformerEngine's fused permute replaces the permutation anyway"),
        ("moe_shared_expert_overlap", bool(config.moe_shared_expert_overlap),
         "the overlapped shared expert hooks into Megatron's own permute steps"),
    ]
    for flag, bad, why in checks:
        if bad:
            raise UnsupportedConfigError(
                f"{where}: {flag}={getattr(config, flag)!r} is not supported by the plan "
                f"dispatcher ({why}); leave Megatron's dispatcher in place")


class PlanAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """MoEAlltoAllTokenDispatcher whose permutation 1 and its inverse use the replay
    router's RoutingPlan. When the router has no plan for the routing map it is given
    (replay off and fusion off), it runs Megatron's own permutation."""

    replay_router: ReplayTopKRouter | None = None

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        plan = None if self.replay_router is None else self.replay_router.plan_for(routing_map)
        self._plan = plan
        if plan is None:
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(self.routing_map)
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
            "before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = hidden_states.shape
        T, K = plan.expert_indices.shape
        E = routing_map.shape[1]
        rows = T * K  # dropless: exactly K distinct experts per row (the router's guarantee)
        permuted = replay_ops.permute(hidden_states, plan, num_rows=rows,
                                      backend=self.replay_router.replay_options.backend)
        slots = plan.sorted_slots[:rows].long()
        tok = torch.div(slots, K, rounding_mode="floor")
        expert = plan.expert_indices.reshape(-1)[slots].long()
        permuted_probs = probs.reshape(-1).index_select(0, tok * E + expert)
        # Megatron keeps the token ids of each permuted row for its unpermute; the same ids
        # (tokens ascending inside each expert) are kept for inspection and tests.
        self.reversed_local_input_permutation_mapping = tok
        return permuted, permuted_probs

    def combine_postprocess(self, permutated_local_input_tokens):
        plan = self._plan
        if plan is None:
            return super().combine_postprocess(permutated_local_input_tokens)
        ones = plan._replace(weights=torch.ones_like(plan.weights))
        output = replay_ops.unpermute(permutated_local_input_tokens, ones,
                                      backend=self.replay_router.replay_options.backend)
        self._plan = None
        return output.view(self.hidden_shape)


def enable_plan_dispatch(model) -> int:
    """Switch the all-to-all dispatcher of every MoE layer of `model` (a module or a list
    of chunks) whose router is a ReplayTopKRouter to PlanAlltoAllTokenDispatcher, in place.
    Returns the number of layers switched. Unsupported settings raise, naming the flag."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    n = 0
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        for name, m in chunk.named_modules():
            if not isinstance(m, MoELayer):
                continue
            if not isinstance(m.router, ReplayTopKRouter):
                raise UnsupportedConfigError(
                    f"enable_plan_dispatch: {name}.router is a {type(m.router).__name__}; the plan "
                    f"dispatcher needs the replay router (replay_spec or install first)")
            check_plan_dispatch_config(m.config, where=f"enable_plan_dispatch({name})")
            d = m.token_dispatcher
            if type(d) is MoEAlltoAllTokenDispatcher:
                d.__class__ = PlanAlltoAllTokenDispatcher
            elif not isinstance(d, PlanAlltoAllTokenDispatcher):
                raise UnsupportedConfigError(
                    f"enable_plan_dispatch: {name}.token_dispatcher is a {type(d).__name__}, not "
                    f"Megatron's MoEAlltoAllTokenDispatcher")
            d.replay_router = m.router
            d._plan = None
            n += 1
    if n == 0:
        raise UnsupportedConfigError("enable_plan_dispatch: the model has no MoE layer")
    return n
