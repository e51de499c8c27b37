"""What every rollout adapter shares: the per-sequence routing type, the checks of a batch,
multi-turn assembly, and the packing into the training formats (`packing=`):

* `pack_padded`: verl's `[B, S, L, K]`, the prompt left-padded to `max_prompt_len` and the
  response right-padded to `max_response_len`, plus `replay_mask [B, S]`.
* `pack_thd`: packed tokens `[N, L, K]` with `cu_seqlens [B+1]` and `replay_mask [N]`.

Empty slots and padding are -1 (never 0: a zero row would send the token to expert 0), and
`replay_mask` is False for padding, for the final token of each sequence (it has no route),
for requests explicitly allowed to have no routing, and for a token the engine returned no
route for (every slot -1). A token marked for replay is routed in every MoE layer: one with
no route (every slot -1) in some MoE layers but not in others is refused, since replaying
it would give it no expert (a MoE output of 0) in those layers.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

import numpy as np
import torch

from ..._deprecated import (deprecated_names, deprecated_property, renamed_keyword,
                             resolve_renamed)
from ...errors import RoutingError
from ..._validate import UNSIGNED, int16_routing, signed_routing, unsigned_note
from .._bounds import MAX_LAYER_SLOTS, MAX_LAYERS, MAX_TOP_K, check_limits
from ..shape import MAPPINGS, ModelShape, describe_bad_route, first_bad_route

INDEX_DTYPE = torch.int16

# The training formats the packers produce (`packing=`): verl's padded [B, S, L, K], or
# packed THD [N, L, K] with cu_seqlens.
PACKINGS = ("padded", "thd")


class RoutingMismatchError(RoutingError, ValueError):
    """Rollout routing that does not line up with the batch it belongs to."""


class MoEColumns(NamedTuple):
    """Rollout routing whose layer mapping is decided (`moe_columns`): the MoE columns
    `[n, L_moe, K]` (signed), the mapping they came in, and the dtype they arrived as."""

    routing: torch.Tensor
    mapping: str
    arrived_as: torch.dtype


def moe_columns(model_shape: ModelShape, routing: torch.Tensor, who: str,
                arrived_as: torch.dtype | None = None) -> MoEColumns:
    """The one layer-mapping decision for rollout routing [n, L, K] (absolute or MoE layers)
    of any integer dtype (`signed_routing`): the shape checked against the model, the mapping
    decided by L, the dense layers' columns checked (`check_dense_columns`), and the MoE
    columns taken (a view when the routing is signed and already indexed by MoE ordinal).
    No value is scanned here: `to_moe` does that, once."""
    if routing.dim() != 3:
        raise RoutingMismatchError(f"{who}: routing must be [tokens, L, K], got shape "
                                   f"{tuple(routing.shape)}")
    n, L, K = routing.shape
    if K != model_shape.top_k:
        raise RoutingMismatchError(f"{who}: routing has K={K} experts per token, the model "
                                   f"has top_k={model_shape.top_k} (shape {tuple(routing.shape)})")
    mapping = model_shape.mapping_for(L, who, error=RoutingMismatchError)
    routing, dtype = signed_routing(routing, who, "routing", RoutingMismatchError)
    if model_shape.num_experts > torch.iinfo(INDEX_DTYPE).max:
        raise RoutingMismatchError(f"{who}: num_experts={model_shape.num_experts} does not fit the "
                                   f"int16 routing of the training batch")
    if mapping == "absolute":
        check_dense_columns(model_shape, routing, who)
        routing = routing[:, model_shape.columns(mapping), :]
    return MoEColumns(routing, mapping, arrived_as or dtype)


@renamed_keyword("layout", "model_shape", "to_moe")
def to_moe(model_shape: ModelShape, routing, who: str,
           arrived_as: torch.dtype | None = None) -> tuple[torch.Tensor, str]:
    """[n, L, K] routing (absolute or MoE layers) of any integer dtype (`signed_routing`), or
    the `MoEColumns` of it -> ([n, L_moe, K] int16, the mapping), with the values checked
    (range -1..E-1, no repeated expert in a token's layer; an unsigned maximum is an expert
    id, so out of range unless E exceeds it; `arrived_as`: the dtype it came in, when
    converted already). The one scan of the values of rollout routing."""
    cols = routing if isinstance(routing, MoEColumns) else \
        moe_columns(model_shape, routing, who, arrived_as)
    moe = cols.routing
    bad = first_bad_route(moe, model_shape.num_experts)
    if bad is not None:
        raise RoutingMismatchError(
            f"{who}: {describe_bad_route(bad, model_shape.num_experts, model_shape.moe_layer_ids)}"
            f"{unsigned_note(cols.arrived_as, bad.value)}")
    return moe.to(INDEX_DTYPE), cols.mapping


def first_unrouted(routing: torch.Tensor, mask: torch.Tensor | None = None):
    """The first token of `routing` [n, L, K] (where `mask` [n] is True, if given) that has
    no route in some layer column: (token, [its columns with every slot -1]), or None. One
    host read."""
    if routing.numel() == 0:
        return None
    empty = (routing < 0).all(dim=2)  # [n, L]
    bad = empty.any(dim=1)
    if mask is not None:
        bad = bad & mask.to(torch.bool).to(bad.device).reshape(-1)
    if not bool(bad.any()):
        return None
    t = int(bad.nonzero()[0, 0])
    return t, empty[t].nonzero().flatten().tolist()


def routed_rows(moe: torch.Tensor, who: str, layer_ids: Sequence[int],
                token_offset: int = 0) -> torch.Tensor:
    """The replay mask of MoE routing [n, L_moe, K]: True for a token routed in every MoE
    layer, False for one with no route at all (every slot -1: the engine returned none, so
    the token keeps the model's own top-k). A token routed in some MoE layers and not in others
    raises RoutingMismatchError naming it (`token_offset` + its row) and the layers."""
    if moe.numel() == 0:
        return torch.ones(moe.shape[0], dtype=torch.bool)
    empty = (moe < 0).all(dim=2)  # [n, L]
    none = empty.all(dim=1)
    partial = empty.any(dim=1) & ~none
    if bool(partial.any()):
        t = int(partial.nonzero()[0, 0])
        layers = [layer_ids[j] for j in empty[t].nonzero().flatten().tolist()]
        raise RoutingMismatchError(
            f"{who}: token {t + token_offset} has no route (every slot -1) in MoE layers "
            f"{layers} but routes in the other MoE layers; replayed, it would get no expert "
            f"in those layers. A token is routed in every MoE layer, or not at all (-1 "
            f"everywhere: replay mask False, the model's own top-k)")
    return ~none


def check_dense_columns(model_shape: ModelShape, routing: torch.Tensor, who: str) -> None:
    """In routing indexed by absolute layer id, the columns of the layers the model says are
    dense hold no route: 0 (what vLLM and SGLang write there; SGLang measured with DeepSeek-V3's
    first_k_dense_replace) or -1. Anything else means the engine's
    model has MoE layers where this model shape has dense ones (another model, or a wrong
    `moe_layer_ids`), and the MoE columns cannot be trusted either."""
    moe = set(model_shape.moe_layer_ids)
    dense = [lid for lid in range(model_shape.num_hidden_layers) if lid not in moe]
    if not dense or routing.shape[0] == 0:
        return
    cols = routing[:, dense, :]
    bad = (cols != 0) & (cols != -1)
    if not bool(bad.any()):
        return
    t, c, k = (int(v) for v in bad.nonzero()[0])
    rows = int(bad.any(2).any(1).sum())
    raise RoutingMismatchError(
        f"{who}: token {t}, layer {dense[c]} routes to experts {cols[t, c].tolist()}, but the "
        f"model's layer {dense[c]} is dense (MoE layers {list(model_shape.moe_layer_ids)} of "
        f"{model_shape.num_hidden_layers}); {rows} of {routing.shape[0]} token rows have routes in "
        f"dense layers. The routing comes from a model with other MoE layers"
    )


@dataclass
class SequenceRouting:
    """Routing of one training sequence: `indices [n, L_moe, K]` (int16, -1 = none) and
    `mask [n]` (True where the token has a route to replay)."""

    indices: torch.Tensor
    mask: torch.Tensor
    mapping: str | None = None

    def __post_init__(self) -> None:
        # one dtype for every sequence, whatever integer type the indices were built from
        self.indices, _ = int16_routing(self.indices, "SequenceRouting", "indices",
                                        RoutingMismatchError)

    @property
    def num_tokens(self) -> int:
        return int(self.indices.shape[0])


def b64_size(payload: str | bytes) -> int:
    """The bytes that valid base64 `payload` decodes to, without decoding it (to bound a
    payload by what the request can hold before decoding it)."""
    tail = payload[-2:]
    pad = tail.count("=") if isinstance(tail, str) else tail.count(b"=")
    return len(payload) // 4 * 3 - pad


def decode_b64(payload, who: str, what: str = "base64 text") -> bytes:
    """An engine's base64 routing payload (ASCII text or bytes) -> the bytes, strictly
    (`validate=True`: no stray characters); anything else raises RoutingMismatchError
    naming `who` (`what`: the words for what was expected, for a payload of another type)."""
    if isinstance(payload, str):
        try:
            payload = payload.encode("ascii")
        except UnicodeEncodeError:
            raise RoutingMismatchError(f"{who}: not valid base64 (non-ASCII text)") from None
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise RoutingMismatchError(f"{who}: expected {what}, got {type(payload).__name__}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RoutingMismatchError(f"{who}: not valid base64: {e}") from None


def as_tensor(x, who: str) -> torch.Tensor:
    """An array, list or tensor of routing as a CPU tensor."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, (list, tuple)):
        return torch.as_tensor(np.asarray(x))
    raise RoutingMismatchError(f"{who}: routing must be an array or tensor, got {type(x).__name__}")


@renamed_keyword("layout", "model_shape", "missing_sequence")
def missing_sequence(model_shape: ModelShape, n: int) -> SequenceRouting:
    """A sequence of n tokens without routing: every slot -1, every mask entry False."""
    return SequenceRouting(
        torch.full((n, model_shape.num_moe_layers, model_shape.top_k), -1, dtype=INDEX_DTYPE),
        torch.zeros(n, dtype=torch.bool),
        None,
    )


def check_batch(routings: Sequence, batch_size: int, who: str, allow_missing: bool) -> None:
    """One entry per request (None for no routing); missing entries are an error unless
    `allow_missing` (the requests then run with the model's own top-k)."""
    if len(routings) != batch_size:
        raise RoutingMismatchError(
            f"{who}: got routing for {len(routings)} requests but the batch has {batch_size}; "
            f"every request needs an entry (None for no routing) or later requests would take "
            f"their neighbour's routing"
        )
    missing = [i for i, r in enumerate(routings) if r is None]
    if missing and not allow_missing:
        have = batch_size - len(missing)
        raise RoutingMismatchError(
            f"{who}: requests {missing[:16]}{'...' if len(missing) > 16 else ''} have no routing "
            f"({have} of {batch_size} requests do); the routing was lost between rollout and "
            f"training. Pass allow_missing=True to run those requests with the model's own "
            f"top-k"
        )


# ---------------------------------------------------------------------------- multi-turn
class MultiTurnRouting:
    """Routing of one conversation built turn by turn, appended in order.

    Turn i is a request of `seq_len` tokens (the whole conversation so far, generated
    tokens included) whose routing covers tokens `[start, seq_len - 1)`. Rows already
    held are kept (never overwritten); the turn contributes the rows after them. A turn
    that starts after the rows held (a gap) or ends before them raises. A row the engine
    gave no route (every slot -1) gets replay mask False; one routed in some MoE layers
    and not in others raises (`routed_rows`).
    """

    @renamed_keyword("layout", "model_shape", "MultiTurnRouting")
    def __init__(self, model_shape: ModelShape, *, request: int | str = 0) -> None:
        self.model_shape = model_shape
        self.request = request
        self._parts: list[torch.Tensor] = []
        self._masks: list[torch.Tensor] = []
        self.rows = 0
        self.turns = 0
        self.mapping: str | None = None
        self.masked: list[tuple[int, int, str]] = []  # (first row, end row, why)

    layout = deprecated_property("model_shape", "MultiTurnRouting.layout")

    def add_turn(self, routing, seq_len: int, start: int = 0) -> None:
        """Append a turn: `routing` in any form `as_tensor` takes, or the `MoEColumns` an
        engine module took from it already (then its mapping is not decided again)."""
        who = f"request {self.request} turn {self.turns}"
        cols = routing if isinstance(routing, MoEColumns) else None
        r = cols.routing if cols is not None else as_tensor(routing, who)
        if r.dim() != 3:
            raise RoutingMismatchError(f"{who}: routing must be [tokens, L, K], got "
                                       f"{tuple(r.shape)}")
        want = seq_len - 1 - start
        if not 0 <= start <= max(seq_len - 1, 0):
            raise RoutingMismatchError(f"{who}: start={start} is outside 0..seq_len-1="
                                       f"{seq_len - 1}")
        if r.shape[0] != want:
            raise RoutingMismatchError(
                f"{who}: routing has {r.shape[0]} token rows but seq_len - 1 - start = {want} "
                f"(seq_len={seq_len}, start={start})"
            )
        if start > self.rows:
            raise RoutingMismatchError(
                f"{who}: routing starts at token {start} but the earlier turns cover only "
                f"{self.rows} tokens; tokens {self.rows}..{start - 1} would have no routing"
            )
        if seq_len - 1 < self.rows:
            raise RoutingMismatchError(
                f"{who}: seq_len={seq_len} is shorter than the {self.rows + 1} tokens of the "
                f"earlier turns; turns must be added in order"
            )
        moe, mapping = to_moe(self.model_shape, r if cols is None else cols, who)
        if self.mapping is not None and mapping != self.mapping:
            raise RoutingMismatchError(f"{who}: layer mapping {mapping!r} differs from earlier "
                                       f"turns ({self.mapping!r})")
        self.mapping = mapping
        new = moe[self.rows - start:]
        if new.shape[0]:
            mask = routed_rows(new, who, self.model_shape.moe_layer_ids, self.rows)
            self._parts.append(new)
            self._masks.append(mask)
            self.rows += int(new.shape[0])
        self.turns += 1

    def add_masked(self, n: int, why: str) -> None:
        """Append `n` rows without routing (-1, replay mask False: the model's own top-k), e.g. a
        prompt prefix the engine omitted and nobody supplied, under an explicit policy.
        `why` is kept in `masked` for the caller's report."""
        if n < 0:
            raise RoutingMismatchError(f"request {self.request}: cannot mask {n} rows")
        if n:
            L, K = self.model_shape.num_moe_layers, self.model_shape.top_k
            self._parts.append(torch.full((n, L, K), -1, dtype=INDEX_DTYPE))
            self._masks.append(torch.zeros(n, dtype=torch.bool))
            self.masked.append((self.rows, self.rows + n, why))
            self.rows += n

    def sequence(self, num_tokens: int) -> SequenceRouting:
        """The conversation's routing for its `num_tokens` training tokens, which must be
        the routed rows plus the final token (which has no route)."""
        who = f"request {self.request}"
        if self.turns == 0:
            raise RoutingMismatchError(f"{who}: no turn was added")
        if num_tokens != self.rows + 1:
            raise RoutingMismatchError(
                f"{who}: the sequence has {num_tokens} tokens but its routing covers "
                f"{self.rows} tokens (+1 final token without route = {self.rows + 1})"
            )
        L, K = self.model_shape.num_moe_layers, self.model_shape.top_k
        tail = torch.full((1, L, K), -1, dtype=INDEX_DTYPE)
        idx = torch.cat(self._parts + [tail], dim=0)
        mask = torch.cat(self._masks + [torch.zeros(1, dtype=torch.bool)])
        return SequenceRouting(idx, mask, self.mapping)


# ---------------------------------------------------------------------------- the batch
@dataclass(frozen=True)
class ReplayBatch:
    """Routing in a training format: the one type for it, from every source (the rollout
    adapters, `RoutingFile.batch()`, `RouterReplay.recorded_batch()`, `from_bytes`) to every
    sink (`RouterReplay.set_routing`, Megatron's `pad_thd`, `cp_split`, `sp_scatter` and
    `set_replay_routing`).

    indices       [B, S, L, K] (padded) or [N, L, K] (THD), -1 = none; int16 from the
                  packers (any integer dtype is carried as is)
    replay_mask   [B, S] or [N] bool, False for padding and rows without a route
    cu_seqlens    [B+1] int64 for THD: the real sequence boundaries (global packed frame)
    mappings      mappings[i]: the layer mapping request i arrived in ("absolute", "moe",
                  or None when it had no routing); may be empty
    layer_index   how the L columns of `indices` are indexed: "moe" (one per MoE layer, in
                  order; what the adapters give) or "absolute" (one per layer id; a record
                  file written that way)

    After Megatron's padding step (`integrations.megatron.pad_thd`), CP split and SP
    scatter:

    cu_seqlens_padded [B+1] int64: the padded boundaries (what PackedSeqParams carries);
                  None = not padded (the boundaries are `cu_seqlens`)
    cp_size, cp_rank, cp_scheme: which share of the CP split this is (1, 0, None = whole)
    sp_size, sp_rank: which TP rank's rows of the sequence-parallel split (1, 0 = all)

    **Checked against a model shape.** `check(shape)` scans the routing once against a
    `ModelShape` (the layer mapping decided by L and `layer_index`; every id of a row to
    replay in -1..E-1, no expert twice in a token's layer; a row to replay routed in every
    MoE layer) and marks the batch checked for that shape: `checked_shape` is the shape,
    `layer_ids` the absolute layer id of each column. The adapters, `RoutingFile.batch()`,
    `RouterReplay.recorded_batch()` and `from_bytes(..., shape=)` give batches checked
    already; `pad_thd`, `cp_split`, `cp_gather` and `sp_scatter` keep the mark (they only
    move rows and add padding rows). A sink given a batch checked for its own shape
    scans nothing and decides no mapping again; one checked for another shape is refused,
    naming what differs (a record file's MoE layer ids against the model's, say); an
    unchecked batch, or a bare tensor, is checked there as before.

    The rule that keeps the mark honest: the mark is the shape plus the indices and mask
    tensors it was made for and their version counters. The batch is frozen (its fields
    cannot be rebound), `dataclasses.replace` and every constructor give an unchecked
    batch, and an in-place write through either tensor (or a view of it) bumps its version
    counter, which voids the mark; the next sink checks again. A write that bypasses
    PyTorch (through memory shared with a numpy array, or another process) cannot be seen:
    do not write routing that way after checking it.
    """

    indices: torch.Tensor
    replay_mask: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    mappings: list = field(default_factory=list)
    layer_index: str = "moe"
    cu_seqlens_padded: torch.Tensor | None = None
    cp_size: int = 1
    cp_rank: int = 0
    cp_scheme: str | None = None
    sp_size: int = 1
    sp_rank: int = 0
    _checked: _Checked | None = field(default=None, init=False, repr=False, compare=False)

    # -- the THD frame
    @property
    def padded_cu_seqlens(self) -> torch.Tensor:
        """The row boundaries of the sequences in `indices`: `cu_seqlens_padded`, or
        `cu_seqlens` when the batch is not padded. THD batches only."""
        if self.cu_seqlens is None:
            raise RoutingMismatchError(f"{self.describe()} is a padded [B, S] batch, not THD; "
                                       f"it has no cu_seqlens")
        return self.cu_seqlens if self.cu_seqlens_padded is None else self.cu_seqlens_padded

    @property
    def num_sequences(self) -> int:
        if self.cu_seqlens is None:
            return int(self.indices.shape[0])
        return int(self.cu_seqlens.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.replay_mask.numel())

    def seq_lens(self) -> list[int]:
        cu = self.padded_cu_seqlens if self.cu_seqlens is None else self.cu_seqlens
        return (cu[1:] - cu[:-1]).tolist()

    def padded_lens(self) -> list[int]:
        cup = self.padded_cu_seqlens
        return (cup[1:] - cup[:-1]).tolist()

    def describe(self) -> str:
        sp = f", sp_size={self.sp_size}, sp_rank={self.sp_rank}" if self.sp_size != 1 else ""
        return (f"ReplayBatch(tokens={self.num_tokens}, sequences={self.num_sequences}, "
                f"cp_size={self.cp_size}, cp_rank={self.cp_rank}, cp_scheme={self.cp_scheme}"
                f"{sp})")

    cp_layout = deprecated_property("cp_scheme", "ReplayBatch.cp_layout")

    def _megatron_fields(self) -> bool:
        return (self.cu_seqlens_padded is not None or self.cp_size != 1
                or self.cp_scheme is not None or self.sp_size != 1)

    # -- checked against a model shape
    @property
    def checked_shape(self) -> ModelShape | None:
        """The `ModelShape` this batch was checked against, while the mark holds (see the
        class docstring); else None."""
        c = self._checked
        return c.shape if c is not None and c.holds(self) else None

    def checked_for(self, shape: ModelShape) -> bool:
        """Whether this batch was checked against `shape` and its routing has not changed
        since."""
        return self.checked_shape == shape

    @property
    def layer_ids(self) -> list[int] | None:
        """The absolute layer id of each column of `indices` (checked batches; else None:
        only a model shape says which layers the columns are)."""
        shape = self.checked_shape
        return None if shape is None else shape.layer_ids(self.layer_index)

    def check(self, shape: ModelShape, *, who: str = "ReplayBatch.check",
              error: Callable[[str], Exception] = RoutingMismatchError) -> ReplayBatch:
        """This batch checked against `shape` (the scan and the rule: the class docstring).
        Returns the checked batch: this one, or, when the indices arrived unsigned or int8
        or `layer_index` was "auto", a copy with signed indices and the mapping resolved.
        A batch checked for `shape` already is returned as is, without a scan. Errors name
        the token (a padded batch's tokens counted b * S + s) and the layer; `error` makes
        the exception from the message (default RoutingMismatchError)."""
        if self.checked_for(shape):
            return self
        idx, mask = self.indices, self.replay_mask
        if not isinstance(idx, torch.Tensor) or idx.dim() not in (3, 4):
            got = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise error(f"{who}: indices must be [N, L, K] or [B, S, L, K], got {got}")
        if (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                or tuple(mask.shape) != tuple(idx.shape[:-2])):
            got = (f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor)
                   else type(mask).__name__)
            raise error(f"{who}: replay_mask must be bool {tuple(idx.shape[:-2])} (the tokens "
                        f"of indices {tuple(idx.shape)}), got {got}")
        try:
            idx, dtype = signed_routing(idx, who, "indices")
        except (TypeError, ValueError) as e:
            raise error(str(e)) from None
        L, K = idx.shape[-2:]
        if K != shape.top_k:
            raise error(f"{who}: indices have K={K} slots per token but the model has "
                        f"top_k={shape.top_k} (shape {tuple(idx.shape)})")
        try:
            mapping = shape.mapping_for(L, who, self.layer_index)
        except ValueError as e:
            raise error(str(e)) from None
        flat, keep = idx.reshape(-1, L, K), mask.reshape(-1)
        moe = flat if mapping == "moe" else flat[:, shape.columns(mapping), :]
        bad = first_bad_route(moe, shape.num_experts, keep)
        if bad is not None:
            raise error(f"{who}: {describe_bad_route(bad, shape.num_experts, shape.moe_layer_ids)}"
                        f"{unsigned_note(dtype, bad.value) if bad.kind == 'range' else ''}")
        hit = first_unrouted(moe, keep)
        if hit is not None:
            layers = [shape.moe_layer_ids[j] for j in hit[1]]
            raise error(f"{who}: token {hit[0]} is marked for replay (replay_mask True) but has "
                        f"no route (every slot -1) in MoE layers {layers}; replayed, it would "
                        f"get no expert there. Set its replay_mask False (the model's own "
                        f"top-k) or route it in every MoE layer")
        out = self
        if idx is not self.indices or mapping != self.layer_index:
            out = replace(self, indices=idx, layer_index=mapping)
        return _mark_checked(out, shape)

    def apply(self, replay) -> None:
        """`replay.set_routing(self)`: the batch and its mask to a `RouterReplay`."""
        replay.set_routing(self)

    # -- bytes (transport from rollout workers to trainers)
    def to_bytes(self, *, num_experts: int | None = None, level: int = 3) -> bytes:
        """The batch as compact bytes: the indices as a `codec` blob (order kept exactly;
        one chunk run per sequence: a THD batch's sequences, a padded batch's rows), the
        mask bit-packed, and a small JSON header, each checksummed. `num_experts` defaults
        to the largest id + 1. `ReplayBatch.from_bytes` inverts it; pickling (Ray) uses it.
        A batch that `from_bytes` would refuse (an index dtype outside `BATCH_DTYPES`,
        cu_seqlens that are not the sequences' boundaries...) raises here."""
        from .. import codec

        who = "ReplayBatch.to_bytes"
        if self._megatron_fields():
            raise RoutingMismatchError(
                f"{who}: {self.describe()} is padded for Megatron or one CP rank's share; "
                f"send the batch before `pad_thd` / `cp_split` and take those steps where "
                f"it is used")
        idx = self.indices.detach().cpu()
        if idx.dim() not in (3, 4):
            raise RoutingMismatchError(f"{who}: indices must be [N, L, K] or "
                                       f"[B, S, L, K], got {tuple(idx.shape)}")
        flat = idx.reshape(-1, *idx.shape[-2:])
        mask = self.replay_mask.detach().cpu()
        head = {
            "indices_shape": list(idx.shape), "indices_dtype": str(idx.dtype).split(".")[-1],
            "mask_shape": list(mask.shape),
            "cu_seqlens": None if self.cu_seqlens is None else
            [int(v) for v in self.cu_seqlens.detach().cpu().reshape(-1).tolist()],
            "mappings": list(self.mappings), "layer_index": self.layer_index,
        }
        lens = _check_batch_head(head, who)
        _check_masked_rows(flat, mask.reshape(-1), head["layer_index"], who)
        if num_experts is None:
            num_experts = max(int(flat.max()) + 1, 1) if flat.numel() else 1
        try:
            blob = codec.encode(flat, num_experts=num_experts, order="keep", level=level,
                                seq_lens=lens)
        except codec.CodecError as e:
            raise RoutingMismatchError(f"{who}: {e}") from None
        _check_batch_dtype(head["indices_dtype"], num_experts, who)
        head = json.dumps(head, separators=(",", ":")).encode()
        bits = np.packbits(mask.numpy().astype(bool).reshape(-1)).tobytes()
        body = struct.pack("<QQ", len(head), len(bits)) + head + bits
        return _BATCH_MAGIC + struct.pack("<I", zlib.crc32(body)) + body + blob

    @classmethod
    def from_bytes(cls, data, *, shape: ModelShape | None = None, max_tokens: int | None = None,
                   max_bytes: int | None = None) -> "ReplayBatch":
        """Inverse of `to_bytes`, the safe way to take a batch from another process (never
        unpickle bytes from a peer you do not trust). Every header field is checked against
        a whitelist and against the data before anything is allocated: the index dtype (a
        fixed table), the shapes, L and K (bounded), the mask length against the tokens,
        cu_seqlens against the blob's sequences. `max_tokens` / `max_bytes` bound the
        decoded batch further (tokens; bytes of indices). A corrupt, foreign or crafted
        payload raises RoutingMismatchError naming the problem (the codec's errors name the
        offset within the blob). A token marked for replay must be routed
        (`_check_masked_rows`). With `shape` (the receiving model's) the batch is also
        checked against it (`check`) and returned checked."""
        from .. import codec

        model_shape = shape  # (`shape` names the header's indices_shape below)
        who = "ReplayBatch.from_bytes"
        try:
            buf = memoryview(data).cast("B")
        except TypeError as e:
            raise RoutingMismatchError(f"{who}: expected bytes, got {type(data).__name__} "
                                       f"({e})") from None
        m = len(_BATCH_MAGIC)
        if len(buf) < m + 20 or bytes(buf[:m]) != _BATCH_MAGIC:
            raise RoutingMismatchError(f"{who}: not a ReplayBatch payload (magic or length)")
        (crc,) = struct.unpack_from("<I", buf, m)
        nh, nb = struct.unpack_from("<QQ", buf, m + 4)
        end = m + 4 + 16 + nh + nb
        if len(buf) < end or zlib.crc32(buf[m + 4:end]) != crc:
            raise RoutingMismatchError(f"{who}: truncated or corrupt header (checksum "
                                       f"mismatch)")
        try:
            head = json.loads(bytes(buf[m + 20:m + 20 + nh]))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise RoutingMismatchError(f"{who}: the JSON header does not parse: "
                                       f"{type(e).__name__}: {str(e)[:200]}") from None
        lens = _check_batch_head(head, who, nb)
        shape = head["indices_shape"]
        n, L, K = math.prod(shape[:-2]), shape[-2], shape[-1]
        dtype, decode_dtype = BATCH_DTYPES[head["indices_dtype"]]
        row_bytes = L * K * dtype.itemsize
        out_bytes = n * L * K * decode_dtype.itemsize  # what the codec decodes into
        check_limits(who, n, row_bytes, max_tokens, max_bytes, RoutingMismatchError,
                     "indices_shape tokens")
        blob = buf[end:]
        try:
            inf = codec.info(blob, max_tokens=n)  # bytes: checked by decode, in its dtype
        except codec.CodecError as e:
            raise RoutingMismatchError(f"{who}: {e}") from None
        got = (inf.order, inf.num_layers, inf.top_k, inf.num_tokens, list(inf.seq_lens),
               inf.has_token_ids)
        want = ("keep", L, K, n, lens, False)
        if got != want:
            raise RoutingMismatchError(
                f"{who}: the routing blob holds (order, L, K, tokens, sequence lengths, token "
                f"ids) = {_short(got)}, the header says {_short(want)}")
        _check_batch_dtype(head["indices_dtype"], inf.num_experts, who)
        try:
            flat = torch.empty((n, L, K), dtype=decode_dtype)
        except (RuntimeError, MemoryError) as e:
            raise RoutingMismatchError(f"{who}: indices_shape {shape} ({n * row_bytes} "
                                       f"bytes) cannot be allocated: {e}") from None
        try:
            codec.decode(blob, out=flat, max_tokens=n, max_bytes=out_bytes)
        except codec.CodecError as e:
            raise RoutingMismatchError(f"{who}: {e}") from None
        if decode_dtype != dtype:  # an unsigned batch: every id fits, no -1 was encoded
            if n and bool((flat < 0).any()):
                raise RoutingMismatchError(f"{who}: indices_dtype {head['indices_dtype']!r} "
                                           f"but the blob holds empty slots (-1)")
            flat = flat.to(dtype)
        bits = np.frombuffer(buf[m + 20 + nh:end], dtype=np.uint8)
        if n % 8 and int(bits[-1]) & (0xFF >> (n % 8)):
            raise RoutingMismatchError(f"{who}: the mask's padding bits are set (corrupt)")
        mask = np.unpackbits(bits, count=n).astype(bool)
        _check_masked_rows(flat, torch.from_numpy(mask), head["layer_index"], who)
        mask = mask.reshape(shape[:-2])
        cu = head["cu_seqlens"]
        batch = cls(flat.reshape(shape), torch.from_numpy(mask),
                    None if cu is None else torch.tensor(cu, dtype=torch.int64),
                    list(head["mappings"]), head["layer_index"])
        return batch if model_shape is None else batch.check(model_shape, who=who)

    def __reduce__(self):
        # a copy is unchecked: the receiving side checks it against its model again
        if self._megatron_fields():  # a trainer-side stage: its tensors, as they are
            return (_batch_from_fields, (
                {f.name: getattr(self, f.name) for f in fields(self) if f.init},))
        return (_batch_from_bytes, (self.to_bytes(),))


def _versions(*tensors: torch.Tensor) -> tuple | None:
    """The version counters of `tensors` (bumped by every in-place write through them or
    a view of them); None where a tensor has none (an inference-mode tensor)."""
    try:
        return tuple(t._version for t in tensors)
    except RuntimeError:
        return None


class _Checked:
    """The mark `ReplayBatch.check` leaves: the shape, the two tensors it scanned and their
    version counters at that time. It holds for a batch that still has those tensors,
    unwritten since (the rule: `ReplayBatch`'s docstring)."""

    __slots__ = ("indices", "mask", "shape", "versions")

    def __init__(self, shape: ModelShape, indices: torch.Tensor, mask: torch.Tensor) -> None:
        self.shape, self.indices, self.mask = shape, indices, mask
        self.versions = _versions(indices, mask)

    def holds(self, batch: ReplayBatch) -> bool:
        return (self.versions is not None and batch.indices is self.indices
                and batch.replay_mask is self.mask
                and _versions(self.indices, self.mask) == self.versions)


def _mark_checked(batch: ReplayBatch, shape: ModelShape) -> ReplayBatch:
    """Mark `batch` checked for `shape`. Only for a batch whose routing was scanned against
    `shape` by this package (`ReplayBatch.check`, the adapters), or built from such a batch
    by steps that keep the check true (padding rows of -1 with mask False, row selection).
    The structure is confirmed here (no value is read); the values are the caller's
    promise."""
    idx, mask = batch.indices, batch.replay_mask
    L = shape.num_moe_layers if batch.layer_index == "moe" else shape.num_hidden_layers
    ok = (batch.layer_index in MAPPINGS and idx.dim() in (3, 4)
          and tuple(idx.shape[-2:]) == (L, shape.top_k)
          and not idx.is_floating_point() and idx.dtype not in UNSIGNED
          and idx.dtype != torch.bool
          and mask.dtype == torch.bool and tuple(mask.shape) == tuple(idx.shape[:-2]))
    if not ok:
        raise AssertionError(f"a {tuple(idx.shape)} {idx.dtype} batch ({batch.layer_index}, "
                             f"mask {mask.dtype} {tuple(mask.shape)}) cannot be checked for "
                             f"{shape}")
    object.__setattr__(batch, "_checked", _Checked(shape, idx, mask))
    return batch


def _keep_checked(src: ReplayBatch, out: ReplayBatch) -> ReplayBatch:
    """`out`, marked checked for the shape `src` is checked for (if any): for the steps that
    keep a check true (Megatron's padding, CP split and SP scatter: rows moved or selected,
    padding rows of -1 with replay_mask False)."""
    shape = src.checked_shape
    return out if shape is None else _mark_checked(out, shape)


_BATCH_MAGIC = b"RRBATCH1"
# indices_dtype name -> (the batch's dtype, the signed dtype the codec decodes into)
BATCH_DTYPES = {
    "int8": (torch.int8, torch.int8),
    "int16": (torch.int16, torch.int16),
    "int32": (torch.int32, torch.int32),
    "int64": (torch.int64, torch.int64),
    "uint8": (torch.uint8, torch.int16),
}
_BATCH_KEYS = {"indices_shape", "indices_dtype", "mask_shape", "cu_seqlens", "mappings",
               "layer_index"}
_BATCH_MAPPINGS = (None,) + MAPPINGS  # None: a request without routing


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 300 else s[:300] + "..."


def _check_batch_dtype(name: str, num_experts: int, who: str) -> None:
    dtype = BATCH_DTYPES[name][0]
    if num_experts - 1 > torch.iinfo(dtype).max:
        raise RoutingMismatchError(f"{who}: indices_dtype {name!r} cannot hold the blob's "
                                   f"expert ids 0..{num_experts - 1}")


def _check_batch_head(head, who: str, mask_bytes: int | None = None) -> list[int]:
    """The header of a `ReplayBatch` payload, checked field by field (types, whitelists,
    bounds, consistency between the fields and with the `mask_bytes` of mask bits the
    payload carries: one bit per token, so the token count is bounded by data that is
    there); returns the sequence lengths its blob must hold. Raises RoutingMismatchError
    naming the field."""
    if not isinstance(head, dict) or set(head) != _BATCH_KEYS:
        keys = sorted(head) if isinstance(head, dict) else type(head).__name__
        raise RoutingMismatchError(f"{who}: the header must have exactly the fields "
                                   f"{sorted(_BATCH_KEYS)}, got {_short(keys)}")
    name = head["indices_dtype"]
    if not isinstance(name, str) or name not in BATCH_DTYPES:
        raise RoutingMismatchError(f"{who}: indices_dtype {_short(name)} is not one of "
                                   f"{sorted(BATCH_DTYPES)}")
    shape = head["indices_shape"]
    if (not isinstance(shape, list) or len(shape) not in (3, 4)
            or not all(_is_int(v) and v >= 0 for v in shape)):
        raise RoutingMismatchError(f"{who}: indices_shape {_short(shape)} is not [N, L, K] or "
                                   f"[B, S, L, K] of non-negative integers")
    L, K = shape[-2], shape[-1]
    if not (1 <= L <= MAX_LAYERS and 1 <= K <= MAX_TOP_K and L * K <= MAX_LAYER_SLOTS):
        raise RoutingMismatchError(f"{who}: indices_shape {shape}: L={L}, K={K} is outside "
                                   f"1..{MAX_LAYERS} layers, 1..{MAX_TOP_K} experts per token, "
                                   f"L*K <= {MAX_LAYER_SLOTS}")
    if head["mask_shape"] != shape[:-2]:
        raise RoutingMismatchError(f"{who}: mask_shape {_short(head['mask_shape'])} is not "
                                   f"the tokens of indices_shape {shape} ({shape[:-2]})")
    n = math.prod(shape[:-2])
    if mask_bytes is not None and mask_bytes != (n + 7) // 8:
        raise RoutingMismatchError(f"{who}: mask_shape {shape[:-2]} holds {n} tokens, which "
                                   f"take {(n + 7) // 8} bytes of mask bits, but the payload "
                                   f"carries {mask_bytes}")
    cu = head["cu_seqlens"]
    if len(shape) == 4:
        if cu is not None:
            raise RoutingMismatchError(f"{who}: a padded [B, S, L, K] batch has no cu_seqlens, "
                                       f"got {_short(cu)}")
        lens, nseq = [shape[1]] * shape[0], shape[0]
    elif cu is None:
        lens, nseq = [n], None
    else:
        if (not isinstance(cu, list) or not cu or not all(_is_int(v) for v in cu)
                or cu[0] != 0 or cu[-1] != n or any(b < a for a, b in zip(cu, cu[1:]))):
            raise RoutingMismatchError(f"{who}: cu_seqlens {_short(cu)} must be integers from 0 "
                                       f"to the token count N={n}, never decreasing")
        lens, nseq = [b - a for a, b in zip(cu, cu[1:])], len(cu) - 1
    maps = head["mappings"]
    if (not isinstance(maps, list) or any(v not in _BATCH_MAPPINGS or isinstance(v, bool)
                                          for v in maps)
            or (maps and nseq is not None and len(maps) != nseq)):
        raise RoutingMismatchError(f"{who}: mappings {_short(maps)} must be a list of "
                                   f"{_BATCH_MAPPINGS[1:]} or None, one per sequence "
                                   f"({nseq}) or empty")
    if head["layer_index"] not in ("moe", "absolute") or not isinstance(head["layer_index"], str):
        raise RoutingMismatchError(f"{who}: layer_index {_short(head['layer_index'])} is not "
                                   f"'moe' or 'absolute'")
    return lens


def _check_masked_rows(flat: torch.Tensor, mask: torch.Tensor, layer_index: str,
                       who: str) -> None:
    """A token marked for replay (mask True) is routed: with layer_index "moe" in every
    layer (each column is a MoE layer), with "absolute" in some layer (which columns are
    MoE layers only the model knows: `RouterReplay.set_routing` checks each of them)."""
    if flat.numel() == 0:
        return
    if layer_index == "moe":
        hit = first_unrouted(flat, mask)
        if hit is not None:
            raise RoutingMismatchError(
                f"{who}: token {hit[0]} is marked for replay (replay_mask True) but has no "
                f"route (every slot -1) in MoE layer columns {hit[1]}; replayed, it would "
                f"get no expert there. Route it in every MoE layer, or set its mask False")
        return
    none = (flat < 0).flatten(1).all(dim=1) & mask.to(torch.bool)
    if bool(none.any()):
        t = int(none.nonzero()[0, 0])
        raise RoutingMismatchError(
            f"{who}: token {t} is marked for replay (replay_mask True) but has no route in "
            f"any layer (every slot -1); set its mask False")


def _batch_from_bytes(data: bytes) -> ReplayBatch:
    return ReplayBatch.from_bytes(data)


def _batch_from_fields(fields: dict) -> ReplayBatch:
    return ReplayBatch(**fields)


def pack_thd(seqs: Sequence[SequenceRouting]) -> ReplayBatch:
    """Concatenate sequences (packed THD): `cu_seqlens` are the sequence boundaries."""
    if not seqs:
        raise RoutingMismatchError("pack_thd: no sequences")
    lens = [s.num_tokens for s in seqs]
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return ReplayBatch(torch.cat([s.indices for s in seqs], 0),
                       torch.cat([s.mask for s in seqs], 0), cu, [s.mapping for s in seqs])


def pack_padded(
    seqs: Sequence[SequenceRouting],
    prompt_lens: Sequence[int],
    *,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
) -> ReplayBatch:
    """verl's padded format: `[B, max_prompt_len + max_response_len, L, K]`, sequence i's first
    `prompt_lens[i]` tokens end at column `max_prompt_len` (left padding) and its
    remaining tokens start there (right padding)."""
    if not seqs:
        raise RoutingMismatchError("pack_padded: no sequences")
    if len(prompt_lens) != len(seqs):
        raise RoutingMismatchError(f"pack_padded: {len(prompt_lens)} prompt lengths for "
                                   f"{len(seqs)} sequences")
    P = [int(p) for p in prompt_lens]
    R = [s.num_tokens - p for s, p in zip(seqs, P)]
    for i, (p, r) in enumerate(zip(P, R)):
        if p < 0 or r < 0:
            raise RoutingMismatchError(f"request {i}: prompt_len={p} is outside the sequence's "
                                       f"{seqs[i].num_tokens} tokens")
    Pm = max(P) if max_prompt_len is None else int(max_prompt_len)
    Rm = max(R) if max_response_len is None else int(max_response_len)
    for i, (p, r) in enumerate(zip(P, R)):
        if p > Pm:
            raise RoutingMismatchError(f"request {i}: prompt_len={p} exceeds max_prompt_len={Pm}")
        if r > Rm:
            raise RoutingMismatchError(f"request {i}: response has {r} tokens, exceeds "
                                       f"max_response_len={Rm}")
    B, L, K = len(seqs), seqs[0].indices.shape[1], seqs[0].indices.shape[2]
    idx = torch.full((B, Pm + Rm, L, K), -1, dtype=INDEX_DTYPE)
    mask = torch.zeros(B, Pm + Rm, dtype=torch.bool)
    for i, (s, p, r) in enumerate(zip(seqs, P, R)):
        idx[i, Pm - p:Pm + r] = s.indices
        mask[i, Pm - p:Pm + r] = s.mask
    return ReplayBatch(idx, mask, None, [s.mapping for s in seqs])


def pack(seqs, prompt_lens, packing, max_prompt_len=None, max_response_len=None) -> ReplayBatch:
    """`pack_thd` (packing="thd") or `pack_padded` (packing="padded")."""
    if packing == "thd":
        return pack_thd(seqs)
    if packing == "padded":
        return pack_padded(seqs, prompt_lens, max_prompt_len=max_prompt_len,
                           max_response_len=max_response_len)
    raise ValueError(f"unknown packing={packing!r}; expected one of {PACKINGS}")


def packing_arg(packing: str | None, layout_kind: str | None, who: str) -> str:
    """`packing=`, or the deprecated `layout_kind=` it replaces (which warns)."""
    return resolve_renamed(who, "layout_kind", "packing", layout_kind, packing, "padded")


# deprecated (one release): the model shape is ModelShape
__getattr__ = deprecated_names(__name__, {"ModelLayout": ("ModelShape", ModelShape)})
