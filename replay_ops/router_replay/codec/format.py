"""The routing codec's blob format: the header structs, the format versions (`Format`), the
checksum chain, and the bounds a header is checked against before anything is allocated;
`info` parses and checks every header of a blob, and `_check_content` is the one final check
of a decoded chunk, on every decode path.

The format is specified in docs/codec_format.md; this module is its one implementation (the
encoder and the parser both build and check headers here).
"""
from __future__ import annotations

import dataclasses
import math
import struct
import threading
import typing
import zlib

import numpy as np
import torch

from ..._deprecated import deprecated_property
from ...errors import RoutingError
from .._bounds import MAX_IDS, MAX_LAYERS, MAX_TOKENS, MAX_TOP_K

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
# of its own); a chunk is what `decode_sequence` decompresses. Smaller chunks compress less
# (bench/results/codec_choices.md).
DEFAULT_CHUNK_TOKENS = 16384
MAX_LEHMER_K = 20  # 20! < 2**63
MAX_EXPERTS = 2**31 - 1
# Sizes a header may claim, checked before anything is allocated: beyond any real model
# (the largest published MoE models route K <= 16 of <= 512 experts in <= 128 layers).
# (MAX_TOP_K, MAX_LAYERS, MAX_TOKENS, MAX_IDS: router_replay/_bounds.py)
# A zstd frame cannot expand more than this (a 4-byte RLE block gives 128 KiB): a chunk
# whose header claims more than this many bytes per payload byte is refused unread.
ZSTD_MAX_RATIO = 32768
_BLOB = struct.Struct("<8sHBBIIII")       # + crc u32 (versions 1 and 2)
# version 3: + blob_id u64, num_tokens u64, num_chunks u32, num_seqs u32, chain u32, crc u32
_BLOB3 = struct.Struct("<QQIII")
BLOB_HEADER_SIZE_V2 = _BLOB.size + 4
BLOB_HEADER_SIZE = _BLOB.size + _BLOB3.size + 4
_U32 = struct.Struct("<I")
_CHUNK = struct.Struct("<4sIIBBBBQQQII")  # + crc u32 (covers this and the seq_lens)
CHUNK_HEADER_SIZE = _CHUNK.size + 4
_METHOD_RAW, _METHOD_ZSTD = 0, 1
_TRANSFORM_TOKENS, _TRANSFORM_GROUPED = 0, 1
# transform bit (format 2, "keep", zstd chunks): the ids were relabelled per layer before the
# row transform, and the payload holds the relabelling table (`_relabel_table`)
_TRANSFORM_RELABEL = 2
# relabel when the table (L*E ids) is at most this fraction of the chunk's ids (T*L*K)
_RELABEL_MIN_IDS_PER_EXPERT = 16
_FLAG_TOKENS = 1


@dataclasses.dataclass(frozen=True)
class Format:
    """A format version and what it implies (docs/codec_format.md, "Versions"). Every stage
    takes one of these instead of a version number: `FORMATS[v]`, or `as_format(v)`."""

    version: int

    @property
    def header_size(self) -> int:
        """Bytes of the blob header."""
        return BLOB_HEADER_SIZE if self.binds_chunks else BLOB_HEADER_SIZE_V2

    @property
    def binds_chunks(self) -> bool:
        """Version 3: a blob id, chunk header checksums chained from the blob header and the
        chunk's index, and a blob header that counts the chunks, sequences and tokens."""
        return self.version >= 3

    @property
    def slot_order_code(self) -> bool:
        """Version 2 on: "keep" codes a row's order as the Lehmer code of its slot order,
        most significant byte first, and chunks may relabel their ids."""
        return self.version >= 2

    def inverse_code(self, k: int) -> bool:
        """Whether a K-id row's order is coded as the Lehmer code of the slot order (q)
        rather than of the sorted order (p)."""
        return self.slot_order_code and 1 < k <= MAX_LEHMER_K

    def relabels(self, order: str, T: int, K: int, E: int) -> bool:
        """Whether a chunk of T tokens relabels its ids ("keep" with 2 <= K <= 20 from
        version 2 on, when the [L, E] table is small against the chunk's ids)."""
        return (order == "keep" and self.inverse_code(K)
                and T * K >= _RELABEL_MIN_IDS_PER_EXPERT * E)


FORMATS = {v: Format(v) for v in READ_VERSIONS}
CURRENT = FORMATS[FORMAT_VERSION]


def as_format(version) -> Format:
    """The `Format` of a version number (a `Format` is returned as it is)."""
    if isinstance(version, Format):
        return version
    if version not in FORMATS:
        raise CodecError(f"format version {version!r} is not one of {READ_VERSIONS}")
    return FORMATS[version]


def header_size(version) -> int:
    """Bytes of the blob header of format `version` (a number or a `Format`)."""
    return as_format(version).header_size


class CodecError(RoutingError, ValueError):
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


def _token_hash(tok: np.ndarray) -> int:
    """64 bits: crc32 and adler32 of the ids as little-endian int64 (never 0: 0 means "no
    token ids"), faster than a cryptographic hash (bench/results/codec_choices.md); it
    detects ids that differ by accident (the wrong batch, a shifted slice), it is no
    defence against forgery."""
    b = np.ascontiguousarray(tok, dtype="<i8").view(np.uint8)
    return ((zlib.crc32(b) << 32) | zlib.adler32(b)) or 1


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
    def format(self) -> Format:
        return FORMATS[self.version]

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
    transform: int         # the row transforms applied: _TRANSFORM_* bits
    width: int
    num_tokens: int
    payload_offset: int
    payload_len: int
    token_hash: int
    content_crc: int
    payload_crc: int
    token_start: int       # of the chunk's first token in the whole blob

    layout = deprecated_property("transform", "ChunkInfo.layout")


def _blob_header(order: str, E: int, L: int, K: int, has_tokens: bool,
                 fmt: Format = None, blob_id: int = 0, num_tokens: int = 0,
                 num_chunks: int = 0, num_seqs: int = 0, chain: int = 0) -> bytes:
    fmt = fmt or CURRENT
    head = _BLOB.pack(MAGIC, fmt.version, ORDERS.index(order),
                      _FLAG_TOKENS if has_tokens else 0, E, L, K, 0)
    if fmt.binds_chunks:
        if num_chunks > 0xFFFFFFFF or num_seqs > 0xFFFFFFFF:
            raise CodecError(f"a blob holds at most {0xFFFFFFFF} chunks and sequences, got "
                             f"{num_chunks} chunks, {num_seqs} sequences")
        head += _BLOB3.pack(blob_id, num_tokens, num_chunks, num_seqs, chain)
    return head + struct.pack("<I", zlib.crc32(head))


@dataclasses.dataclass(frozen=True)
class Canonical:
    """A chunk's routing in canonical form, the value that passes between the stages: `ids`
    [T, L, K] each row's ids ascending (narrow, the sentinel E for an empty slot), and, for
    "keep", `code` [T*L, w] the permutation code bytes of the chunk's format (None for
    "set"). The row transform makes it (numpy or device), the chunk stage stores it, and
    every decoder re-derives it from the routing it returns: the content checksum covers
    exactly this (`crc`)."""

    ids: np.ndarray
    code: np.ndarray | None = None

    def crc(self) -> int:
        """crc32 of the sorted ids (narrow, little-endian, token order) and, for "keep",
        the permutation code bytes after them. The transform is a bijection, so this checks
        the routing itself."""
        w = self.ids.dtype.itemsize
        a = np.ascontiguousarray(self.ids)
        if w > 1:
            a = a.astype(f"<u{w}", copy=False)
        crc = zlib.crc32(a.view(np.uint8))
        if self.code is not None and self.code.size:
            crc = zlib.crc32(np.ascontiguousarray(self.code).view(np.uint8), crc)
        return crc


def _chain_start(head: bytes) -> int:
    """Format 3: the chain's start value, the crc32 of the blob header's fields that never
    change (magic, version, order, flags, E, L, K, reserved, blob id)."""
    return zlib.crc32(head[:_BLOB.size + 8])


def _chunk_crc(fmt: Format, fixed, lens_b, index: int, chain: int) -> int:
    """The checksum in a chunk header: crc32 of the header (`fixed`) and the sequence
    lengths; from format 3 on, seeded with the chunk's index and the previous chunk's
    checksum (the chain start for chunk 0), which binds the chunk to its blob and its
    position. Encoder and parser both compute it here."""
    seed = zlib.crc32(_U32.pack(index), chain) if fmt.binds_chunks else 0
    return zlib.crc32(lens_b, zlib.crc32(fixed, seed))


def _link(parts: list, fmt: Format, index: int, chain: int) -> tuple[list, int]:
    """Chunk bytes for `parts` (chunks index, index+1, ...), and the chain value after them."""
    out = []
    for i, c in enumerate(parts):
        chain = _chunk_crc(fmt, c.fixed, c.lens_b, index + i, chain)
        out.append(c.fixed + struct.pack("<I", chain) + c.lens_b + c.payload)
    return out, chain


def _blob_id(parts: list) -> int:
    """Format 3's blob id: 64 bits derived from the first encode's chunk headers (which hold
    the checksums of their payload, content and token ids), so the same input gives the same
    blob, and blobs of different routing get different ids."""
    b = b"".join(c.fixed + c.lens_b for c in parts)
    return ((zlib.crc32(b) << 32) | zlib.adler32(b)) or 1


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
    fmt = FORMATS[version]
    hs = fmt.header_size
    if len(buf) < hs:
        _fail(len(buf), f"truncated: {len(buf)} bytes, the blob header needs {hs}")
    (crc,) = struct.unpack_from("<I", buf, hs - 4)
    if crc != zlib.crc32(buf[:hs - 4]):
        _fail(hs - 4, "blob header checksum mismatch (corrupt header)")
    if order >= len(ORDERS) or flags & ~_FLAG_TOKENS or not 1 <= E <= MAX_EXPERTS or \
            (fmt.binds_chunks and reserved):
        _fail(10, f"corrupt blob header (order={order}, flags={flags}, num_experts={E})")
    _check_shape(0, L, K, "blob header", 16)
    ext = _BLOB3.unpack_from(buf, _BLOB.size) if fmt.binds_chunks else None
    return ORDERS[order], bool(flags & _FLAG_TOKENS), E, L, K, fmt, ext


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
    order, has_tok, E, L, K, fmt, ext = _parse_header(buf)
    itemsize = _default_dtype(E).itemsize
    hs = fmt.header_size
    if ext is not None:
        blob_id, h_tokens, h_chunks, h_seqs, h_chain = ext
        _check_shape(h_tokens, L, K, "blob header", _BLOB.size + 8)
        _check_limits(h_tokens, L, K, itemsize, max_tokens, max_bytes, _BLOB.size + 8)
        # every chunk takes a header's bytes and every sequence a length's (4): counts the
        # bytes cannot hold are refused before any chunk is read
        room = len(buf) - hs
        if h_chunks > room // CHUNK_HEADER_SIZE or h_seqs > room // 4:
            _fail(_BLOB.size + 16, f"truncated or corrupt: the blob header counts {h_chunks} "
                                   f"chunks and {h_seqs} "
                                   f"sequences, but the {room} bytes after it hold at most "
                                   f"{room // CHUNK_HEADER_SIZE} chunks "
                                   f"({CHUNK_HEADER_SIZE}-byte headers) and {room // 4} "
                                   f"sequence lengths")
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
        (magic, first, nseq, cont, method, transform, w, T, plen, th, ccrc,
         pcrc) = _CHUNK.unpack_from(buf, off)
        if magic != CHUNK_MAGIC:
            _fail(off, f"not a chunk header (magic {magic!r}, expected {CHUNK_MAGIC!r})")
        lens_off = off + CHUNK_HEADER_SIZE
        if len(buf) < lens_off + 4 * nseq:
            _fail(off, f"truncated: the chunk's {nseq} sequence lengths run past the end")
        (hcrc,) = struct.unpack_from("<I", buf, off + _CHUNK.size)
        lens_b = buf[lens_off:lens_off + 4 * nseq]
        if hcrc != _chunk_crc(fmt, buf[off:off + _CHUNK.size], lens_b, len(chunks), chain):
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
        relabel = (transform & _TRANSFORM_RELABEL) != 0
        if (first != want_first or method > 1 or (transform & ~_TRANSFORM_RELABEL) > 1
                or (relabel and (not fmt.slot_order_code or order != "keep"
                                 or method != _METHOD_ZSTD or not fmt.relabels(order, T, K, E)))
                or w != w_id
                or lsum != T or cont > 1 or (cont and nseq == 0)
                or (th != 0) != has_tok
                or (transform & _TRANSFORM_GROUPED and method == _METHOD_ZSTD and not th)):
            _fail(off, f"corrupt chunk header (first_seq={first}, expected {want_first}; "
                       f"method={method}, transform={transform}, width={w}, tokens={T}, "
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
        chunks.append(ChunkInfo(off, first, lens, bool(cont), method, transform, w, T, poff,
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
    return BlobInfo(fmt.version, order, E, L, K, has_tok, total, tuple(seqs), tuple(chunks),
                    blob_id, chain)


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


def _check_content(ch: ChunkInfo, rows: Canonical, path: str = "") -> None:
    """THE check of a decoded chunk, on every decode path: the canonical form (sorted narrow
    ids, and for "keep" the permutation code bytes) re-derived from the routing the decoder
    returns must hash to the content crc32 the encoder stored."""
    if rows.crc() != ch.content_crc:
        _fail(ch.offset, "decoded content checksum mismatch: the chunk does not decode to "
                         "the routing that was encoded (corrupt blob or a decoder bug)" + path)


_ROW_MASKS: dict[int, np.ndarray] = {}
# the comparisons of a "set" chunk's ids are made this many bytes at a time, in a buffer
# each thread keeps. NOTE: a fresh chunk-sized buffer (1 MB for a 16384-token chunk of the
# bench corpus, L = K = 8) cost its page faults on every decode: the check took about
# 0.8 ms of a 3 ms chunk decode, 0.2 ms with the kept buffer (2-core CPU, best of 30;
# bench/results/codec_hardening_cb007ad_cpu_2core.md: every row >= 0.90x)
_COMPARE_BYTES = 1 << 18


def _row_mask(K: int) -> np.ndarray:
    """For rows of K ids (cached): little-endian u64 words whose bytes are 0xFF where a
    comparison of neighbours in the flat ids stays inside a row and 0 where it crosses
    into the next row; one word when 8 bytes hold whole rows, else whole periods of
    lcm(K, 8) bytes, about 32 KB of them (a long inner loop for numpy)."""
    if K not in _ROW_MASKS:
        period = K * 8 // math.gcd(K, 8)
        b = np.full(period, 0xFF, np.uint8)
        b[K - 1::K] = 0
        _ROW_MASKS[K] = (b if period == 8 else np.tile(b, max(1, 32768 // period))).view("<u8")
    return _ROW_MASKS[K]


def _check_set_rows(ch: ChunkInfo, ids: np.ndarray) -> None:
    """The canonical form of a "set" chunk, on every decode path before anything is
    returned: each row's ids ascending (the sentinel E, an empty slot, is the largest, so
    it comes last). The content checksum covers the ids as stored, so without this a
    chunk whose checksums were recomputed over unsorted rows would decode to them on the
    host while the device path, which sorts what it wrote again, refuses them."""
    K = ids.shape[-1]
    if K < 2 or ids.size == 0:
        return
    # each id compared with the next over the flat ids (one byte per comparison), a block
    # at a time; the bytes that compare across two rows are masked out, the rest
    # OR-reduced as words
    flat = ids.reshape(-1)
    n, mask = flat.size, _row_mask(K)
    step = mask.size * 8  # bytes: whole rows, whole masks
    block = max(step, _COMPARE_BYTES // step * step)
    buf = getattr(_tls, "compare", None)
    if buf is None or buf.size < block:
        buf = _tls.compare = np.empty(block, np.uint8)
    bad = 0
    for i in range(0, n - 1, block):
        m = min(block, n - 1 - i)
        down = buf[:-(-m // step) * step]
        np.less(flat[i + 1:i + 1 + m], flat[i:i + m], out=down[:m].view(bool))
        down[m:] = 0
        words = down.view("<u8")
        if mask.size > 1:
            masked = words.reshape(-1, mask.size)
            np.bitwise_and(masked, mask, out=masked)
        bad |= int(np.bitwise_or.reduce(words))
    if mask.size == 1:
        bad &= int(mask[0])
    if bad:
        rows = ids.reshape(-1, K)
        r = int(np.flatnonzero((rows[:, 1:] < rows[:, :-1]).any(axis=1))[0])
        _fail(ch.offset, f"a \"set\" chunk holds row {r} (token {r // ids.shape[1]}, layer "
                         f"{r % ids.shape[1]}) = {rows[r].tolist()} out of canonical order "
                         f"(ids ascending, empty slots last): a corrupt or forged chunk")


def _default_dtype(E: int) -> torch.dtype:
    return torch.int16 if E <= 32767 else torch.int32


