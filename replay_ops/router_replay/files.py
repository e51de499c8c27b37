"""Record files: recorded routing on disk, in the safetensors container.

A record file is a plain safetensors file (readable by `safetensors.safe_open`) with two
tensors and string metadata:

    cu_seqlens  int64 [B + 1]      sequence boundaries: sequence b is tokens
                                   cu_seqlens[b]:cu_seqlens[b+1]; cu_seqlens[0] = 0,
                                   cu_seqlens[B] = N, non-decreasing
    indices     uint8 | int16 [N, L, K]
                                   expert ids per token, layer and slot, in the smallest
                                   type that holds E: uint8 when E <= 255 (empty slot =
                                   255), else int16 (E <= 32767, empty slot = -1)

    __metadata__ (all strings):
      format          "replay_ops.router_replay"
      format_version  "1"
      num_experts, top_k, num_hidden_layers, num_tokens, num_sequences
      moe_layer_ids   JSON list of the absolute ids of the MoE layers
      layer_index     "moe" (L = number of MoE layers, in moe_layer_ids order) or
                      "absolute" (L = num_hidden_layers, indexed by absolute layer id)
      model_name      free text ("" if unknown)
      empty_value     "255" or "-1"
      checksum        "sha256:<hex>" of every byte after the header (the data buffer)

Writes go to a temporary file in the same directory, are fsynced, then renamed over the
target (`os.replace`), so a reader sees the old file or the new one, never a partial
one; a writer killed mid-write leaves the previous file intact. Appending copies the old
data into the new temporary file in chunks (the old file is memory-mapped, never loaded
whole) under an advisory lock, after verifying the old file's checksum.

Reading memory-maps the data: `open_routing` parses the header, checks sizes and (by
default) the checksum by streaming over the map, and returns tensors that view the map.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

FORMAT = "replay_ops.router_replay"
FORMAT_VERSION = 1
MAX_HEADER_BYTES = 100 * 1024 * 1024
UINT8_EMPTY = 255
_CHUNK_BYTES = 1 << 20  # copy/hash granularity
_chunk_hook = None  # called after each data chunk is written (tests: kill mid-write)

_ST_DTYPES = {"U8": np.uint8, "I16": np.int16, "I64": np.int64}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


class RoutingFileError(ValueError):
    """A record file that cannot be used: truncated, corrupt, wrong checksum, wrong
    version, or recorded for a different model shape. The message names the file."""

    def __init__(self, path, problem: str) -> None:
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"router replay file {self.path!r}: {problem}")


class RoutingShapeError(RoutingFileError):
    """The file was recorded for a different model shape (experts, top-k, layers)."""


@dataclass
class RecordMeta:
    num_experts: int
    top_k: int
    moe_layer_ids: list[int]
    num_hidden_layers: int
    layer_index: str = "moe"
    model_name: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        """L of the stored [N, L, K] indices."""
        return len(self.moe_layer_ids) if self.layer_index == "moe" else self.num_hidden_layers

    def check(self) -> None:
        if self.layer_index not in ("moe", "absolute"):
            raise ValueError(f"RecordMeta: layer_index must be 'moe' or 'absolute', got "
                             f"{self.layer_index!r}")
        if self.num_experts < 1 or self.top_k < 1 or self.top_k > self.num_experts:
            raise ValueError(f"RecordMeta: bad num_experts={self.num_experts} / "
                             f"top_k={self.top_k}")
        ids = list(self.moe_layer_ids)
        if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= self.num_hidden_layers:
            raise ValueError(f"RecordMeta: moe_layer_ids={ids} must be ascending distinct ids "
                             f"below num_hidden_layers={self.num_hidden_layers}")


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
    bad = (idx < -1) | (idx >= meta.num_experts)
    if bool(bad.any()):
        n, l, k = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"record file {os.fspath(path)!r}: indices[{n}, {l}, {k}] (token {n + offset}) = "
            f"{int(idx[n, l, k])} is out of range for num_experts={meta.num_experts} "
            f"(valid: 0..{meta.num_experts - 1}, -1 = empty)"
        )
    if K > 1 and N:
        s = idx.sort(dim=2).values
        dup = ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any(dim=2)
        if bool(dup.any()):
            n, l = (int(v) for v in dup.nonzero()[0])
            raise ValueError(
                f"record file {os.fspath(path)!r}: token {n + offset}, layer {l} repeats an "
                f"expert: {idx[n, l].tolist()}"
            )
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


def _meta_dict(meta: RecordMeta, dt: np.dtype, n_tokens: int, n_seq: int, checksum: str):
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
        empty_value=str(UINT8_EMPTY if dt == np.uint8 else -1),
        num_tokens=str(n_tokens),
        num_sequences=str(n_seq),
        checksum=checksum,
    )
    return d


def _header_bytes(meta_d: dict, dt: np.dtype, n_tokens: int, L: int, K: int, n_cu: int) -> bytes:
    cu_bytes = 8 * n_cu
    idx_bytes = n_tokens * L * K * dt.itemsize
    header = {
        "__metadata__": meta_d,
        "cu_seqlens": {"dtype": "I64", "shape": [n_cu], "data_offsets": [0, cu_bytes]},
        "indices": {"dtype": _ST_NAMES[dt], "shape": [n_tokens, L, K],
                    "data_offsets": [cu_bytes, cu_bytes + idx_bytes]},
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _chunks(buf: memoryview) -> Iterator[memoryview]:
    for i in range(0, len(buf), _CHUNK_BYTES):
        yield buf[i:i + _CHUNK_BYTES]


@contextlib.contextmanager
def _atomic_target(path) -> Iterator[str]:
    """A temporary file next to `path`, renamed over it on success, removed on error."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    _remove_stale_temps(d, base)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.tmp-{os.getpid()}-", dir=d)
    os.close(fd)
    # mkstemp creates 0600; give the file the mode a plain open() would (0666 & ~umask),
    # or the existing file's mode when it is replaced
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(tmp, mode)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _remove_stale_temps(d: str, base: str) -> None:
    """Temporaries left by writers that were killed (their pid no longer exists)."""
    prefix = f".{base}.tmp-"
    with contextlib.suppress(OSError):
        for name in os.listdir(d):
            if not name.startswith(prefix):
                continue
            try:
                pid = int(name[len(prefix):].split("-", 1)[0])
            except ValueError:
                continue
            if pid != os.getpid() and not _pid_alive(pid):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(d, name))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True


@contextlib.contextmanager
def _locked(path) -> Iterator[None]:
    """Advisory exclusive lock for read-modify-write appends (a sibling .lock file)."""
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


def _write(path, meta: RecordMeta, cu: np.ndarray, parts: Sequence[np.ndarray], L: int) -> None:
    """Stream the header, cu_seqlens and the index parts into an atomic temp file."""
    meta.check()
    dt = index_dtype(meta.num_experts)
    n_tokens = int(sum(p.shape[0] for p in parts))
    placeholder = "sha256:" + "0" * 64
    md = _meta_dict(meta, dt, n_tokens, cu.size - 1, placeholder)
    header = _header_bytes(md, dt, n_tokens, L, meta.top_k, cu.size)
    h = hashlib.sha256()
    with _atomic_target(path) as tmp:
        with open(tmp, "r+b") as f:
            f.write(header)
            cu_b = memoryview(np.ascontiguousarray(cu, dtype="<i8")).cast("B")
            h.update(cu_b)
            f.write(cu_b)
            for p in parts:
                if p.dtype != dt:
                    raise RuntimeError(f"record file part has dtype {p.dtype}, expected {dt}")
                buf = memoryview(np.ascontiguousarray(p)).cast("B")
                for c in _chunks(buf):
                    h.update(c)
                    f.write(c)
                    if _chunk_hook is not None:
                        _chunk_hook()
            final = "sha256:" + h.hexdigest()
            md["checksum"] = final
            header2 = _header_bytes(md, dt, n_tokens, L, meta.top_k, cu.size)
            if len(header2) != len(header):  # the checksum has a fixed width
                raise RuntimeError("record file header changed size while writing")
            f.seek(0)
            f.write(header2)
            f.flush()
            os.fsync(f.fileno())


def write_routing(path, indices: torch.Tensor, meta: RecordMeta, *, cu_seqlens=None) -> None:
    """Write [N, L, K] routing (-1 = empty) with its sequence boundaries, atomically,
    replacing any existing file."""
    meta.check()
    arr = _encode(indices, meta, path)
    cu = _check_cu_seqlens(cu_seqlens, arr.shape[0], path)
    _write(path, meta, cu, [arr], meta.num_layers)


def append_routing(path, indices: torch.Tensor, meta: RecordMeta, *, cu_seqlens=None) -> None:
    """Add a batch of sequences after those already in `path` (created if missing).
    The existing file is verified and must have the same model metadata; it is copied,
    never modified in place, so a crash leaves it as it was."""
    meta.check()
    with _locked(path):
        if not os.path.exists(path):
            write_routing(path, indices, meta, cu_seqlens=cu_seqlens)
            return
        old = open_routing(path, verify=True)
        old.check_model(num_experts=meta.num_experts, top_k=meta.top_k,
                        moe_layer_ids=meta.moe_layer_ids,
                        num_hidden_layers=meta.num_hidden_layers,
                        model_name=meta.model_name or None, layer_index=meta.layer_index)
        arr = _encode(indices, meta, path, offset=old.num_tokens)
        cu_new = _check_cu_seqlens(cu_seqlens, arr.shape[0], path)
        cu = np.concatenate([old.cu_seqlens_np, cu_new[1:] + old.num_tokens])
        _write(path, old.meta, cu, [old.raw_np, arr], meta.num_layers)
        del old


# ---------------------------------------------------------------------------- reading
class RoutingFile:
    """An opened record file. The arrays view a memory map of the file; nothing is
    read until used (except by the checksum verification)."""

    def __init__(self, path, header: dict, data_start: int, file_size: int) -> None:
        self.path = os.fspath(path)
        md = header["__metadata__"]
        self.metadata = dict(md)
        self.meta = _parse_meta(self.path, md)
        self.data_start = data_start
        self.file_size = file_size
        self._header = header
        cu_info, idx_info = header["cu_seqlens"], header["indices"]
        self.cu_seqlens_np = self._map(cu_info)
        self.raw_np = self._map(idx_info)
        self.dtype = self.raw_np.dtype
        self.empty_value = UINT8_EMPTY if self.dtype == np.uint8 else -1

    def _map(self, info) -> np.ndarray:
        dt = np.dtype(_ST_DTYPES[info["dtype"]]).newbyteorder("<")
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        if end == begin:
            return np.zeros(shape, dtype=dt)
        # mode "c": a private (copy-on-write) map, so torch gets a writable array and
        # nothing can ever write back to the file.
        return np.memmap(self.path, mode="c", dtype=dt, offset=self.data_start + begin,
                         shape=shape)

    # -- views
    @property
    def num_tokens(self) -> int:
        return int(self.raw_np.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens_np.shape[0] - 1)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.from_numpy(np.array(self.cu_seqlens_np))

    def raw(self) -> torch.Tensor:
        """The stored indices as a tensor viewing the memory map (uint8 or int16)."""
        return torch.from_numpy(self.raw_np)

    def indices(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tokens start:stop as [n, L, K] int16 with -1 = empty. For int16 files this is a
        view of the memory map (no copy); uint8 files decode the requested slice."""
        stop = self.num_tokens if stop is None else stop
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"router replay file {self.path!r}: token range {start}:{stop} is "
                             f"outside 0:{self.num_tokens}")
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
        return self.indices(int(cu[i]), int(cu[i + 1]))

    def replay_mask(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """[n] bool: False for tokens with no route (all slots empty in every layer)."""
        idx = self.indices(start, stop)
        return (idx >= 0).flatten(1).any(dim=1)

    # -- checks
    def verify(self) -> None:
        """Recompute the sha256 of the data buffer (streaming over the map)."""
        stored = self.metadata.get("checksum", "")
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            f.seek(self.data_start)
            while True:
                chunk = f.read(_CHUNK_BYTES * 8)
                if not chunk:
                    break
                h.update(chunk)
        got = "sha256:" + h.hexdigest()
        if got != stored:
            raise RoutingFileError(
                self.path, f"checksum mismatch: the header says {stored!r} but the data hashes "
                f"to {got!r}; the file is corrupt"
            )

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


def _parse_meta(path: str, md: dict) -> RecordMeta:
    def get(key):
        if key not in md:
            raise RoutingFileError(path, f"corrupt header: metadata key {key!r} is missing")
        return md[key]

    try:
        meta = RecordMeta(
            num_experts=int(get("num_experts")),
            top_k=int(get("top_k")),
            moe_layer_ids=[int(i) for i in json.loads(get("moe_layer_ids"))],
            num_hidden_layers=int(get("num_hidden_layers")),
            layer_index=get("layer_index"),
            model_name=md.get("model_name", ""),
        )
        meta.check()
    except RoutingFileError:
        raise
    except (ValueError, TypeError) as e:
        raise RoutingFileError(path, f"corrupt header metadata: {e}") from e
    return meta


def open_routing(path, *, verify: bool = True) -> RoutingFile:
    """Open a record file (memory-mapped). Raises FileNotFoundError, or
    RoutingFileError naming the file and the problem: truncated, corrupt header, not a
    record file, unsupported format_version, inconsistent shapes, checksum mismatch
    (`verify=True` streams over the data once)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "router replay file does not exist", path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
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
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RoutingFileError(path, f"corrupt header (not valid JSON): {e}") from None
    if not isinstance(header, dict):
        raise RoutingFileError(path, "corrupt header: not a JSON object")
    if not isinstance(header.get("__metadata__"), dict):
        raise RoutingFileError(path, "not a router replay record file (a safetensors header "
                                     "with no __metadata__)")
    md = header["__metadata__"]
    if md.get("format") != FORMAT:
        raise RoutingFileError(path, f"not a router replay record file (format="
                                     f"{md.get('format')!r}, expected {FORMAT!r})")
    version = md.get("format_version")
    if version != str(FORMAT_VERSION):
        raise RoutingFileError(path, f"format_version {version!r} is not supported; this "
                                     f"reader reads version {FORMAT_VERSION}")
    for name, dts in (("cu_seqlens", ("I64",)), ("indices", ("U8", "I16"))):
        info = header.get(name)
        if not isinstance(info, dict) or info.get("dtype") not in dts:
            raise RoutingFileError(path, f"corrupt header: tensor {name!r} missing or not of "
                                         f"dtype {dts}")
    data_start = 8 + n
    data_len = size - data_start
    end = 0
    for name in ("cu_seqlens", "indices"):
        info = header[name]
        shape = info.get("shape")
        offs = info.get("data_offsets")
        if (not isinstance(shape, list) or not isinstance(offs, list) or len(offs) != 2
                or any(not isinstance(v, int) or v < 0 for v in shape + offs)):
            raise RoutingFileError(path, f"corrupt header: bad shape/offsets for {name!r}")
        itemsize = np.dtype(_ST_DTYPES[info["dtype"]]).itemsize
        if offs[0] != end or offs[1] - offs[0] != int(np.prod(shape, dtype=np.int64)) * itemsize:
            raise RoutingFileError(path, f"corrupt header: offsets {offs} of {name!r} do not "
                                         f"match its shape {shape}")
        end = offs[1]
    if data_len < end:
        raise RoutingFileError(path, f"truncated: the header describes {end} data bytes but "
                                     f"only {data_len} are present")
    if data_len > end:
        raise RoutingFileError(path, f"corrupt: {data_len - end} unexpected bytes after the "
                                     f"data")
    rf = RoutingFile(path, header, data_start, size)
    shape = header["indices"]["shape"]
    m = rf.meta
    if len(shape) != 3 or shape[1] != m.num_layers or shape[2] != m.top_k:
        raise RoutingFileError(path, f"corrupt: indices shape {shape} does not match the "
                                     f"metadata (L={m.num_layers}, K={m.top_k})")
    if rf.dtype != index_dtype(m.num_experts):
        raise RoutingFileError(path, f"corrupt: indices dtype {rf.dtype} does not match "
                                     f"num_experts={m.num_experts}")
    if verify:
        rf.verify()
    cu = rf.cu_seqlens_np
    if cu.shape[0] < 1 or cu[0] != 0 or cu[-1] != shape[0] or np.any(np.diff(cu) < 0):
        raise RoutingFileError(path, f"corrupt: cu_seqlens {cu.tolist()[:8]} do not run from 0 "
                                     f"to N={shape[0]}")
    for key, want in (("num_tokens", shape[0]), ("num_sequences", cu.shape[0] - 1)):
        if md.get(key) != str(want):
            raise RoutingFileError(path, f"corrupt: metadata {key}={md.get(key)!r} but the "
                                         f"tensors hold {want}")
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
    "index_dtype",
    "open_routing",
    "read_routing",
    "write_routing",
]
