"""A compact, lossless codec for routing `[T, L, K]` (expert ids per token, layer and slot).

    from replay_ops.router_replay import codec

    blob = codec.encode(routing, num_experts=128, order="set", token_ids=ids, seq_lens=lens)
    routing2 = codec.decode(blob, token_ids=ids)                 # torch tensor [T, L, K]
    seq3 = codec.decode_sequence(blob, 3, token_ids=ids[cu[3]:cu[4]])
    blob = codec.append(blob, suffix, token_ids=suffix_ids, continue_last=True)  # next turn

## What comes back

Modes (`order=`):

* ``"keep"``: exactly the input, slot for slot.
* ``"set"``: each token's layer row as a sorted multiset: ids ascending, empty slots (-1)
  last. Megatron's routing_map is order-free, so this is what a replay that only needs the
  expert set consumes; the order of the K ids is not kept (normalising probabilities over
  the K selected experts in another order can change their bits).

Rows with a repeated expert id round-trip exactly in both modes (in ``"set"`` as a sorted
multiset, the repeats adjacent): the codec carries routing, it does not judge it (the replay
checks refuse such rows where they matter). Ids must lie in -1..num_experts-1; anything
else is refused with the position and the value. Unsigned inputs carry no -1: their
maximum (255 for uint8) is an expert id like any other.

`decode` returns an int16 tensor when num_experts <= 32767 (the adapters' training dtype),
else int32, on the CPU unless `device=` names another device; `dtype=` chooses another
signed integer dtype that holds every id, and `out=` decodes into an existing tensor (any
device, contiguous or not) of shape [T, L, K].

## Where things are

The blob format (headers, versions, checksums, the row transforms' bytes, what a decoder
refuses) is specified in docs/codec_format.md. The package has one module per stage:

* `format`: the header structs, the format versions (`Format`), the checksum chain, the
  bounds on header sizes, `info`, and `_check_content`, the one final check of a decoded
  chunk on every decode path;
* `transform`: the row transforms (sorting, Lehmer codes, relabelling, regrouping by token,
  byte planes), in numpy;
* `chunk`: the chunk pipeline (chunks of whole sequences, compressed, headed; and back);
* `device`: the same transforms by the Triton kernels, on the routing's device;
* this module: the public API (`encode`, `append`, `info`, `decode`, `decode_sequence`).

A stage passes a chunk's routing to the next as a `format.Canonical` (its sorted ids and
permutation code), and every stage takes the blob's `format.Format`, not a version number.
Each chunk holds whole sequences, so a sequence decodes from its own chunks alone, and
appending a turn adds chunks without touching the earlier ones. A corrupt, truncated,
spliced or foreign blob raises `CodecError` naming the byte offset and the reason. Every
size a header claims is checked before anything is allocated (router_replay/_bounds.py);
`max_tokens=` and `max_bytes=` bound a blob further.
"""
from __future__ import annotations

import bisect

import numpy as np
import torch

from .._bounds import MAX_IDS, MAX_LAYERS, MAX_TOKENS, MAX_TOP_K  # noqa: F401
from .chunk import HostRows, _as_numpy, _canonical, _chunks_bytes, _seq_lens, _token_array
from .device import BACKENDS, DeviceRows, _use_triton, writer
from .format import (BLOB_HEADER_SIZE, BLOB_HEADER_SIZE_V2, CHUNK_HEADER_SIZE, CHUNK_MAGIC,
                     CURRENT, DEFAULT_CHUNK_TOKENS, DEFAULT_LEVEL, FORMAT_VERSION, FORMATS,
                     MAGIC, MAX_EXPERTS, MAX_LEHMER_K, ORDERS, READ_VERSIONS, ZSTD_MAX_RATIO,
                     BlobInfo, Canonical, ChunkInfo, CodecError, Format, _blob_header,
                     _blob_id, _chain_start, _check_level, _check_limit_args, _check_limits,
                     _check_order, _check_shape, _default_dtype, _link, header_size, id_width,
                     info, lehmer_width)
from .transform import lehmer_digits, sort_rows


def encode(routing, *, num_experts: int, order: str = "keep", level: int = DEFAULT_LEVEL,
           token_ids=None, seq_lens=None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
           backend: str = "auto") -> bytes:
    """Encode routing `[T, L, K]` (any integer dtype, numpy or torch, -1 = empty slot) into
    a blob. `order`: "keep" (exact) or "set" (each row's ids sorted, empty slots last).
    `level`: zstd level. `token_ids` [T]: side information the decoder must be given again
    (a hash of them is stored and checked). `seq_lens` [S] (sum T): the sequences, each
    decodable alone; packed into chunks of up to `chunk_tokens` tokens. `backend`: "numpy",
    "triton" (the per-row transform in Triton, on the routing's device: only the narrow
    sorted ids and the permutation codes leave it), or "auto" (Triton for a tensor on a GPU)."""
    _check_order(order)
    _check_level(level)
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) \
            or not 1 <= num_experts <= MAX_EXPERTS:
        raise CodecError(f"num_experts must be an integer in 1..{MAX_EXPERTS}, got "
                         f"{num_experts!r}")
    E = int(num_experts)
    if _use_triton(backend, routing, order, "encode") and not (
            order == "keep" and routing.dim() == 3 and routing.shape[2] > MAX_LEHMER_K):
        rows = DeviceRows(routing, E)
    else:
        rows = HostRows(_canonical(routing, E), E)
    T, L, K = rows.shape
    _check_shape(T, L, K, "routing")
    tok = None if token_ids is None else _token_array(token_ids, T, "token_ids")
    lens = _seq_lens(seq_lens, T)
    if chunk_tokens < 1:
        raise CodecError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    parts = _chunks_bytes(rows, tok, order, E, level, lens, chunk_tokens, 0, False, CURRENT)
    bid = _blob_id(parts)
    chain0 = _chain_start(_blob_header(order, E, L, K, tok is not None, blob_id=bid))
    body, chain = _link(parts, CURRENT, 0, chain0)
    head = _blob_header(order, E, L, K, tok is not None, blob_id=bid, num_tokens=T,
                        num_chunks=len(parts), num_seqs=len(lens), chain=chain)
    return b"".join([head] + body)


def append(blob: bytes, routing, *, token_ids=None, seq_lens=None, continue_last=False,
           level: int = DEFAULT_LEVEL, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
           max_tokens: int | None = None, max_bytes: int | None = None) -> bytes:
    """A new blob: `blob` followed by more routing with the blob's mode and shape. New
    sequences by default; with `continue_last=True` the first of them continues the blob's
    last sequence (the next turn of a conversation: its new rows only). An append of no
    sequence (`seq_lens=[]`) adds no chunk and changes no count. The existing chunks
    are verified (headers and payload checksums) and copied unchanged; a format-3 blob's
    header is rewritten (chunk, sequence and token counts, the chain's end), and the new
    chunks continue its chain. A blob of an older format is extended in that format (its
    chunks bound to nothing: docs/codec_format.md). `max_tokens`/`max_bytes` bound the
    existing blob, as for `info`."""
    _check_level(level)
    buf = memoryview(blob).cast("B")
    info_ = info(buf, verify_payload=True, max_tokens=max_tokens, max_bytes=max_bytes)
    if (token_ids is not None) == info_.has_token_ids:
        pass
    elif info_.has_token_ids:
        raise CodecError("append: the blob was encoded with token_ids; pass the token ids of "
                         "the appended routing")
    else:
        raise CodecError("append: the blob was encoded without token_ids; appending with "
                         "them is not possible")
    canon = _canonical(routing, info_.num_experts)
    T, L, K = canon.shape
    if (L, K) != (info_.num_layers, info_.top_k):
        raise CodecError(f"append: routing is [T, L={L}, K={K}] but the blob holds L="
                         f"{info_.num_layers}, K={info_.top_k}")
    _check_shape(info_.num_tokens + T, L, K, "append")
    tok = None if token_ids is None else _token_array(token_ids, T, "token_ids")
    lens = _seq_lens(seq_lens, T)
    if continue_last and info_.num_sequences == 0:
        raise CodecError("append: continue_last=True but the blob holds no sequence")
    # no sequence to add (seq_lens=[]): no chunk, and nothing continues
    continue_last = bool(continue_last) and len(lens) > 0
    first = info_.num_sequences - 1 if continue_last else info_.num_sequences
    fmt = info_.format
    parts = _chunks_bytes(HostRows(canon, info_.num_experts), tok, info_.order,
                          info_.num_experts, level, lens, chunk_tokens, first, continue_last,
                          fmt)
    body, chain = _link(parts, fmt, len(info_.chunks), info_.chain)
    if not fmt.binds_chunks:
        return bytes(buf) + b"".join(body)
    head = _blob_header(info_.order, info_.num_experts, L, K, info_.has_token_ids, fmt,
                        blob_id=info_.blob_id, num_tokens=info_.num_tokens + T,
                        num_chunks=len(info_.chunks) + len(parts),
                        num_seqs=first + len(lens), chain=chain)
    return b"".join([head, bytes(buf[fmt.header_size:])] + body)


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of `t` may share memory (an expanded, stride-0 tensor, or
    strides that interleave): the dims of more than one element, by stride, must each step
    past everything the smaller ones span. A conservative test, like torch's own."""
    span = 0
    dims = sorted(((abs(st), sz) for sz, st in zip(t.shape, t.stride()) if sz > 1))
    for stride, size in dims:
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def _output(shape, E: int, device, dtype, out, max_bytes=None,
            offset: int = 0) -> torch.Tensor:
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise CodecError(f"out must be a torch tensor, got {type(out).__name__}")
        if tuple(out.shape) != tuple(shape):
            raise CodecError(f"out has shape {tuple(out.shape)}, the blob decodes to "
                             f"{tuple(shape)}")
        if out.numel() and _overlaps(out):
            raise CodecError(f"out has overlapping elements (shape {tuple(out.shape)}, "
                             f"strides {tuple(out.stride())}: an expanded tensor?); decode "
                             f"into a tensor whose elements are distinct")
        dtype = out.dtype
    dtype = dtype or _default_dtype(E)
    if dtype.is_floating_point or dtype == torch.bool or dtype.is_complex or \
            not dtype.is_signed or torch.iinfo(dtype).max < E - 1:
        raise CodecError(f"decode: dtype {dtype} cannot hold ids -1..{E - 1}; use a signed "
                         f"integer dtype at least as wide as {_default_dtype(E)}")
    T, L, K = shape
    _check_limits(T, L, K, dtype.itemsize, None, max_bytes, offset)
    if out is None:
        try:
            out = torch.empty(shape, dtype=dtype, device=device or "cpu")
        except (RuntimeError, MemoryError) as e:
            raise CodecError(f"decode: cannot allocate the output {tuple(shape)} {dtype}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") \
                from None
    return out


def _chunk_into(buf, ch: ChunkInfo, inf: BlobInfo, tok, dst: torch.Tensor, a: int, b: int,
                path) -> None:
    """Rows a:b of chunk `ch`, decoded and verified by `path` (a `chunk.ChunkWriter`), into
    dst."""
    try:
        path.write(buf, ch, inf, tok, dst, a, b)
    except MemoryError:
        raise CodecError(f"routing blob, offset {ch.offset}: out of memory decoding a chunk "
                         f"of {ch.num_tokens} tokens") from None


def _no_tokens(inf: BlobInfo, token_ids, who: str) -> None:
    if token_ids is not None and not inf.has_token_ids:
        raise CodecError(f"{who}: the blob was encoded without token_ids; decoding with them "
                         f"is not possible (they would not be checked)")


def decode(blob, *, token_ids=None, device=None, dtype: torch.dtype | None = None,
           out: torch.Tensor | None = None, backend: str = "auto",
           max_tokens: int | None = None, max_bytes: int | None = None) -> torch.Tensor:
    """Decode a whole blob into `[T, L, K]` (int16 when num_experts <= 32767, else int32;
    -1 = empty slot). `token_ids` [T]: required, and must be the same ids, when the blob was
    encoded with them (refused when it was not). `device`/`dtype` choose the new tensor's;
    `out` is filled instead (its elements distinct). `backend`: "auto" (Triton when the
    output is on a GPU: the permutation is undone and scattered there, straight into the
    tensor), "triton" or "numpy". `max_tokens`: the most tokens the blob may hold;
    `max_bytes`: the most bytes the decoded routing may take (in the output's dtype); both
    checked before anything is allocated."""
    _check_limit_args(max_tokens, max_bytes)
    buf = memoryview(blob).cast("B")
    inf = info(buf, max_tokens=max_tokens)
    T = inf.num_tokens
    tok = None
    _no_tokens(inf, token_ids, "decode")
    if inf.has_token_ids:
        if token_ids is None:
            raise CodecError("decode: the blob was encoded with token_ids; pass the same "
                             "token ids")
        tok = _token_array(token_ids, T, "token_ids")
    res = _output((T, inf.num_layers, inf.top_k), inf.num_experts, device, dtype, out,
                  max_bytes)
    path = writer(backend, res, inf, "decode")
    done = 0
    for ch in inf.chunks:
        a, b = ch.token_start, ch.token_start + ch.num_tokens
        _chunk_into(buf, ch, inf, None if tok is None else tok[a:b], res[a:b], 0,
                    ch.num_tokens, path)
        done += ch.num_tokens
    _covered(done, T, "decode")
    return res


def _covered(done: int, n: int, who: str) -> None:
    """Every row of a (possibly preallocated) output was written by a chunk: a blob whose
    chunks do not add up would otherwise return rows it never wrote."""
    if done != n:
        raise CodecError(f"{who}: the blob's chunks hold {done} of the {n} tokens to decode "
                         f"(a corrupt or inconsistent blob); nothing is returned")


def _sequence_chunks(inf: BlobInfo, index: int) -> list:
    """The chunks that hold sequence `index`, in order: the last chunk whose first sequence
    is at or before it, and the chunks before that one that continue into it (a continued
    sequence spans consecutive chunks). A chunk with no sequence (an empty append of an
    older writer: this encoder writes none) holds no row and breaks the order of first_seq
    that the search needs: it is left out."""
    held = [c for c in inf.chunks if c.seq_lens]
    j = bisect.bisect_right([c.first_seq for c in held], index) - 1
    mine = []
    while j >= 0 and held[j].first_seq + len(held[j].seq_lens) > index:
        mine.append(held[j])
        j -= 1
    mine.reverse()
    return mine


def decode_sequence(blob, index: int, *, token_ids=None, device=None,
                    dtype: torch.dtype | None = None,
                    out: torch.Tensor | None = None, backend: str = "auto",
                    max_tokens: int | None = None,
                    max_bytes: int | None = None) -> torch.Tensor:
    """Decode sequence `index` alone (only the chunks that hold it are decompressed).
    `token_ids`, when the blob has them: the whole blob's token ids, or that sequence's own
    (all of its turns) when none of its chunks holds another sequence (chunk_tokens=1).
    `max_tokens`/`max_bytes` bound the whole blob, as for `decode`."""
    _check_limit_args(max_tokens, max_bytes)
    buf = memoryview(blob).cast("B")
    inf = info(buf, max_tokens=max_tokens)
    if not 0 <= index < inf.num_sequences:
        raise IndexError(f"decode_sequence: sequence {index} is outside 0.."
                         f"{inf.num_sequences - 1}")
    _no_tokens(inf, token_ids, "decode_sequence")
    n = inf.seq_lens[index]
    mine = _sequence_chunks(inf, index)
    tok, whole = None, False
    if inf.has_token_ids:
        if token_ids is None:
            raise CodecError("decode_sequence: the blob was encoded with token_ids; pass the "
                             "token ids (of the whole blob, or of this sequence)")
        t = _as_numpy(token_ids, "token_ids").reshape(-1)
        whole = t.shape[0] == inf.num_tokens and (t.shape[0] != n or len(inf.seq_lens) > 1)
        if not whole:
            tok = _token_array(t, n, "token_ids")
            shared = [ch.offset for ch in mine if len(ch.seq_lens) != 1]
            if shared:
                raise CodecError(
                    f"decode_sequence: sequence {index} shares the chunk at offset "
                    f"{shared[0]} with other sequences, whose token ids the chunk needs too; "
                    f"pass the whole blob's token_ids (or encode with chunk_tokens=1)")
        else:
            tok = t.astype(np.int64, copy=False)
    if max_bytes is not None:
        dt = out.dtype if isinstance(out, torch.Tensor) else (
            dtype if isinstance(dtype, torch.dtype) else _default_dtype(inf.num_experts))
        _check_limits(inf.num_tokens, inf.num_layers, inf.top_k, dt.itemsize, None,
                      max_bytes, 0)
    res = _output((n, inf.num_layers, inf.top_k), inf.num_experts, device, dtype, out)
    path = writer(backend, res, inf, "decode_sequence")
    done = 0
    for ch in mine:
        cu = np.concatenate([[0], np.cumsum(ch.seq_lens)])
        a, b = int(cu[index - ch.first_seq]), int(cu[index - ch.first_seq + 1])
        if tok is None:
            ctok = None
        elif whole:
            ctok = tok[ch.token_start:ch.token_start + ch.num_tokens]
        else:
            ctok = tok[done:done + (b - a)]
        if done + (b - a) > n:
            break  # refused below: the chunks claim more rows than the sequence has
        _chunk_into(buf, ch, inf, ctok, res[done:done + (b - a)], a, b, path)
        done += b - a
    _covered(done, n, f"decode_sequence({index})")
    return res


__all__ = [
    "BLOB_HEADER_SIZE",
    "BlobInfo",
    "CHUNK_HEADER_SIZE",
    "CodecError",
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_LEVEL",
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "BACKENDS",
    "append",
    "decode",
    "decode_sequence",
    "encode",
    "id_width",
    "info",
    "lehmer_width",
    "sort_rows",
]

