"""SGLang (`--enable-return-routed-experts`, `return_routed_experts=True`): per request,
`meta_info["routed_experts"]` is base64 of little-endian int32, a flattened
`[seqlen - 1 - start, L, K]` covering tokens `[start, seqlen - 1)`, where `start` is the
request's `routed_experts_start_len` (0 = the whole sequence; multi-turn sends only the
suffix).

The payload is flat, so its layer count L (all hidden layers, or the MoE layers) cannot
always be read off the data: a payload of n rows of one L can have the length of n' rows of
the other (with DeepSeek-V3's 61 and 58 layers, for some row counts). Pass the engine's
layer count as `num_layers`; without it, a payload whose length fits both layer counts is
refused (`RoutingMismatchError`), never read with a guessed one.
"""
from __future__ import annotations

import base64
import binascii
from typing import Mapping, Sequence

import numpy as np
import torch

from .layout import (
    ModelShape,
    MultiTurnRouting,
    ReplayBatch,
    RoutingMismatchError,
    SequenceRouting,
    as_tensor,
    check_batch,
    missing_sequence,
    pack,
)

SGLANG_KEY = "routed_experts"
SGLANG_START_KEY = "routed_experts_start_len"


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


def payload_layers(n_values: int, rows: int, layout: ModelShape, who: str,
                   num_layers: int | None = None) -> int:
    """The layer count L of a flat payload of `n_values` int32 values that must hold `rows`
    token rows: `num_layers` when the caller knows it, else the one layer count of the
    model (MoE or all hidden layers) that divides the payload. A payload that fits both is
    ambiguous and refused; a payload whose rows differ from `rows` is refused."""
    K = layout.top_k
    counts = sorted({layout.num_moe_layers, layout.num_hidden_layers})
    if n_values == 0 and rows == 0:  # an empty payload for an empty range of tokens
        return num_layers or layout.num_moe_layers
    if num_layers is not None:
        if num_layers not in counts:
            raise RoutingMismatchError(
                f"{who}: num_layers={num_layers} is neither the model's {layout.num_moe_layers} "
                f"MoE layers nor its {layout.num_hidden_layers} hidden layers")
        readings = [num_layers] if n_values % (num_layers * K) == 0 else []
    else:
        readings = [L for L in counts if n_values % (L * K) == 0]
        if len(readings) > 1:
            raise RoutingMismatchError(
                f"{who}: {n_values} int32 values fit both {n_values // (counts[0] * K)} token "
                f"rows x L={counts[0]} and {n_values // (counts[1] * K)} rows x L={counts[1]} "
                f"(x K={K}); the payload alone cannot tell which. Pass the engine's layer "
                f"count as num_layers={layout.num_moe_layers} (MoE layers) or "
                f"num_layers={layout.num_hidden_layers} (all hidden layers)"
            )
    if not readings or n_values // (readings[0] * K) != rows:
        options = [num_layers] if num_layers is not None else counts
        raise RoutingMismatchError(
            f"{who}: {n_values} int32 values do not fit the expected {rows} token rows x K={K} "
            f"x L in {options} ({n_values / max(rows * K, 1):g} layers per row); the request "
            f"and its routing do not line up"
        )
    return readings[0]


def sglang_sequences(
    meta_infos: Sequence[Mapping | Sequence[Mapping] | None],
    seq_lens: Sequence[int | Sequence[int]],
    layout: ModelShape,
    *,
    starts: Sequence[int | Sequence[int]] | None = None,
    num_layers: int | None = None,
    allow_missing: bool = False,
) -> list[SequenceRouting]:
    """Per-request routing from SGLang responses.

    `meta_infos[i]` is the response's `meta_info` (holding base64 `routed_experts`), or a
    list of them for a multi-turn conversation (one per turn, in order), or None.
    `seq_lens[i]` is the request's total token count (prompt + generated), or a list per
    turn. `starts[i]` is the request's `routed_experts_start_len` (default: the value in
    meta_info if present, else 0), or a list per turn. `num_layers` is the engine's layer
    count L (see the module docstring).
    """
    who = "sglang meta_info"
    B = len(seq_lens)
    check_batch(list(meta_infos), B, who, allow_missing)
    out = []
    for i, (m, n) in enumerate(zip(meta_infos, seq_lens)):
        turns_meta = [m] if isinstance(m, Mapping) else m
        turns_len = [n] if isinstance(n, (int, np.integer)) else list(n)
        total = int(turns_len[-1])
        if turns_meta is None:
            out.append(missing_sequence(layout, total))
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
                # bound the decoded size by the request's tokens before decoding
                most = 4 * rows * max(layout.num_hidden_layers, layout.num_moe_layers) * \
                    layout.top_k
                if len(payload) > 4 * -(-most // 3) + 4:
                    raise RoutingMismatchError(
                        f"{tw}: routed_experts is {len(payload)} base64 characters, more than "
                        f"the {4 * -(-most // 3)} that {rows} token rows (seqlen={sl}, "
                        f"start={s}) of int32 [L, K={layout.top_k}] take")
                raw = _b64(payload, tw)
                if len(raw) % 4:
                    raise RoutingMismatchError(f"{tw}: {len(raw)} bytes is not a whole number "
                                               f"of int32 values")
                L = payload_layers(len(raw) // 4, rows, layout, tw, num_layers)
                arr = torch.from_numpy(
                    np.frombuffer(raw, dtype="<i4").reshape(-1, L, layout.top_k).copy())
            else:
                arr = as_tensor(payload, tw)
            if arr.shape[0] != rows:
                raise RoutingMismatchError(
                    f"{tw}: routed_experts has {arr.shape[0]} token rows but seqlen - 1 - start "
                    f"= {rows} (seqlen={sl}, start={s})"
                )
            acc.add_turn(arr, sl, s)
        out.append(acc.sequence(total))
    return out


def sglang_batch(meta_infos, seq_lens, prompt_lens, layout, *, starts=None, num_layers=None,
                 layout_kind="padded", max_prompt_len=None, max_response_len=None,
                 allow_missing=False) -> ReplayBatch:
    """`sglang_sequences` then `pack_padded` or `pack_thd`."""
    seqs = sglang_sequences(meta_infos, seq_lens, layout, starts=starts, num_layers=num_layers,
                            allow_missing=allow_missing)
    return pack(seqs, prompt_lens, layout_kind, max_prompt_len, max_response_len)
