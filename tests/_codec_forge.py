"""A forger's tools for routing codec blobs (tests only): take a blob apart without checking
it, and put chunks back together with every checksum a sender can recompute made right
(payload crc32s, the chained chunk header checksums, a format-3 blob header's counts and
chain end). What such a blob still cannot fake is what the decoder re-derives itself: the
content checksum of the routing it returns and the token ids' hash."""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from replay_ops.router_replay import codec


@dataclass
class Chunk:
    fields: list          # codec.format._CHUNK fields
    lens: tuple
    payload: bytes

    @property
    def num_tokens(self) -> int:
        return self.fields[7]


def split(blob: bytes):
    """(version, header fields (_BLOB then, format 3, _BLOB3), [Chunk]) of a well-formed
    blob, read without any check."""
    head = list(codec.format._BLOB.unpack_from(blob, 0))
    version = head[1]
    ext = (list(codec.format._BLOB3.unpack_from(blob, codec.format._BLOB.size))
           if version >= 3 else None)
    off = codec.header_size(version)
    chunks = []
    while off < len(blob):
        f = list(codec.format._CHUNK.unpack_from(blob, off))
        nseq, plen = f[2], f[8]
        lo = off + codec.CHUNK_HEADER_SIZE
        lens = tuple(np.frombuffer(blob[lo:lo + 4 * nseq], "<u4").tolist())
        po = lo + 4 * nseq
        chunks.append(Chunk(f, lens, bytes(blob[po:po + plen])))
        off = po + plen
    return version, head, ext, chunks


def reseal(version: int, head: list, ext, chunks, *, fix_first_seq: bool = True,
           fix_counts: bool = True) -> bytes:
    """A blob of `chunks` under `head`, every recomputable checksum right: payload crc32s,
    chunk header checksums (chained from format 3 on), and a format-3 header's token, chunk
    and sequence counts and chain end (`fix_counts`). `fix_first_seq`: renumber the chunks'
    first sequences as a decoder expects them."""
    hb = codec.format._BLOB.pack(*head)
    if version >= 3:
        bid = ext[0]
        chain = codec.format._chain_start(hb + codec.format._BLOB3.pack(bid, 0, 0, 0, 0))
    else:
        chain = 0
    out, nseq = [], 0
    for i, c in enumerate(chunks):
        f = list(c.fields)
        if fix_first_seq:
            f[1] = nseq - 1 if f[3] else nseq
        nseq = f[1] + len(c.lens)
        f[2], f[8], f[11] = len(c.lens), len(c.payload), zlib.crc32(c.payload)
        fixed = codec.format._CHUNK.pack(*f)
        lens_b = np.asarray(c.lens, dtype="<u4").tobytes()
        chain = codec.format._chunk_crc(codec.format.as_format(version), fixed, lens_b, i,
                                        chain)
        out.append(fixed + struct.pack("<I", chain) + lens_b + c.payload)
    if version >= 3:
        e = list(ext)
        if fix_counts:
            e[1:] = [sum(c.fields[7] for c in chunks), len(chunks), nseq, chain]
        hb += codec.format._BLOB3.pack(*e)
    return hb + struct.pack("<I", zlib.crc32(hb)) + b"".join(out)


def forge_header(blob: bytes, **changes) -> bytes:
    """`blob` with format-3 blob header fields changed (E, L, K, order, flags, version,
    blob_id, num_tokens, num_chunks, num_seqs, chain) and its crc32 made right."""
    names = ["magic", "version", "order", "flags", "E", "L", "K", "reserved"]
    head = list(codec.format._BLOB.unpack_from(blob, 0))
    version = head[1]
    ext = (list(codec.format._BLOB3.unpack_from(blob, codec.format._BLOB.size))
           if version >= 3 else [])
    names3 = ["blob_id", "num_tokens", "num_chunks", "num_seqs", "chain"]
    for k, v in changes.items():
        if k in names:
            head[names.index(k)] = v
        else:
            ext[names3.index(k)] = v
    hb = codec.format._BLOB.pack(*head) + (codec.format._BLOB3.pack(*ext) if ext else b"")
    return hb + struct.pack("<I", zlib.crc32(hb)) + blob[codec.header_size(version):]


def empty_chunk(width: int, token_hash: int = 0) -> Chunk:
    """A chunk of no sequence and no token, as older encoders wrote for an append of
    nothing (`seq_lens=[]`): first_seq is set by `reseal`."""
    return Chunk([codec.CHUNK_MAGIC, 0, 0, 0, 0, 0, width, 0, 0, token_hash, 0, 0], (), b"")


def with_rows(chunk: Chunk, ids: np.ndarray, code: np.ndarray | None = None, *,
              zstd: bool = True, content_crc: int | None = None) -> Chunk:
    """`chunk` (of a blob of that shape and order) holding the stored rows a forger chose:
    `ids` [T, L, K] narrow ids (the sentinel E for an empty slot) in the order given, and
    for "keep" `code` [T*L, w] the permutation code bytes (format 2 and 3: each code's most
    significant byte is stored first); token-major, zstd-compressed or raw (raw: `ids` are
    the stored rows themselves). `content_crc`: the checksum to claim, by default that of
    (ids, code) as stored, which is what a sender computes. The chunk holds one sequence."""
    from replay_ops.router_replay.codec import format as fm, transform

    T, L, K = ids.shape
    w = ids.dtype.itemsize
    streams = [transform._planes(ids, w)]
    if code is not None and code.shape[1]:
        streams.append(transform._planes_bytes(code.reshape(T, L, -1)[..., ::-1]))
    f = list(chunk.fields)
    payload = fm._compressor(3).compress(b"".join(streams)) if zstd else (
        ids.astype(f"<u{w}").tobytes())
    f[4], f[5], f[7] = (1 if zstd else 0), 0, T
    f[10] = (fm.Canonical(ids, code).crc() if content_crc is None else content_crc)
    return Chunk(f, (T,), payload)
