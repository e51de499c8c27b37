"""Router replay for Hugging Face `transformers` MoE models.

    from replay_ops.integrations import hf
    from replay_ops.router_replay import ReplayAction

    patch = hf.patch_model(model, "R3")          # or a RouterReplayConfig / RouterReplay
    patch.replay.set_routing(rollout_routing)    # [T, L, K] from the inference engine
    patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
    out = model(input_ids)                       # every MoE block replays that routing
    patch.remove()                               # (or hf.unpatch_model(model))

The package, one module per part:

* `families`: the architectures it knows (`SUPPORTED`: Mixtral, Qwen2-MoE, Qwen3-MoE,
  OLMoE, DeepSeek-V3), how each one's router computes its logits (`linear_logits`) and
  selects (a `replay_ops.Selection`, which the gate applies under replay; `own_topk`, the
  router's own top-k), and `register_family` to add one without editing the package;
* `patch`: `patch_model` / `unpatch_model`, the MoE blocks of a model (`find_moe_blocks`) and
  the `ReplayPatch` handle; its docstring covers recompute, host syncs, torch.compile and
  CUDA graphs;
* `block`: the one forward every patched block runs (`patched_forward`): the router and the
  replay plan (`route_block`), then the experts through the experts module's own call
  (`call_experts`, `experts_forward`) and the implementation the config names
  (`plan_experts`, `rows_experts`);
* `aux_loss`: the auxiliary load-balancing loss of a patched model counts the routing the
  tokens were sent to;
* `ep`: expert parallelism (`patch_model(..., ep_group=g)`, `enable_expert_parallel`), on
  top of `replay_ops.distributed`'s dispatch and combine.

`replay_ops.integrations.hf_block` and `replay_ops.distributed.hf`, the modules these were
in, still import for one release and warn.
"""
from __future__ import annotations

from .block import BlockRouting, LayerAgreement, route_block
from .families import (
    SUPPORTED,
    ArchSpec,
    SelectionTopK,
    UnsupportedModelError,
    linear_logits,
    native_topk,
    own_topk,
    register_family,
    softmax_topk,
    supported_architectures,
    top_k_of_scores,
    unregister_family,
)
from ..._deprecated import deprecated_names
from . import patch as _patch
from .patch import (
    MoEBlocks,
    ReplayPatch,
    find_moe_blocks,
    make_router_replay,
    patch_model,
    unpatch_model,
)

__all__ = [
    "SUPPORTED",
    "ArchSpec",
    "BlockRouting",
    "EPState",
    "LayerAgreement",
    "MoEBlocks",
    "ReplayPatch",
    "SelectionTopK",
    "UnsupportedModelError",
    "enable_expert_parallel",
    "find_moe_blocks",
    "linear_logits",
    "make_router_replay",
    "native_topk",
    "own_topk",
    "patch_model",
    "register_family",
    "route_block",
    "softmax_topk",
    "supported_architectures",
    "top_k_of_scores",
    "unpatch_model",
    "unregister_family",
]


_deprecated = deprecated_names(__name__, _patch.RENAMED)  # renamed names, for one release


def __getattr__(name: str):
    # the expert-parallel names import torch.distributed: only when asked for
    if name in ("enable_expert_parallel", "EPState"):
        from . import ep

        return getattr(ep, name)
    if name in _patch.RENAMED:
        return _deprecated(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
