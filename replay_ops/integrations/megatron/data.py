"""The replay tensor follows the tokens: THD packing, context-parallel and sequence-parallel
splits, in the order Megatron-Core gives the tokens.

Plain PyTorch (plus `torch.distributed` for the collective forms): nothing here imports
megatron-core, so the data path can be prepared in a data loader or a trainer process
that does not hold a model.

The order Megatron-Core applies to the tokens, and so to the routing:

    a THD ReplayBatch [N, L, K]                 a record file's `RoutingFile.batch()`, a
                                                rollout adapter's (`packing="thd"`), or
                                                `pack_megatron_thd` of per-sequence routing
      -> pad_thd              [N_pad, L, K]     each sequence padded to a multiple (FP8 too)
      -> cp_split             [N_pad/CP, L, K]  zigzag (2*CP chunks per sequence) or contiguous
      -> sp_scatter           [N_pad/(CP*TP), L, K]  along the packed token dimension, TP group
      -> set_replay_routing   each MoE router of the stage gets its layer's [T, K] view

R2 goes back: `sp_gather` over the TP group, `cp_gather`/`cp_all_gather` over the CP group,
`unpack_thd` to per-sequence routing.

Every step takes and returns the one type for routing in a training format,
`router_replay.adapters.ReplayBatch` (its `cu_seqlens_padded`, `cp_*` and `sp_*` fields say
how far along the steps it is), with its replay mask and layer mapping. A batch checked
against a model shape stays checked through `pad_thd`, `cp_split`, `cp_gather` and
`sp_scatter` (they move rows and add -1 rows with replay_mask False), so
`set_replay_routing` scans nothing again.

Every routing tensor here holds **logical** expert ids (the ids the router's top-k picks,
before any EPLB/physical-replica remapping), `-1` for an empty slot, and is int16 unless
stated otherwise. Padding rows are -1 with `replay_mask` False, never 0.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import torch

from ..._deprecated import deprecated_function, deprecated_names, resolve_renamed
from ...errors import RoutingError
from ..._validate import first_bad_route, int16_routing, signed_routing, unsigned_note
from ...router_replay.adapters.batch import ReplayBatch, SequenceRouting, _keep_checked
from ...router_replay.adapters.batch import pack_thd as _concat_thd

INDEX_DTYPE = torch.int16
# How CP splits each sequence's rows over the ranks (`scheme=`).
CP_SCHEMES = ("zigzag", "contiguous")

__all__ = [
    "CP_SCHEMES",
    "LayoutError",
    "ReplayBatch",
    "check_expert_range",
    "cp_all_gather",
    "cp_gather",
    "cp_partition_index",
    "cp_split",
    "megatron_thd_alignment",
    "pack_megatron_thd",
    "pad_thd",
    "sp_gather",
    "sp_scatter",
    "unpack_thd",
]

# Deprecated names (one release): old name -> (new name, value).
_DEPRECATED = {
    "PackedRouting": ("ReplayBatch", ReplayBatch),
    "CP_LAYOUTS": ("CP_SCHEMES", CP_SCHEMES),
}


__getattr__ = deprecated_names(__name__, _DEPRECATED)


def _scheme(scheme, layout, who: str, default=None):
    """The CP split scheme from `scheme=`, or from the deprecated `layout=`."""
    return resolve_renamed(who, "layout", "scheme", layout, scheme, default)


class LayoutError(RoutingError, ValueError):
    """Routing whose layout does not match the tokens it is meant to follow, or whose
    layers do not match the model's (`set_replay_routing`)."""


# ----------------------------------------------------------------------------- checks
def check_expert_range(indices, num_experts: int, *, who: str,
                       layer_ids: Sequence[int] | None = None,
                       arrived_as: torch.dtype | None = None) -> None:
    """Raise LayoutError if an id is outside -1..num_experts-1. Ids are logical expert ids
    (before EPLB remapping); a physical replica id (>= E) is a wrong recording. Any integer
    dtype (see `_validate.signed_routing`); an unsigned maximum is an expert id like any
    other (`arrived_as`: the dtype the routing came in, when it was converted already).
    One host read."""
    indices, dtype = signed_routing(indices, who, "routing", LayoutError)
    dtype = arrived_as or dtype
    if indices.numel() == 0:
        return
    # the one scan (`_validate.first_bad_route`), range only, on a [tokens, L, K] view
    dim = indices.dim()
    view = indices.reshape(indices.shape[0], -1, indices.shape[-1]) if dim >= 2 else \
        indices.reshape(-1, 1, 1)
    bad = first_bad_route(view, num_experts, repeats=False)
    if bad is not None:
        val = bad.value
        where = f"token {bad.token}"
        if dim == 3:
            lid = layer_ids[bad.layer] if layer_ids is not None else bad.layer
            where += f", layer column {bad.layer} (layer {lid}), slot {bad.slot}"
        elif dim == 2:
            where += f", slot {bad.slot}"
        raise LayoutError(
            f"{who}: {where} holds expert id {val}, outside 0..{num_experts - 1} (-1 = no "
            f"route); recordings must hold logical expert ids (before any EPLB remapping)"
            f"{unsigned_note(dtype, val)}"
        )


def _as_index_tensor(x, who: str) -> tuple[torch.Tensor, torch.dtype]:
    return signed_routing(x, who, "routing", LayoutError)


# ----------------------------------------------------------------------------- packing
def megatron_thd_alignment(tp_size: int = 1, cp_size: int = 1, *, fp8: bool = False
                           ) -> tuple[int, int]:
    """(align, total_align) for THD packing with Megatron-Core, as RL trainers pad the
    tokens (verl's `preprocess_packed_seqs`):

    * every sequence is padded to a multiple of `tp*cp*2` when cp > 1, else of `tp`
      (sequence parallel splits the packed tokens over TP; zigzag CP splits each sequence
      into 2*CP chunks);
    * with FP8, sequences are padded to a multiple of lcm(16, that), and the packed total
      to a multiple of `that * 128` by growing the last sequence (TransformerEngine's FP8
      GEMMs want 16-row multiples).
    """
    for name, v in (("tp_size", tp_size), ("cp_size", cp_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"megatron_thd_alignment: {name} must be an integer >= 1, got {v!r}")
    base = tp_size * cp_size * 2 if cp_size > 1 else tp_size
    if fp8:
        return math.lcm(16, base), base * 128
    return base, 1


def _sequence_parts(routings, seq_lens, who):
    """[(indices [n, L, K] signed, mask [n], seq_len, the dtype it came in)] from
    SequenceRouting objects or tensors of any integer dtype."""
    out = []
    if seq_lens is not None and len(seq_lens) != len(routings):
        raise LayoutError(f"{who}: {len(routings)} routings but {len(seq_lens)} sequence lengths; "
                          f"every sequence needs its entry (a shorter list would give later "
                          f"sequences their neighbour's routing)")
    for i, r in enumerate(routings):
        want = None if seq_lens is None else int(seq_lens[i])
        if hasattr(r, "indices") and hasattr(r, "mask"):  # adapters.SequenceRouting
            idx, dtype = _as_index_tensor(r.indices, f"{who}: sequence {i}")
            mask = r.mask.to(torch.bool)
            n = int(idx.shape[0])
            if want is not None and want != n:
                raise LayoutError(f"{who}: sequence {i} has {n} routing rows (placeholder "
                                  f"included) but seq_lens[{i}] = {want}")
            out.append((idx, mask, n, dtype))
            continue
        if r is None:
            raise LayoutError(f"{who}: sequence {i} has no routing (None); build it with the "
                              f"rollout adapters' allow_missing=True to run it with the "
                              f"model's own top-k")
        idx, dtype = _as_index_tensor(r, f"{who}: sequence {i}")
        if idx.dim() != 3:
            raise LayoutError(f"{who}: sequence {i} routing must be [rows, L, K], got shape "
                              f"{tuple(idx.shape)}")
        if want is None:
            raise LayoutError(f"{who}: plain tensors need seq_lens (is sequence {i} "
                              f"{idx.shape[0]} or {idx.shape[0] + 1} tokens long?)")
        n = int(idx.shape[0])
        if n == want - 1:
            # rollout engines return len-1 rows: the last token has no route
            tail = torch.full((1, *idx.shape[1:]), -1, dtype=idx.dtype)
            idx = torch.cat([idx.cpu(), tail], 0)
            mask = torch.ones(want, dtype=torch.bool)
            mask[-1] = False
        elif n == want:
            mask = ~(idx < 0).all(dim=(1, 2)).cpu()
        else:
            raise LayoutError(f"{who}: sequence {i} has {n} routing rows but {want} tokens; "
                              f"expected {want - 1} (rollout rows, the last token has no route) "
                              f"or {want}")
        out.append((idx.cpu(), mask.cpu(), want, dtype))
    return out


def pack_megatron_thd(
    routings: Sequence,
    seq_lens: Sequence[int] | None = None,
    *,
    align: int = 1,
    total_align: int = 1,
    cu_seqlens_padded: torch.Tensor | Sequence[int] | None = None,
    num_experts: int | None = None,
) -> ReplayBatch:
    """Per-sequence routing in Megatron's padded THD format: the adapters' THD batch
    (`adapters.pack_thd`), then Megatron's padding (`pad_thd`).

    `routings[i]` is an `adapters.SequenceRouting` (its rows include the placeholder last
    row), or a tensor `[n_i, L, K]` with `seq_lens[i]` tokens: `n_i == seq_lens[i] - 1`
    (vLLM/SGLang rows; a placeholder -1 row with replay_mask False is appended) or
    `n_i == seq_lens[i]` (rows that are all -1 get replay_mask False). With `num_experts`
    the ids are checked against it first.

    Padding follows the tokens: each sequence is padded to a multiple of `align` and the
    packed total to a multiple of `total_align` (the last sequence grows), see
    `megatron_thd_alignment(tp, cp, fp8=...)`. Or pass the `cu_seqlens_padded` your token
    packing produced (PackedSeqParams.cu_seqlens_q_padded) and the routing uses exactly
    those boundaries. Padding rows are -1 with replay_mask False.
    """
    who = "pack_megatron_thd"
    if not routings:
        raise LayoutError(f"{who}: no sequences")
    _check_align(align, total_align, who)
    parts = _sequence_parts(routings, seq_lens, who)
    L, K = parts[0][0].shape[1:]
    seqs = []
    for i, (idx, m, n, dtype) in enumerate(parts):
        if tuple(idx.shape[1:]) != (L, K):
            raise LayoutError(f"{who}: sequence {i} routing is [*, {idx.shape[1]}, {idx.shape[2]}] "
                              f"but sequence 0 is [*, {L}, {K}]; one model has one [L, K]")
        if num_experts is not None:
            check_expert_range(idx, num_experts, who=f"{who}: sequence {i}", arrived_as=dtype)
        idx, _ = int16_routing(idx, f"{who}: sequence {i}", "routing", LayoutError,
                               arrived_as=dtype)
        seqs.append(SequenceRouting(idx, m, getattr(routings[i], "mapping", None)))
    return pad_thd(_concat_thd(seqs), align=align, total_align=total_align,
                   cu_seqlens_padded=cu_seqlens_padded, who=who)


def _check_align(align, total_align, who: str) -> None:
    if not isinstance(align, int) or align < 1 or not isinstance(total_align, int) or total_align < 1:
        raise ValueError(f"{who}: align and total_align must be integers >= 1, got align={align!r}, "
                         f"total_align={total_align!r}")


def pad_thd(batch: ReplayBatch, *, align: int = 1, total_align: int = 1,
            cu_seqlens_padded: torch.Tensor | Sequence[int] | None = None,
            who: str = "pad_thd") -> ReplayBatch:
    """Megatron's padding of a THD batch (`adapters.pack_thd`, not padded yet): each
    sequence padded to a multiple of `align`, the packed total to a multiple of
    `total_align` (the last sequence grows), or exactly to the `cu_seqlens_padded` the
    token packing produced. Padding rows are -1 with replay_mask False; the result carries
    both boundaries (`cu_seqlens`, `cu_seqlens_padded`)."""
    _check_align(align, total_align, who)
    if batch.cu_seqlens is None or batch.indices.dim() != 3:
        raise LayoutError(f"{who}: needs a THD batch ([N, L, K] with cu_seqlens), got indices "
                          f"{tuple(batch.indices.shape)}, cu_seqlens={batch.cu_seqlens}")
    if batch.cu_seqlens_padded is not None or batch.cp_size != 1 or batch.sp_size != 1:
        raise LayoutError(f"{who}: {batch.describe()} is padded or split already")
    cu = batch.cu_seqlens.detach().to(torch.int64).cpu()
    lens = (cu[1:] - cu[:-1]).tolist()
    B = len(lens)
    if cu_seqlens_padded is None:
        padded = [-(-n // align) * align for n in lens]
        total = sum(padded)
        extra = (-total) % total_align
        padded[-1] += extra
        cup = torch.zeros(B + 1, dtype=torch.int64)
        cup[1:] = torch.tensor(padded, dtype=torch.int64).cumsum(0)
    else:
        cup = torch.as_tensor(cu_seqlens_padded).to(torch.int64).cpu()
        if cup.dim() != 1 or cup.numel() != B + 1 or int(cup[0]) != 0:
            raise LayoutError(f"{who}: cu_seqlens_padded must be [B+1]=[{B + 1}] starting at 0, "
                              f"got {cup.tolist()}")
        padded = (cup[1:] - cup[:-1]).tolist()
        for i, (p, n) in enumerate(zip(padded, lens)):
            if p < n:
                raise LayoutError(f"{who}: sequence {i} has {n} tokens but cu_seqlens_padded gives "
                                  f"it {p} rows")
            if p % align:
                raise LayoutError(f"{who}: sequence {i} is padded to {p} rows, not a multiple of "
                                  f"align={align}")
        if int(cup[-1]) % total_align:
            raise LayoutError(f"{who}: packed total {int(cup[-1])} is not a multiple of "
                              f"total_align={total_align}")
    N = int(cup[-1])
    L, K = batch.indices.shape[1:]
    indices = torch.full((N, L, K), -1, dtype=batch.indices.dtype)
    mask = torch.zeros(N, dtype=torch.bool)
    for i, n in enumerate(lens):
        s, f = int(cup[i]), int(cu[i])
        indices[s:s + n] = batch.indices[f:f + n]
        mask[s:s + n] = batch.replay_mask[f:f + n]
    return _keep_checked(batch, replace(batch, indices=indices, replay_mask=mask, cu_seqlens=cu,
                                        cu_seqlens_padded=cup))


# (`adapters.pack_thd` is the unpadded THD packing; this one pads for Megatron)
pack_thd = deprecated_function(pack_megatron_thd, "replay_ops.integrations.megatron.pack_thd",
                               "pack_megatron_thd")


def unpack_thd(packed: ReplayBatch, *, with_placeholder: bool = True) -> list[torch.Tensor]:
    """Per-sequence routing from a whole (not CP-split) THD pack: `[len_i, L, K]` each, or
    `[len_i - 1, L, K]` (the rollout form) with `with_placeholder=False`."""
    if packed.cp_size != 1 or packed.sp_size != 1:
        raise LayoutError(f"unpack_thd: {packed.describe()} is one CP or TP rank's share; "
                          f"gather it first (sp_gather, cp_gather / cp_all_gather)")
    out = []
    for i in range(packed.num_sequences):
        s = int(packed.padded_cu_seqlens[i])
        n = int(packed.cu_seqlens[i + 1] - packed.cu_seqlens[i])
        e = s + n - (0 if with_placeholder else 1)
        out.append(packed.indices[s:e])
    return out


# ----------------------------------------------------------------------------- context parallel
def cp_partition_index(cu_seqlens_padded, cp_size: int, cp_rank: int,
                       scheme: str | None = None, *, layout: str | None = None) -> torch.Tensor:
    """int64 row indices of the packed THD tensor that CP rank `cp_rank` holds.

    zigzag (Megatron-Core's default, TransformerEngine's `thd_get_partitioned_indices`):
    each sequence (padded length P, a multiple of 2*cp) is cut into 2*cp chunks of P/(2*cp)
    rows; rank r takes chunk r and chunk 2*cp-1-r. contiguous: each sequence (P a multiple
    of cp) is cut into cp chunks; rank r takes chunk r. Sequences stay in order."""
    who = "cp_partition_index"
    scheme = _scheme(scheme, layout, who, "zigzag")
    if scheme not in CP_SCHEMES:
        raise ValueError(f"{who}: unknown scheme={scheme!r}; expected one of {CP_SCHEMES}")
    if not isinstance(cp_size, int) or cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"{who}: need cp_size >= 1 and 0 <= cp_rank < cp_size, got "
                         f"cp_size={cp_size!r}, cp_rank={cp_rank!r}")
    cup = torch.as_tensor(cu_seqlens_padded).to(torch.int64).cpu().tolist()
    chunks = 2 * cp_size if scheme == "zigzag" else cp_size
    pieces = []
    for i in range(len(cup) - 1):
        s, p = cup[i], cup[i + 1] - cup[i]
        if p % chunks:
            raise LayoutError(
                f"{who}: sequence {i} is padded to {p} rows, not a multiple of {chunks} "
                f"({'2*cp' if scheme == 'zigzag' else 'cp'} with cp={cp_size}, scheme={scheme!r}); "
                f"pad with megatron_thd_alignment(tp, cp) like the tokens")
        c = p // chunks
        if scheme == "zigzag":
            for j in (cp_rank, 2 * cp_size - 1 - cp_rank):
                pieces.append(torch.arange(s + j * c, s + (j + 1) * c))
        else:
            pieces.append(torch.arange(s + cp_rank * c, s + (cp_rank + 1) * c))
    if not pieces:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat(pieces)


def cp_split(packed: ReplayBatch, cp_size: int, cp_rank: int, scheme: str | None = None,
             *, layout: str | None = None) -> ReplayBatch:
    """CP rank `cp_rank`'s share of a whole THD pack, split like the tokens
    (`cp_partition_index`)."""
    if packed.cp_size != 1 or packed.sp_size != 1:
        raise LayoutError(f"cp_split: {packed.describe()} is already split; split the whole "
                          f"pack (CP before SP, as Megatron splits the tokens)")
    scheme = _scheme(scheme, layout, "cp_split", "zigzag")
    if cp_size == 1:
        return _keep_checked(packed, replace(packed, cp_scheme=scheme))
    idx = cp_partition_index(packed.padded_cu_seqlens, cp_size, cp_rank, scheme)
    return _keep_checked(packed, replace(
        packed, indices=packed.indices.index_select(0, idx.to(packed.indices.device)),
        replay_mask=packed.replay_mask.index_select(0, idx.to(packed.replay_mask.device)),
        cp_size=cp_size, cp_rank=cp_rank, cp_scheme=scheme))


def cp_gather(parts: Sequence[ReplayBatch], scheme: str | None = None, *,
              layout: str | None = None) -> ReplayBatch:
    """Inverse of `cp_split`: the whole pack from every CP rank's share, in rank order.
    Shares from another split (scheme, CP size, rank order, sequence boundaries) raise."""
    who = "cp_gather"
    if not parts:
        raise LayoutError(f"{who}: no parts")
    cp = len(parts)
    first = parts[0]
    lay = _scheme(scheme, layout, who, first.cp_scheme)
    for r, p in enumerate(parts):
        if p.cp_size != cp or p.cp_rank != r:
            raise LayoutError(f"{who}: part {r} is {p.describe()}; expected cp_size={cp}, "
                              f"cp_rank={r} (parts must be every rank's share, in rank order)")
        if p.cp_scheme != lay:
            raise LayoutError(f"{who}: part {r} was split with scheme={p.cp_scheme!r} but the "
                              f"gather is for scheme={lay!r}; the routing would land on other "
                              f"tokens")
        if not torch.equal(p.padded_cu_seqlens.cpu(), first.padded_cu_seqlens.cpu()) or \
                not torch.equal(p.cu_seqlens.cpu(), first.cu_seqlens.cpu()):
            raise LayoutError(f"{who}: part {r} has other sequence boundaries than part 0")
        if p.num_tokens * cp != int(first.padded_cu_seqlens[-1]):
            raise LayoutError(f"{who}: part {r} has {p.num_tokens} rows; {cp} parts of a pack of "
                              f"{int(first.padded_cu_seqlens[-1])} rows need "
                              f"{int(first.padded_cu_seqlens[-1]) // cp} each")
    N = int(first.padded_cu_seqlens[-1])
    L, K = first.indices.shape[1:]
    dev = first.indices.device
    indices = torch.empty((N, L, K), dtype=first.indices.dtype, device=dev)
    mask = torch.empty(N, dtype=torch.bool, device=dev)
    # the whole pack is checked if every share was checked for one shape
    shapes = {p.checked_shape for p in parts}
    src = first if len(shapes) == 1 else None
    if cp == 1:
        out = replace(first, cp_size=1, cp_rank=0, cp_scheme=None)
        return out if src is None else _keep_checked(src, out)
    for r, p in enumerate(parts):
        idx = cp_partition_index(first.padded_cu_seqlens, cp, r, lay).to(dev)
        indices.index_copy_(0, idx, p.indices.to(dev))
        mask.index_copy_(0, idx, p.replay_mask.to(dev))
    out = replace(first, indices=indices, replay_mask=mask, cp_size=1, cp_rank=0, cp_scheme=None)
    return out if src is None else _keep_checked(src, out)


def cp_all_gather(local: ReplayBatch, group) -> ReplayBatch:
    """`cp_gather` over the CP process group (R2 recording back to the whole pack)."""
    import torch.distributed as dist

    cp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if local.cp_size != cp or local.cp_rank != rank:
        raise LayoutError(f"cp_all_gather: {local.describe()} but this is rank {rank} of a CP "
                          f"group of {cp}")
    idx = _gather_tensor(local.indices, group)
    mask = _gather_tensor(local.replay_mask, group)
    parts = [replace(local, indices=i, replay_mask=m, cp_rank=r)
             for r, (i, m) in enumerate(zip(idx, mask))]
    return cp_gather(parts)


# ----------------------------------------------------------------------------- sequence parallel
def _group_size_rank(group) -> tuple[int, int]:
    import torch.distributed as dist

    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def sp_scatter(x, tp_group, *, who: str = "sp_scatter"):
    """This TP rank's share along the packed token dimension, exactly as Megatron's
    `scatter_to_sequence_parallel_region` splits the hidden states: TP equal contiguous
    chunks, rank r takes chunk r. A view, no copy.

    `x` is a `ReplayBatch` (after `pad_thd` and `cp_split`): the result is the batch of this
    rank's rows, its replay mask with them, `sp_size`/`sp_rank` set, and checked where `x`
    was (what `set_replay_routing` takes). A padded [B, S] batch is split along S, as
    Megatron splits an unpacked [S, B] micro-batch. Or a tensor: the routing `[T, L, K]`, a
    layer's `[T, K]` or the `[T]` replay mask."""
    if isinstance(x, ReplayBatch):
        if x.sp_size != 1:
            raise LayoutError(f"{who}: {x.describe()} is one TP rank's share already")
        tp, rank = _group_size_rank(tp_group)
        dim = 1 if x.indices.dim() == 4 else 0  # padded [B, S]: the sequence dimension
        idx = _sp_rows(x.indices, tp, rank, dim, who)
        mask = _sp_rows(x.replay_mask, tp, rank, dim, who)
        return _keep_checked(x, replace(x, indices=idx, replay_mask=mask, sp_size=tp,
                                        sp_rank=rank))
    tp, rank = _group_size_rank(tp_group)
    return _sp_rows(x, tp, rank, 0, who)


def _sp_rows(x: torch.Tensor, tp: int, rank: int, dim: int, who: str) -> torch.Tensor:
    if tp == 1:
        return x
    T = x.shape[dim]
    if T % tp:
        raise LayoutError(f"{who}: {T} tokens do not split over TP={tp} ranks; the tokens are "
                          f"padded to a multiple of TP (megatron_thd_alignment), pad the routing "
                          f"the same way (pad_thd(align=...))")
    n = T // tp
    return x.narrow(dim, rank * n, n)


def sp_gather(x, tp_group):
    """Inverse of `sp_scatter` over the TP group (R2: each rank recorded its share of the
    tokens), for a tensor or a `ReplayBatch` (the whole batch back, unchecked: the other
    ranks' rows come from elsewhere). int16 and bool travel as uint8 views (NCCL has
    neither)."""
    tp, _ = _group_size_rank(tp_group)
    if isinstance(x, ReplayBatch):
        if x.sp_size != tp:
            raise LayoutError(f"sp_gather: {x.describe()} but the TP group has {tp} ranks")
        if tp == 1:
            return x
        dim = 1 if x.indices.dim() == 4 else 0
        return replace(x, indices=torch.cat(_gather_tensor(x.indices, tp_group), dim=dim),
                       replay_mask=torch.cat(_gather_tensor(x.replay_mask, tp_group), dim=dim),
                       sp_size=1, sp_rank=0)
    if tp == 1:
        return x
    return torch.cat(_gather_tensor(x, tp_group), dim=0)


def _gather_tensor(x: torch.Tensor, group) -> list[torch.Tensor]:
    """all_gather of equal-shaped tensors; int16/bool are sent as uint8 views."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    x = x.contiguous()
    if x.dtype in (torch.int16, torch.bool):
        wire = x.view(torch.uint8)  # int16 -> [..., 2*last]; bool -> same shape
    else:
        wire = x
    if wire.dim() == 0:
        wire = wire.reshape(1)
    bufs = [torch.empty_like(wire) for _ in range(world)]
    dist.all_gather(bufs, wire, group=group)
    if x.dtype in (torch.int16, torch.bool):
        bufs = [b.view(x.dtype) for b in bufs]
    return [b.reshape(x.shape) for b in bufs]
