"""Which MoE router replays which column of the recording: found by walking the model
a pipeline stage holds, never by position in Megatron's global list.

Megatron's `RouterReplay.global_router_replay_instances` is a class-level list that every
router appends to when it is built. It goes stale when a model is rebuilt (reference
models, a resumed actor, a test that builds twice), it mixes MTP routers in, and its
order is construction order, not layer order. `find_moe_routers` walks the modules of
the stage's model chunks instead and reads each router's `layer_number` (Megatron's
global 1-based layer number, pipeline and virtual-pipeline offsets included).

Column of a `[T, L, K]` recording for the decoder layer with layer number n:
* `layer_index="absolute"` (L = num_layers, dense layers included): column n - 1;
* `layer_index="moe"` (L = number of MoE layers, `moe_layer_freq`): the MoE ordinal of n;
* `"auto"` picks by L (the two agree when every layer is MoE).

MTP layers restart their layer numbers at 1, so they would alias the first decoder
layers. They are left out unless `include_mtp=True`; then MTP layer j (0-based, in the
MTP block's order) takes the column after all decoder layers (num_layers + j absolute,
or n_moe + j by MoE ordinal), and L must count them.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from ..._validate import UNSIGNED, signed_routing
from .data import LayoutError, check_expert_range
from ...router_replay.shape import LAYER_INDEX, resolve_mapping  # noqa: F401  (LAYER_INDEX: the choices)

__all__ = [
    "RouterSlot",
    "find_moe_routers",
    "gather_recorded_routing",
    "moe_layer_numbers",
    "prune_global_registry",
    "recorded_routing",
    "set_replay_action",
    "set_replay_routing",
]



@dataclasses.dataclass
class RouterSlot:
    """One MoE router of this stage and the recording column it replays."""

    router: TopKRouter
    name: str
    layer_number: int  # Megatron's 1-based layer number (restarts at 1 inside MTP)
    is_mtp: bool
    mtp_index: int | None  # 0-based position among the MTP MoE layers, else None
    chunk: int  # index of the model chunk (virtual pipeline stage) holding it

    def column(self, mapping: str, decoder_moe: Sequence[int], num_layers: int) -> int:
        if self.is_mtp:
            base = len(decoder_moe) if mapping == "moe" else num_layers
            return base + self.mtp_index
        if mapping == "absolute":
            return self.layer_number - 1
        return decoder_moe.index(self.layer_number)


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def moe_layer_numbers(config) -> list[int]:
    """1-based layer numbers of the decoder's MoE layers, from `num_layers` and
    `moe_layer_freq` (an int N: layers 1, 1+N, ...; or a 0/1 list per layer), the pattern
    Megatron's decoder block spec uses."""
    n = int(config.num_layers)
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        pattern = [1 if i % freq == 0 else 0 for i in range(n)]
    else:
        pattern = list(freq)
        if len(pattern) != n:
            raise LayoutError(f"moe_layer_numbers: moe_layer_freq has {len(pattern)} entries but "
                              f"num_layers={n}")
    return [i + 1 for i, p in enumerate(pattern) if p]


def find_moe_routers(model, *, include_mtp: bool = False) -> list[RouterSlot]:
    """The MoE routers in `model` (a module or a list of virtual-pipeline chunks), sorted
    by layer (decoder layers by layer number, then MTP layers). MTP routers are returned
    only with `include_mtp=True`."""
    slots: list[RouterSlot] = []
    mtp_count = 0
    for c, chunk in enumerate(_chunks(model)):
        mtp_prefixes = [name for name, m in chunk.named_modules()
                        if type(m).__name__.startswith("MultiTokenPrediction")]
        for name, m in chunk.named_modules():
            if not isinstance(m, TopKRouter):
                continue
            is_mtp = any(name.startswith(p + ".") for p in mtp_prefixes if p)
            if m.layer_number is None:
                raise LayoutError(f"find_moe_routers: router {name!r} has no layer_number (the "
                                  f"MoE layer was built outside a TransformerLayer); call "
                                  f"set_layer_number first")
            if is_mtp:
                slots.append(RouterSlot(m, name, int(m.layer_number), True, mtp_count, c))
                mtp_count += 1
            else:
                slots.append(RouterSlot(m, name, int(m.layer_number), False, None, c))
    dec = sorted((s for s in slots if not s.is_mtp), key=lambda s: s.layer_number)
    seen = {}
    for s in dec:
        if s.layer_number in seen:
            raise LayoutError(f"find_moe_routers: routers {seen[s.layer_number]!r} and {s.name!r} "
                              f"both have layer number {s.layer_number}")
        seen[s.layer_number] = s.name
    mtp = [s for s in slots if s.is_mtp]
    return dec + (mtp if include_mtp else [])


def _layout(slots: Sequence[RouterSlot], config, include_mtp: bool):
    decoder_moe = moe_layer_numbers(config)
    num_layers = int(config.num_layers)
    n_mtp = int(getattr(config, "mtp_num_layers", None) or 0) if include_mtp else 0
    for s in slots:
        if not s.is_mtp and s.layer_number not in decoder_moe:
            raise LayoutError(
                f"router {s.name!r} has layer number {s.layer_number}, which is not a MoE layer "
                f"of num_layers={num_layers}, moe_layer_freq={config.moe_layer_freq} (MoE layers "
                f"{decoder_moe}); the model and its config disagree")
    return decoder_moe, num_layers, n_mtp


def _resolve_mapping(L: int, layer_index: str, n_moe: int, n_abs: int, who: str) -> str:
    return resolve_mapping(
        L, n_moe, n_abs, who, layer_index, error=LayoutError,
        moe_need=f"L={n_moe} columns", abs_need=f"L={n_abs} columns",
        neither=f"the routing has L={L} layer columns, but the model has {n_moe} MoE layers "
                f"and {n_abs} layers (MTP layers counted only with include_mtp=True); L must "
                f"be one of them")


def _flatten_tokens(routing: torch.Tensor, batch_first, who: str) -> torch.Tensor:
    if routing.dim() == 4:
        if batch_first is None:
            raise LayoutError(
                f"{who}: a 4-D routing {tuple(routing.shape)} needs batch_first=True ([B, S, L, K]) "
                f"or False ([S, B, L, K]): Megatron's routers see tokens sequence-first "
                f"(token s*B + b), and a batch-first tensor flattened as is would give tokens "
                f"the routes of other tokens")
        if batch_first:
            routing = routing.transpose(0, 1)
        return routing.reshape(-1, *routing.shape[2:])
    if routing.dim() != 3:
        raise LayoutError(f"{who}: routing must be [T, L, K] (or 4-D with batch_first), got "
                          f"{tuple(routing.shape)}")
    return routing


def set_replay_routing(model, routing: torch.Tensor, *, layer_index: str = "auto",
                       include_mtp: bool = False, batch_first: bool | None = None,
                       validate: bool = True) -> list[tuple[str, int, int]]:
    """Give every MoE router of this stage its layer's `[T, K]` view of `routing`
    through Megatron's own `router_replay.set_target_indices` (which also queues it for
    REPLAY_BACKWARD).

    `routing` is `[T, L, K]` in the token order the routers see (Megatron's [S, B]
    flattened sequence-first; THD: the packed order after the CP and SP splits), or
    `[B, S, L, K]`/`[S, B, L, K]` with `batch_first` said explicitly. Ids are logical
    expert ids (before EPLB remapping), -1 = empty; with `validate` the range is checked
    (one host read). Returns (router name, layer number, column) per router."""
    who = "set_replay_routing"
    slots = find_moe_routers(model, include_mtp=include_mtp)
    if not slots:
        raise LayoutError(f"{who}: the model holds no MoE router")
    config = slots[0].router.config
    routing = _flatten_tokens(routing, batch_first, who)
    routing, dtype = signed_routing(routing, who, "routing", LayoutError)
    decoder_moe, num_layers, n_mtp = _layout(slots, config, include_mtp)
    T, L, K = routing.shape
    mapping = _resolve_mapping(L, layer_index, len(decoder_moe) + n_mtp, num_layers + n_mtp, who)
    if K != config.moe_router_topk:
        raise LayoutError(f"{who}: routing has K={K} slots per token but moe_router_topk="
                          f"{config.moe_router_topk}")
    if validate or dtype in UNSIGNED:  # unsigned cannot hold -1: always checked
        check_expert_range(routing, config.num_moe_experts, who=who, arrived_as=dtype)
    report = []
    from .router import SEQUENCE_FIRST_MARK, ReplayTopKRouter

    for s in slots:
        rr = s.router.router_replay
        if rr is None:
            raise LayoutError(f"{who}: router {s.name!r} has no router_replay; build the model "
                              f"with moe_enable_routing_replay=True")
        col = s.column(mapping, decoder_moe, num_layers)
        idx = routing[:, col, :]
        if not isinstance(s.router, ReplayTopKRouter):
            idx = idx.long()  # Megatron's own replay path gathers with int64 only
        # in the routers' token order (4-D input was reordered above): no token-order warning
        setattr(idx, SEQUENCE_FIRST_MARK, True)
        rr.set_target_indices(idx)
        report.append((s.name, s.layer_number, col))
    return report


def set_replay_action(model, action: RouterReplayAction | None, *,
                      include_mtp: bool = False) -> int:
    """Set the replay action of this model's MoE routers only (not every router in
    Megatron's global list). Excluded MTP routers get None (native routing). Returns the
    number of routers given `action`."""
    n = 0
    for s in find_moe_routers(model, include_mtp=True):
        rr = s.router.router_replay
        if rr is None:
            raise LayoutError(f"set_replay_action: router {s.name!r} has no router_replay; build "
                              f"the model with moe_enable_routing_replay=True")
        if s.is_mtp and not include_mtp:
            rr.clear_router_replay_action()
            continue
        if action is None:
            rr.clear_router_replay_action()
        else:
            rr.set_router_replay_action(action)
        n += 1
    return n


def recorded_routing(model, *, include_mtp: bool = False) -> tuple[torch.Tensor, list[int]]:
    """This stage's RECORDed routing: `[T, L_stage, K]` int64 in layer order (decoder
    layers by layer number, then MTP layers) and the layer numbers of the columns (MTP
    layers as -(j+1)). Raises if a router recorded nothing or token counts differ."""
    slots = find_moe_routers(model, include_mtp=include_mtp)
    if not slots:
        raise LayoutError("recorded_routing: the model holds no MoE router")
    cols, ids = [], []
    for s in slots:
        rr = s.router.router_replay
        rec = None if rr is None else rr.get_recorded_indices()
        if rec is None:
            raise LayoutError(f"recorded_routing: router {s.name!r} (layer {s.layer_number}) has "
                              f"no recording; run a forward with RouterReplayAction.RECORD")
        cols.append(rec)
        ids.append(-(s.mtp_index + 1) if s.is_mtp else s.layer_number)
    T = {i: int(c.shape[0]) for i, c in zip(ids, cols)}
    if len(set(T.values())) != 1:
        raise LayoutError(f"recorded_routing: layers recorded different token counts {T}")
    return torch.stack([c.long() for c in cols], dim=1), ids


def gather_recorded_routing(model, pp_group=None, *, layer_index: str = "moe",
                            include_mtp: bool = False) -> torch.Tensor:
    """R2 under pipeline parallelism: every stage's RECORDed routing gathered over the PP
    group into one `[T, L, K]` int64 tensor in global layer order (virtual-pipeline chunks
    and stages interleave by layer number, not by schedule). `layer_index="moe"`: one
    column per MoE layer; `"absolute"`: one per layer, dense layers -1. All ranks of the
    group get the result."""
    import torch.distributed as dist

    local, ids = recorded_routing(model, include_mtp=include_mtp)
    config = find_moe_routers(model)[0].router.config
    decoder_moe = moe_layer_numbers(config)
    num_layers = int(config.num_layers)
    n_mtp = int(getattr(config, "mtp_num_layers", None) or 0) if include_mtp else 0
    if pp_group is not None and dist.is_initialized() and dist.get_world_size(pp_group) > 1:
        world = dist.get_world_size(pp_group)
        T, Ls, K = local.shape
        meta = torch.tensor([T, Ls, K], dtype=torch.int64, device=local.device)
        metas = [torch.empty_like(meta) for _ in range(world)]
        dist.all_gather(metas, meta, group=pp_group)
        metas = [m.tolist() for m in metas]
        if len({(m[0], m[2]) for m in metas}) != 1:
            raise LayoutError(f"gather_recorded_routing: stages recorded different [T, K]: {metas}")
        Lmax = max(m[1] for m in metas)
        pad = torch.full((T, Lmax, K), -1, dtype=torch.int32, device=local.device)
        pad[:, :Ls] = local.to(torch.int32)
        pid = torch.full((Lmax,), 0, dtype=torch.int64, device=local.device)
        pid[:Ls] = torch.tensor(ids, dtype=torch.int64)
        bufs = [torch.empty_like(pad) for _ in range(world)]
        ibufs = [torch.empty_like(pid) for _ in range(world)]
        dist.all_gather(bufs, pad, group=pp_group)
        dist.all_gather(ibufs, pid, group=pp_group)
        cols, all_ids = [], []
        for b, i, m in zip(bufs, ibufs, metas):
            cols.append(b[:, :m[1]].to(torch.int64))
            all_ids += i[:m[1]].tolist()
        stacked = torch.cat(cols, dim=1)
    else:
        stacked, all_ids = local, ids
    key = [(1, -i) if i < 0 else (0, i) for i in all_ids]  # decoder by number, then MTP
    if len(set(all_ids)) != len(all_ids):
        raise LayoutError(f"gather_recorded_routing: layer numbers recorded twice {all_ids}")
    order = sorted(range(len(all_ids)), key=lambda j: key[j])
    want = decoder_moe + [-(j + 1) for j in range(n_mtp)]
    got = [all_ids[j] for j in order]
    if got != want:
        raise LayoutError(f"gather_recorded_routing: the stages recorded layers {got}, expected "
                          f"every MoE layer {want}; a stage is missing or a layer bypassed RECORD")
    ordered = stacked[:, order]
    if layer_index == "moe":
        return ordered
    if layer_index != "absolute":
        raise ValueError(f"gather_recorded_routing: unknown layer_index={layer_index!r}")
    T, _, K = ordered.shape
    out = torch.full((T, num_layers + n_mtp, K), -1, dtype=ordered.dtype, device=ordered.device)
    for j, lid in enumerate(got):
        out[:, (lid - 1) if lid > 0 else num_layers + (-lid - 1)] = ordered[:, j]
    return out


def prune_global_registry(model) -> int:
    """Make Megatron's `RouterReplay.global_router_replay_instances` hold exactly this
    model's routers' replay objects, in layer order (decoder, then MTP), so code that uses
    Megatron's list API (`set_replay_data`, `get_recorded_data`) addresses this model and
    not routers of a model built earlier. Returns how many stale entries were dropped."""
    slots = find_moe_routers(model, include_mtp=True)
    mine = [s.router.router_replay for s in slots if s.router.router_replay is not None]
    reg = RouterReplay.global_router_replay_instances
    stale = sum(1 for r in reg if not any(r is m for m in mine))
    reg[:] = mine
    return stale
