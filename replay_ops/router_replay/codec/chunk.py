"""The codec's chunk pipeline: routing in, checked and made canonical (`_canonical`); split
into chunks of whole sequences (`_chunk_plan`); each chunk transformed (on the host here, or
on the device: `device.py`), laid out, compressed and given its header (`_encode_chunk`);
and back: a chunk's payload checked, decompressed, put back in token order, unsorted and
checked against its content checksum (`_decode_chunk`). The byte layout of a chunk is
specified in docs/codec_format.md ("Chunks").

Both paths sit behind one interface: encoding takes a `Rows` (`HostRows` here,
`device.DeviceRows`), which gives a chunk's tokens in canonical form (`format.Canonical`);
decoding writes a chunk with a `ChunkWriter` (`HOST` here, `device.DEVICE`), which ends in
`format._check_content`, the one final check.
"""
from __future__ import annotations

import dataclasses
import typing
import zlib

import numpy as np
import torch

from .format import (_CHUNK, _TRANSFORM_GROUPED, _TRANSFORM_RELABEL, _TRANSFORM_TOKENS, _METHOD_RAW,
                     _METHOD_ZSTD, _NARROW, CHUNK_MAGIC, BlobInfo, Canonical, ChunkInfo,
                     CodecError, Format, _check_content, _check_frame, _check_set_rows,
                     _compressor, _decompressor, _fail, _token_hash, id_width, lehmer_width)
from .transform import (_apply_labels, _from_grouped, _group_order, _planes, _planes_bytes,
                        _relabel_table, _to_grouped, _unplanes, _unsort_np, sort_rows)

def _as_numpy(x, who: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise CodecError(f"{who} must hold integers, got dtype {x.dtype}")
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        if x.dtype == torch.uint16 or x.dtype == torch.uint32 or x.dtype == torch.uint64:
            x = x.to(torch.int64)
        return x.numpy()
    a = np.asarray(x)
    if a.dtype == object or not np.issubdtype(a.dtype, np.integer):
        if a.size == 0 and a.dtype == np.float64:  # an empty list
            return a.astype(np.int64)
        raise CodecError(f"{who} must hold integers, got dtype {a.dtype}")
    return a


def _canonical(routing, num_experts: int, who: str = "routing") -> np.ndarray:
    """[T, L, K] integer routing -> narrow canonical ids (-1 -> num_experts), checked."""
    a = _as_numpy(routing, who)
    if a.ndim != 3:
        raise CodecError(f"{who} must be [T, L, K], got shape {tuple(a.shape)}")
    E = num_experts
    nd = _NARROW[id_width(E)]
    if a.size == 0:
        return np.zeros(a.shape, nd)
    lo, hi = a.min(), a.max()
    if lo < -1 or hi > E - 1:
        bad = np.argwhere((a < -1) | (a > E - 1))[0]
        v = int(a[tuple(bad)])
        raise CodecError(f"{who}[{bad[0]}, {bad[1]}, {bad[2]}] = {v} is out of range for "
                         f"num_experts={E} (valid: 0..{E - 1}, -1 = empty slot)")
    if lo >= 0 and a.dtype.itemsize <= np.dtype(nd).itemsize and a.dtype.kind == "u":
        return np.ascontiguousarray(a).view(nd) if a.dtype == nd else a.astype(nd)
    if lo >= 0:
        return a.astype(nd)
    return np.where(a < 0, E, a).astype(nd)


def _token_array(token_ids, n: int, who: str) -> np.ndarray:
    t = _as_numpy(token_ids, who).reshape(-1)
    if t.shape[0] != n:
        raise CodecError(f"{who} has {t.shape[0]} entries but the routing has {n} tokens")
    return t.astype(np.int64, copy=False)


def _seq_lens(seq_lens, n: int) -> list[int]:
    if seq_lens is None:
        return [n]
    s = _as_numpy(seq_lens, "seq_lens").reshape(-1)
    lens = [int(v) for v in s]
    if any(v < 0 for v in lens) or sum(lens) != n:
        raise CodecError(f"seq_lens must be non-negative and sum to the routing's T={n}; got "
                         f"{lens[:8]}{'...' if len(lens) > 8 else ''} (sum {sum(lens)})")
    return lens


class Rows(typing.Protocol):
    """Routing to encode, checked, where it lives (the host or a device): `shape` [T, L, K];
    `canonical(a, b, order, fmt)` tokens a:b in canonical form (the row transform);
    `ids(a, b)` tokens a:b as narrow canonical host ids [b - a, L, K], or None when they are
    only on the device (`_encode_chunk` then derives them from the canonical form)."""

    shape: tuple

    def canonical(self, a: int, b: int, order: str, fmt: Format) -> Canonical: ...

    def ids(self, a: int, b: int) -> np.ndarray | None: ...


class HostRows:
    """Routing on the host: narrow canonical ids [T, L, K] (`_canonical`), transformed in
    numpy (`transform.sort_rows`)."""

    def __init__(self, canon: np.ndarray, E: int) -> None:
        self.canon, self.E, self.shape = canon, E, canon.shape

    def canonical(self, a: int, b: int, order: str, fmt: Format) -> Canonical:
        c = self.canon[a:b]
        T, L, K = c.shape
        srt, code = sort_rows(c.reshape(T * L, K), order, self.E, fmt)
        return Canonical(srt.reshape(T, L, K), code)

    def ids(self, a: int, b: int) -> np.ndarray:
        return self.canon[a:b]


def _encode_chunk(canon: np.ndarray | None, rows: Canonical, tok: np.ndarray | None,
                  order: str, E: int, level: int, first_seq: int, lens: list[int],
                  continues: bool, fmt: Format) -> _Chunk:
    """One chunk of format `fmt`: `rows` its tokens in canonical form, `canon` the same
    tokens as narrow canonical ids [T, L, K] (or None: derived from `rows` when needed)."""
    srt, perm = rows.ids, rows.code
    T, L, K = srt.shape
    w = id_width(E)
    if order == "keep" and perm is None:
        perm = np.zeros((T * L, 0), np.uint8)
    content_crc = Canonical(srt, perm).crc()
    srt_z, perm_z, table = srt, perm, None
    if fmt.relabels(order, T, K, E):
        if canon is None:
            canon = _unsort_np(srt.reshape(T * L, K), perm, K, fmt).reshape(T, L, K)
        lab = _relabel_table(canon, E)
        srt_z, perm_z = sort_rows(_apply_labels(canon, lab, E).reshape(T * L, K), order, E,
                                  fmt)
        srt_z = srt_z.reshape(T, L, K)
        table = _planes(lab.astype(_NARROW[w]), w)
    pc = None if perm_z is None or not perm_z.shape[1] else perm_z.reshape(
        T, L, perm_z.shape[1])
    if tok is not None and T > 1:
        transform = _TRANSFORM_GROUPED
        g = _group_order(tok)
        ids = _to_grouped(srt_z, g)
        pc = None if pc is None else _to_grouped(pc, g)
    else:
        transform = _TRANSFORM_TOKENS
        ids = srt_z
    streams = [_planes(ids, w)]
    if table is not None:
        transform |= _TRANSFORM_RELABEL
        streams.append(table)
    if pc is not None:
        # from version 2: the code's most significant byte first (slot 0's digit leads it)
        streams.append(_planes_bytes(pc[..., ::-1] if fmt.inverse_code(K) else pc))
    method, payload = _METHOD_RAW, None
    if T:
        z = _compressor(level).compress(b"".join(streams))
        if len(z) < T * L * K * w:
            method, payload = _METHOD_ZSTD, z
    if method == _METHOD_RAW:
        # the ids as given ("keep") or sorted ("set"), never larger than narrow ids
        if canon is None:
            canon = _unsort_np(srt.reshape(T * L, K), perm, K, fmt).reshape(T, L, K)
        content = srt if order == "set" else canon
        payload = (content.astype(f"<u{w}", copy=False).tobytes() if w > 1
                   else np.ascontiguousarray(content).tobytes())
        transform = _TRANSFORM_TOKENS
    th = _token_hash(tok) if tok is not None else 0
    fixed = _CHUNK.pack(CHUNK_MAGIC, first_seq, len(lens), int(continues), method, transform, w,
                        T, len(payload), th, content_crc, zlib.crc32(payload))
    return _Chunk(fixed, np.asarray(lens, dtype="<u4").tobytes(), payload, T, len(lens))


@dataclasses.dataclass
class _Chunk:
    """An encoded chunk before its header checksum (which, from format 3 on, depends on the
    chunks before it)."""

    fixed: bytes
    lens_b: bytes
    payload: bytes
    num_tokens: int
    num_seqs: int


def _chunk_plan(lens: list[int], chunk_tokens: int) -> list[tuple[int, int]]:
    """[(first sequence, end sequence)] of whole sequences of up to chunk_tokens tokens."""
    plan, start, tok = [], 0, 0
    for i, n in enumerate(lens):
        if i > start and tok + n > chunk_tokens:
            plan.append((start, i))
            start, tok = i, 0
        tok += n
    plan.append((start, len(lens)))
    return plan


def _chunks_bytes(rows: Rows, tok, order: str, E: int, level: int, lens, chunk_tokens: int,
                  first_seq: int, continues: bool, fmt: Format) -> list[_Chunk]:
    """The chunks (before their header checksums) of `rows`, sequences `lens`. No sequence,
    no chunk: a chunk holds at least one sequence (one of none would claim a sequence
    number out of order, docs/codec_format.md)."""
    if not len(lens):
        return []
    parts, cu = [], np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
    for ci, (s0, s1) in enumerate(_chunk_plan(lens, chunk_tokens)):
        a, b = int(cu[s0]), int(cu[s1])
        parts.append(_encode_chunk(rows.ids(a, b), rows.canonical(a, b, order, fmt),
                                   None if tok is None else tok[a:b], order, E, level,
                                   first_seq + s0, lens[s0:s1], continues and ci == 0, fmt))
    return parts


def _decode_chunk(buf: memoryview, ch: ChunkInfo, inf: BlobInfo, tok: np.ndarray | None,
                  device: bool = False):
    """The chunk's rows [T, L, K] (narrow, -1 as the sentinel E), verified (`_check_content`).
    With `device`, nothing is checked here: the device path checks what it writes, and for
    order "keep" this returns the `Canonical` form for it to unsort on the device (the rows
    for raw and relabelled chunks)."""
    order, E, L, K, fmt = inf.order, inf.num_experts, inf.num_layers, inf.top_k, inf.format
    T, w = ch.num_tokens, ch.width
    nd = np.dtype(_NARROW[w]).newbyteorder("<")
    payload = buf[ch.payload_offset:ch.payload_offset + ch.payload_len]
    if zlib.crc32(payload) != ch.payload_crc:
        _fail(ch.payload_offset, "chunk payload checksum mismatch (corrupt payload)")
    device_out = device
    if ch.token_hash:
        if tok is None:
            raise CodecError(f"routing blob, offset {ch.offset}: the blob was encoded with "
                             f"token_ids; pass the same token ids to decode it")
        if _token_hash(tok) != ch.token_hash:
            raise CodecError(f"routing blob, offset {ch.offset}: token_ids differ from those "
                             f"the chunk was encoded with (hash mismatch); decoding would "
                             f"return wrong routing")
    n_ids = T * L * K
    if ch.method == _METHOD_RAW:
        if ch.payload_len != n_ids * w:
            _fail(ch.payload_offset, f"raw payload has {ch.payload_len} bytes, expected "
                                     f"{n_ids * w}")
        if n_ids == 0:
            return _no_rows(ch, T, L, K, w)
        out = np.frombuffer(payload, dtype=nd).reshape(T, L, K)
        out = out.astype(_NARROW[w]) if w > 1 else out
        if out.size and out.max() > E:
            _fail(ch.payload_offset, "raw payload holds ids above num_experts (corrupt)")
        if order == "set":
            _check_set_rows(ch, out)
        if device_out:
            return out
        if order == "set":
            rows = Canonical(out)
        else:  # the checksum covers the canonical form: derive it from what is returned
            rows = Canonical(*sort_rows(out.reshape(T * L, K), "keep", E, fmt))
        _check_content(ch, rows)
        return out
    pw = lehmer_width(K) if (order == "keep" and K > 1) else 0
    relabel = bool(ch.transform & _TRANSFORM_RELABEL)
    n_tab = L * E if relabel else 0
    want = n_ids * w + n_tab * w + T * L * pw
    _check_frame(payload, want, ch.payload_offset)
    try:
        raw = _decompressor().decompress(payload, max_output_size=want)
    except MemoryError:
        raise CodecError(f"routing blob, offset {ch.payload_offset}: cannot allocate the "
                         f"{want} bytes the chunk decompresses to") from None
    except Exception as e:  # zstd.ZstdError
        _fail(ch.payload_offset, f"corrupt zstd payload: {e}")
    if len(raw) != want:
        _fail(ch.payload_offset, f"zstd payload holds {len(raw)} bytes, expected {want}")
    if n_ids == 0:
        return _no_rows(ch, T, L, K, w)
    rawv = np.frombuffer(raw, dtype=np.uint8)
    ids = _unplanes(rawv[:n_ids * w], w, n_ids)
    inv = None
    if relabel:
        lab = _unplanes(rawv[n_ids * w:(n_ids + n_tab) * w], w, n_tab).reshape(L, E)
        inv = np.full((L, E), -1, np.int64)
        if lab.max() < E:
            np.put_along_axis(inv, lab.astype(np.intp), np.arange(E, dtype=np.int64)[None, :],
                              axis=1)
        if inv.min() < 0:
            _fail(ch.payload_offset, "the relabelling table is not a permutation of the "
                                     "experts (corrupt)")
    pc = rawv[(n_ids + n_tab) * w:].reshape(pw, T * L).T if pw else None
    if pc is not None and fmt.inverse_code(K):
        pc = pc[:, ::-1]  # stored most significant byte first
    if (ch.transform & ~_TRANSFORM_RELABEL) == _TRANSFORM_GROUPED:
        g = _group_order(tok)
        srt = _from_grouped(ids.reshape(L, T, K), g)
        if pc is not None:
            pc = _from_grouped(np.ascontiguousarray(pc).reshape(L, T, pw), g)
            pc = pc.reshape(T * L, pw)
    else:
        srt = np.ascontiguousarray(ids.reshape(T, L, K))
        pc = None if pc is None else np.ascontiguousarray(pc)
    if srt.size and srt.max() > E:
        _fail(ch.payload_offset, "decoded ids above num_experts (corrupt)")
    if order == "set":
        _check_set_rows(ch, srt)
        if not device_out:
            _check_content(ch, Canonical(srt))
        return srt
    if device_out and inv is None:  # the Triton path decodes (and checks) on the device
        return Canonical(srt, pc if pc is not None else np.zeros((T * L, 0), np.uint8))
    try:
        out = _unsort_np(srt.reshape(T * L, K), pc, K, fmt).reshape(T, L, K)
    except CodecError as e:
        _fail(ch.payload_offset, str(e))
    if inv is not None:  # labels -> expert ids
        out = _apply_labels(out, inv, E)
    # the decoded routing itself is checked: its canonical form must hash as encoded
    if not device_out:
        _check_content(ch, Canonical(*sort_rows(out.reshape(T * L, K), "keep", E, fmt)))
    return out


def _no_rows(ch: ChunkInfo, T: int, L: int, K: int, w: int) -> np.ndarray:
    """A chunk of no ids (T * L * K = 0), its payload checked: the canonical form of
    nothing hashes to 0, checked in constant time (the row transforms would cost a fixed
    number of numpy calls per chunk, whatever its size)."""
    out = np.zeros((T, L, K), _NARROW[w])
    _check_content(ch, Canonical(out))
    return out


def _widen_into(canon: np.ndarray, E: int, dst: torch.Tensor) -> None:
    """dst (a torch tensor) <- canonical ids with the sentinel E as -1. A CPU destination is
    written through a numpy view (torch's own copy wakes its thread pool:
    bench/results/codec_choices.md)."""
    if canon.size == 0:
        return
    # the max (a fast reduction) settles most chunks: no slot holds the sentinel
    empty = canon == E if canon.max() >= E else None
    if dst.device.type == "cpu" and not dst.requires_grad:
        dn = dst.numpy()
        np.copyto(dn, canon, casting="unsafe")
        if empty is not None:
            dn[empty] = -1
        return
    signed = {1: np.int16, 2: np.int32, 4: np.int64}[canon.dtype.itemsize]
    a = canon.astype(signed)
    if empty is not None:
        a[empty] = -1
    dst.copy_(torch.from_numpy(a).to(dst.dtype))


class ChunkWriter(typing.Protocol):
    """Decodes one chunk of a blob and writes its tokens a:b into `dst` [b - a, L, K] (a torch
    tensor): `write(buf, ch, inf, tok, dst, a, b)`, `tok` the chunk's token ids or None.
    Every writer ends in `_check_content` of the routing it decoded."""

    def write(self, buf, ch: ChunkInfo, inf: BlobInfo, tok, dst: torch.Tensor, a: int,
              b: int) -> None: ...


class _HostWriter:
    """The numpy path: the chunk decoded and checked on the host (`_decode_chunk`), then
    widened into dst."""

    def write(self, buf, ch: ChunkInfo, inf: BlobInfo, tok, dst: torch.Tensor, a: int,
              b: int) -> None:
        _widen_into(_decode_chunk(buf, ch, inf, tok)[a:b], inf.num_experts, dst)


HOST = _HostWriter()
