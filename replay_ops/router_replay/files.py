"""Record files: recorded routing on disk, in the safetensors container.

A record file is a plain safetensors file (readable by `safetensors.safe_open`) with two
tensors and string metadata:

    cu_seqlens  int64 [B + 1]      sequence boundaries: sequence b is tokens
                                   cu_seqlens[b]:cu_seqlens[b+1]; cu_seqlens[0] = 0,
                                   cu_seqlens[B] = N, non-decreasing
    and either (indices_encoding "raw", the only layout of versions 1 and 2)
    indices     uint8 | int16 [N, L, K]
                                   expert ids per token, layer and slot, in the smallest
                                   type that holds E: uint8 when E <= 255 (empty slot =
                                   255), else int16 (E <= 32767, empty slot = -1)
    or (indices_encoding "codec", the default of this writer)
    indices_codec  uint8 [nbytes]  the [N, L, K] ids as one `codec` blob (order "keep": the
                                   exact ids, one chunk per run of whole sequences, the
                                   sequences of cu_seqlens), several times smaller than
                                   `indices`; `indices_shape` gives [N, L, K]

    __metadata__ (all strings):
      format          "replay_ops.router_replay"
      format_version  "3" (this writer; the reader also reads "1" and "2")
      indices_encoding "raw" | "codec" (version 3; versions 1 and 2 are raw)
      indices_shape   JSON [N, L, K] (version 3)
      num_experts, top_k, num_hidden_layers, num_tokens, num_sequences
      moe_layer_ids   JSON list of the absolute ids of the MoE layers
      layer_index     "moe" (L = number of MoE layers, in moe_layer_ids order) or
                      "absolute" (L = num_hidden_layers, indexed by absolute layer id)
      model_name      free text ("" if unknown)
      empty_value     "255" or "-1"
      checksum        "sha256:<hex>" of every byte after the header (the data buffer)
      header_checksum "sha256:<hex>" of the header itself: its JSON with sorted keys and no
                      spaces, header_checksum left out (format_version 2 and 3)

Any other metadata key is the writer's own (`RecordMeta.extra`): the reader keeps it (a
string) in `RoutingFile.meta.extra`, and an append keeps it in the new file.

A "codec" file is read by decoding: `indices()` decodes the whole blob once (then slices
the cached result), `sequence(i)` decodes only the chunks of sequence i; both verify the
codec's own checksums of the decoded ids. A "raw" file (`write_routing(...,
encoding="raw")`) is not decoded: int16 slices are views of the bytes read.

Version 1 files (no header_checksum) stay readable: every metadata key the version 1 writer
wrote must then be present, but a changed value in their header cannot be detected.

Writes go through `replay_ops._atomic` (a temporary file in the same directory, fsynced,
renamed over the target), so a reader sees the old file or the new one, never a partial
one; a writer killed mid-write leaves the previous file intact. The path is resolved once
(symbolic links followed) and that file is locked, written next to and replaced, so a
write through a link updates the file it points to and the link stays. Appending reads the
old file once into memory, verifies that copy's checksums and copies it into the new
temporary file in chunks. Writers and appenders of a path hold one advisory lock across
their read-modify-write, so no returned write is lost to an append.

A header is untrusted input: every field is checked (type, range, bounds far beyond any
real model, sizes against the bytes present) before anything is built from it, and every
failure is a RoutingFileError naming the field.

Reading opens the file once, without blocking (a FIFO or any other file that is not a
regular file is refused, naming it): the size, the header and the data all come from that
one descriptor, so a writer replacing the file during a read cannot mix two files in one
result. The data is read once into private memory, and that copy is what the checksum is
computed over and what every tensor views: a writer that rewrites or truncates the file in
place afterwards (`cp` over it, `rsync --inplace`) changes nothing that was read, and one
that truncates it during the read makes the read short, a RoutingFileError. Only
`open_routing(..., verify=False, mmap=True)` maps the file instead (lazily, for very large
files): that reader sees such a writer's bytes, and a truncation kills it with SIGBUS.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import stat
import struct
from typing import Iterator, Sequence

import numpy as np
import torch

from .._atomic import atomic_target
from ..errors import RoutingError
from ._bounds import MAX_LAYERS, MAX_TOP_K
from .shape import ModelShape, first_bad_route

FORMAT = "replay_ops.router_replay"
FORMAT_VERSION = 3
READABLE_VERSIONS = ("1", "2", "3")
ENCODINGS = ("codec", "raw")
# every key the version 1 writer wrote (besides RecordMeta.extra)
V1_KEYS = ("format", "format_version", "num_experts", "top_k", "num_hidden_layers",
           "moe_layer_ids", "layer_index", "model_name", "empty_value", "num_tokens",
           "num_sequences", "checksum")
# the metadata keys this writer owns (computes on every write); any other key is the
# writer's own (RecordMeta.extra), read back and kept by appends
OWNED_KEYS = frozenset(V1_KEYS + ("indices_encoding", "indices_shape", "header_checksum"))
MAX_HEADER_BYTES = 100 * 1024 * 1024
UINT8_EMPTY = 255
_CHUNK_BYTES = 1 << 20  # copy/hash granularity
_READ_BYTES = 1 << 30  # the most one read asks for
_chunk_hook = None  # called after each data chunk is written (tests: kill mid-write)
_DIGEST_PLACEHOLDER = "sha256:" + "0" * 64

_ST_DTYPES = {"U8": np.uint8, "I16": np.int16, "I64": np.int64}
_CODEC_TENSOR = "indices_codec"
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


class RoutingFileError(RoutingError, ValueError):
    """A record file that cannot be used: truncated, corrupt, wrong checksum, wrong
    version, or recorded for a different model shape. The message names the file."""

    def __init__(self, path, problem: str) -> None:
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"router replay file {self.path!r}: {problem}")


class RoutingShapeError(RoutingFileError):
    """The file was recorded for a different model shape (experts, top-k, layers)."""


class RecordMeta:
    """The metadata of a record file: the model shape (`shape`, a ModelShape), the layer
    mapping of the stored indices, the model name and free extra strings. Built from the
    four shape fields (`RecordMeta(num_experts=..., top_k=..., moe_layer_ids=...,
    num_hidden_layers=...)`) or from a shape (`RecordMeta(shape=...)`)."""

    def __init__(self, num_experts: int | None = None, top_k: int | None = None,
                 moe_layer_ids: Sequence[int] | None = None,
                 num_hidden_layers: int | None = None, layer_index: str = "moe",
                 model_name: str = "", extra: dict[str, str] | None = None, *,
                 shape: ModelShape | None = None) -> None:
        if shape is None:
            shape = ModelShape(num_experts, top_k, tuple(moe_layer_ids or ()), num_hidden_layers)
        self.shape = shape
        self.layer_index = layer_index
        self.model_name = model_name or ""
        self.extra = dict(extra or {})
        self.check()

    num_experts = property(lambda self: self.shape.num_experts)
    top_k = property(lambda self: self.shape.top_k)
    moe_layer_ids = property(lambda self: list(self.shape.moe_layer_ids))
    num_hidden_layers = property(lambda self: self.shape.num_hidden_layers)

    @property
    def num_layers(self) -> int:
        """L of the stored [N, L, K] indices."""
        return (self.shape.num_moe_layers if self.layer_index == "moe"
                else self.shape.num_hidden_layers)

    def check(self) -> None:
        if self.layer_index not in ("moe", "absolute"):
            raise ValueError(f"RecordMeta: layer_index must be 'moe' or 'absolute', got "
                             f"{self.layer_index!r}")

    def __repr__(self) -> str:
        return (f"RecordMeta({self.shape}, layer_index={self.layer_index!r}, "
                f"model_name={self.model_name!r})")


def index_dtype(num_experts: int) -> np.dtype:
    """The smallest stored type that holds expert ids 0..E-1 plus an empty sentinel."""
    if num_experts <= UINT8_EMPTY:
        return np.dtype(np.uint8)
    if num_experts <= np.iinfo(np.int16).max:
        return np.dtype(np.int16)
    raise ValueError(f"record files hold at most 32767 experts, got num_experts={num_experts}")


# ---------------------------------------------------------------------------- writing
def _encode(indices: torch.Tensor, meta: RecordMeta, path, offset: int = 0) -> np.ndarray:
    """Validate [N, L, K] indices (-1 = empty) and convert them to the stored type."""
    if not isinstance(indices, torch.Tensor):
        indices = torch.as_tensor(np.asarray(indices))
    if indices.dim() != 3:
        raise ValueError(f"record file {os.fspath(path)!r}: indices must be [N, L, K], got shape "
                         f"{tuple(indices.shape)}")
    N, L, K = indices.shape
    if L != meta.num_layers or K != meta.top_k:
        raise ValueError(
            f"record file {os.fspath(path)!r}: indices have shape {tuple(indices.shape)} but the "
            f"metadata says L={meta.num_layers} (layer_index={meta.layer_index!r}) and "
            f"K=top_k={meta.top_k}"
        )
    if indices.is_floating_point() or indices.dtype == torch.bool:
        raise TypeError(f"record file {os.fspath(path)!r}: indices must be integers, got "
                        f"{indices.dtype}")
    idx = indices.detach().to("cpu", torch.int64)
    bad = first_bad_route(idx, meta.num_experts)
    if bad is not None and bad.kind == "range":
        raise ValueError(
            f"record file {os.fspath(path)!r}: indices[{bad.token}, {bad.layer}, {bad.slot}] "
            f"(token {bad.token + offset}) = {bad.value} is out of range for num_experts="
            f"{meta.num_experts} (valid: 0..{meta.num_experts - 1}, -1 = empty)"
        )
    if bad is not None:
        raise ValueError(f"record file {os.fspath(path)!r}: token {bad.token + offset}, layer "
                         f"{bad.layer} repeats an expert: {bad.row}")
    dt = index_dtype(meta.num_experts)
    if dt == np.uint8:
        idx = torch.where(idx < 0, UINT8_EMPTY, idx)
    return np.ascontiguousarray(idx.numpy().astype(dt))


def _check_cu_seqlens(cu, n_tokens: int, path) -> np.ndarray:
    if cu is None:
        return np.array([0, n_tokens], dtype=np.int64)
    if isinstance(cu, torch.Tensor):
        cu = cu.detach().cpu().numpy()
    cu = np.asarray(cu, dtype=np.int64).reshape(-1)
    if cu.size < 1 or cu[0] != 0 or cu[-1] != n_tokens or np.any(np.diff(cu) < 0):
        raise ValueError(
            f"record file {os.fspath(path)!r}: cu_seqlens must start at 0, end at the token "
            f"count N={n_tokens} and not decrease; got {cu.tolist()[:8]}"
            f"{'...' if cu.size > 8 else ''} (length {cu.size})"
        )
    return cu


def _meta_dict(meta: RecordMeta, dt: np.dtype, n_tokens: int, n_seq: int,
               encoding: str = "raw") -> dict:
    d = {str(k): str(v) for k, v in meta.extra.items()}
    d.update(
        format=FORMAT,
        format_version=str(FORMAT_VERSION),
        num_experts=str(meta.num_experts),
        top_k=str(meta.top_k),
        num_hidden_layers=str(meta.num_hidden_layers),
        moe_layer_ids=json.dumps([int(i) for i in meta.moe_layer_ids]),
        layer_index=meta.layer_index,
        model_name=meta.model_name or "",
        empty_value=str(UINT8_EMPTY if dt == np.uint8 and encoding == "raw" else -1),
        indices_encoding=encoding,
        indices_shape=json.dumps([n_tokens, meta.num_layers, meta.top_k]),
        num_tokens=str(n_tokens),
        num_sequences=str(n_seq),
        checksum=_DIGEST_PLACEHOLDER,
        header_checksum=_DIGEST_PLACEHOLDER,
    )
    return d


def _header(meta_d: dict, dt: np.dtype, n_tokens: int, L: int, K: int, n_cu: int,
            codec_bytes: int | None = None) -> dict:
    cu_bytes = 8 * n_cu
    if codec_bytes is not None:
        return {
            "__metadata__": meta_d,
            "cu_seqlens": {"dtype": "I64", "shape": [n_cu], "data_offsets": [0, cu_bytes]},
            _CODEC_TENSOR: {"dtype": "U8", "shape": [codec_bytes],
                            "data_offsets": [cu_bytes, cu_bytes + codec_bytes]},
        }
    idx_bytes = n_tokens * L * K * dt.itemsize
    return {
        "__metadata__": meta_d,
        "cu_seqlens": {"dtype": "I64", "shape": [n_cu], "data_offsets": [0, cu_bytes]},
        "indices": {"dtype": _ST_NAMES[dt], "shape": [n_tokens, L, K],
                    "data_offsets": [cu_bytes, cu_bytes + idx_bytes]},
    }


def header_digest(header: dict) -> str:
    """The sha256 of a header (its JSON with sorted keys and no spaces), header_checksum
    itself left out."""
    md = {k: v for k, v in header["__metadata__"].items() if k != "header_checksum"}
    canon = json.dumps(dict(header, __metadata__=md), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()


def _header_bytes(header: dict) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _chunks(buf: memoryview) -> Iterator[memoryview]:
    for i in range(0, len(buf), _CHUNK_BYTES):
        yield buf[i:i + _CHUNK_BYTES]


@contextlib.contextmanager
def _locked(path) -> Iterator[None]:
    """Advisory exclusive lock (flock of a sibling .lock file) held by every writer and
    appender of `path` across its read-modify-write, so that none of them replaces a file
    another wrote meanwhile. It serialises processes and threads (each holds its own
    descriptor) on one host, and hosts on a filesystem whose flock is cluster-wide (NFS:
    Linux maps it to a POSIX lock on the server)."""
    import fcntl

    path = os.fspath(path)
    lock = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _write(path, meta: RecordMeta, cu: np.ndarray, parts: Sequence[np.ndarray], L: int,
           codec_blob: bytes | None = None) -> None:
    """Stream the header, cu_seqlens and the index parts (or the codec blob) into an atomic
    temp file; the checksums (fixed width) are filled into the header at the end."""
    if codec_blob is not None:
        dt = np.dtype(np.uint8)
        n_tokens = int(cu[-1])
        parts = [np.frombuffer(codec_blob, dtype=np.uint8)]
        md = _meta_dict(meta, dt, n_tokens, cu.size - 1, "codec")
        header = _header(md, dt, n_tokens, L, meta.top_k, cu.size, len(codec_blob))
    else:
        dt = index_dtype(meta.num_experts)
        n_tokens = int(sum(p.shape[0] for p in parts))
        md = _meta_dict(meta, dt, n_tokens, cu.size - 1)
        header = _header(md, dt, n_tokens, L, meta.top_k, cu.size)
    size = len(_header_bytes(header))
    h = hashlib.sha256()
    with atomic_target(path) as tmp:
        with open(tmp, "r+b") as f:
            f.write(_header_bytes(header))
            cu_b = memoryview(np.ascontiguousarray(cu, dtype="<i8")).cast("B")
            h.update(cu_b)
            f.write(cu_b)
            for p in parts:
                if p.dtype != dt:
                    raise RuntimeError(f"record file part has dtype {p.dtype}, expected {dt}")
                for c in _chunks(memoryview(np.ascontiguousarray(p)).cast("B")):
                    h.update(c)
                    f.write(c)
                    if _chunk_hook is not None:
                        _chunk_hook()
            md["checksum"] = "sha256:" + h.hexdigest()
            md["header_checksum"] = header_digest(header)
            final = _header_bytes(header)
            if len(final) != size:  # the checksums have a fixed width
                raise RuntimeError("record file header changed size while writing")
            f.seek(0)
            f.write(final)


def _signed(arr: np.ndarray) -> np.ndarray:
    """Stored ids (uint8 with 255 = empty, or int16) as int16 with -1 = empty."""
    if arr.dtype == np.uint8:
        out = arr.astype(np.int16)
        out[arr == UINT8_EMPTY] = -1
        return out
    return arr


def _check_encoding(encoding: str, level: int) -> None:
    if encoding not in ENCODINGS:
        raise ValueError(f"record file: encoding must be one of {ENCODINGS}, got {encoding!r}")
    if isinstance(level, bool) or not isinstance(level, int):
        raise ValueError(f"record file: level must be a zstd level (int), got {level!r}")


def _codec_blob(ids: np.ndarray, meta: RecordMeta, cu: np.ndarray, level: int) -> bytes:
    from . import codec

    return codec.encode(ids, num_experts=meta.num_experts, order="keep", level=level,
                        seq_lens=np.diff(cu))


def write_routing(path, indices: torch.Tensor, meta: RecordMeta, *, cu_seqlens=None,
                  encoding: str = "codec", level: int = 3) -> None:
    """Write [N, L, K] routing (-1 = empty) with its sequence boundaries, atomically,
    replacing any existing file. `encoding="codec"` (default) stores the ids as one
    `codec` blob (exact, order kept; zstd `level`); `"raw"` stores them uncompressed in the
    smallest integer type, read back as views of the bytes read (no decoding). Writers and
    appenders of one path take the same lock (`_locked`), so a write is never lost to an
    append that read the file before it. A symbolic link is followed (the file it points
    to is replaced, the link stays); anything at the path but a regular file is refused."""
    _check_encoding(encoding, level)
    path = _write_target(path)
    with _locked(path):
        _write_routing(path, indices, meta, cu_seqlens, encoding, level)


def _write_target(path) -> str:
    """The file a write or append goes to: `path` with its symbolic links resolved, once,
    so the lock, the temporary file and the rename all name the same file (a link is not
    replaced by a regular file, which would part the two names and lose each one's
    appends to the other). What is there must be a regular file, or nothing."""
    real = os.path.realpath(os.fspath(path))
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return real
    if not stat.S_ISREG(st.st_mode):
        raise RoutingFileError(real, f"not a regular file ({_file_kind(st.st_mode)}); a record "
                                     f"file is written over a regular file or none")
    return real


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return f"file type {stat.S_IFMT(mode):#o}"


def _write_routing(path, indices, meta: RecordMeta, cu_seqlens, encoding: str,
                   level: int) -> None:
    arr = _encode(indices, meta, path)
    cu = _check_cu_seqlens(cu_seqlens, arr.shape[0], path)
    if encoding == "codec":
        _write(path, meta, cu, [], meta.num_layers,
               codec_blob=_codec_blob(_signed(arr), meta, cu, level))
    else:
        _write(path, meta, cu, [arr], meta.num_layers)


def append_routing(path, indices: torch.Tensor, meta: RecordMeta, *, cu_seqlens=None,
                   encoding: str = "codec", level: int = 3) -> None:
    """Add a batch of sequences after those already in `path` (created if missing).
    The existing file is verified and must have the same model metadata; it is copied,
    never modified in place, so a crash leaves it as it was. The new file has `encoding`
    (a codec file appended to stays a codec file: its chunks are copied, not re-encoded).
    The metadata keys the writer does not own (`RecordMeta.extra` of the file) are kept,
    with `meta.extra` added over them. A symbolic link is followed, as by `write_routing`."""
    _check_encoding(encoding, level)
    path = _write_target(path)
    with _locked(path):
        if not os.path.exists(path):
            _write_routing(path, indices, meta, cu_seqlens, encoding, level)
            return
        # read once into memory and verified: the copy written below is the one verified
        old = open_routing(path, verify=True)
        old.check_model(num_experts=meta.num_experts, top_k=meta.top_k,
                        moe_layer_ids=meta.moe_layer_ids,
                        num_hidden_layers=meta.num_hidden_layers,
                        model_name=meta.model_name or None, layer_index=meta.layer_index)
        arr = _encode(indices, meta, path, offset=old.num_tokens)
        cu_new = _check_cu_seqlens(cu_seqlens, arr.shape[0], path)
        cu = np.concatenate([old.cu_seqlens_np, cu_new[1:] + old.num_tokens])
        out = RecordMeta(shape=old.meta.shape, layer_index=old.meta.layer_index,
                         model_name=old.meta.model_name,
                         extra={**old.meta.extra, **meta.extra})
        if encoding == "codec" and old.encoding == "codec":
            from . import codec

            blob = codec.append(old.raw_np, _signed(arr),
                                seq_lens=np.diff(cu_new), level=level,
                                **old._limits(int(cu[-1])))
            _write(path, out, cu, [], meta.num_layers, codec_blob=blob)
        elif encoding == "codec":
            ids = np.concatenate([old.indices().numpy(), _signed(arr)])
            _write(path, out, cu, [], meta.num_layers,
                   codec_blob=_codec_blob(ids, old.meta, cu, level))
        elif old.encoding == "raw":
            _write(path, out, cu, [old.raw_np, arr], meta.num_layers)
        else:
            dt = index_dtype(meta.num_experts)
            prev = old.indices().numpy()
            if dt == np.uint8:
                prev = np.where(prev < 0, UINT8_EMPTY, prev).astype(np.uint8)
            _write(path, out, cu, [prev.astype(dt), arr], meta.num_layers)
        del old


# ---------------------------------------------------------------------------- reading
class _Snapshot:
    """One open descriptor of a record file. Every step of a read (the size, the header,
    the data, the checksum) takes its bytes from it, so a concurrent `os.replace` of the
    path is invisible: the descriptor keeps the file it opened. It is opened without
    blocking and must be a regular file (opening a FIFO would wait for a writer forever;
    a device or a directory is no record file)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "router replay file does not exist",
                                    path) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise RoutingFileError(path, f"not a regular file ({_file_kind(st.st_mode)}); a "
                                         f"record file is read from a regular file")
        # O_NONBLOCK has no effect on a regular file's reads
        self.file = os.fdopen(fd, "rb", buffering=0)
        self.size = st.st_size

    def read(self, offset: int, n: int) -> bytes:
        return os.pread(self.file.fileno(), n, offset)

    def load(self, offset: int, n: int) -> np.ndarray:
        """Bytes offset:offset+n, read into private memory (uint8 [n]): what the checksum is
        computed over and what every tensor views, whatever happens to the file later. A
        file that is shorter now than when it was opened (truncated in place) is an
        error."""
        try:
            buf = np.empty(n, np.uint8)
        except MemoryError:
            raise RoutingFileError(self.path, f"the {n} data bytes cannot be read into "
                                              f"memory") from None
        view, got = memoryview(buf), 0
        while got < n:
            k = os.preadv(self.file.fileno(), [view[got:got + _READ_BYTES]], offset + got)
            if k == 0:
                raise RoutingFileError(self.path, f"truncated while being read: {got} of the "
                                                  f"{n} data bytes it had when opened are "
                                                  f"there (rewritten or truncated in place by "
                                                  f"another process?)")
            got += k
        return buf

    def map(self, offset: int, dtype: np.dtype, shape: tuple) -> np.ndarray:
        # mode "c": a private (copy-on-write) map, so torch gets a writable array and
        # nothing can ever write back to the file
        return np.memmap(self.file, mode="c", dtype=dtype, offset=offset, shape=shape)

    def close(self) -> None:
        self.file.close()


def _read_header(snap: _Snapshot) -> tuple[dict, int]:
    """(the parsed header, the offset where the data starts)."""
    path, size = snap.path, snap.size
    head = snap.read(0, 8)
    if len(head) < 8:
        raise RoutingFileError(path, f"truncated: {size} bytes, shorter than the 8-byte "
                                     f"header length field")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
        raise RoutingFileError(path, f"corrupt: header length field says {n} bytes; not a "
                                     f"safetensors record file")
    if 8 + n > size:
        raise RoutingFileError(path, f"truncated: the header needs {n} bytes but the file "
                                     f"has only {size - 8} after the length field")
    try:
        header = json.loads(snap.read(8, n).decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError...
        raise RoutingFileError(path, f"corrupt header (not valid JSON): "
                                     f"{type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise RoutingFileError(path, "corrupt header: not a JSON object")
    return header, 8 + n


def _check_header(path: str, header: dict) -> dict:
    """The metadata of a record file header, after the format, the version and (version 2)
    the header's own checksum are checked."""
    md = header.get("__metadata__")
    if not isinstance(md, dict):
        raise RoutingFileError(path, "not a router replay record file (a safetensors header "
                                     "with no __metadata__)")
    if md.get("format") != FORMAT:
        raise RoutingFileError(path, f"not a router replay record file (format="
                                     f"{md.get('format')!r}, expected {FORMAT!r})")
    version = md.get("format_version")
    if version not in READABLE_VERSIONS:
        raise RoutingFileError(path, f"format_version {version!r} is not supported; this "
                                     f"reader reads versions {', '.join(READABLE_VERSIONS)}")
    if version == "1":
        missing = [k for k in V1_KEYS if k not in md]
        if missing:
            raise RoutingFileError(path, f"corrupt header: format_version 1 metadata keys "
                                         f"{missing} are missing (version 1 headers carry no "
                                         f"checksum of their own, so a damaged one shows only "
                                         f"as missing keys)")
    else:
        stored = md.get("header_checksum")
        try:
            got = header_digest(header)
        except (ValueError, TypeError, RecursionError) as e:
            raise RoutingFileError(path, f"corrupt header: {type(e).__name__}: "
                                         f"{str(e)[:200]}") from None
        if stored != got:
            raise RoutingFileError(path, f"header checksum mismatch: the header says "
                                         f"{stored!r} but hashes to {got!r}; the header is "
                                         f"corrupt")
    if version == "3" and md.get("indices_encoding") not in ENCODINGS:
        raise RoutingFileError(path, f"corrupt header: indices_encoding "
                                     f"{md.get('indices_encoding')!r} is not one of {ENCODINGS}")
    return md


def _encoding(md: dict) -> str:
    return md.get("indices_encoding", "raw") if md.get("format_version") == "3" else "raw"


def _check_layout(path: str, header: dict, data_len: int) -> None:
    """The two tensors are described consistently and fill the data buffer exactly."""
    data_name = _CODEC_TENSOR if _encoding(header["__metadata__"]) == "codec" else "indices"
    data_dts = ("U8",) if data_name == _CODEC_TENSOR else ("U8", "I16")
    for name, dts in (("cu_seqlens", ("I64",)), (data_name, data_dts)):
        info = header.get(name)
        if not isinstance(info, dict) or info.get("dtype") not in dts:
            raise RoutingFileError(path, f"corrupt header: tensor {name!r} missing or not of "
                                         f"dtype {dts}")
    end = 0
    for name in ("cu_seqlens", data_name):
        info = header[name]
        shape, offs = info.get("shape"), info.get("data_offsets")
        ndim = 3 if name == "indices" else 1
        if (not isinstance(shape, list) or not isinstance(offs, list) or len(offs) != 2
                or len(shape) != ndim or any(isinstance(v, bool) or not isinstance(v, int)
                                             or v < 0 for v in shape + offs)):
            raise RoutingFileError(path, f"corrupt header: bad shape/offsets for {name!r} "
                                         f"(shape {_short(shape)}, data_offsets {_short(offs)})")
        itemsize = np.dtype(_ST_DTYPES[info["dtype"]]).itemsize
        if offs[0] != end or offs[1] - offs[0] != math.prod(shape) * itemsize:
            raise RoutingFileError(path, f"corrupt header: offsets {offs} of {name!r} do not "
                                         f"match its shape {shape}")
        end = offs[1]
    if data_len < end:
        raise RoutingFileError(path, f"truncated: the header describes {end} data bytes but "
                                     f"only {data_len} are present")
    if data_len > end:
        raise RoutingFileError(path, f"corrupt: {data_len - end} unexpected bytes after the "
                                     f"data")


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 200 else s[:200] + "..."


def _meta_str(path: str, md: dict, key: str) -> str:
    if key not in md:
        raise RoutingFileError(path, f"corrupt header: metadata key {key!r} is missing")
    v = md[key]
    if not isinstance(v, str):
        raise RoutingFileError(path, f"corrupt header: metadata {key} is {_short(v)}, not a "
                                     f"string")
    return v


def _meta_int(path: str, md: dict, key: str, lo: int, hi: int) -> int:
    v = _meta_str(path, md, key)
    if not re.fullmatch(r"[0-9]{1,10}", v) or not lo <= int(v) <= hi:
        raise RoutingFileError(path, f"corrupt header: metadata {key}={_short(v)} is not an "
                                     f"integer in {lo}..{hi}")
    return int(v)


def _meta_json(path: str, md: dict, key: str):
    v = _meta_str(path, md, key)
    try:
        return json.loads(v)
    except (ValueError, RecursionError) as e:
        raise RoutingFileError(path, f"corrupt header: metadata {key} is not valid JSON "
                                     f"({type(e).__name__}: {str(e)[:100]})") from None


def _int_list(path: str, key: str, v, n: int | None, hi: int) -> list[int]:
    if (not isinstance(v, list) or (n is not None and len(v) != n) or len(v) > MAX_LAYERS
            or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= hi
                   for i in v)):
        raise RoutingFileError(path, f"corrupt header: metadata {key}={_short(v)} is not a "
                                     f"list of {'' if n is None else f'{n} '}integers in "
                                     f"0..{hi}")
    return v


def _parse_meta(path: str, md: dict) -> RecordMeta:
    """The model metadata, every field checked (type, range, bounds far beyond any real
    model: at most 32767 experts, MAX_TOP_K, MAX_LAYERS) before anything is built from it;
    RoutingFileError names the field. The keys the writer does not own are `extra`
    (strings, as safetensors metadata is)."""
    E = _meta_int(path, md, "num_experts", 1, np.iinfo(np.int16).max)
    K = _meta_int(path, md, "top_k", 1, min(E, MAX_TOP_K))
    H = _meta_int(path, md, "num_hidden_layers", 1, MAX_LAYERS)
    ids = _int_list(path, "moe_layer_ids", _meta_json(path, md, "moe_layer_ids"), None, H - 1)
    layer_index = _meta_str(path, md, "layer_index")
    if layer_index not in ("moe", "absolute"):
        raise RoutingFileError(path, f"corrupt header: metadata layer_index={_short(layer_index)}"
                                     f" is not 'moe' or 'absolute'")
    extra = {k: _meta_str(path, md, k) for k in md if k not in OWNED_KEYS}
    try:
        return RecordMeta(num_experts=E, top_k=K, moe_layer_ids=ids, num_hidden_layers=H,
                          layer_index=layer_index, model_name=_meta_str(path, md, "model_name"),
                          extra=extra)
    except ValueError as e:
        raise RoutingFileError(path, f"corrupt header metadata: {e}") from None


class RoutingFile:
    """An opened record file. The arrays view the file's data as `open_routing` read it,
    once, into private memory from the one descriptor it opened (with `mmap=True`: a
    private memory map of that descriptor, read lazily)."""

    def __init__(self, snap: _Snapshot, header: dict, data_start: int,
                 mmap: bool = False) -> None:
        self.path = snap.path
        md = header["__metadata__"]
        self.metadata = dict(md)
        self.format_version = int(md["format_version"])
        self.meta = _parse_meta(self.path, md)
        self.data_start = data_start
        self.file_size = snap.size
        self._header = header
        self.encoding = _encoding(md)
        self.mapped = mmap
        data_name = _CODEC_TENSOR if self.encoding == "codec" else "indices"
        self._data = None if mmap else snap.load(
            data_start, header[data_name]["data_offsets"][1])
        self.cu_seqlens_np = self._map(snap, header["cu_seqlens"])
        # the stored data: [N, L, K] ids ("raw"), or the bytes of the codec blob ("codec")
        self.raw_np = self._map(snap, header[data_name])
        self._decoded = None
        if self.encoding == "codec":
            shape = _meta_json(self.path, md, "indices_shape")
            if (not isinstance(shape, list) or len(shape) != 3
                    or any(isinstance(v, bool) or not isinstance(v, int) or v < 0
                           for v in shape)):
                raise RoutingFileError(self.path, f"corrupt header: metadata indices_shape "
                                                  f"{_short(shape)} is not [N, L, K]")
            self.shape = tuple(shape)
            # the type raw() returns: that of a raw file of the same model (uint8 for at
            # most 255 experts, 255 = empty), whichever encoding stored the ids
            self.dtype = index_dtype(self.meta.num_experts)
        else:
            self.shape = tuple(self.raw_np.shape)
            self.dtype = self.raw_np.dtype
        self.empty_value = UINT8_EMPTY if self.dtype == np.uint8 else -1

    def _map(self, snap: _Snapshot, info) -> np.ndarray:
        dt = np.dtype(_ST_DTYPES[info["dtype"]]).newbyteorder("<")
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        if end == begin:
            return np.zeros(shape, dtype=dt)
        if self._data is None:
            return snap.map(self.data_start + begin, dt, shape)
        return self._data[begin:end].view(dt).reshape(shape)  # no copy

    # -- views
    @property
    def num_tokens(self) -> int:
        return int(self.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens_np.shape[0] - 1)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.from_numpy(np.array(self.cu_seqlens_np))

    def raw(self) -> torch.Tensor:
        """The stored indices as a tensor viewing the data read (uint8 or int16); for a
        codec file, the decoded indices in the same type, with the same empty value
        (`dtype`, `empty_value`)."""
        if self.encoding == "codec":
            out = self._decode_all()
            if self.dtype == np.uint8:
                return torch.where(out < 0, UINT8_EMPTY, out).to(torch.uint8)
            return out
        return torch.from_numpy(self.raw_np)

    def _limits(self, n: int) -> dict:
        """The codec's limits for decoding n tokens of this file (from its metadata)."""
        return {"max_tokens": n, "max_bytes": n * self.shape[1] * self.shape[2] * 2}

    def _empty(self, n: int) -> torch.Tensor:
        """The int16 [n, L, K] output of a decode, allocated here, so that a size no memory
        holds is this file's error."""
        shape = (n,) + tuple(self.shape[1:])
        try:
            return torch.empty(shape, dtype=torch.int16)
        except (RuntimeError, MemoryError) as e:
            raise RoutingFileError(self.path, f"indices_shape {list(self.shape)}: {shape} int16 "
                                              f"({math.prod(shape) * 2} bytes) cannot be "
                                              f"allocated: {str(e)[:200]}") from None

    def _codec_error(self, e) -> RoutingFileError:
        return RoutingFileError(self.path, f"corrupt indices_codec data: {e}")

    def _decode_all(self) -> torch.Tensor:
        from . import codec

        if self._decoded is None:
            out = self._empty(self.num_tokens)
            try:
                self._decoded = codec.decode(memoryview(self.raw_np), out=out,
                                             **self._limits(self.num_tokens))
            except codec.CodecError as e:
                raise self._codec_error(e) from None
        return self._decoded

    def indices(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tokens start:stop as [n, L, K] int16 with -1 = empty. For raw int16 files this is
        a view of the data read (no copy); uint8 files decode the requested slice."""
        stop = self.num_tokens if stop is None else stop
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"router replay file {self.path!r}: token range {start}:{stop} is "
                             f"outside 0:{self.num_tokens}")
        if self.encoding == "codec":
            return self._decode_all()[start:stop]
        part = self.raw()[start:stop]
        if self.dtype == np.uint8:
            out = part.to(torch.int16)
            return out.masked_fill_(part == UINT8_EMPTY, -1)
        return part

    def sequence(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.num_sequences:
            raise IndexError(f"router replay file {self.path!r}: sequence {i} is outside "
                             f"0..{self.num_sequences - 1}")
        cu = self.cu_seqlens_np
        if self.encoding == "codec" and self._decoded is None:
            from . import codec

            n = int(cu[i + 1] - cu[i])
            out = self._empty(n)
            try:  # only the chunks that hold sequence i (the limits are the whole blob's)
                return codec.decode_sequence(memoryview(self.raw_np), i, out=out,
                                             **self._limits(self.num_tokens))
            except codec.CodecError as e:
                raise self._codec_error(e) from None
        return self.indices(int(cu[i]), int(cu[i + 1]))

    def batch(self, shape: ModelShape | None = None, *,
              sequences: tuple[int, int] | None = None, model_name: str | None = None,
              check: bool = True):
        """The file's routing as a `ReplayBatch` (THD: `[N, L, K]` int16, -1 = empty, the
        file's `cu_seqlens` and `layer_index`), checked against `shape`, the model it is
        replayed into (default: the shape the file records, for a caller that compares it
        later: a sink of another shape refuses the batch, naming the difference).

        The file's shape is compared with `shape` first (`check_model`): a file recorded
        for another model, MoE layer ids included, raises RoutingShapeError naming each
        difference. `sequences=(b0, b1)`: only sequences b0..b1-1. `replay_mask` is False
        for a token with no route in any MoE layer; a token with a route in some MoE layers
        and not in others is refused. Then the values are scanned once (`ReplayBatch.check`:
        expert ids in range, no repeats) unless `check=False` (a batch that the sink
        checks). Raw int16 files give views of the data read, without a copy."""
        from .adapters.batch import ReplayBatch

        if shape is None:
            shape = self.meta.shape
        self.check_model(num_experts=shape.num_experts, top_k=shape.top_k,
                         moe_layer_ids=shape.moe_layer_ids,
                         num_hidden_layers=shape.num_hidden_layers, model_name=model_name)
        b0, b1 = (0, self.num_sequences) if sequences is None else \
            (int(v) for v in sequences)
        if not 0 <= b0 <= b1 <= self.num_sequences:
            raise IndexError(f"router replay file {self.path!r}: sequences=({b0}, {b1}) is "
                             f"outside the file's {self.num_sequences} sequences")
        cu = torch.from_numpy(np.array(self.cu_seqlens_np[b0:b1 + 1], dtype=np.int64))
        start, stop = int(cu[0]), int(cu[-1])
        cu -= start
        idx = self.indices(start, stop)
        mapping = self.meta.layer_index
        moe = idx if mapping == "moe" else idx[:, shape.columns(mapping), :]
        empty = (moe < 0).all(dim=2)  # [n, L_moe]
        none = empty.all(dim=1)
        partial = empty.any(dim=1) & ~none
        if bool(partial.any()):
            t = int(partial.nonzero()[0, 0])
            layers = [shape.moe_layer_ids[j] for j in empty[t].nonzero().flatten().tolist()]
            raise RoutingFileError(
                self.path, f"token {start + t} has no route (every slot -1) in MoE layers "
                f"{layers} but routes in the other MoE layers; a token is routed in every MoE "
                f"layer or in none")
        batch = ReplayBatch(idx, ~none, cu, [mapping] * (b1 - b0), mapping)
        if not check:
            return batch
        return batch.check(shape, who="cannot be replayed",
                           error=lambda msg: RoutingFileError(self.path, msg))

    def replay_mask(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """[n] bool: False for tokens with no route (all slots empty in every layer)."""
        idx = self.indices(start, stop)
        return (idx >= 0).flatten(1).any(dim=1)

    # -- checks
    def verify(self) -> None:
        """Recompute the sha256 of the data buffer: the bytes read when the file was opened,
        which are the bytes every tensor views (with `mmap=True`: the file's bytes now)."""
        stored = self.metadata.get("checksum", "")
        h = hashlib.sha256()
        for arr in (self.cu_seqlens_np, self.raw_np):
            for c in _chunks(memoryview(np.ascontiguousarray(arr)).cast("B")):
                h.update(c)
        got = "sha256:" + h.hexdigest()
        if got != stored:
            raise RoutingFileError(
                self.path, f"checksum mismatch: the header says {stored!r} but the data hashes "
                f"to {got!r}; the file is corrupt"
            )

    def check_routes(self) -> None:
        """Decode every token (a codec file: every chunk, each against the checksum of its
        content) and check every route as `write_routing` does: expert ids in range, no
        expert twice in a token's layer. RoutingFileError names the token. What
        `python -m replay_ops.router_replay verify` runs after the checksums."""
        idx = self.indices()
        bad = first_bad_route(idx, self.meta.num_experts)
        if bad is None:
            return
        m = self.meta
        lid = m.shape.layer_ids(m.layer_index)[bad.layer]
        what = (f"routes to expert {bad.value}, out of range for num_experts={m.num_experts}"
                if bad.kind == "range" else f"repeats an expert: {bad.row}")
        raise RoutingFileError(self.path, f"token {bad.token}, layer {lid} (slot {bad.slot}) "
                                          f"{what}; not a routing this package writes")

    def check_consistency(self) -> None:
        """The tensors agree with the metadata: shapes, dtype, sequence boundaries, counts
        (for a codec file: the blob's own headers, its chunk checksums included)."""
        shape, m, md = list(self.shape), self.meta, self.metadata
        if len(shape) != 3 or shape[1] != m.num_layers or shape[2] != m.top_k:
            raise RoutingFileError(self.path, f"corrupt: indices shape {shape} does not match "
                                              f"the metadata (L={m.num_layers}, K={m.top_k})")
        if self.encoding == "codec":
            self._check_codec(shape)
        elif self.dtype != index_dtype(m.num_experts):
            raise RoutingFileError(self.path, f"corrupt: indices dtype {self.dtype} does not "
                                              f"match num_experts={m.num_experts}")
        cu = self.cu_seqlens_np
        if cu.shape[0] < 1 or cu[0] != 0 or cu[-1] != shape[0] or np.any(np.diff(cu) < 0):
            raise RoutingFileError(self.path, f"corrupt: cu_seqlens {cu.tolist()[:8]} do not "
                                              f"run from 0 to N={shape[0]}")
        for key, want in (("num_tokens", shape[0]), ("num_sequences", cu.shape[0] - 1)):
            if md.get(key) != str(want):
                raise RoutingFileError(self.path, f"corrupt: metadata {key}={md.get(key)!r} but "
                                                  f"the tensors hold {want}")

    def _check_codec(self, shape) -> None:
        from . import codec

        try:
            inf = codec.info(memoryview(self.raw_np), verify_payload=True,
                             **self._limits(self.num_tokens))
        except codec.CodecError as e:
            raise self._codec_error(e) from None
        m, cu = self.meta, self.cu_seqlens_np
        got = (inf.order, inf.num_experts, inf.num_layers, inf.top_k, inf.num_tokens,
               list(inf.seq_lens))
        want = ("keep", m.num_experts, shape[1], shape[2], shape[0], np.diff(cu).tolist())
        if got != want or inf.has_token_ids:
            raise RoutingFileError(self.path, f"corrupt: the indices_codec blob holds (order, "
                                              f"E, L, K, tokens, seq_lens) = {got}, the header "
                                              f"says {want}")

    def check_model(
        self,
        *,
        num_experts: int,
        top_k: int,
        moe_layer_ids: Sequence[int],
        num_hidden_layers: int | None = None,
        model_name: str | None = None,
        layer_index: str | None = None,
    ) -> None:
        """Raise RoutingShapeError if the file was recorded for a different model."""
        m = self.meta
        problems = []
        if m.num_experts != num_experts:
            problems.append(f"num_experts: file {m.num_experts}, model {num_experts}")
        if m.top_k != top_k:
            problems.append(f"top_k: file {m.top_k}, model {top_k}")
        if list(m.moe_layer_ids) != [int(i) for i in moe_layer_ids]:
            problems.append(f"moe_layer_ids: file {m.moe_layer_ids}, model {list(moe_layer_ids)}")
        if num_hidden_layers is not None and m.num_hidden_layers != num_hidden_layers:
            problems.append(
                f"num_hidden_layers: file {m.num_hidden_layers}, model {num_hidden_layers}")
        if model_name and m.model_name and m.model_name != model_name:
            problems.append(f"model_name: file {m.model_name!r}, model {model_name!r}")
        if layer_index is not None and m.layer_index != layer_index:
            problems.append(f"layer_index: file {m.layer_index!r}, given {layer_index!r}")
        if problems:
            raise RoutingShapeError(
                self.path, "recorded for a different model shape: " + "; ".join(problems))

    def __repr__(self) -> str:
        m = self.meta
        return (f"RoutingFile({self.path!r}, tokens={self.num_tokens}, "
                f"sequences={self.num_sequences}, L={m.num_layers} ({m.layer_index}), "
                f"K={m.top_k}, E={m.num_experts}, dtype={self.dtype})")


def open_routing(path, *, verify: bool = True, mmap: bool = False) -> RoutingFile:
    """Open a record file: its data is read once into private memory, and that copy is
    what is verified and used. Raises FileNotFoundError, or RoutingFileError naming the file
    and the problem: not a regular file (a FIFO, a device: refused without waiting),
    truncated (also while being read), corrupt header, header checksum mismatch, not a
    record file, unsupported format_version, inconsistent shapes, data checksum mismatch
    (`verify=True`). The whole read comes from one descriptor: a file replaced meanwhile is
    never mixed into the result, and one rewritten or truncated in place afterwards changes
    nothing that was read.

    `mmap=True` (with `verify=False` only): map the data lazily instead, for a file too
    large to read whole. Nothing protects that reader from a process that rewrites the file
    in place (it sees the new bytes), and a truncation kills it with SIGBUS."""
    if mmap and verify:
        raise ValueError("open_routing: mmap=True maps the file lazily, so its checksum could "
                         "not cover the bytes used later; pass verify=False with it (or read "
                         "the file into memory, the default)")
    snap = _Snapshot(os.fspath(path))
    try:
        header, data_start = _read_header(snap)
        _check_header(snap.path, header)
        _check_layout(snap.path, header, snap.size - data_start)
        rf = RoutingFile(snap, header, data_start, mmap=mmap)
    finally:
        snap.close()  # the data is read (or the maps keep what they need)
    if verify:
        rf.verify()
    rf.check_consistency()
    return rf


def read_routing(path, *, verify: bool = True) -> tuple[torch.Tensor, torch.Tensor, RecordMeta]:
    """(indices [N, L, K] int16 with -1 = empty, cu_seqlens int64 [B+1], meta)."""
    rf = open_routing(path, verify=verify)
    return rf.indices(), rf.cu_seqlens, rf.meta


__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "RecordMeta",
    "RoutingFile",
    "RoutingFileError",
    "RoutingShapeError",
    "append_routing",
    "header_digest",
    "index_dtype",
    "open_routing",
    "read_routing",
    "write_routing",
]
