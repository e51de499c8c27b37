"""Rollout adapters (R3): routing returned by vLLM or SGLang, in the training layouts.

What the engines return, per request:

* vLLM (`enable_return_routed_experts`): `routed_experts`, an array `[prompt_len +
  gen_len - 1, L, K]` of int16 or int32. The last token has no route.
* SGLang (`--enable-return-routed-experts`, `return_routed_experts=True`):
  `meta_info["routed_experts"]`, base64 of int32, a flattened `[seqlen - 1 - start, L, K]`,
  covering tokens `[start, seqlen - 1)` where `start` is the request's
  `routed_experts_start_len` (0 = the whole sequence; multi-turn sends only the suffix).

L is either the number of all hidden layers (rows indexed by absolute layer id, dense
layers included) or the number of MoE layers; `ModelLayout.to_moe` picks by L and keeps
the MoE layers, in `moe_layer_ids` order. Every output here is indexed by MoE ordinal
(`layer_index="moe"` for `RouterReplay.set_routing`).

Training layouts:

* `pack_padded`: verl's `[B, S, L, K]`, the prompt left-padded to `max_prompt_len` and the
  response right-padded to `max_response_len`, plus `replay_mask [B, S]`.
* `pack_thd`: packed tokens `[N, L, K]` with `cu_seqlens [B+1]` and `replay_mask [N]`.

Empty slots and padding are -1 (never 0: a zero row would send the token to expert 0),
and `replay_mask` is False for padding, for the final token of each sequence (it has no
route) and for requests explicitly allowed to have no routing. Every mismatch raises
`RoutingMismatchError` naming the request and both lengths.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

INDEX_DTYPE = torch.int16
SGLANG_KEY = "routed_experts"
SGLANG_START_KEY = "routed_experts_start_len"


class RoutingMismatchError(ValueError):
    """Rollout routing that does not line up with the batch it belongs to."""


@dataclass(frozen=True)
class ModelLayout:
    """The layer and expert shape of the model whose routing is replayed."""

    num_experts: int
    top_k: int
    moe_layer_ids: tuple[int, ...]
    num_hidden_layers: int

    def __post_init__(self) -> None:
        ids = tuple(int(i) for i in self.moe_layer_ids)
        object.__setattr__(self, "moe_layer_ids", ids)
        if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0:
            raise ValueError(
                f"ModelLayout: moe_layer_ids must be ascending distinct ids, got {ids}")
        if self.num_hidden_layers <= ids[-1]:
            raise ValueError(f"ModelLayout: num_hidden_layers={self.num_hidden_layers} but "
                             f"moe_layer_ids contains {ids[-1]}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"ModelLayout: top_k={self.top_k} must be in 1..num_experts="
                             f"{self.num_experts}")
        if self.num_experts > torch.iinfo(INDEX_DTYPE).max:
            raise ValueError(f"ModelLayout: num_experts={self.num_experts} does not fit int16")

    @classmethod
    def of(cls, replay) -> "ModelLayout":
        """The layout of a `RouterReplay`."""
        return cls(replay.num_experts, replay.top_k, tuple(replay.moe_layer_ids),
                   replay.num_hidden_layers)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    def mapping_for(self, L: int, who: str) -> str:
        if L == self.num_moe_layers:
            return "moe"
        if L == self.num_hidden_layers:
            return "absolute"
        raise RoutingMismatchError(
            f"{who}: routing has L={L} layers, but the model has {self.num_moe_layers} MoE "
            f"layers (ids {list(self.moe_layer_ids)}) and {self.num_hidden_layers} hidden "
            f"layers; L must be one of them"
        )

    def to_moe(self, routing: torch.Tensor, who: str) -> tuple[torch.Tensor, str]:
        """[n, L, K] (absolute or MoE layers) -> ([n, L_moe, K] int16, mapping used), with
        the values checked (range -1..E-1, no repeated expert in a token's layer)."""
        if routing.dim() != 3:
            raise RoutingMismatchError(f"{who}: routing must be [tokens, L, K], got shape "
                                       f"{tuple(routing.shape)}")
        n, L, K = routing.shape
        if K != self.top_k:
            raise RoutingMismatchError(f"{who}: routing has K={K} experts per token, the model "
                                       f"has top_k={self.top_k} (shape {tuple(routing.shape)})")
        mapping = self.mapping_for(L, who)
        if routing.is_floating_point() or routing.dtype == torch.bool:
            raise RoutingMismatchError(f"{who}: routing must be integers, got {routing.dtype}")
        if mapping == "absolute" and self.num_moe_layers != L:
            routing = routing[:, list(self.moe_layer_ids), :]
        r = routing.to(torch.int64)
        bad = (r < -1) | (r >= self.num_experts)
        if bool(bad.any()):
            t, l, k = (int(v) for v in bad.nonzero()[0])
            raise RoutingMismatchError(
                f"{who}: token {t}, MoE layer {self.moe_layer_ids[l]} (slot {k}) routes to expert "
                f"{int(r[t, l, k])}, out of range for num_experts={self.num_experts} "
                f"(valid 0..{self.num_experts - 1}, -1 = no route)"
            )
        if K > 1 and n:
            s = r.sort(dim=2).values
            dup = ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any(dim=2)
            if bool(dup.any()):
                t, l = (int(v) for v in dup.nonzero()[0])
                raise RoutingMismatchError(
                    f"{who}: token {t}, MoE layer {self.moe_layer_ids[l]} repeats an expert "
                    f"{r[t, l].tolist()}; zero-filled or duplicated rows are not routes (mark "
                    f"missing routes with -1)"
                )
        return r.to(INDEX_DTYPE), mapping


@dataclass
class SequenceRouting:
    """Routing of one training sequence: `indices [n, L_moe, K]` (int16, -1 = none) and
    `mask [n]` (True where the token has a route to replay)."""

    indices: torch.Tensor
    mask: torch.Tensor
    mapping: str | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.indices.shape[0])


def _as_tensor(x, who: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, (list, tuple)):
        return torch.as_tensor(np.asarray(x))
    raise RoutingMismatchError(f"{who}: routing must be an array or tensor, got {type(x).__name__}")


def _missing_sequence(layout: ModelLayout, n: int) -> SequenceRouting:
    return SequenceRouting(
        torch.full((n, layout.num_moe_layers, layout.top_k), -1, dtype=INDEX_DTYPE),
        torch.zeros(n, dtype=torch.bool),
        None,
    )


def _check_batch(routings: Sequence, batch_size: int, who: str, allow_missing: bool) -> None:
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
            f"training. Pass allow_missing=True to run those requests with native top-k"
        )


# ---------------------------------------------------------------------------- multi-turn
class MultiTurnRouting:
    """Routing of one conversation built turn by turn, appended in order.

    Turn i is a request of `seq_len` tokens (the whole conversation so far, generated
    tokens included) whose routing covers tokens `[start, seq_len - 1)`. Rows already
    held are kept (never overwritten); the turn contributes the rows after them. A turn
    that starts after the rows held (a gap) or ends before them raises.
    """

    def __init__(self, layout: ModelLayout, *, request: int | str = 0) -> None:
        self.layout = layout
        self.request = request
        self._parts: list[torch.Tensor] = []
        self.rows = 0
        self.turns = 0
        self.mapping: str | None = None

    def add_turn(self, routing, seq_len: int, start: int = 0) -> None:
        who = f"request {self.request} turn {self.turns}"
        r = _as_tensor(routing, who)
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
        moe, mapping = self.layout.to_moe(r, who)
        if self.mapping is not None and mapping != self.mapping:
            raise RoutingMismatchError(f"{who}: layer mapping {mapping!r} differs from earlier "
                                       f"turns ({self.mapping!r})")
        self.mapping = mapping
        new = moe[self.rows - start:]
        if new.shape[0]:
            self._parts.append(new)
            self.rows += int(new.shape[0])
        self.turns += 1

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
        L, K = self.layout.num_moe_layers, self.layout.top_k
        tail = torch.full((1, L, K), -1, dtype=INDEX_DTYPE)
        idx = torch.cat(self._parts + [tail], dim=0)
        mask = torch.ones(num_tokens, dtype=torch.bool)
        mask[-1] = False
        return SequenceRouting(idx, mask, self.mapping)


# ---------------------------------------------------------------------------- vLLM
def vllm_sequences(
    routed_experts: Sequence[Any | None],
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    layout: ModelLayout,
    *,
    allow_missing: bool = False,
) -> list[SequenceRouting]:
    """Per-request routing from vLLM: `routed_experts[i]` is `[prompt_lens[i] +
    response_lens[i] - 1, L, K]` (int16/int32), or None for a request without routing
    (an error unless `allow_missing`). A multi-turn request is a list of turns, each
    `(routed_experts, seq_len)` for the turn's whole request, appended in order."""
    who = "vllm routed_experts"
    B = len(prompt_lens)
    if len(response_lens) != B:
        raise RoutingMismatchError(f"{who}: {len(prompt_lens)} prompt lengths but "
                                   f"{len(response_lens)} response lengths")
    _check_batch(routed_experts, B, who, allow_missing)
    out = []
    for i, (r, P, G) in enumerate(zip(routed_experts, prompt_lens, response_lens)):
        P, G = int(P), int(G)
        if P < 0 or G < 0 or P + G < 1:
            raise RoutingMismatchError(f"request {i}: prompt_len={P}, response_len={G} is empty")
        if r is None:
            out.append(_missing_sequence(layout, P + G))
            continue
        acc = MultiTurnRouting(layout, request=i)
        if isinstance(r, list) and r and isinstance(r[0], tuple):
            for turn, seq_len in r:
                acc.add_turn(turn, int(seq_len), 0)
        else:
            t = _as_tensor(r, f"request {i}")
            if t.dim() == 3 and t.shape[0] != P + G - 1:
                raise RoutingMismatchError(
                    f"request {i}: vLLM routed_experts has {t.shape[0]} token rows but "
                    f"prompt_len + response_len - 1 = {P + G - 1} (prompt_len={P}, "
                    f"response_len={G})"
                )
            acc.add_turn(t, P + G, 0)
        out.append(acc.sequence(P + G))
    return out


# ---------------------------------------------------------------------------- SGLang
def decode_sglang(payload: str | bytes, *, num_layers: int, top_k: int,
                  who: str = "sglang routed_experts") -> torch.Tensor:
    """base64 of little-endian int32 -> [n, num_layers, top_k] int32."""
    raw = _b64(payload, who)
    row = 4 * num_layers * top_k
    if len(raw) % row:
        raise RoutingMismatchError(
            f"{who}: {len(raw)} bytes is not a whole number of [L={num_layers}, K={top_k}] "
            f"int32 rows ({row} bytes each)"
        )
    arr = np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k)
    return torch.from_numpy(arr.copy())


def _b64(payload: str | bytes, who: str) -> bytes:
    if isinstance(payload, str):
        try:
            payload = payload.encode("ascii")
        except UnicodeEncodeError:
            raise RoutingMismatchError(f"{who}: not valid base64 (non-ASCII text)") from None
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RoutingMismatchError(f"{who}: not valid base64: {e}") from None


def encode_sglang(routing) -> str:
    """The inverse of decode_sglang (int32 little-endian, base64), for tests and tools."""
    arr = np.ascontiguousarray(np.asarray(routing, dtype="<i4"))
    return base64.b64encode(arr.tobytes()).decode("ascii")


def _sglang_layers(payload_len: int, rows: int, layout: ModelLayout, who: str) -> int:
    """L of a flattened payload of `payload_len` int32 values with `rows` token rows."""
    if rows == 0:
        if payload_len:
            raise RoutingMismatchError(f"{who}: {payload_len} values for 0 expected token rows")
        return layout.num_moe_layers
    per_row, rem = divmod(payload_len, rows * layout.top_k)
    if rem or per_row not in (layout.num_moe_layers, layout.num_hidden_layers):
        raise RoutingMismatchError(
            f"{who}: {payload_len} int32 values do not fit the expected {rows} token rows x K="
            f"{layout.top_k} x L in ({layout.num_moe_layers} MoE, {layout.num_hidden_layers} "
            f"hidden) layers ({payload_len / max(rows * layout.top_k, 1):g} layers per row)"
        )
    return per_row


def sglang_sequences(
    meta_infos: Sequence[Mapping | Sequence[Mapping] | None],
    seq_lens: Sequence[int | Sequence[int]],
    layout: ModelLayout,
    *,
    starts: Sequence[int | Sequence[int]] | None = None,
    allow_missing: bool = False,
) -> list[SequenceRouting]:
    """Per-request routing from SGLang responses.

    `meta_infos[i]` is the response's `meta_info` (holding base64 `routed_experts`), or a
    list of them for a multi-turn conversation (one per turn, in order), or None.
    `seq_lens[i]` is the request's total token count (prompt + generated), or a list per
    turn. `starts[i]` is the request's `routed_experts_start_len` (default: the value in
    meta_info if present, else 0), or a list per turn.
    """
    who = "sglang meta_info"
    B = len(seq_lens)
    entries = [None if m is None else m for m in meta_infos]
    _check_batch(entries, B, who, allow_missing)
    out = []
    for i, (m, n) in enumerate(zip(entries, seq_lens)):
        turns_meta = [m] if isinstance(m, Mapping) else (m if m is not None else None)
        turns_len = [n] if isinstance(n, (int, np.integer)) else list(n)
        total = int(turns_len[-1])
        if turns_meta is None:
            out.append(_missing_sequence(layout, total))
            continue
        if len(turns_meta) != len(turns_len):
            raise RoutingMismatchError(f"request {i}: {len(turns_meta)} turns of meta_info but "
                                       f"{len(turns_len)} turn lengths")
        st = None if starts is None else starts[i]
        turns_start = ([st] if isinstance(st, (int, np.integer)) else st) if st is not None \
            else [None] * len(turns_meta)
        if len(turns_start) != len(turns_meta):
            raise RoutingMismatchError(f"request {i}: {len(turns_start)} start offsets for "
                                       f"{len(turns_meta)} turns")
        acc = MultiTurnRouting(layout, request=i)
        for j, (mi, sl, s0) in enumerate(zip(turns_meta, turns_len, turns_start)):
            tw = f"request {i} turn {j}"
            if not isinstance(mi, Mapping) or mi.get(SGLANG_KEY) is None:
                raise RoutingMismatchError(
                    f"{tw}: meta_info has no {SGLANG_KEY!r} (keys: "
                    f"{sorted(mi) if isinstance(mi, Mapping) else type(mi).__name__}); was the "
                    f"request sent with return_routed_experts=True?"
                )
            s = int(s0) if s0 is not None else int(mi.get(SGLANG_START_KEY, 0) or 0)
            sl = int(sl)
            rows = sl - 1 - s
            payload = mi[SGLANG_KEY]
            if rows < 0:
                raise RoutingMismatchError(f"{tw}: start={s} is past seq_len - 1 = {sl - 1}")
            if isinstance(payload, (str, bytes)):
                raw = _b64(payload, tw)
                if len(raw) % 4:
                    raise RoutingMismatchError(f"{tw}: {len(raw)} bytes is not a whole number "
                                               f"of int32 values")
                L = _sglang_layers(len(raw) // 4, rows, layout, tw)
                arr = torch.from_numpy(
                    np.frombuffer(raw, dtype="<i4").reshape(-1, L, layout.top_k).copy())
            else:
                arr = _as_tensor(payload, tw)
            if arr.shape[0] != rows:
                raise RoutingMismatchError(
                    f"{tw}: routed_experts has {arr.shape[0]} token rows but seqlen - 1 - start "
                    f"= {rows} (seqlen={sl}, start={s})"
                )
            acc.add_turn(arr, sl, s)
        out.append(acc.sequence(total))
    return out


# ---------------------------------------------------------------------------- layouts
@dataclass
class ReplayBatch:
    """Routing in a training layout, ready for `RouterReplay.set_routing`:
    `indices` [B, S, L_moe, K] (padded) or [N, L_moe, K] (THD), int16 with -1 = none;
    `replay_mask` [B, S] or [N]; `cu_seqlens` [B+1] for THD. `mappings[i]` is the layer
    mapping request i arrived in ("absolute", "moe", or None when it had no routing)."""

    indices: torch.Tensor
    replay_mask: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    mappings: list = field(default_factory=list)
    layer_index: str = "moe"

    def apply(self, replay) -> None:
        replay.set_routing(self.indices, self.replay_mask, layer_index=self.layer_index)


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
    """verl's layout: `[B, max_prompt_len + max_response_len, L, K]`, sequence i's first
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


def from_verl_padded(
    routed: torch.Tensor,
    attention_mask: torch.Tensor,
    layout: ModelLayout,
) -> ReplayBatch:
    """verl's own int16 `[B, S, L, K]` (zero rows where there is no data) plus its
    `attention_mask [B, S]`: rows outside the mask and the last real token of each row
    become -1 with replay_mask False, so a zero row is never read as expert 0."""
    if routed.dim() != 4 or attention_mask.shape != routed.shape[:2]:
        raise RoutingMismatchError(
            f"from_verl_padded: routed must be [B, S, L, K] and attention_mask [B, S]; got "
            f"{tuple(routed.shape)} and {tuple(attention_mask.shape)}"
        )
    B, S, L, K = routed.shape
    am = attention_mask.to(torch.bool).cpu()
    pos = torch.arange(S).expand(B, S)
    last = torch.where(am, pos, -1).max(dim=1).values  # [B]
    mask = am & (pos != last[:, None])
    flat = routed.detach().cpu().reshape(B * S, L, K)
    mapping = layout.mapping_for(L, "from_verl_padded")
    if mapping == "absolute" and L != layout.num_moe_layers:
        flat = flat[:, list(layout.moe_layer_ids), :]
    idx = torch.where(mask.reshape(B * S, 1, 1), flat.to(torch.int64), -1)
    try:
        moe, _ = layout.to_moe(idx, "from_verl_padded")
    except RoutingMismatchError as e:
        raise RoutingMismatchError(f"{e} (flattened token index = b * S + s, S={S})") from None
    return ReplayBatch(moe.reshape(B, S, layout.num_moe_layers, K), mask, None,
                       [mapping] * B)


def vllm_batch(routed_experts, prompt_lens, response_lens, layout, *, layout_kind="padded",
               max_prompt_len=None, max_response_len=None, allow_missing=False) -> ReplayBatch:
    """`vllm_sequences` then `pack_padded` (layout_kind="padded") or `pack_thd` ("thd")."""
    seqs = vllm_sequences(routed_experts, prompt_lens, response_lens, layout,
                          allow_missing=allow_missing)
    return _pack(seqs, prompt_lens, layout_kind, max_prompt_len, max_response_len)


def sglang_batch(meta_infos, seq_lens, prompt_lens, layout, *, starts=None, layout_kind="padded",
                 max_prompt_len=None, max_response_len=None, allow_missing=False) -> ReplayBatch:
    """`sglang_sequences` then `pack_padded` or `pack_thd`."""
    seqs = sglang_sequences(meta_infos, seq_lens, layout, starts=starts,
                            allow_missing=allow_missing)
    return _pack(seqs, prompt_lens, layout_kind, max_prompt_len, max_response_len)


def _pack(seqs, prompt_lens, kind, max_prompt_len, max_response_len) -> ReplayBatch:
    if kind == "thd":
        return pack_thd(seqs)
    if kind == "padded":
        return pack_padded(seqs, prompt_lens, max_prompt_len=max_prompt_len,
                           max_response_len=max_response_len)
    raise ValueError(f"unknown layout_kind={kind!r}; expected 'padded' or 'thd'")


def routing_from_batch(batch: Mapping, key: str = "routed_experts") -> Any:
    """`batch[key]`, raising a clear error when the key was dropped on the way from the
    generator to the trainer (R3 must never silently run without routing)."""
    if key not in batch or batch[key] is None:
        keys = sorted(map(str, batch.keys()))
        raise RoutingMismatchError(
            f"the training batch has no {key!r} (keys: {keys}); rollout routing replay (R3) "
            f"needs the rollout's routing to reach the trainer"
        )
    return batch[key]


__all__ = [
    "ModelLayout",
    "MultiTurnRouting",
    "ReplayBatch",
    "RoutingMismatchError",
    "SequenceRouting",
    "decode_sglang",
    "encode_sglang",
    "from_verl_padded",
    "pack_padded",
    "pack_thd",
    "routing_from_batch",
    "sglang_batch",
    "sglang_sequences",
    "vllm_batch",
    "vllm_sequences",
]
