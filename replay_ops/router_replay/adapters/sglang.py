"""SGLang (`--enable-return-routed-experts`, `return_routed_experts=True`): per request,
`meta_info["routed_experts"]` is base64 of a flattened `[seqlen - 1 - start, L, K]` covering
tokens `[start, seqlen - 1)`, where `start` is the request's `routed_experts_start_len` (0 =
the whole sequence; multi-turn sends only the suffix).

The payload is flat, so its layer count L (all hidden layers, or the MoE layers) cannot
always be read off the data: a payload of n rows of one L can have the length of n' rows of
the other (with DeepSeek-V3's 61 and 58 layers, for some row counts). Pass the engine's
layer count as `num_layers`; without it, a payload whose length fits both layer counts is
refused (`RoutingMismatchError`), never read with a guessed one.

The forms a real SGLang (0.5.23, measured) sends, and how they are taken:

1. **The start is not echoed.** `routed_experts_start_len` never appears in `meta_info`:
   the start is taken from the request the caller sent (`requests=`, the request bodies,
   or `starts=`). Without either it is 0, and a payload with fewer rows than the request
   is refused with the start it suggests.
2. **Multi-turn.** Turn j's request is the whole conversation so far. Send
   `routed_experts_start_len` = the previous turn's full length - 1 (the rows already
   held): the previous turn's last token has no route in its own turn (the last token of a
   request never has one), and the next turn routes it as a prompt token. With start =
   the previous length, that token is routed in neither turn: it is refused, unless its
   row is supplied (`prefix_routing=`) or masked out (`omitted="mask"`, replay mask False:
   the model's own top-k there); it is never zero-filled.
3. **The OpenAI-compatible endpoints** (`/v1/completions`, `/v1/chat/completions`) carry
   the payload in the choice's `sglext.routed_experts`, and only the first choice of a
   response has one (2 prompts x n=2 gave 4 choices, 1 payload): `openai_meta_infos`
   takes a response and refuses the choices without a payload, naming them.
4. **A batched `/generate`** (`input_ids` a list of requests) takes one int
   `routed_experts_start_len` for the whole batch (a list is answered with HTTP 400):
   `starts=` may be that one int, and `requests=` that one batched body.
5. **A server started without `--enable-return-routed-experts`** omits the field
   silently: refused as "the engine was not started with --enable-return-routed-experts".
6. **The wire dtype.** 0.5.23 sends int32; newer SGLang narrows it
   (`SGLANG_ROUTED_EXPERTS_DTYPE`: uint8 or uint16, int32 when an id does not fit) and
   names what it sent in `meta_info["routed_experts_dtype"]`. The field is read when
   present and int32 assumed when absent; a name other than int32/uint16/uint8 is refused.
   An array from SGLang's own decode helper, `[positions, L*K]`, is taken too.
7. **Dense layers.** L is every hidden layer, by absolute layer id. A dense layer's rows
   hold no route: all 0, measured on a real DeepSeek-V3 with `first_k_dense_replace`, and
   accepted (see `check_dense_columns`); a payload with routes there comes from a
   model with other MoE layers and is refused. SGLang's Qwen3-MoE ignores
   `mlp_only_layers` (it serves such a checkpoint as all-MoE, the dense layer's weights
   never loaded): its payload has routes in the layer the checkpoint says is dense, and is
   refused, rightly.
"""
from __future__ import annotations

import base64
from typing import Mapping, Sequence

import numpy as np
import torch

from .batch import (
    ModelShape,
    MultiTurnRouting,
    ReplayBatch,
    RoutingMismatchError,
    SequenceRouting,
    _mark_checked,
    _short,
    as_tensor,
    b64_size,
    check_batch,
    decode_b64,
    missing_sequence,
    pack,
    packing_arg,
)
from ..._deprecated import renamed_keyword

SGLANG_KEY = "routed_experts"
SGLANG_START_KEY = "routed_experts_start_len"
SGLANG_DTYPE_KEY = "routed_experts_dtype"
# the dtypes SGLang names in meta_info["routed_experts_dtype"] (little-endian on the wire)
WIRE_DTYPES = {"int32": np.dtype("<i4"), "uint16": np.dtype("<u2"), "uint8": np.dtype("u1")}
OMITTED = ("error", "mask")
NOT_ENABLED = "the engine was not started with --enable-return-routed-experts"


def wire_dtype(meta_info: Mapping | str | None = None, who: str = "sglang meta_info") -> np.dtype:
    """The dtype of a payload: `meta_info["routed_experts_dtype"]` (or that name itself) when
    present, else int32 (SGLang before the field existed). Unknown names are refused."""
    name = meta_info.get(SGLANG_DTYPE_KEY) if isinstance(meta_info, Mapping) else meta_info
    if name is None:
        return WIRE_DTYPES["int32"]
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in WIRE_DTYPES:
        raise RoutingMismatchError(f"{who}: {SGLANG_DTYPE_KEY}={name!r} is not a routing wire "
                                   f"dtype SGLang sends (one of {sorted(WIRE_DTYPES)})")
    return WIRE_DTYPES[key]


def decode_sglang(payload: str | bytes, *, num_layers: int, top_k: int, dtype="int32",
                  who: str = "sglang routed_experts") -> torch.Tensor:
    """base64 of little-endian `dtype` (int32, SGLang's default; uint16 or uint8, as named
    by `meta_info["routed_experts_dtype"]`; a meta_info mapping may be given as `dtype`)
    -> [n, num_layers, top_k] of that dtype."""
    dt = wire_dtype(dtype, who)
    raw = decode_b64(payload, who)
    row = dt.itemsize * num_layers * top_k
    if len(raw) % row:
        raise RoutingMismatchError(
            f"{who}: {len(raw)} bytes is not a whole number of [L={num_layers}, K={top_k}] "
            f"{dt.name} rows ({row} bytes each)"
        )
    arr = np.frombuffer(raw, dtype=dt).reshape(-1, num_layers, top_k)
    return torch.from_numpy(arr.astype(dt.newbyteorder("="), copy=True))


def encode_sglang(routing, dtype: str = "int32") -> str:
    """The inverse of decode_sglang (little-endian `dtype`, base64), for tests and tools."""
    dt = wire_dtype(dtype, "encode_sglang")
    src = np.asarray(routing)
    arr = np.ascontiguousarray(src.astype(dt))
    if not np.array_equal(arr.astype(np.int64), src.astype(np.int64)):
        raise ValueError(f"encode_sglang: routing does not fit {dt.name}")
    return base64.b64encode(arr.tobytes()).decode("ascii")


def payload_layers(n_values: int, rows: int, model_shape: ModelShape, who: str,
                   num_layers: int | None = None, dtype_name: str = "int32") -> int:
    """The layer count L of a flat payload of `n_values` values (of `dtype_name`, for the
    messages) that must hold `rows` token rows: `num_layers` when the caller knows it, else
    the one layer count of the model (MoE or all hidden layers) that divides the payload. A
    payload that fits both is ambiguous and refused; a payload whose rows differ from `rows`
    is refused."""
    K = model_shape.top_k
    counts = sorted({model_shape.num_moe_layers, model_shape.num_hidden_layers})
    if n_values == 0 and rows == 0:  # an empty payload for an empty range of tokens
        return num_layers or model_shape.num_moe_layers
    if num_layers is not None:
        if num_layers not in counts:
            raise RoutingMismatchError(
                f"{who}: num_layers={num_layers} is neither the model's "
                f"{model_shape.num_moe_layers} "
                f"MoE layers nor its {model_shape.num_hidden_layers} hidden layers")
        readings = [num_layers] if n_values % (num_layers * K) == 0 else []
    else:
        readings = [L for L in counts if n_values % (L * K) == 0]
        if len(readings) > 1:
            raise RoutingMismatchError(
                f"{who}: {n_values} {dtype_name} values fit both "
                f"{n_values // (counts[0] * K)} token rows x L={counts[0]} and "
                f"{n_values // (counts[1] * K)} rows x L={counts[1]} "
                f"(x K={K}); the payload alone cannot tell which. Pass the engine's layer "
                f"count as num_layers={model_shape.num_moe_layers} (MoE layers) or "
                f"num_layers={model_shape.num_hidden_layers} (all hidden layers)"
            )
    if not readings or n_values // (readings[0] * K) != rows:
        options = [num_layers] if num_layers is not None else counts
        raise RoutingMismatchError(
            f"{who}: {n_values} {dtype_name} values do not fit the expected {rows} token rows x "
            f"K={K} x L in {options} ({n_values / max(rows * K, 1):g} layers per row); the request "
            f"and its routing do not line up"
        )
    return readings[0]


def openai_meta_infos(response: Mapping, *, allow_missing: bool = False,
                      who: str = "sglang OpenAI response") -> list[dict | None]:
    """A `/v1/completions` or `/v1/chat/completions` response -> one meta_info-like dict per
    choice (in `index` order: each choice must carry a distinct non-negative integer
    `index`, else RoutingMismatchError names it) holding `routed_experts` (and
    `routed_experts_dtype` when sent). SGLang 0.5.23 puts one payload in the response's
    `sglext.routed_experts`: the routing of its first result, choice 0 (a choice's own
    `sglext`, if a version sends one, is taken for that choice). A choice without a payload is refused, naming it, unless
    `allow_missing` (it is then None, and `sglang_sequences(..., allow_missing=True)` runs
    it with the model's own top-k)."""
    if not isinstance(response, Mapping) or not isinstance(response.get("choices"), list):
        raise RoutingMismatchError(f"{who}: not a completion response (no 'choices' list)")
    choices = response["choices"]
    index, seen = [], {}
    for j, c in enumerate(choices):
        # each choice names its place: a payload is matched to a choice by this index, so a
        # missing, non-integer, negative or repeated one cannot be guessed around
        if not isinstance(c, Mapping):
            raise RoutingMismatchError(f"{who}: choices[{j}] is {type(c).__name__}, not a "
                                       f"choice object")
        if "index" not in c:
            raise RoutingMismatchError(f"{who}: choices[{j}] has no 'index'; each choice must "
                                       f"say which one it is")
        i = c["index"]
        if not _is_int(i) or i < 0:
            raise RoutingMismatchError(f"{who}: choices[{j}] has index {_short(i)}; a choice "
                                       f"index is a non-negative integer")
        if int(i) in seen:
            raise RoutingMismatchError(f"{who}: choices[{seen[int(i)]}] and choices[{j}] both "
                                       f"have index {int(i)}; each choice index must be "
                                       f"unique (one would take the other's routing)")
        seen[int(i)] = j
        index.append(int(i))
    order = sorted(range(len(choices)), key=lambda j: index[j])

    def meta(ext):
        if not isinstance(ext, Mapping) or ext.get(SGLANG_KEY) is None:
            return None
        m = {SGLANG_KEY: ext[SGLANG_KEY]}
        if ext.get(SGLANG_DTYPE_KEY) is not None:
            m[SGLANG_DTYPE_KEY] = ext[SGLANG_DTYPE_KEY]
        return m

    top = meta(response.get("sglext"))
    out, missing = [], []
    for j in order:
        c = choices[j]
        m = meta(c.get("sglext")) if isinstance(c, Mapping) else None
        if m is None and index[j] == 0:
            m = top
        if m is None:
            missing.append(index[j])
        out.append(m)
    if missing and not allow_missing:
        n = len(choices)
        if len(missing) == n:
            raise RoutingMismatchError(
                f"{who}: none of the {n} choices has a routing payload (no sglext."
                f"{SGLANG_KEY}): {NOT_ENABLED} (SGLang then omits it silently), or the request "
                f"was sent without return_routed_experts=True")
        raise RoutingMismatchError(
            f"{who}: choices {missing[:16]}{'...' if len(missing) > 16 else ''} (of {n}) have "
            f"no routing payload: SGLang returns sglext.{SGLANG_KEY} for the first choice of a "
            f"response only. Send one prompt with n=1 per request (or use /generate), or pass "
            f"allow_missing=True to run those choices with the model's own top-k")
    return out


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _request_starts(requests, B: int, who: str) -> list:
    """Per request, the `routed_experts_start_len` of the body (or bodies, one per turn) the
    caller sent; `requests` may be one batched /generate body (one int start for all)."""
    if isinstance(requests, Mapping):
        st = requests.get(SGLANG_START_KEY, 0)
        if not _is_int(st):
            raise RoutingMismatchError(
                f"{who}: the batched request's {SGLANG_START_KEY}={st!r} is not one int (SGLang's "
                f"/generate takes a single int for a batch and answers a list with HTTP 400)")
        return [int(st)] * B
    if len(requests) != B:
        raise RoutingMismatchError(f"{who}: requests has {len(requests)} entries but the batch "
                                   f"has {B} requests")
    out = []
    for i, r in enumerate(requests):
        bodies = [r] if isinstance(r, Mapping) or r is None else list(r)
        st = []
        for j, body in enumerate(bodies):
            v = 0 if body is None else body.get(SGLANG_START_KEY, 0)
            if not _is_int(v):
                raise RoutingMismatchError(f"request {i} turn {j}: {SGLANG_START_KEY}={v!r} "
                                           f"in the request body is not an int")
            st.append(int(v))
        out.append(st[0] if isinstance(r, Mapping) or r is None else st)
    return out


def _turn_routing(mi, rows: int, model_shape: ModelShape, who: str,
                  num_layers: int | None) -> torch.Tensor:
    """One turn's payload (base64 of the meta_info's dtype, or an array `[rows, L, K]` or
    SGLang's decoded `[rows, L*K]`) as a tensor `[rows, L, K]`."""
    payload = mi[SGLANG_KEY]
    dt = wire_dtype(mi, who)
    if isinstance(payload, (str, bytes)):
        # bound the decoded size by the request's rows before decoding (twice that, plus a
        # little: a payload slightly off is decoded and refused below with its row count)
        ms = model_shape
        need = dt.itemsize * rows * max(ms.num_hidden_layers, ms.num_moe_layers) * ms.top_k
        if b64_size(payload) > 2 * need + 4096:
            raise RoutingMismatchError(
                f"{who}: routed_experts is {len(payload)} base64 characters, far more than the "
                f"{4 * -(-need // 3)} that {rows} token rows of {dt.name} "
                f"[L, K={model_shape.top_k}] "
                f"take")
        raw = decode_b64(payload, who)
        if len(raw) % dt.itemsize:
            raise RoutingMismatchError(f"{who}: {len(raw)} bytes is not a whole number "
                                       f"of {dt.name} values")
        n = len(raw) // dt.itemsize
        L = payload_layers(n, rows, model_shape, who, num_layers, dt.name)
        arr = np.frombuffer(raw, dtype=dt).reshape(-1, L, model_shape.top_k)
        return torch.from_numpy(arr.astype(dt.newbyteorder("="), copy=True))
    arr = as_tensor(payload, who)
    if arr.dim() == 2:  # SGLang's decode helper: [positions, L * K]
        if arr.shape[0] != rows:
            raise RoutingMismatchError(
                f"{who}: routed_experts [positions, L*K] has {arr.shape[0]} token rows but "
                f"seqlen - 1 - start = {rows}")
        L = payload_layers(arr.numel(), rows, model_shape, who, num_layers,
                           str(arr.dtype).split(".")[-1])
        arr = arr.reshape(rows, L, model_shape.top_k)
    return arr


def _start_hint(n_values: int, want: int, model_shape: ModelShape, num_layers) -> str:
    """How many rows fewer than the whole request a payload holds, when one reading fits."""
    K = model_shape.top_k
    counts = [num_layers] if num_layers else sorted({model_shape.num_moe_layers,
                                                     model_shape.num_hidden_layers})
    fits = {n_values // (L * K) for L in counts if n_values % (L * K) == 0}
    if len(fits) == 1:
        d = want - fits.pop()
        if 0 < d < want:
            return (f". The payload holds {want - d} rows, {d} fewer than the whole request: "
                    f"was it sent with {SGLANG_START_KEY}={d}? SGLang does not echo the start "
                    f"in meta_info; pass the request (requests=) or its start (starts=)")
    return ""


@renamed_keyword("layout", "model_shape", "sglang_sequences")
def sglang_sequences(
    meta_infos: Sequence[Mapping | Sequence[Mapping] | None],
    seq_lens: Sequence[int | Sequence[int]],
    model_shape: ModelShape,
    *,
    starts: int | Sequence[int | Sequence[int]] | None = None,
    requests: Mapping | Sequence[Mapping | Sequence[Mapping] | None] | None = None,
    num_layers: int | None = None,
    prefix_routing: Sequence | None = None,
    omitted: str = "error",
    allow_missing: bool = False,
) -> list[SequenceRouting]:
    """Per-request routing from SGLang responses (the forms: the module docstring).

    `meta_infos[i]` is the response's `meta_info` (holding base64 `routed_experts`, and
    `routed_experts_dtype` when sent), or a list of them for a multi-turn conversation (one
    per turn, in order), or None (no routing: an error unless `allow_missing`). For the
    OpenAI-compatible endpoints, `openai_meta_infos(response)` gives them.
    `seq_lens[i]` is the request's total token count (prompt + generated), or a list per
    turn. The start of each payload (`routed_experts_start_len`, never echoed by SGLang) is
    taken from the request the caller sent: `requests[i]`, the request body (or a list of
    bodies, one per turn), or `requests` one batched /generate body for every request; or
    from `starts`: one int for the whole batch (as a batched /generate sends it), or per
    request an int or a list per turn. Without either the start is 0.
    `num_layers` is the engine's layer count L (see the module docstring).
    Rows a start leaves uncovered (a single request sent with a start, or a turn whose start
    is past the rows the earlier turns hold) are refused unless supplied, `prefix_routing[i]`
    (the rows of request i's one gap, any form a turn takes; or a dict {turn: rows} for
    several gaps), or masked with `omitted="mask"` (-1, replay_mask False: the model's own
    top-k).
    """
    who = "sglang meta_info"
    if omitted not in OMITTED:
        raise ValueError(f"{who}: unknown omitted={omitted!r}; expected one of {OMITTED}")
    B = len(seq_lens)
    check_batch(list(meta_infos), B, who, allow_missing)
    if starts is not None and _is_int(starts):
        starts = [int(starts)] * B
    if starts is not None and len(starts) != B:
        raise RoutingMismatchError(f"{who}: starts has {len(starts)} entries but the batch has "
                                   f"{B} requests")
    req_starts = None if requests is None else _request_starts(requests, B, who)
    req_flags = _request_flags(requests, B)
    if prefix_routing is not None and len(prefix_routing) != B:
        raise RoutingMismatchError(f"{who}: prefix_routing has {len(prefix_routing)} entries "
                                   f"but the batch has {B} requests")
    out = []
    for i, (m, n) in enumerate(zip(meta_infos, seq_lens)):
        turns_meta = [m] if isinstance(m, Mapping) or m is None else list(m)
        turns_len = [n] if _is_int(n) else list(n)
        total = int(turns_len[-1])
        if m is None:
            out.append(missing_sequence(model_shape, total))
            continue
        if len(turns_meta) != len(turns_len):
            raise RoutingMismatchError(f"request {i}: {len(turns_meta)} turns of meta_info but "
                                       f"{len(turns_len)} turn lengths")
        turns_start = _turn_starts(i, len(turns_meta), starts, req_starts)
        gaps = _gap_rows(prefix_routing, i)
        acc = MultiTurnRouting(model_shape, request=i)
        for j, (mi, sl, s0) in enumerate(zip(turns_meta, turns_len, turns_start)):
            tw = f"request {i} turn {j}"
            if not isinstance(mi, Mapping) or mi.get(SGLANG_KEY) is None:
                asked = req_flags[i] if req_flags is not None else None
                why = (f"{NOT_ENABLED} (the request asked for it with return_routed_experts="
                       f"True; SGLang then omits the field silently)" if asked else
                       f"{NOT_ENABLED} (SGLang then omits the field silently), or the request "
                       f"was sent without return_routed_experts=True")
                raise RoutingMismatchError(
                    f"{tw}: meta_info has no {SGLANG_KEY!r} (keys: "
                    f"{sorted(mi) if isinstance(mi, Mapping) else type(mi).__name__}): {why}")
            echoed = mi.get(SGLANG_START_KEY)
            s = s0 if s0 is not None else int(echoed or 0)
            if echoed is not None and s0 is not None and int(echoed) != s0:
                raise RoutingMismatchError(f"{tw}: meta_info says {SGLANG_START_KEY}="
                                           f"{echoed} but the request's start is {s0}")
            sl = int(sl)
            rows = sl - 1 - s
            if rows < 0:
                raise RoutingMismatchError(f"{tw}: start={s} is past seq_len - 1 = {sl - 1}")
            try:
                arr = _turn_routing(mi, rows, model_shape, tw, num_layers)
            except RoutingMismatchError as e:
                p = mi[SGLANG_KEY]
                if s or not isinstance(p, (str, bytes)):
                    raise
                raw_len = b64_size(p) // wire_dtype(mi, tw).itemsize
                raise RoutingMismatchError(
                    f"{e}{_start_hint(raw_len, rows, model_shape, num_layers)}") from None
            if arr.shape[0] != rows:
                raise RoutingMismatchError(
                    f"{tw}: routed_experts has {arr.shape[0]} token rows but seqlen - 1 - start "
                    f"= {rows} (seqlen={sl}, start={s})"
                )
            if s > acc.rows:
                _fill_gap(acc, gaps, i, j, s, model_shape, num_layers, omitted)
            acc.add_turn(arr, sl, s)
        out.append(acc.sequence(total))
    return out


def _request_flags(requests, B: int) -> list | None:
    """Per request, whether its (first) body asked for return_routed_experts."""
    if requests is None:
        return None
    if isinstance(requests, Mapping):
        return [bool(requests.get("return_routed_experts"))] * B
    out = []
    for r in requests:
        body = r if isinstance(r, Mapping) or r is None else (list(r) or [None])[-1]
        out.append(bool(body and body.get("return_routed_experts")))
    return out


def _turn_starts(i: int, n_turns: int, starts, req_starts) -> list:
    """Request i's start per turn (None: not given), from `starts` and the requests; where
    both give one they must agree."""
    def per_turn(v, name):
        if v is None:
            return [None] * n_turns
        v = [v] if _is_int(v) else list(v)
        if len(v) != n_turns:
            raise RoutingMismatchError(f"request {i}: {len(v)} start offsets ({name}) for "
                                       f"{n_turns} turns")
        return [None if x is None else int(x) for x in v]

    a = per_turn(None if starts is None else starts[i], "starts")
    b = per_turn(None if req_starts is None else req_starts[i], "requests")
    for j, (x, y) in enumerate(zip(a, b)):
        if x is not None and y is not None and x != y:
            raise RoutingMismatchError(f"request {i} turn {j}: starts gives {x} but the "
                                       f"request body's {SGLANG_START_KEY} is {y}")
    return [x if x is not None else y for x, y in zip(a, b)]


def _gap_rows(prefix_routing, i: int) -> dict:
    """Request i's supplied gap rows: {turn: rows} (a single entry: the request's one gap)."""
    if prefix_routing is None or prefix_routing[i] is None:
        return {}
    p = prefix_routing[i]
    return dict(p) if isinstance(p, Mapping) and SGLANG_KEY not in p else {None: p}


def _fill_gap(acc: MultiTurnRouting, gaps: dict, i: int, j: int, start: int,
              model_shape: ModelShape, num_layers, omitted: str) -> None:
    """Rows acc.rows..start-1, which turn j's start leaves uncovered: supplied, masked, or
    refused."""
    lo, n = acc.rows, start - acc.rows
    tw = f"request {i} turn {j}"
    key = j if j in gaps else (None if None in gaps else -1)
    if key != -1:
        rows = gaps.pop(key)
        pw = f"request {i} prefix_routing" + (f"[{j}]" if key is not None else "")
        mi = rows if isinstance(rows, Mapping) else {SGLANG_KEY: rows}
        try:
            r = _turn_routing(mi, n, model_shape, pw, num_layers)
        except RoutingMismatchError as e:
            raise RoutingMismatchError(f"{e} (it must hold the rows of tokens {lo}..{start - 1}, "
                                       f"which {tw}'s start={start} leaves uncovered)") from None
        if r.dim() == 3 and r.shape[0] != n:
            raise RoutingMismatchError(
                f"{pw}: has {r.shape[0]} token rows but {tw}'s start={start} leaves tokens "
                f"{lo}..{start - 1} ({n} rows) uncovered")
        acc.add_turn(r, start + 1, lo)
        acc.turns -= 1  # the supplied rows are not a turn of their own
        return
    if omitted == "mask":
        acc.add_masked(n, f"tokens {lo}..{start - 1} uncovered by {SGLANG_START_KEY}={start}, "
                          f"masked (omitted='mask')")
        return
    what = "no earlier turn covers them" if j else "nothing supplies them"
    fix = ""
    if j and start == lo + 1:
        fix = (f" With {SGLANG_START_KEY} = the previous turn's full length, its last token "
               f"(token {lo}) is routed in neither turn: send {SGLANG_START_KEY} = the previous "
               f"turn's length - 1 = {lo}.")
    raise RoutingMismatchError(
        f"{tw}: SGLang returned no routing for tokens {lo}..{start - 1} "
        f"({SGLANG_START_KEY}={start}) and {what}.{fix} Supply them (prefix_routing[{i}]), or "
        f"pass omitted='mask' to run those tokens with the model's own top-k; they are "
        f"never zero-filled")


@renamed_keyword("layout", "model_shape", "sglang_batch")
def sglang_batch(meta_infos, seq_lens, prompt_lens, model_shape, *, starts=None, requests=None,
                 num_layers=None, prefix_routing=None, omitted="error", packing=None,
                 max_prompt_len=None, max_response_len=None,
                 allow_missing=False, layout_kind=None) -> ReplayBatch:
    """`sglang_sequences` then `pack_padded` (packing="padded", the default) or `pack_thd`
    ("thd"). `layout_kind` is the deprecated name of `packing`."""
    packing = packing_arg(packing, layout_kind, "sglang_batch")
    seqs = sglang_sequences(meta_infos, seq_lens, model_shape, starts=starts, requests=requests,
                            num_layers=num_layers, prefix_routing=prefix_routing,
                            omitted=omitted, allow_missing=allow_missing)
    # scanned against model_shape per turn (`to_moe`); packing adds only -1 rows, mask False
    return _mark_checked(pack(seqs, prompt_lens, packing, max_prompt_len, max_response_len),
                         model_shape)
