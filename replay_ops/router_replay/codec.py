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

## Stages (per chunk)

0. ``"keep"`` only, when the chunk has at least 16 ids per expert (T*K >= 16*E) and
   2 <= K <= 20: the ids are relabelled per layer (`_relabel_table`: the experts by their
   mean slot over the chunk, so the experts that usually score high get the small labels)
   and the [L, E] table is stored. The slot order of a relabelled row is close to its
   ascending order, so its permutation code below is small and compresses (dev corpus,
   zstd-3: 4.02x against 3.82x without token ids, 4.25x against 4.16x with them).
1. canonical rows: -1 becomes the sentinel E; each row is sorted ascending by a sorting
   network over the K columns (`sort_rows`). ``"keep"`` also stores the order of each row
   as a Lehmer code, a mixed-radix number below K! (ceil(log2 K!) bits rounded up to
   bytes: 2 bytes for K = 8): that of the slot order q (q[s] = the rank of slot s's id in
   the row, equal ids ranked by slot; digit s = #{s' > s : id[s'] < id[s]} in radix K - s,
   slot 0's digit most significant), stored most significant byte first: the top-scoring
   slot's rank leads, and it repeats between a token's occurrences more than the rest.
   Format 1 stored the code of the inverse permutation p (p[j] = the slot of the j-th
   smallest id), least significant byte first. K > 20 stores the slot of each sorted id
   instead.
2. narrow ids: 1 byte per id when E <= 255, 2 bytes when E <= 65535, else 4, as byte
   planes (all low bytes, then the next byte...).
3. with token ids (`token_ids=`, side information both ends must hold), the chunk's tokens
   are regrouped by token id (a stable sort: occurrences of a token in order), and the ids
   are laid out layer-major: the same token's rows, which share most experts, become
   neighbours for the general compressor. Without token ids: token-major.
4. zstd (the `zstandard` package) at `level`; when that does not make the chunk smaller,
   the chunk stores the routing raw ("set": the sorted rows; "keep": the ids as given;
   never more than the narrow ids plus the headers). The zstd payload is the ids' byte
   planes, then (relabelled chunks) the table's byte planes [L, E], then ("keep") the
   code's byte planes.

## Format (little-endian; FORMAT_VERSION 3; version 1 and 2 blobs are read and appended
## to in their own format)

    blob header  (BLOB_HEADER_SIZE bytes; BLOB_HEADER_SIZE_V2 before version 3)
        magic b"RRCODEC\\0", version u16, order u8 (0 set, 1 keep), flags u8 (bit 0: token
        ids), num_experts u32, num_layers u32, top_k u32, reserved u32 (0),
        version 3 only: blob_id u64, num_tokens u64, num_chunks u32, num_seqs u32,
        chain u32 (the last chunk's header checksum),
        crc32 of the bytes before it (u32)
    chunks, each:
        chunk header  (CHUNK_HEADER_SIZE bytes)
            magic b"RRCK", first_seq u32, num_seqs u32, continues u8 (1: the first sequence
            continues sequence first_seq of an earlier chunk), method u8 (0 raw, 1 zstd),
            layout u8 (bit 0: 0 token-major, 1 grouped by token and layer-major; bit 1:
            relabelled, format 2 "keep" zstd chunks only), width u8,
            num_tokens u64, payload_len u64, token_hash u64 (crc32 << 32 | adler32 of
            the chunk's token ids as int64; 0 without), content_crc u32 (crc32 of the chunk's
            canonical rows of the expert ids, never of labels: the sorted narrow ids in
            token order, then for "keep" the permutation code bytes of the blob's version,
            little-endian rows; decoders re-derive them from the routing they return),
            payload_crc u32, crc32 of the chunk header before it and the sequence lengths
            after it (u32; version 3: seeded with crc32(index u32) continued from the
            previous chunk's checksum, the first chunk's from the crc32 of the blob
            header's first 36 bytes, which never change: `_chunk_crc`)
        seq_lens  u32 * num_seqs
        payload   payload_len bytes

Each chunk holds whole sequences (or the next turn of the blob's last sequence, when
appended with `continue_last=True`), so a sequence decodes from its own chunks alone, and
appending a turn adds chunks without touching the earlier ones (version 3: and rewrites
the blob header). A corrupt, truncated, spliced or foreign blob raises `CodecError` naming
the byte offset and the reason; a decoded chunk whose content crc32 differs is refused, on
every decode path (`_check_content`), so decoding never returns wrong routing by accident.
The checksums are crc32s: they catch accidents, not a sender that recomputes them.

## Bounds

Every size a header claims is checked before anything is allocated (`MAX_TOP_K`,
`MAX_LAYERS`, `MAX_TOKENS`, `MAX_IDS`, and `ZSTD_MAX_RATIO` decompressed bytes per payload
byte), and a zstd frame must declare exactly what its chunk header implies, with nothing
after it; `max_tokens=` and `max_bytes=` bound a blob further. Decoding any input takes
memory within a small constant factor of the output its validated header allows, plus a
constant, and time linear in its size (tests/test_fuzz_codec.py).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import struct
import threading
import typing
import zlib
from typing import Sequence

import numpy as np
import torch

from ._bounds import MAX_IDS, MAX_LAYERS, MAX_TOKENS, MAX_TOP_K

FORMAT_VERSION = 3
# Versions this decoder reads (and `append` extends in their own format): 1 stored the
# Lehmer code of the sorted-id order (p), its bytes least significant first; 2 stores that
# of the slot order (the inverse permutation q), most significant first; 3 is 2 with the
# chunks bound to their blob and position (a blob id, a chained header checksum) and a blob
# header that counts the chunks, sequences and tokens (`append` rewrites it).
READ_VERSIONS = (1, 2, 3)
MAGIC = b"RRCODEC\x00"
CHUNK_MAGIC = b"RRCK"
ORDERS = ("set", "keep")
DEFAULT_LEVEL = 3
# Sequences are packed into chunks of up to this many tokens (a longer sequence is a chunk
# of its own). NOTE: on the dev corpus (E=128, K=8, L=8, 512-token sequences, token ids
# given, zstd-3) one chunk per sequence gives 5.1x smaller than int16, 8192-token chunks
# 7.6x, one 32768-token chunk 8.2x; a chunk is what `decode_sequence` decompresses.
DEFAULT_CHUNK_TOKENS = 16384
MAX_LEHMER_K = 20  # 20! < 2**63
MAX_EXPERTS = 2**31 - 1
# Sizes a header may claim, checked before anything is allocated: beyond any real model
# (the largest published MoE models route K <= 16 of <= 512 experts in <= 128 layers).
# (MAX_TOP_K, MAX_LAYERS, MAX_TOKENS, MAX_IDS: router_replay/_bounds.py)
# A zstd frame cannot expand more than this (a 4-byte RLE block gives 128 KiB): a chunk
# whose header claims more than this many bytes per payload byte is refused unread.
ZSTD_MAX_RATIO = 32768
# Rows are sorted by a sorting network (one numpy call per comparator) up to this K, by
# np.sort above it.
_NETWORK_MAX_K = 20

_BLOB = struct.Struct("<8sHBBIIII")       # + crc u32 (versions 1 and 2)
# version 3: + blob_id u64, num_tokens u64, num_chunks u32, num_seqs u32, chain u32, crc u32
_BLOB3 = struct.Struct("<QQIII")
BLOB_HEADER_SIZE_V2 = _BLOB.size + 4
BLOB_HEADER_SIZE = _BLOB.size + _BLOB3.size + 4
_U32 = struct.Struct("<I")
_CHUNK = struct.Struct("<4sIIBBBBQQQII")  # + crc u32 (covers this and the seq_lens)
CHUNK_HEADER_SIZE = _CHUNK.size + 4
_METHOD_RAW, _METHOD_ZSTD = 0, 1
_LAYOUT_TOKENS, _LAYOUT_GROUPED = 0, 1
# layout bit (format 2, "keep", zstd chunks): the ids were relabelled per layer before the
# row transform, and the payload holds the relabelling table (`_relabel_table`)
_LAYOUT_RELABEL = 2
# relabel when the table (L*E ids) is at most this fraction of the chunk's ids (T*L*K)
_RELABEL_MIN_IDS_PER_EXPERT = 16
_FLAG_TOKENS = 1


def header_size(version: int) -> int:
    """Bytes of the blob header of format `version`."""
    return BLOB_HEADER_SIZE if version >= 3 else BLOB_HEADER_SIZE_V2


class CodecError(ValueError):
    """A blob that cannot be decoded (corrupt, truncated, foreign, newer version, wrong or
    missing token ids), or input that cannot be encoded. Decoding problems name the byte
    offset in the blob."""


def _zstd():
    try:
        import zstandard
    except ImportError as e:  # pragma: no cover - a dependency of replay_ops
        raise ImportError("replay_ops.router_replay.codec needs the `zstandard` package "
                          "(pip install zstandard)") from e
    return zstandard


_tls = threading.local()


def _compressor(level: int):
    cache = _tls.__dict__.setdefault("c", {})
    if level not in cache:
        cache[level] = _zstd().ZstdCompressor(level=level, write_content_size=True,
                                              write_checksum=False)
    return cache[level]


def _decompressor():
    if not hasattr(_tls, "d"):
        _tls.d = _zstd().ZstdDecompressor()
    return _tls.d


# ---------------------------------------------------------------------------- row transforms
def id_width(num_experts: int) -> int:
    """Bytes per stored id: the sentinel value num_experts must fit too."""
    if num_experts <= 0xFF:
        return 1
    if num_experts <= 0xFFFF:
        return 2
    return 4


_NARROW = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def lehmer_width(k: int) -> int:
    """Bytes per row for the permutation: the Lehmer code (< k!) for k <= 20, else k slot
    numbers of one byte (k <= 256) or two."""
    if k <= MAX_LEHMER_K:
        bits = max(1, math.ceil(math.log2(math.factorial(k)))) if k > 1 else 0
        for w in (0, 1, 2, 4, 8):
            if bits <= 8 * w:
                return w
    return k * (1 if k <= 256 else 2)


def _network(k: int) -> list[tuple[int, int]]:
    """Batcher's odd-even merge sort for k inputs (the network of the next power of two,
    comparators touching an index >= k dropped: those inputs act as +inf)."""
    n = 1
    while n < k:
        n *= 2
    pairs: list[tuple[int, int]] = []

    def merge(lo, m, r):
        step = r * 2
        if step < m:
            merge(lo, m, step)
            merge(lo + r, m, step)
            pairs.extend((i, i + r) for i in range(lo + r, lo + m - r, step))
        else:
            pairs.append((lo, lo + r))

    def sort(lo, m):
        if m > 1:
            h = m // 2
            sort(lo, h)
            sort(lo + h, h)
            merge(lo, m, 1)

    sort(0, n)
    return [(i, j) for i, j in pairs if j < k]


_NETWORKS: dict[int, list] = {}


def _sort_columns(cols: list[np.ndarray]) -> list[np.ndarray]:
    """Sort across the K column arrays, element by element (each row ascending). The arrays
    must be the caller's own: they are overwritten."""
    k = len(cols)
    if k > _NETWORK_MAX_K:  # a vectorised sort: a network costs one call per comparator
        m = np.sort(np.stack(cols, axis=1), axis=1)
        return [m[:, j] for j in range(k)]
    if k not in _NETWORKS:
        _NETWORKS[k] = _network(k)
    cols = list(cols)
    for i, j in _NETWORKS[k]:
        lo = np.minimum(cols[i], cols[j])
        np.maximum(cols[i], cols[j], out=cols[j])
        cols[i] = lo
    return cols


def _key_dtype(num_experts: int, k: int):
    top = (num_experts + 1) * _slot_mult(k)
    for dt in (np.uint16, np.uint32, np.uint64):
        if top <= np.iinfo(dt).max + 1:
            return dt
    raise CodecError(f"num_experts={num_experts} with top_k={k} is too large")


def _slot_mult(k: int) -> int:
    return 1 << max(0, (k - 1).bit_length())


def _inverse_code(version: int, k: int) -> bool:
    """Whether format `version` codes the order of a K-id row as the Lehmer code of the
    slot order (q, version >= 2) rather than of the sorted order (p)."""
    return version >= 2 and 1 < k <= MAX_LEHMER_K


def sort_rows(canon: np.ndarray, order: str, num_experts: int,
              version: int = FORMAT_VERSION):
    """The per-row transform. `canon` [N, K] holds ids with -1 already mapped to the sentinel
    num_experts (any unsigned narrow dtype). Returns (sorted [N, K] in canon's dtype,
    perm_code [N, lehmer_width(K)] uint8 bytes or None for "set"). The code is that of
    format `version` (`_inverse_code`)."""
    n, k = canon.shape
    if order == "keep" and _inverse_code(version, k):
        cols = [canon[:, j].copy() for j in range(k)]  # the network overwrites them
        code = _lehmer_of_slots(cols, k)
        srt = np.stack(_sort_columns(cols), axis=1)
        return srt, code
    if order == "set" or k <= 1:
        cols = _sort_columns([np.ascontiguousarray(canon[:, j]) for j in range(k)])
        out = np.stack(cols, axis=1) if k else canon.copy()
        return out, (None if order == "set" else np.zeros((n, lehmer_width(k)), np.uint8))
    kd = _key_dtype(num_experts, k)
    mult = _slot_mult(k)
    shift = mult.bit_length() - 1
    keys = [(canon[:, j].astype(kd) << kd(shift)) | kd(j) for j in range(k)]
    keys = _sort_columns(keys)
    srt = np.stack([(c >> kd(shift)).astype(canon.dtype) for c in keys], axis=1)
    perm = [(c & kd(mult - 1)).astype(np.uint8 if k <= 256 else np.uint16) for c in keys]
    return srt, _perm_encode(perm, k)


def _lehmer_bytes(cols: list[np.ndarray], k: int) -> np.ndarray:
    """The Lehmer code of each row of the columns `cols` (K arrays of N values), as
    [N, lehmer_width(k)] little-endian bytes: digit j = #{i > j : cols[i] < cols[j]} in
    radix k - j, column 0's digit most significant."""
    n = cols[0].shape[0]
    w = lehmer_width(k)
    if w == 0:
        return np.zeros((n, 0), np.uint8)
    code = np.zeros(n, np.uint64)
    for j in range(k - 1):
        c = np.zeros(n, np.uint8)
        cj = cols[j]
        for i in range(j + 1, k):
            c += cols[i] < cj
        code *= np.uint64(k - j)
        code += c
    return np.ascontiguousarray(code.astype(f"<u{w}")).view(np.uint8).reshape(n, w)


def _lehmer_of_slots(cols: list[np.ndarray], k: int) -> np.ndarray:
    """The Lehmer code of each row's slot order: q[s] = the rank of slot s's id in the row
    (equal ids ranked by slot), digit s = #{s' > s : q[s'] < q[s]} = #{s' > s : id[s'] <
    id[s]}, slot 0's digit most significant. Equal to `_perm_encode` of the inverse
    permutation."""
    return _lehmer_bytes(cols, k)


def _perm_encode(perm: list[np.ndarray], k: int) -> np.ndarray:
    """perm[j][r] = the original slot of row r's j-th smallest key -> [N, width] bytes."""
    n = perm[0].shape[0]
    if k > MAX_LEHMER_K:
        p = np.ascontiguousarray(np.stack(perm, axis=1))
        return p.view(np.uint8).reshape(n, k * p.itemsize)
    return _lehmer_bytes(perm, k)


def lehmer_digits(code: np.ndarray, k: int) -> np.ndarray:
    """Lehmer codes [N] (below k!) -> their digits [N, k] uint8: c_j = #{i > j : p[i] < p[j]}
    (digit j in radix k - j). A code not below k! raises CodecError."""
    code = np.asarray(code).astype(np.uint64)
    n = code.shape[0]
    digits = np.zeros((n, k), np.uint8)
    for j in range(k - 2, -1, -1):
        radix = np.uint64(k - j)
        digits[:, j] = code % radix
        code = code // radix
    if np.any(code):
        bad = int(np.flatnonzero(code)[0])
        raise CodecError(f"permutation code of row {bad} is not below {k}! (corrupt)")
    return digits


def _perm_decode(code_bytes: np.ndarray, k: int) -> list[np.ndarray]:
    """Inverse of `_perm_encode`: [N, width] bytes -> perm[j] arrays."""
    n = code_bytes.shape[0]
    if k > MAX_LEHMER_K:
        dt = np.uint8 if k <= 256 else np.dtype("<u2")
        p = np.ascontiguousarray(code_bytes).view(dt).reshape(n, k)
        return [p[:, j] for j in range(k)]
    w = lehmer_width(k)
    code = (np.ascontiguousarray(code_bytes).view(f"<u{w}").reshape(n)
            if w else np.zeros(n, np.uint64))
    d = lehmer_digits(code, k)
    p = [d[:, j] for j in range(k)]
    for j in range(k - 2, -1, -1):
        pj = p[j]
        for i in range(j + 1, k):
            p[i] = p[i] + (p[i] >= pj)
    return p


# ---------------------------------------------------------------------------- inputs
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


def _token_hash(tok: np.ndarray) -> int:
    """64 bits: crc32 and adler32 of the ids as little-endian int64 (never 0: 0 means "no
    token ids"). NOTE: 0.05 ms for 16384 ids against 0.5 ms for blake2b; it detects ids that
    differ by accident (the wrong batch, a shifted slice), it is no defence against forgery."""
    b = np.ascontiguousarray(tok, dtype="<i8").view(np.uint8)
    return ((zlib.crc32(b) << 32) | zlib.adler32(b)) or 1


def _seq_lens(seq_lens, n: int) -> list[int]:
    if seq_lens is None:
        return [n]
    s = _as_numpy(seq_lens, "seq_lens").reshape(-1)
    lens = [int(v) for v in s]
    if any(v < 0 for v in lens) or sum(lens) != n:
        raise CodecError(f"seq_lens must be non-negative and sum to the routing's T={n}; got "
                         f"{lens[:8]}{'...' if len(lens) > 8 else ''} (sum {sum(lens)})")
    return lens


# ---------------------------------------------------------------------------- encoding
@dataclasses.dataclass(frozen=True)
class BlobInfo:
    """What a blob's headers say (`info`)."""

    version: int
    order: str
    num_experts: int
    num_layers: int
    top_k: int
    has_token_ids: bool
    num_tokens: int
    seq_lens: tuple[int, ...]
    chunks: tuple["ChunkInfo", ...]
    blob_id: int = 0       # format 3 (0 before)
    chain: int = 0         # the last chunk's header checksum (format 3: the chain's end)

    @property
    def first_seqs(self) -> list[int]:
        return [c.first_seq for c in self.chunks]

    @property
    def num_sequences(self) -> int:
        return len(self.seq_lens)

    @property
    def cu_seqlens(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.seq_lens, dtype=np.int64)])


class ChunkInfo(typing.NamedTuple):
    """What a chunk's header says (a named tuple: `info` builds one per chunk)."""

    offset: int            # of the chunk header
    first_seq: int
    seq_lens: tuple[int, ...]
    continues: bool
    method: int
    layout: int
    width: int
    num_tokens: int
    payload_offset: int
    payload_len: int
    token_hash: int
    content_crc: int
    payload_crc: int
    token_start: int       # of the chunk's first token in the whole blob


def _blob_header(order: str, E: int, L: int, K: int, has_tokens: bool,
                 version: int = FORMAT_VERSION, blob_id: int = 0, num_tokens: int = 0,
                 num_chunks: int = 0, num_seqs: int = 0, chain: int = 0) -> bytes:
    head = _BLOB.pack(MAGIC, version, ORDERS.index(order),
                      _FLAG_TOKENS if has_tokens else 0, E, L, K, 0)
    if version >= 3:
        if num_chunks > 0xFFFFFFFF or num_seqs > 0xFFFFFFFF:
            raise CodecError(f"a blob holds at most {0xFFFFFFFF} chunks and sequences, got "
                             f"{num_chunks} chunks, {num_seqs} sequences")
        head += _BLOB3.pack(blob_id, num_tokens, num_chunks, num_seqs, chain)
    return head + struct.pack("<I", zlib.crc32(head))


def _content_crc(srt: np.ndarray, perm: np.ndarray | None) -> int:
    """crc32 of the canonical rows: the sorted ids (narrow, little-endian, token order) and,
    for "keep", the permutation code bytes after them. The transform is a bijection, so
    this checks the decoded routing itself: decoders re-derive it from what they return."""
    w = srt.dtype.itemsize
    a = np.ascontiguousarray(srt)
    if w > 1:
        a = a.astype(f"<u{w}", copy=False)
    crc = zlib.crc32(a.view(np.uint8))
    if perm is not None and perm.size:
        crc = zlib.crc32(np.ascontiguousarray(perm).view(np.uint8), crc)
    return crc


def _relabels(version: int, order: str, T: int, K: int, E: int) -> bool:
    """Whether a chunk relabels its ids (format 2 "keep" with 2 <= K <= 20, when the table
    is small against the chunk)."""
    return (order == "keep" and _inverse_code(version, K)
            and T * K >= _RELABEL_MIN_IDS_PER_EXPERT * E)


def _relabel_table(canon: np.ndarray, E: int) -> np.ndarray:
    """[L, E] new labels (each row a permutation of 0..E-1): per layer, the experts by their
    mean slot over the chunk's rows (the slot order is the score order, so experts that
    usually score high get small labels; unused experts last; ties by id). Relabelled, the
    slot order of a row is close to its ascending order, so its Lehmer code is small and
    compresses (dev corpus, keep, zstd-3: 4.02x against 3.82x without token ids). The
    sentinel E keeps its label."""
    T, L, K = canon.shape
    E1 = E + 1
    # NOTE: one count of (slot, layer, id) triples: 1.6 ms for 16384 x 8 x 8 ids, against
    # 2.2 ms for a count per slot and 6 ms for one weighted count (2-core test machine)
    it = np.int32 if K * L * E1 < 2**31 else np.int64
    if K * L * E1 <= 1 << 20:
        off = ((np.arange(L, dtype=it) * E1)[None, :, None]
               + (np.arange(K, dtype=it) * (L * E1))[None, None, :])
        per = np.bincount((canon + off).reshape(-1), minlength=K * L * E1).reshape(K, L, E1)
        cnt = per.sum(axis=0)[:, :E]
        tot = np.tensordot(np.arange(K, dtype=np.int64), per, axes=1)[:, :E]
    else:  # a count per slot: L * E bins at a time
        off = (np.arange(L, dtype=it) * E1)[None, :]
        cnt = np.zeros(L * E1, np.int64)
        tot = np.zeros(L * E1, np.int64)
        for j in range(K):
            c = np.bincount((canon[:, :, j] + off).reshape(-1), minlength=L * E1)
            cnt += c
            tot += j * c
        cnt, tot = cnt.reshape(L, E1)[:, :E], tot.reshape(L, E1)[:, :E]
    mean = np.where(cnt > 0, tot / np.maximum(cnt, 1), float(K))
    order = np.argsort(mean, axis=1, kind="stable")
    lab = np.empty((L, E), np.int64)
    np.put_along_axis(lab, order, np.arange(E, dtype=np.int64)[None, :], axis=1)
    return lab


def _apply_labels(canon: np.ndarray, lab: np.ndarray, E: int) -> np.ndarray:
    """[T, L, K] ids -> the labels lab[l, id] (the sentinel E stays E), canon's dtype."""
    L = lab.shape[0]
    # one gather from a flat [L, stride] table, indexed by layer * stride + id. NOTE: with
    # 16-bit indices (E < 256, L <= 256) 1.2 ms for 16384 x 8 x 8 ids, against 2.4 ms for a
    # gather per layer (2-core test machine)
    stride = 256 if E < 256 and L <= 256 else E + 1
    it = np.uint16 if stride == 256 else np.uint32 if L * stride < 2**32 else np.int64
    ext = np.zeros((L, stride), canon.dtype)
    ext[:, :E] = lab
    ext[:, E] = E
    idx = canon.astype(it)
    idx += (np.arange(L, dtype=it) * it(stride))[None, :, None]
    return np.take(ext.reshape(-1), idx)


def _encode_chunk(canon: np.ndarray | None, tok: np.ndarray | None, order: str, E: int,
                  level: int, first_seq: int, lens: list[int], continues: bool,
                  pre: tuple | None = None, version: int = FORMAT_VERSION) -> bytes:
    """One chunk of format `version`. `canon` [T, L, K] narrow canonical ids, or `pre` =
    (sorted [T, L, K], perm code bytes [T*L, w] or None) already transformed (the Triton
    path)."""
    if pre is None:
        T, L, K = canon.shape
        srt, perm = sort_rows(canon.reshape(T * L, K), order, E, version)
        srt = srt.reshape(T, L, K)
    else:
        srt, perm = pre
        T, L, K = srt.shape
    w = id_width(E)
    if order == "keep" and perm is None:
        perm = np.zeros((T * L, 0), np.uint8)
    content_crc = _content_crc(srt, perm)
    srt_z, perm_z, table = srt, perm, None
    if _relabels(version, order, T, K, E):
        if canon is None:
            canon = _unsort_np(srt.reshape(T * L, K), perm, K, version).reshape(T, L, K)
        lab = _relabel_table(canon, E)
        srt_z, perm_z = sort_rows(_apply_labels(canon, lab, E).reshape(T * L, K), order, E,
                                  version)
        srt_z = srt_z.reshape(T, L, K)
        table = _planes(lab.astype(_NARROW[w]), w)
    pc = None if perm_z is None or not perm_z.shape[1] else perm_z.reshape(
        T, L, perm_z.shape[1])
    if tok is not None and T > 1:
        layout = _LAYOUT_GROUPED
        g = _group_order(tok)
        ids = _to_grouped(srt_z, g)
        pc = None if pc is None else _to_grouped(pc, g)
    else:
        layout = _LAYOUT_TOKENS
        ids = srt_z
    streams = [_planes(ids, w)]
    if table is not None:
        layout |= _LAYOUT_RELABEL
        streams.append(table)
    if pc is not None:
        # version 2: the code's most significant byte first (slot 0's digit leads it)
        streams.append(_planes_bytes(pc[..., ::-1] if _inverse_code(version, K) else pc))
    method, payload = _METHOD_RAW, None
    if T:
        z = _compressor(level).compress(b"".join(streams))
        if len(z) < T * L * K * w:
            method, payload = _METHOD_ZSTD, z
    if method == _METHOD_RAW:
        # the ids as given ("keep") or sorted ("set"), never larger than narrow ids
        if canon is None:
            canon = _unsort_np(srt.reshape(T * L, K), perm, K, version).reshape(T, L, K)
        content = srt if order == "set" else canon
        payload = (content.astype(f"<u{w}", copy=False).tobytes() if w > 1
                   else np.ascontiguousarray(content).tobytes())
        layout = _LAYOUT_TOKENS
    th = _token_hash(tok) if tok is not None else 0
    fixed = _CHUNK.pack(CHUNK_MAGIC, first_seq, len(lens), int(continues), method, layout, w,
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


def _chain_start(head: bytes) -> int:
    """Format 3: the chain's start value, the crc32 of the blob header's fields that never
    change (magic, version, order, flags, E, L, K, reserved, blob id)."""
    return zlib.crc32(head[:_BLOB.size + 8])


def _chunk_crc(version: int, fixed, lens_b, index: int, chain: int) -> int:
    """The checksum in a chunk header: crc32 of the header (`fixed`) and the sequence
    lengths; from format 3 on, seeded with the chunk's index and the previous chunk's
    checksum (the chain start for chunk 0), which binds the chunk to its blob and its
    position. Encoder and parser both compute it here."""
    seed = 0 if version < 3 else zlib.crc32(_U32.pack(index), chain)
    return zlib.crc32(lens_b, zlib.crc32(fixed, seed))


def _link(parts: list, version: int, index: int, chain: int) -> tuple[list, int]:
    """Chunk bytes for `parts` (chunks index, index+1, ...), and the chain value after them."""
    out = []
    for i, c in enumerate(parts):
        chain = _chunk_crc(version, c.fixed, c.lens_b, index + i, chain)
        out.append(c.fixed + struct.pack("<I", chain) + c.lens_b + c.payload)
    return out, chain


def _blob_id(parts: list) -> int:
    """Format 3's blob id: 64 bits derived from the first encode's chunk headers (which hold
    the checksums of their payload, content and token ids), so the same input gives the same
    blob, and blobs of different routing get different ids."""
    b = b"".join(c.fixed + c.lens_b for c in parts)
    return ((zlib.crc32(b) << 32) | zlib.adler32(b)) or 1


def _group_order(tok: np.ndarray) -> np.ndarray:
    """The stable order of the tokens by id (a token's occurrences in order). NOTE: one sort
    of (id << bits | position) keys: 0.47 ms for 16384 tokens against 0.78 ms for a stable
    argsort (2-core test machine)."""
    T = tok.shape[0]
    bits = max(1, int(T).bit_length())
    lo, hi = (int(tok.min()), int(tok.max())) if T else (0, 0)
    if lo >= 0 and hi <= 0xFFFF:
        # NOTE: numpy's stable sort of 16-bit keys is a radix sort: 0.06 ms for 16384 ids
        return np.argsort(tok.astype(np.uint16), kind="stable")
    if lo >= 0 and hi < (1 << (62 - bits)):
        keys = np.sort((tok.astype(np.int64) << bits) | np.arange(T, dtype=np.int64))
        return keys & ((1 << bits) - 1)
    return np.argsort(tok, kind="stable")


_ROW_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _rows(a: np.ndarray) -> np.ndarray:
    """A contiguous [A, B, C] array as [A, B] rows of one item each (moving a row is one
    copy: an unsigned integer when the row is 1, 2, 4 or 8 bytes, else an opaque item)."""
    A, B, C = a.shape
    nb = C * a.itemsize
    return np.ascontiguousarray(a).view(_ROW_UINT.get(nb, np.dtype((np.void, nb)))).reshape(A, B)


def _to_grouped(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    """[T, L, C] token order -> [L, T, C] layer-major, tokens in order g."""
    T, L, C = a.shape
    return np.ascontiguousarray(_rows(a)[g].T).view(a.dtype).reshape(L, T, C)


def _from_grouped(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Inverse of `_to_grouped`: [L, T, C] -> [T, L, C] contiguous."""
    L, T, C = a.shape
    ginv = np.empty_like(g)
    ginv[g] = np.arange(T, dtype=g.dtype)
    # NOTE: a gather along the token axis, then one transpose: 0.2 ms for 16384 x 8 rows of
    # 8 bytes, against 0.8 ms for a gather of the transposed rows
    return np.ascontiguousarray(np.take(_rows(a), ginv, axis=1).T).view(a.dtype).reshape(
        T, L, C)


def _planes(ids: np.ndarray, w: int) -> bytes:
    if w == 1:
        return np.ascontiguousarray(ids).tobytes()
    b = np.ascontiguousarray(ids).astype(f"<u{w}", copy=False).view(np.uint8).reshape(-1, w)
    return np.ascontiguousarray(b.T).tobytes()


def _planes_bytes(b: np.ndarray) -> bytes:
    """[..., w] uint8 -> w planes."""
    w = b.shape[-1]
    b = b.reshape(-1, w)
    return np.ascontiguousarray(b.T).tobytes() if w > 1 else np.ascontiguousarray(b).tobytes()


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


def _check_shape(T: int, L: int, K: int, who: str, offset: int | None = None) -> None:
    """The bounds every blob's shape keeps (`MAX_TOP_K`, `MAX_LAYERS`, `MAX_TOKENS`,
    `MAX_IDS`): checked when encoding, and on every header before anything is allocated."""
    for name, v, top in (("top_k", K, MAX_TOP_K), ("num_layers", L, MAX_LAYERS),
                         ("num_tokens", T, MAX_TOKENS), ("T*L*K", T * L * K, MAX_IDS)):
        if v > top:
            msg = (f"{who}: {name}={v} is above the codec's bound {top} (no real model "
                   f"routes that much)")
            if offset is None:
                raise CodecError(msg)
            _fail(offset, msg)


def _check_order(order):
    if order not in ORDERS:
        raise CodecError(f"order must be 'keep' or 'set', got {order!r}")


def _check_level(level):
    if isinstance(level, bool) or not isinstance(level, int) or not -7 <= level <= 22:
        raise CodecError(f"level must be a zstd level in -7..22, got {level!r}")


def _chunks_bytes(canon, tok, order, E, level, lens, chunk_tokens, first_seq, continues,
                  version=FORMAT_VERSION):
    parts, cu = [], np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
    dev = isinstance(canon, _DeviceRouting)
    for ci, (s0, s1) in enumerate(_chunk_plan(lens, chunk_tokens)):
        a, b = int(cu[s0]), int(cu[s1])
        parts.append(_encode_chunk(None if dev else canon[a:b],
                                   None if tok is None else tok[a:b], order, E, level,
                                   first_seq + s0, lens[s0:s1], continues and ci == 0,
                                   pre=canon.pre(a, b, order, version) if dev else None,
                                   version=version))
    return parts


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
        canon = _DeviceRouting(routing, E)
    else:
        canon = _canonical(routing, E)
    T, L, K = canon.shape
    _check_shape(T, L, K, "routing")
    tok = None if token_ids is None else _token_array(token_ids, T, "token_ids")
    lens = _seq_lens(seq_lens, T)
    if chunk_tokens < 1:
        raise CodecError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    parts = _chunks_bytes(canon, tok, order, E, level, lens, chunk_tokens, 0, False)
    bid = _blob_id(parts)
    chain0 = _chain_start(_blob_header(order, E, L, K, tok is not None, blob_id=bid))
    body, chain = _link(parts, FORMAT_VERSION, 0, chain0)
    head = _blob_header(order, E, L, K, tok is not None, blob_id=bid, num_tokens=T,
                        num_chunks=len(parts), num_seqs=len(lens), chain=chain)
    return b"".join([head] + body)


# ---------------------------------------------------------------------------- Triton path
BACKENDS = ("auto", "numpy", "triton")


def _triton_ok() -> bool:
    try:
        from replay_ops.triton_kernels import codec as _  # noqa: F401
    except Exception:
        return False
    return True


def _use_triton(backend: str, t, order: str, who: str) -> bool:
    if backend not in BACKENDS:
        raise CodecError(f"{who}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "numpy":
        return False
    if backend == "triton":
        if not isinstance(t, torch.Tensor):
            raise CodecError(f"{who}: backend='triton' needs a torch tensor")
        if not _triton_ok():
            raise CodecError(f"{who}: backend='triton' but Triton is not available")
        return True
    return (isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")
            and _triton_ok())


def _device_narrow(E: int) -> torch.dtype:
    return torch.uint8 if E <= 0xFF else torch.int16 if E <= 0x7FFF else torch.int32


class _DeviceRouting:
    """Routing on its device, checked there; `pre(a, b, order)` runs the Triton transform on
    tokens a:b and returns what `_encode_chunk` takes (host arrays)."""

    def __init__(self, routing: torch.Tensor, E: int) -> None:
        x = routing.detach()
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise CodecError(f"routing must hold integers, got dtype {x.dtype}")
        if x.dim() != 3:
            raise CodecError(f"routing must be [T, L, K], got shape {tuple(x.shape)}")
        if x.numel():
            bad = (x < -1) | (x > E - 1)
            if bool(bad.any()):
                pos = [int(v) for v in bad.nonzero()[0]]
                raise CodecError(f"routing[{pos[0]}, {pos[1]}, {pos[2]}] = "
                                 f"{int(x[pos[0], pos[1], pos[2]])} is out of range for "
                                 f"num_experts={E} (valid: 0..{E - 1}, -1 = empty slot)")
        self.x, self.E, self.shape = x, E, tuple(x.shape)

    def pre(self, a: int, b: int, order: str, version: int = FORMAT_VERSION):
        from replay_ops.triton_kernels import codec as tk

        T, L, K = b - a, self.shape[1], self.shape[2]
        rows = self.x[a:b].reshape(T * L, K)
        srt_d, code_d = tk.sort_rows(rows, self.E, order, _device_narrow(self.E),
                                     inverse=_inverse_code(version, K))
        w = id_width(self.E)
        srt = srt_d.cpu().numpy()
        srt = srt if srt.dtype == _NARROW[w] else srt.astype(_NARROW[w])
        perm = None
        if order == "keep":
            pw = lehmer_width(K)
            if code_d is None or not pw:
                perm = np.zeros((T * L, pw), np.uint8)
            else:
                small = torch.int32 if math.factorial(K) <= 2**31 else torch.int64
                code = code_d.to(small).cpu().numpy()
                perm = np.ascontiguousarray(code.astype(f"<u{pw}")).view(np.uint8)
                perm = perm.reshape(T * L, pw)
        return srt.reshape(T, L, K), perm


def _decode_into_device(buf, ch, inf, tok, dst: torch.Tensor) -> None:
    """Decode one chunk on the host up to the canonical rows (checksummed), then unsort and
    write on dst's device with the Triton kernel; the written routing is checked there (its
    canonical form re-derived and compared)."""
    from replay_ops.triton_kernels import codec as tk

    T, L, K, E = ch.num_tokens, inf.num_layers, inf.top_k, inf.num_experts
    if T * L * K == 0:
        return
    res = _decode_chunk(buf, ch, inf.order, E, L, K, tok, device=True, version=inf.version)
    if inf.order == "keep" and isinstance(res, tuple):
        srt, pc = res
    else:  # raw chunks come back in their final form; set chunks need no permutation
        srt, pc = (res, None) if inf.order == "set" else sort_rows(
            res.reshape(T * L, K), "keep", E, inf.version)
    dev = dst.device
    nd = _device_narrow(E)
    srt_d = torch.from_numpy(np.array(srt.reshape(T * L, K), dtype=(
        np.int32 if nd == torch.int32 else np.int16 if nd == torch.int16 else np.uint8))).to(dev)
    digits_d = None
    keep_code = inf.order == "keep" and K > 1
    if keep_code:
        pw = pc.shape[1]
        code = np.ascontiguousarray(pc).view(f"<u{pw}").reshape(-1).astype(np.int64) \
            if pw else np.zeros(T * L, np.int64)
        try:
            digits = lehmer_digits(code, K)
        except CodecError as e:
            _fail(ch.payload_offset, str(e))
        digits_d = torch.from_numpy(digits).to(dev)
    flat = dst.view(T * L, K) if _viewable(dst) else torch.empty(T * L, K, dtype=dst.dtype,
                                                                 device=dev)
    inverse = _inverse_code(inf.version, K)
    tk.unsort_rows(srt_d, digits_d, E, flat, inverse=inverse)
    # check what was written: its canonical form, re-derived on the device, must hash to the
    # content checksum (the same check as the numpy path's)
    again, code2 = tk.sort_rows(flat, E, "keep" if keep_code else "set", nd,
                                inverse=inverse)
    w = id_width(E)
    srt_h = again.cpu().numpy().astype(_NARROW[w], copy=False)
    pc_h = None
    if inf.order == "keep":
        pw = lehmer_width(K)
        if code2 is None or not pw:
            pc_h = np.zeros((T * L, pw), np.uint8)
        else:
            pc_h = np.ascontiguousarray(code2.cpu().numpy().astype(f"<u{pw}")).view(
                np.uint8).reshape(T * L, pw)
    _check_content(ch, srt_h, pc_h, " (device transform check failed: the routing written "
                                    "on the device)")
    if flat.data_ptr() != dst.data_ptr() or not _viewable(dst):
        dst.copy_(flat.view(T, L, K))


def _viewable(t: torch.Tensor) -> bool:
    try:
        t.view(-1, t.shape[-1])
    except RuntimeError:
        return False
    return True


def append(blob: bytes, routing, *, token_ids=None, seq_lens=None, continue_last=False,
           level: int = DEFAULT_LEVEL, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
           max_tokens: int | None = None, max_bytes: int | None = None) -> bytes:
    """A new blob: `blob` followed by more routing with the blob's mode and shape. New
    sequences by default; with `continue_last=True` the first of them continues the blob's
    last sequence (the next turn of a conversation: its new rows only). The existing chunks
    are verified (headers and payload checksums) and copied unchanged; a format-3 blob's
    header is rewritten (chunk, sequence and token counts, the chain's end), and the new
    chunks continue its chain. A blob of an older format is extended in that format (its
    chunks bound to nothing: see the module's docstring). `max_tokens`/`max_bytes` bound the
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
    first = info_.num_sequences - 1 if continue_last else info_.num_sequences
    v = info_.version
    parts = _chunks_bytes(canon, tok, info_.order, info_.num_experts, level, lens,
                          chunk_tokens, first, continue_last, v)
    body, chain = _link(parts, v, len(info_.chunks), info_.chain)
    hs = header_size(v)
    if v < 3:
        return bytes(buf) + b"".join(body)
    head = _blob_header(info_.order, info_.num_experts, L, K, info_.has_token_ids, v,
                        blob_id=info_.blob_id, num_tokens=info_.num_tokens + T,
                        num_chunks=len(info_.chunks) + len(parts),
                        num_seqs=first + len(lens), chain=chain)
    return b"".join([head, bytes(buf[hs:])] + body)


# ---------------------------------------------------------------------------- parsing
def _fail(offset: int, reason: str):
    raise CodecError(f"routing blob, offset {offset}: {reason}")


def _parse_header(buf: memoryview):
    if len(buf) < len(MAGIC) or bytes(buf[:len(MAGIC)]) != MAGIC:
        _fail(0, f"not a routing codec blob (magic {bytes(buf[:8])!r}, expected {MAGIC!r})")
    if len(buf) < _BLOB.size:
        _fail(len(buf), f"truncated: {len(buf)} bytes, the blob header needs "
                        f"{BLOB_HEADER_SIZE_V2} or more")
    magic, version, order, flags, E, L, K, reserved = _BLOB.unpack_from(buf, 0)
    if version not in READ_VERSIONS:
        _fail(8, f"format version {version} is not supported (this decoder reads versions "
                 f"{', '.join(map(str, READ_VERSIONS))})")
    hs = header_size(version)
    if len(buf) < hs:
        _fail(len(buf), f"truncated: {len(buf)} bytes, the blob header needs {hs}")
    (crc,) = struct.unpack_from("<I", buf, hs - 4)
    if crc != zlib.crc32(buf[:hs - 4]):
        _fail(hs - 4, "blob header checksum mismatch (corrupt header)")
    if order >= len(ORDERS) or flags & ~_FLAG_TOKENS or not 1 <= E <= MAX_EXPERTS or \
            (version >= 3 and reserved):
        _fail(10, f"corrupt blob header (order={order}, flags={flags}, num_experts={E})")
    _check_shape(0, L, K, "blob header", 16)
    ext = _BLOB3.unpack_from(buf, _BLOB.size) if version >= 3 else None
    return ORDERS[order], bool(flags & _FLAG_TOKENS), E, L, K, version, ext


def _check_limit_args(max_tokens, max_bytes) -> None:
    for name, v in (("max_tokens", max_tokens), ("max_bytes", max_bytes)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))
                              or v < 0):
            raise CodecError(f"{name} must be a non-negative int or None, got {v!r}")


def _check_limits(T: int, L: int, K: int, itemsize: int, max_tokens, max_bytes,
                  offset: int) -> None:
    """The caller's bounds: the blob's tokens (`max_tokens`) and the bytes of the routing it
    decodes to (`max_bytes`, T * L * K * itemsize of the output dtype)."""
    if max_tokens is not None and T > max_tokens:
        _fail(offset, f"num_tokens={T} is above max_tokens={max_tokens}")
    if max_bytes is not None and T * L * K * itemsize > max_bytes:
        _fail(offset, f"decoded bytes={T * L * K * itemsize} ([{T}, {L}, {K}] x {itemsize}) "
                      f"is above max_bytes={max_bytes}")


def info(blob, *, verify_payload: bool = False, max_tokens: int | None = None,
         max_bytes: int | None = None) -> BlobInfo:
    """Parse and check every header of a blob (and, with `verify_payload`, every payload's
    crc32) without decoding. Raises CodecError naming the offset of the first problem.
    `max_tokens`: the most tokens the blob may hold; `max_bytes`: the most bytes its routing
    may take decoded in the default dtype (int16 when num_experts <= 32767, else int32).
    Either is checked against the format-3 header before the chunks are read."""
    _check_limit_args(max_tokens, max_bytes)
    buf = memoryview(blob).cast("B") if not isinstance(blob, memoryview) else blob.cast("B")
    order, has_tok, E, L, K, version, ext = _parse_header(buf)
    itemsize = _default_dtype(E).itemsize
    hs = header_size(version)
    if ext is not None:
        blob_id, h_tokens, h_chunks, h_seqs, h_chain = ext
        _check_shape(h_tokens, L, K, "blob header", _BLOB.size + 8)
        _check_limits(h_tokens, L, K, itemsize, max_tokens, max_bytes, _BLOB.size + 8)
        chain = _chain_start(bytes(buf[:hs]))
    else:
        blob_id = chain = 0
        h_chunks = None
    w_id = id_width(E)
    max_t = min(MAX_TOKENS, MAX_IDS // max(1, L * K))
    pw = lehmer_width(K) if (order == "keep" and K > 1) else 0
    chunks, seqs, off, total = [], [], hs, 0
    while off < len(buf) if h_chunks is None else len(chunks) < h_chunks:
        if len(buf) - off < CHUNK_HEADER_SIZE:
            if off == len(buf):
                _fail(off, f"truncated: the blob ends after {len(chunks)} of the "
                           f"{h_chunks} chunks its header counts")
            _fail(off, f"truncated: {len(buf) - off} bytes left, a chunk header needs "
                       f"{CHUNK_HEADER_SIZE}")
        (magic, first, nseq, cont, method, layout, w, T, plen, th, ccrc,
         pcrc) = _CHUNK.unpack_from(buf, off)
        if magic != CHUNK_MAGIC:
            _fail(off, f"not a chunk header (magic {magic!r}, expected {CHUNK_MAGIC!r})")
        lens_off = off + CHUNK_HEADER_SIZE
        if len(buf) < lens_off + 4 * nseq:
            _fail(off, f"truncated: the chunk's {nseq} sequence lengths run past the end")
        (hcrc,) = struct.unpack_from("<I", buf, off + _CHUNK.size)
        lens_b = buf[lens_off:lens_off + 4 * nseq]
        if hcrc != _chunk_crc(version, buf[off:off + _CHUNK.size], lens_b, len(chunks), chain):
            _fail(off, "chunk header checksum mismatch (corrupt chunk header"
                       + (", or a chunk of another blob or position)" if ext else ")"))
        chain = hcrc
        if nseq <= 64:
            lens = struct.unpack_from(f"<{nseq}I", lens_b)
            lsum = sum(lens)
        else:
            lens_a = np.frombuffer(lens_b, dtype="<u4")
            lsum = int(lens_a.sum(dtype=np.int64))
            lens = tuple(lens_a.tolist())
        want_first = len(seqs) - 1 if cont else len(seqs)
        relabel = (layout & _LAYOUT_RELABEL) != 0
        if (first != want_first or method > 1 or (layout & ~_LAYOUT_RELABEL) > 1
                or (relabel and (version < 2 or order != "keep" or method != _METHOD_ZSTD
                                 or not _relabels(version, order, T, K, E)))
                or w != w_id
                or lsum != T or cont > 1 or (cont and nseq == 0)
                or (th != 0) != has_tok):
            _fail(off, f"corrupt chunk header (first_seq={first}, expected {want_first}; "
                       f"method={method}, layout={layout}, width={w}, tokens={T}, "
                       f"sum(seq_lens)={lsum})")
        if total + T > max_t:
            _check_shape(total + T, L, K, "chunk header", off)
        n_ids = T * L * K
        if method == _METHOD_RAW:
            if plen != n_ids * w:
                _fail(off, f"raw payload has {plen} bytes, expected {n_ids * w}")
        else:
            want = n_ids * w + (L * E * w if relabel else 0) + T * L * pw
            if want > ZSTD_MAX_RATIO * plen:
                _fail(off, f"the chunk claims {want} decompressed bytes from a "
                           f"{plen}-byte zstd payload (more than a zstd frame can hold)")
        poff = lens_off + 4 * nseq
        if len(buf) < poff + plen:
            _fail(poff, f"truncated: the chunk payload needs {plen} bytes, {len(buf) - poff} "
                        f"are left")
        if verify_payload and zlib.crc32(buf[poff:poff + plen]) != pcrc:
            _fail(poff, "chunk payload checksum mismatch (corrupt payload)")
        if cont:
            seqs[-1] += lens[0]
            seqs.extend(lens[1:])
        else:
            seqs.extend(lens)
        chunks.append(ChunkInfo(off, first, lens, bool(cont), method, layout, w, T, poff,
                                plen, th, ccrc, pcrc, total))
        total += T
        off = poff + plen
    if ext is not None:
        if off != len(buf):
            _fail(off, f"not a chunk header: {len(buf) - off} bytes follow the last of the "
                       f"{h_chunks} chunks the blob header counts")
        if (total, len(seqs), chain) != (h_tokens, h_seqs, h_chain):
            _fail(_BLOB.size + 8, f"the blob header does not match its chunks ({h_tokens} "
                                  f"tokens, {h_seqs} sequences counted, the chunks hold "
                                  f"{total} tokens, {len(seqs)} sequences; chain end "
                                  f"{h_chain:#x}, chunks' {chain:#x}): a truncated, "
                                  f"spliced or corrupt blob")
    else:
        _check_limits(total, L, K, itemsize, max_tokens, max_bytes, hs)
    return BlobInfo(version, order, E, L, K, has_tok, total, tuple(seqs), tuple(chunks),
                    blob_id, chain)


# ---------------------------------------------------------------------------- decoding
def _decode_chunk(buf: memoryview, ch: ChunkInfo, order: str, E: int, L: int, K: int,
                  tok: np.ndarray | None, device: bool = False,
                  version: int = FORMAT_VERSION):
    """The chunk's rows [T, L, K] (narrow, -1 as the sentinel E), verified (`_check_content`).
    With `device`, nothing is checked here: the Triton path checks what it writes, and for
    order "keep" this returns the canonical (sorted [T, L, K], code bytes [T*L, w]) for it
    to unsort on the device (the rows for raw and relabelled chunks)."""
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
        out = np.frombuffer(payload, dtype=nd).reshape(T, L, K)
        out = out.astype(_NARROW[w]) if w > 1 else out
        if out.size and out.max() > E:
            _fail(ch.payload_offset, "raw payload holds ids above num_experts (corrupt)")
        if device_out:
            return out
        if order == "set":
            srt, pc = out, None
        else:  # the checksum covers the canonical form: derive it from what is returned
            srt, pc = sort_rows(out.reshape(T * L, K), "keep", E, version)
        _check_content(ch, srt, pc)
        return out
    pw = lehmer_width(K) if (order == "keep" and K > 1) else 0
    relabel = bool(ch.layout & _LAYOUT_RELABEL)
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
    if pc is not None and _inverse_code(version, K):
        pc = pc[:, ::-1]  # stored most significant byte first
    if (ch.layout & ~_LAYOUT_RELABEL) == _LAYOUT_GROUPED:
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
        if not device_out:
            _check_content(ch, srt, None)
        return srt
    if device_out and inv is None:  # the Triton path decodes (and checks) on the device
        return srt, (pc if pc is not None else np.zeros((T * L, 0), np.uint8))
    try:
        out = _unsort_np(srt.reshape(T * L, K), pc, K, version).reshape(T, L, K)
    except CodecError as e:
        _fail(ch.payload_offset, str(e))
    if inv is not None:  # labels -> expert ids
        out = _apply_labels(out, inv, E)
    # the decoded routing itself is checked: its canonical form must hash as encoded
    srt2, pc2 = sort_rows(out.reshape(T * L, K), "keep", E, version)
    if not device_out:
        _check_content(ch, srt2, pc2)
    return out


def _zstd_frame_end(b: memoryview, offset: int) -> int:
    """The end of the zstd frame at the start of `b` (its header, blocks and checksum),
    read from the block headers alone."""
    zstd = _zstd()
    try:
        pos = zstd.frame_header_size(b)
        params = zstd.get_frame_parameters(b)
    except Exception as e:  # zstd.ZstdError
        _fail(offset, f"corrupt zstd payload: {e}")
    n = len(b)
    while True:
        if pos + 3 > n:
            _fail(offset, "corrupt zstd payload: the frame is cut inside a block header")
        h = b[pos] | (b[pos + 1] << 8) | (b[pos + 2] << 16)
        last, btype, size = h & 1, (h >> 1) & 3, h >> 3
        if btype == 3:
            _fail(offset, "corrupt zstd payload: reserved block type")
        pos += 3 + (1 if btype == 1 else size)
        if last:
            break
    return pos + (4 if params.has_checksum else 0)


def _check_frame(payload: memoryview, want: int, offset: int) -> None:
    """Before decompressing: the payload is one zstd frame that declares exactly the size
    the chunk header implies, and nothing follows it (no decompression bomb, no smuggled
    bytes)."""
    try:
        size = _zstd().frame_content_size(payload)
    except Exception as e:  # zstd.ZstdError
        _fail(offset, f"corrupt zstd payload: {e}")
    if size != want:
        _fail(offset, f"the zstd frame declares {size} bytes, the chunk header implies {want}"
                      f" (-1: not declared)")
    end = _zstd_frame_end(payload, offset)
    if end != len(payload):
        _fail(offset, f"the zstd frame ends at byte {end} of the {len(payload)}-byte payload "
                      f"(bytes after the frame, or a frame cut short)")


def _check_content(ch: ChunkInfo, srt: np.ndarray, pc, path: str = "") -> None:
    """THE check of a decoded chunk, on every decode path: the canonical form (sorted narrow
    ids, and for "keep" the permutation code bytes) re-derived from the routing the decoder
    returns must hash to the content crc32 the encoder stored."""
    if _content_crc(srt, pc) != ch.content_crc:
        _fail(ch.offset, "decoded content checksum mismatch: the chunk does not decode to "
                         "the routing that was encoded (corrupt blob or a decoder bug)" + path)


def _unsort_np(srt: np.ndarray, pc, K: int, version: int = FORMAT_VERSION) -> np.ndarray:
    """[N, K] sorted ids + permutation code bytes (of format `version`) -> the ids in their
    original slots."""
    N = srt.shape[0]
    if pc is None or K <= 1 or not pc.shape[1]:
        return np.ascontiguousarray(srt)
    p = np.stack(_perm_decode(pc, K), axis=1)
    if p.size and p.max() >= K:
        raise CodecError("corrupt permutation (slot out of range)")
    if _inverse_code(version, K):  # q[s]: the rank of slot s's id
        return np.take_along_axis(srt, p.astype(np.intp), axis=1)
    out = np.empty((N, K), srt.dtype)
    np.put_along_axis(out, p.astype(np.intp), srt, axis=1)
    return out


def _unplanes(b: np.ndarray, w: int, n: int) -> np.ndarray:
    if w == 1:
        return b
    return np.ascontiguousarray(b.reshape(w, n).T).view(f"<u{w}").reshape(n).astype(_NARROW[w])


def _default_dtype(E: int) -> torch.dtype:
    return torch.int16 if E <= 32767 else torch.int32


def _widen_into(canon: np.ndarray, E: int, dst: torch.Tensor) -> None:
    """dst (a torch tensor) <- canonical ids with the sentinel E as -1. A CPU destination is
    written through a numpy view (torch's own copy wakes its thread pool: 5.8 ms of CPU for
    1M elements on the 2-core test machine, against 0.3 ms here)."""
    if canon.size == 0:
        return
    # NOTE: the max (a fast reduction) settles most chunks: no slot holds the sentinel
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
                on_device: bool) -> None:
    """Rows a:b of chunk `ch`, decoded and verified, into dst."""
    try:
        if on_device:
            if (a, b) == (0, ch.num_tokens):
                _decode_into_device(buf, ch, inf, tok, dst)
            else:
                tmp = _output((ch.num_tokens,) + tuple(dst.shape[1:]), inf.num_experts,
                              dst.device, dst.dtype, None)
                _decode_into_device(buf, ch, inf, tok, tmp)
                dst.copy_(tmp[a:b])
            return
        c = _decode_chunk(buf, ch, inf.order, inf.num_experts, inf.num_layers, inf.top_k, tok,
                          version=inf.version)
        _widen_into(c[a:b], inf.num_experts, dst)
    except MemoryError:
        raise CodecError(f"routing blob, offset {ch.offset}: out of memory decoding a chunk "
                         f"of {ch.num_tokens} tokens") from None


def _on_device(backend: str, res: torch.Tensor, inf: BlobInfo, who: str) -> bool:
    # "keep" with K > 20 stores slot numbers, not a Lehmer code: decoded on the host (and
    # checked there), then copied
    return _use_triton(backend, res, inf.order, who) and not (
        inf.order == "keep" and inf.top_k > MAX_LEHMER_K)


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
    on_device = _on_device(backend, res, inf, "decode")
    for ch in inf.chunks:
        a, b = ch.token_start, ch.token_start + ch.num_tokens
        _chunk_into(buf, ch, inf, None if tok is None else tok[a:b], res[a:b], 0,
                    ch.num_tokens, on_device)
    return res


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
    # the chunks that hold the sequence: those from the last one starting at or before it
    # (a continued sequence spans consecutive chunks)
    j = bisect.bisect_right(inf.first_seqs, index) - 1
    mine = []
    while j >= 0 and inf.chunks[j].first_seq + len(inf.chunks[j].seq_lens) > index:
        mine.append(inf.chunks[j])
        j -= 1
    mine.reverse()
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
    on_device = _on_device(backend, res, inf, "decode_sequence")
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
        _chunk_into(buf, ch, inf, ctok, res[done:done + (b - a)], a, b, on_device)
        done += b - a
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
