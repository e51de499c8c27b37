"""Router replay for Megatron-Core: the fused replay gate inside Megatron's MoE layer, and
the replay data sharded like the tokens under packing, CP, SP, PP and EP.

    from replay_ops.integrations import megatron as rom

    spec = rom.replay_spec(get_gpt_decoder_block_spec(config, use_transformer_engine=True))
    model = GPTModel(config, spec, ...)                      # moe_enable_routing_replay=True
    # then drive Megatron's own RouterReplay API as before (set_target_indices, actions, ...)

Or, for a model that is already built: `rom.install(model)`. The data path:

    batch = open_routing(path).batch(rom.model_shape(config))     # or a rollout adapter's
    packed = rom.pad_thd(batch, align=a, total_align=t)              # Megatron's THD padding
    local = rom.cp_split(packed, cp_size, cp_rank, "zigzag")         # CP
    rows = rom.sp_scatter(local, tp_group)                           # SP
    rom.set_replay_routing(model_chunks, rows)       # PP: each stage's routers, by layer

One `ReplayBatch` all the way: it keeps its replay mask, layer mapping and the model shape
it was checked against (a record file of a model with another MoE layer pattern is
refused by `set_replay_routing`, naming both).

`data` (packing, CP, SP) needs only torch; `router`, `dispatcher` and `layers` import
megatron-core when first used. `import replay_ops` never imports megatron-core.
See docs/megatron.md.
"""
from __future__ import annotations

import importlib

from .data import (  # noqa: F401  (torch only)
    CP_SCHEMES,
    LayoutError,
    ReplayBatch,
    check_expert_range,
    cp_all_gather,
    cp_gather,
    cp_partition_index,
    cp_split,
    megatron_thd_alignment,
    pack_megatron_thd,
    pad_thd,
    sp_gather,
    sp_scatter,
    unpack_thd,
)

_LAZY = {
    # router.py
    "PADDING_POLICIES": "router",
    "ReplayOptions": "router",
    "ReplayRoutingError": "router",
    "ReplayTokenOrderWarning": "router",
    "ReplayTopKRouter": "router",
    "UnsupportedConfigError": "router",
    "check_config": "router",
    "gate_semantics": "router",
    "megatron_selection": "router",
    "replay_action": "router",
    "replay_router": "router",
    "spread_experts": "router",
    # wiring.py (imports router.py and dispatcher.py)
    "install": "wiring",
    "replay_spec": "wiring",
    # dispatcher.py
    "PlanAlltoAllTokenDispatcher": "dispatcher",
    "ReplayMoELayer": "dispatcher",
    "check_plan_dispatch_config": "dispatcher",
    "enable_plan_dispatch": "dispatcher",
    "plan_dispatch_problems": "dispatcher",
    "use_plan_dispatcher": "dispatcher",
    # layers.py
    "RouterSlot": "layers",
    "find_moe_routers": "layers",
    "gather_recorded_routing": "layers",
    "model_shape": "layers",
    "moe_layer_numbers": "layers",
    "prune_global_registry": "layers",
    "recorded_routing": "layers",
    "routing_agreement": "layers",
    "set_replay_action": "layers",
    "set_replay_routing": "layers",
}

__all__ = sorted(list(_LAZY) + [
    "CP_SCHEMES", "LayoutError", "ReplayBatch", "check_expert_range", "cp_all_gather",
    "cp_gather", "cp_partition_index", "cp_split", "megatron_thd_alignment",
    "pack_megatron_thd", "pad_thd", "sp_gather", "sp_scatter", "unpack_thd",
])


# Deprecated names (one release), each warning with its new name: see data._DEPRECATED.
_DEPRECATED = ("CP_LAYOUTS", "PackedRouting", "pack_thd")


def __getattr__(name: str):
    if name in _DEPRECATED:
        from . import data

        if name == "pack_thd":
            return data.pack_thd  # warns when called
        return getattr(data, name)  # warns
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"{__name__}.{mod}")
    except ImportError as e:
        if (getattr(e, "name", None) or "").split(".")[0] == "megatron":
            raise ImportError(
                f"replay_ops.integrations.megatron.{name} needs megatron-core (pip install "
                f"megatron-core); the data-path helpers (pack_megatron_thd, cp_split, sp_scatter, ...) "
                f"work without it. ({e})") from e
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
