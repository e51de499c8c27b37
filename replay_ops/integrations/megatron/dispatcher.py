"""A Megatron all-to-all dispatcher that permutes with the router's `RoutingPlan`.

Megatron's `MoEAlltoAllTokenDispatcher` counts the tokens per expert with a reduction of
the `[T, E]` routing map, permutes tokens expert-major by transposing that map and
masked-selecting token ids and probs (`moe_utils.permute`), and restores them with a
scatter-add into zeros (`moe_utils.unpermute`). The replay router's gate already wrote the
same order: `plan.sorted_slots` lists the slots expert-major with tokens ascending, which is
exactly Megatron's order. `PlanAlltoAllTokenDispatcher` uses it:

* the counts: `plan.tokens_per_expert` (from the gate kernel) replace the reduction of the
  routing map; Megatron's own `preprocess` computes every split and sync point from them;
* permutation 1 (before the EP all-to-all): `replay_ops.permute(hidden, plan,
  num_rows=T*K, probs=probs)`, one op for the rows and their probs (the dense probs the
  router returned, so the aux-loss hooks attached to them still get their gradient; the
  backward writes the dense probs gradient row by row);
* un-permutation 1 (after the combine all-to-all): `replay_ops.unpermute` with no weights
  (Megatron's experts already applied the probs): a per-token gather-sum in fp32, in the
  recorded column order, with no scatter, no atomics and no weight-gradient kernel.

Everything else (the all-to-alls, the sort by local expert, TP gathers) is Megatron's code.

Where it applies (`check_plan_dispatch_config`): the all-to-all dispatcher, dropless (no
`moe_expert_capacity_factor`, no `moe_pad_expert_input_to_capacity`), no
`moe_router_padding_for_quantization`, no `moe_permute_fusion` (TransformerEngine's fused
permute), no `moe_shared_expert_overlap`. `replay_spec` and `install` turn it on by default
wherever it applies (`ReplayMoELayer`); elsewhere Megatron's dispatcher stays. The
all-gather dispatcher permutes after gathering every rank's tokens (a plan of the local
tokens does not describe them), and the flex dispatcher permutes inside DeepEP/HybridEP.
`enable_plan_dispatch(model)` switches built layers and raises where it does not apply.
"""
from __future__ import annotations

import torch

import replay_ops
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from .router import ReplayTopKRouter, UnsupportedConfigError

__all__ = ["PlanAlltoAllTokenDispatcher", "ReplayMoELayer", "check_plan_dispatch_config",
           "enable_plan_dispatch", "plan_dispatch_problems", "use_plan_dispatcher"]


def plan_dispatch_problems(config) -> list[tuple[str, str]]:
    """(flag, why) for every setting under which the plan dispatcher does not apply: the
    routing map is changed after the gate (so the plan no longer describes it), or the
    tokens are permuted elsewhere. Empty when it applies."""
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
    return [(flag, why) for flag, bad, why in checks if bad]


def check_plan_dispatch_config(config, *, where: str = "enable_plan_dispatch") -> None:
    """Raise UnsupportedConfigError naming the flag for settings whose routing map is
    changed after the gate (so the plan no longer describes it) or that permute elsewhere."""
    for flag, why in plan_dispatch_problems(config):
        raise UnsupportedConfigError(
            f"{where}: {flag}={getattr(config, flag)!r} is not supported by the plan "
            f"dispatcher ({why}); leave Megatron's dispatcher in place")


class _PlanCounts:
    """What Megatron's dropless `preprocess(routing_map)` reads of the routing map, from the
    plan: the tokens per expert (`routing_map.sum(dim=0)`, here the gate kernel's counts),
    the routed total (`routing_map.sum()`, which a patched `preprocess` may read, e.g.
    ms-swift's `num_out_tokens` fix under router replay) and the row count. Megatron's split
    and sync-point logic then runs unchanged."""

    def __init__(self, routing_map: torch.Tensor, counts: torch.Tensor):
        self._map, self._counts = routing_map, counts

    def sum(self, dim=None, *a, **k):
        if a or k or dim not in (None, 0):
            raise AttributeError("_PlanCounts serves routing_map.sum(dim=0) and .sum() only")
        return self._counts if dim == 0 else self._counts.sum()

    def size(self, dim=None):
        return self._map.size() if dim is None else self._map.size(dim)

    @property
    def shape(self):
        return self._map.shape


class PlanAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """MoEAlltoAllTokenDispatcher whose counts, permutation 1 and its inverse use the replay
    router's RoutingPlan. When the router has no plan for the routing map it is given
    (replay off and fusion off), it runs Megatron's own code."""

    replay_router: ReplayTopKRouter | None = None

    def _backend(self):
        return self.replay_router.replay_options.backend

    def preprocess(self, routing_map):
        plan = getattr(self, "_plan", None)
        if plan is None or self.drop_and_pad:
            return super().preprocess(routing_map)
        try:  # the counts come from the plan, not from a reduction of the [T, E] map
            return super().preprocess(_PlanCounts(routing_map, plan.tokens_per_expert.long()))
        except AttributeError:  # a Megatron version that reads more of the map
            return super().preprocess(routing_map)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        plan = None if self.replay_router is None else self.replay_router.plan_for(routing_map)
        self._plan = plan
        self._rows_plan = None
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
        rows = T * K  # dropless: exactly K distinct experts per row (the router's guarantee)
        permuted, permuted_probs = replay_ops.permute(
            hidden_states, plan, num_rows=rows, probs=probs, validate=False,
            backend=self._backend())
        self._rows_plan = (plan.sorted_slots, K, rows)
        return permuted, permuted_probs

    # Megatron keeps the token id of each permuted row for its unpermute. The plan path
    # does not need it; it is computed from the plan when read (inspection, tests).
    @property
    def reversed_local_input_permutation_mapping(self):
        src = self.__dict__.get("_rows_plan")
        if src is not None:
            slots, K, rows = src
            return torch.div(slots[:rows].long(), K, rounding_mode="floor")
        return self.__dict__.get("_reversed_mapping")

    @reversed_local_input_permutation_mapping.setter
    def reversed_local_input_permutation_mapping(self, value):
        self.__dict__["_reversed_mapping"] = value
        self.__dict__["_rows_plan"] = None

    def combine_postprocess(self, permutated_local_input_tokens):
        plan = self._plan
        if plan is None:
            return super().combine_postprocess(permutated_local_input_tokens)
        output = replay_ops.unpermute(permutated_local_input_tokens,
                                      plan._replace(weights=None), validate=False,
                                      backend=self._backend())
        self._plan = None
        return output.view(self.hidden_shape)


def use_plan_dispatcher(layer) -> bool:
    """Switch one built MoE layer with a replay router to the plan dispatcher if it applies
    (`plan_dispatch_problems` is empty); returns whether it did."""
    if not isinstance(layer.router, ReplayTopKRouter) or plan_dispatch_problems(layer.config):
        return False
    d = layer.token_dispatcher
    if type(d) is MoEAlltoAllTokenDispatcher:
        d.__class__ = PlanAlltoAllTokenDispatcher
    elif not isinstance(d, PlanAlltoAllTokenDispatcher):
        return False
    d.replay_router = layer.router
    d._plan = None
    return True


class ReplayMoELayer(MoELayer):
    """Megatron's MoELayer whose all-to-all dispatcher uses the replay router's plan
    wherever that applies (see the module docstring); elsewhere it is Megatron's layer
    unchanged. `replay_spec` builds MoE layers with it; same parameters and state dict."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        options = getattr(self.router, "replay_options", None)
        if options is not None and options.plan_dispatch:
            use_plan_dispatcher(self)


def enable_plan_dispatch(model) -> int:
    """Switch the all-to-all dispatcher of every MoE layer of `model` (a module or a list
    of chunks) whose router is a ReplayTopKRouter to PlanAlltoAllTokenDispatcher, in place.
    Returns the number of layers switched. Unsupported settings raise, naming the flag."""
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
            if not isinstance(d, (PlanAlltoAllTokenDispatcher, MoEAlltoAllTokenDispatcher)) or \
                    not use_plan_dispatcher(m):
                raise UnsupportedConfigError(
                    f"enable_plan_dispatch: {name}.token_dispatcher is a {type(d).__name__}, not "
                    f"Megatron's MoEAlltoAllTokenDispatcher")
            n += 1
    if n == 0:
        raise UnsupportedConfigError("enable_plan_dispatch: the model has no MoE layer")
    return n
