"""The codec's device path: the row transform of `transform.sort_rows` and its inverse run by
the Triton kernels of replay_ops/triton_kernels/codec.py on the routing's own device, so only
the narrow sorted ids and the permutation codes cross to the host when encoding, and the
unsorted routing is written straight into the output tensor when decoding. It writes the
same bytes as the numpy path (docs/codec_format.md) and ends in the same final check
(`format._check_content`), of the routing it wrote, re-derived on the device.

`DeviceRows` is the encode side (a `chunk.Rows`), `DEVICE` the decode side (a
`chunk.ChunkWriter`); `_use_triton` chooses between them and the host path.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .chunk import _decode_chunk
from .format import (MAX_LEHMER_K, _NARROW, BlobInfo, Canonical, ChunkInfo, CodecError,
                     Format, _check_content, _fail, id_width, lehmer_width)
from .transform import lehmer_digits, sort_rows

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


def _host_canonical(srt_d: torch.Tensor, code_d, keep: bool, T: int, L: int, K: int,
                    E: int) -> Canonical:
    """The Triton transform's output (sorted ids [T*L, K] and Lehmer codes [T*L] on the
    device) as the host's `Canonical` (narrow ids, code bytes little-endian)."""
    w = id_width(E)
    srt = srt_d.cpu().numpy()
    srt = srt if srt.dtype == _NARROW[w] else srt.astype(_NARROW[w])
    perm = None
    if keep:
        pw = lehmer_width(K)
        if code_d is None or not pw:
            perm = np.zeros((T * L, pw), np.uint8)
        else:
            small = torch.int32 if math.factorial(K) <= 2**31 else torch.int64
            code = code_d.to(small).cpu().numpy()
            perm = np.ascontiguousarray(code.astype(f"<u{pw}")).view(np.uint8)
            perm = perm.reshape(T * L, pw)
    return Canonical(srt.reshape(T, L, K), perm)


class DeviceRows:
    """Routing on its device, checked there (a `chunk.Rows`): `canonical(a, b, order, fmt)`
    runs the Triton transform on tokens a:b and brings the canonical form to the host."""

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

    def canonical(self, a: int, b: int, order: str, fmt: Format) -> Canonical:
        from replay_ops.triton_kernels import codec as tk

        T, L, K = b - a, self.shape[1], self.shape[2]
        rows = self.x[a:b].reshape(T * L, K)
        srt_d, code_d = tk.sort_rows(rows, self.E, order, _device_narrow(self.E),
                                     inverse=fmt.inverse_code(K))
        return _host_canonical(srt_d, code_d, order == "keep", T, L, K, self.E)

    def ids(self, a: int, b: int) -> None:
        return None


def _decode_into_device(buf, ch: ChunkInfo, inf: BlobInfo, tok, dst: torch.Tensor) -> None:
    """Decode one chunk on the host up to the canonical rows (checksummed), then unsort and
    write on dst's device with the Triton kernel; the written routing is checked there (its
    canonical form re-derived and compared)."""
    from replay_ops.triton_kernels import codec as tk

    T, L, K, E = ch.num_tokens, inf.num_layers, inf.top_k, inf.num_experts
    if T * L * K == 0:  # nothing to write: the host's checks of the chunk, as on that path
        _decode_chunk(buf, ch, inf, tok)
        return
    res = _decode_chunk(buf, ch, inf, tok, device=True)
    if isinstance(res, Canonical):
        srt, pc = res.ids, res.code
    else:  # raw chunks come back in their final form; set chunks need no permutation
        srt, pc = (res, None) if inf.order == "set" else sort_rows(
            res.reshape(T * L, K), "keep", E, inf.format)
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
    inverse = inf.format.inverse_code(K)
    tk.unsort_rows(srt_d, digits_d, E, flat, inverse=inverse)
    # check what was written: its canonical form, re-derived on the device, must hash to the
    # content checksum (the same check as the numpy path's)
    again, code2 = tk.sort_rows(flat, E, "keep" if keep_code else "set", nd,
                                inverse=inverse)
    _check_content(ch, _host_canonical(again, code2, inf.order == "keep", T, L, K, E),
                   " (device transform check failed: the routing written on the device)")
    if flat.data_ptr() != dst.data_ptr() or not _viewable(dst):
        dst.copy_(flat.view(T, L, K))


def _viewable(t: torch.Tensor) -> bool:
    try:
        t.view(-1, t.shape[-1])
    except RuntimeError:
        return False
    return True


class _DeviceWriter:
    """The device path's `chunk.ChunkWriter`: tokens a:b of a chunk into dst, unsorted and
    checked on dst's device (a part of a chunk is decoded whole into a temporary there)."""

    def write(self, buf, ch: ChunkInfo, inf: BlobInfo, tok, dst: torch.Tensor, a: int,
              b: int) -> None:
        if (a, b) == (0, ch.num_tokens):
            _decode_into_device(buf, ch, inf, tok, dst)
            return
        try:
            tmp = torch.empty((ch.num_tokens,) + tuple(dst.shape[1:]), dtype=dst.dtype,
                              device=dst.device)
        except (RuntimeError, MemoryError) as e:
            raise CodecError(f"decode: cannot allocate a chunk of {ch.num_tokens} tokens: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") \
                from None
        _decode_into_device(buf, ch, inf, tok, tmp)
        dst.copy_(tmp[a:b])


DEVICE = _DeviceWriter()


def writer(backend: str, res: torch.Tensor, inf: BlobInfo, who: str):
    """The `chunk.ChunkWriter` that decodes `inf`'s chunks into `res`: the device path for
    `backend` "triton", or "auto" and `res` on a GPU, else the host's. "keep" with K > 20
    stores slot numbers, not a Lehmer code: decoded on the host (and checked there), then
    copied."""
    from .chunk import HOST

    if _use_triton(backend, res, inf.order, who) and not (
            inf.order == "keep" and inf.top_k > MAX_LEHMER_K):
        return DEVICE
    return HOST
