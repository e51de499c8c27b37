"""Which MoE router replays which column of the recording: found by walking the model
a pipeline stage holds, never by position in Megatron's global list.

Megatron's `RouterReplay.global_router_replay_instances` is a class-level list that every
router appends to when it is built. It goes stale when a model is rebuilt (reference
models, a resumed actor, a test that builds twice), it mixes MTP routers in, and its
order is construction order, not layer order. `find_moe_routers` walks the modules of
the stage's model chunks instead and reads each router's `layer_number` (Megatron's
global 1-based layer number, pipeline and virtual-pipeline offsets included).

The model's shape is `ModelShape.from_megatron(config)`, the one shape type of the
package: the router with layer number n is the MoE layer with id n - 1, and a `[T, L, K]`
recording's column for it is `shape.columns(mapping)` at its MoE ordinal:
* `layer_index="absolute"` (L = num_layers, dense layers included): column n - 1;
* `layer_index="moe"` (L = number of MoE layers, `moe_layer_freq`): the MoE ordinal of n;
* `"auto"` picks by L (the two agree when every layer is MoE).

MTP layers restart their layer numbers at 1, so they would alias the first decoder
layers. They are left out unless `include_mtp=True`; then MTP layer j (0-based, in the
MTP block's order) is the layer with id num_layers + j, after every decoder layer (column
num_layers + j absolute, or n_moe + j by MoE ordinal), and L must count them.

A `ReplayBatch` (a record file's `RoutingFile.batch()`, the rollout adapters', after
`pad_thd`, `cp_split` and `sp_scatter`) carries the shape it was checked against: one
checked against this model's shape is used without a scan, one checked against another
shape (a record file of a model with another MoE layer pattern, say) is refused, naming
both sets of MoE layers.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from ..._deprecated import deprecated_function
from ..._validate import UNSIGNED, signed_routing
from ...router_replay.adapters.batch import ReplayBatch
from ...router_replay.shape import LAYER_INDEX, ModelShape, resolve_mapping  # noqa: F401
from .data import LayoutError, check_expert_range

__all__ = [
    "RouterSlot",
    "find_moe_routers",
    "gather_recorded_routing",
    "model_shape",
    "moe_layer_numbers",
    "prune_global_registry",
    "recorded_routing",
    "routing_agreement",
    "set_replay_action",
    "set_replay_routing",
]


@dataclasses.dataclass
class RouterSlot:
    """One MoE router of this stage."""

    router: TopKRouter
    name: str
    layer_number: int  # Megatron's 1-based layer number (restarts at 1 inside MTP)
    is_mtp: bool
    mtp_index: int | None  # 0-based position among the MTP MoE layers, else None
    chunk: int  # index of the model chunk (virtual pipeline stage) holding it

    @property
    def layer_id(self) -> int:
        """The router's layer id in `ModelShape.from_megatron(config, include_mtp=True)`:
        layer_number - 1 for a decoder layer, num_layers + mtp_index for an MTP layer."""
        if self.is_mtp:
            return int(self.router.config.num_layers) + self.mtp_index
        return self.layer_number - 1

    def _column(self, mapping: str, decoder_moe: Sequence[int], num_layers: int) -> int:
        if self.is_mtp:
            base = len(decoder_moe) if mapping == "moe" else num_layers
            return base + self.mtp_index
        if mapping == "absolute":
            return self.layer_number - 1
        return decoder_moe.index(self.layer_number)

    column = deprecated_function(_column, "RouterSlot.column",
                                 "model_shape(config).columns(mapping) at the MoE ordinal of "
                                 "RouterSlot.layer_id")


def model_shape(config, *, include_mtp: bool = False) -> ModelShape:
    """`ModelShape.from_megatron(config, include_mtp=...)`, its errors as LayoutError."""
    try:
        return ModelShape.from_megatron(config, include_mtp=include_mtp)
    except (TypeError, ValueError) as e:
        raise LayoutError(str(e)) from None


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def moe_layer_numbers(config) -> list[int]:
    """1-based layer numbers of the decoder's MoE layers (`model_shape(config)`'s MoE layer
    ids + 1): from `num_layers` and `moe_layer_freq`, the pattern Megatron's decoder block
    spec builds."""
    return [i + 1 for i in model_shape(config).moe_layer_ids]


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



def routing_agreement(model, *, include_mtp: bool = False) -> dict[int, float]:
    """Per MoE layer of `model` (layer id as in `RouterSlot.layer_id`: layer_number - 1 for
    a decoder layer, the same ids as `RouterReplay.agreement()`): the fraction of the rows
    its replay router replayed in its latest call whose replayed set is Megatron's own
    selection from the current logits (`ReplayTopKRouter.agreement_fraction()`). Only the
    routers built with `ReplayOptions(agreement=True)` that replayed a row are listed. One
    host read per router."""
    from .router import ReplayTopKRouter

    out = {}
    for slot in find_moe_routers(model, include_mtp=include_mtp):
        r = slot.router
        if isinstance(r, ReplayTopKRouter):
            frac = r.agreement_fraction()
            if frac is not None:
                out[slot.layer_id] = frac
    return out

def _check_slots(slots: Sequence[RouterSlot], shape: ModelShape, config) -> None:
    """Every router found is a MoE layer of the config's shape."""
    ids = set(shape.moe_layer_ids)
    for s in slots:
        if s.layer_id not in ids:
            what = (f"MTP router {s.mtp_index} (layer id {s.layer_id})" if s.is_mtp else
                    f"layer number {s.layer_number}")
            raise LayoutError(
                f"router {s.name!r} is {what}, which is not a MoE layer of num_layers="
                f"{config.num_layers}, moe_layer_freq={config.moe_layer_freq} (MoE layers "
                f"{[i + 1 for i in shape.moe_layer_ids if i < config.num_layers]}); the model "
                f"and its config disagree")


def _resolve_mapping(L: int, layer_index: str, shape: ModelShape, who: str) -> str:
    n_moe, n_abs = shape.num_moe_layers, shape.num_hidden_layers
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


def _batch_rows(batch: ReplayBatch, shape: ModelShape, layer_index: str, batch_first,
                validate: bool, who: str) -> tuple[torch.Tensor, str]:
    """The `[T, L, K]` rows of a `ReplayBatch` in the routers' token order, and their
    mapping; rows the batch does not replay (replay_mask False) become -1 (no route: the
    router's padding policy routes them, by default with Megatron's own top-k)."""
    if layer_index != "auto":
        raise LayoutError(f"{who}: a ReplayBatch carries its own layer_index "
                          f"({batch.layer_index!r}); pass the batch without layer_index")
    checked = batch.checked_shape
    if checked is not None and checked != shape:
        raise LayoutError(
            f"{who}: the batch was checked against another model shape: "
            + "; ".join(checked.differences(shape, "batch", "model"))
            + ". Its columns hold those layers' routes; replayed here they would route this "
              "model's layers with other layers' experts")
    if checked is None and validate:
        batch = batch.check(shape, who=who, error=LayoutError)  # the one scan
        checked = shape
    idx = batch.indices
    if checked is not None:
        mapping = batch.layer_index  # decided when it was checked
    else:
        idx, dtype = signed_routing(idx, who, "routing", LayoutError)
        if dtype in UNSIGNED:  # unsigned cannot hold -1: always checked
            check_expert_range(idx, shape.num_experts, who=who, arrived_as=dtype)
        if idx.dim() not in (3, 4) or idx.shape[-1] != shape.top_k:
            raise LayoutError(f"{who}: routing {tuple(idx.shape)} is not [..., L, K] with "
                              f"K = moe_router_topk={shape.top_k}")
        mapping = _resolve_mapping(idx.shape[-2], batch.layer_index, shape, who)
    mask = batch.replay_mask
    if idx.dim() == 4:  # a padded batch is [B, S] batch-first; the routers read [S, B]
        if batch_first is False:
            raise LayoutError(f"{who}: a padded ReplayBatch is [B, S, L, K] batch-first; "
                              f"batch_first=False contradicts it")
        idx = idx.transpose(0, 1).reshape(-1, *idx.shape[2:])
        mask = mask.transpose(0, 1).reshape(-1)
    rows = torch.where(mask.to(idx.device)[:, None, None], idx, idx.new_full((), -1))
    return rows, mapping


def set_replay_routing(model, routing: torch.Tensor | ReplayBatch, *, layer_index: str = "auto",
                       include_mtp: bool = False, batch_first: bool | None = None,
                       validate: bool = True) -> list[tuple[str, int, int]]:
    """Give every MoE router of this stage its layer's `[T, K]` view of `routing`
    through Megatron's own `router_replay.set_target_indices` (which also queues it for
    REPLAY_BACKWARD).

    `routing` is a `ReplayBatch` (THD after `pad_thd`, `cp_split` and `sp_scatter`: the
    rows of this CP and TP rank, or a padded [B, S] batch), or a tensor `[T, L, K]` in the
    token order the routers see (Megatron's [S, B] flattened sequence-first; THD: the
    packed order after the CP and SP splits), or `[B, S, L, K]`/`[S, B, L, K]` with
    `batch_first` said explicitly. Ids are logical expert ids (before EPLB remapping), -1 =
    empty.

    A batch keeps its mask, its layer mapping and the shape it was checked against all the
    way here: checked against this model's shape (`ModelShape.from_megatron(config)`), it
    is used without another scan; checked against another shape (a record file of a model
    with another MoE layer pattern), it is refused naming both; unchecked, it is checked
    now (with `validate`). Its rows with replay_mask False reach the routers as -1 rows
    (no route; the router's padding policy routes them). A tensor has only its L: with
    `validate` its range is checked (one host read). Returns (router name, layer number,
    column) per router."""
    who = "set_replay_routing"
    slots = find_moe_routers(model, include_mtp=include_mtp)
    if not slots:
        raise LayoutError(f"{who}: the model holds no MoE router")
    config = slots[0].router.config
    shape = model_shape(config, include_mtp=include_mtp)
    _check_slots(slots, shape, config)
    if isinstance(routing, ReplayBatch):
        routing, mapping = _batch_rows(routing, shape, layer_index, batch_first, validate, who)
    else:
        routing = _flatten_tokens(routing, batch_first, who)
        routing, dtype = signed_routing(routing, who, "routing", LayoutError)
        T, L, K = routing.shape
        mapping = _resolve_mapping(L, layer_index, shape, who)
        if K != config.moe_router_topk:
            raise LayoutError(f"{who}: routing has K={K} slots per token but moe_router_topk="
                              f"{config.moe_router_topk}")
        if validate or dtype in UNSIGNED:  # unsigned cannot hold -1: always checked
            check_expert_range(routing, config.num_moe_experts, who=who, arrived_as=dtype)
    column = dict(zip(shape.moe_layer_ids, shape.columns(mapping)))
    report = []
    from .router import SEQUENCE_FIRST_MARK, ReplayTopKRouter

    for s in slots:
        rr = s.router.router_replay
        if rr is None:
            raise LayoutError(f"{who}: router {s.name!r} has no router_replay; build the model "
                              f"with moe_enable_routing_replay=True")
        col = column[s.layer_id]
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
    Megatron's global list). Excluded MTP routers get None (the model's own routing). Returns the
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
    shape = model_shape(config, include_mtp=include_mtp)
    num_layers = int(config.num_layers)
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
    if len(set(all_ids)) != len(all_ids):
        raise LayoutError(f"gather_recorded_routing: layer numbers recorded twice {all_ids}")
    # layer numbers (MTP layer j as -(j+1)) -> layer ids of the shape: decoder by number,
    # then MTP
    layer_ids = [i - 1 if i > 0 else num_layers + (-i - 1) for i in all_ids]
    order = sorted(range(len(all_ids)), key=lambda j: layer_ids[j])
    if [layer_ids[j] for j in order] != list(shape.moe_layer_ids):
        got = [all_ids[j] for j in order]
        want = [i + 1 if i < num_layers else -(i - num_layers + 1) for i in shape.moe_layer_ids]
        raise LayoutError(f"gather_recorded_routing: the stages recorded layers {got}, expected "
                          f"every MoE layer {want}; a stage is missing or a layer bypassed RECORD")
    ordered = stacked[:, order]
    if layer_index == "moe":
        return ordered
    if layer_index != "absolute":
        raise ValueError(f"gather_recorded_routing: unknown layer_index={layer_index!r}")
    T, _, K = ordered.shape
    out = torch.full((T, shape.num_hidden_layers, K), -1, dtype=ordered.dtype,
                     device=ordered.device)
    out[:, shape.columns("absolute")] = ordered
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
