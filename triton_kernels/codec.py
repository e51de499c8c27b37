"""The routing codec's per-row transforms (replay_ops.router_replay.codec), in Triton, so
routing leaves the GPU already narrow and sorted, and decoding scatters straight into the
tensor replay reads.

Public launchers: `sort_rows` (encode side), `unsort_rows` (decode side), both bitwise
equal to the numpy transform of the codec (`codec.sort_rows` and its inverse).

    sort:    v'[r, k]  = E where routing[r, k] < 0, else routing[r, k]
             key[r, k] = v'[r, k] * 2^S + k           (2^S = the power of two >= K)
             sorted[r] = v' in ascending key order      (set: ascending v'; equal ids keep
                                                         their slot order, which for "set"
                                                         does not matter)
             p[r, j]   = slot of the j-th smallest key
             code[r]   = sum_j c_j * (K-1-j)!,  c_j = #{i > j : p[i] < p[j]}   (Lehmer code,
                                                         "keep" only; K <= 20)
             inverse:  c_s = #{s' > s : key[s'] < key[s]} on the keys in slot order (the
                       Lehmer code of q, the inverse of p: format version 2)
    unsort:  given the Lehmer digits c_j (split from the code on the host, `codec.
             lehmer_digits`: no 64-bit division on the GPU), p from c (for j from K-2
             down to 0: every later p[i] >= p[j] moves up by one), then
             out[r, p[r, j]] = sorted[r, j]  with E written as -1   ("set": p = identity)
             inverse: the digits give q, and out[r, s] = sorted[r, q[r, s]] (a gather)

One program handles BLOCK_R rows; a row's K ids (padded to the power of two KP) sit in
registers. No atomics, no floating point: the output is a pure function of the input.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import LAUNCH_OPTIONS, device_ctx

MAX_LEHMER_K = 20  # 20! < 2^63


@triton.jit
def _row_block(N, K, KP: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's BLOCK_R rows (int64) and the KP slot columns, with their masks."""
    pid = tl.program_id(0).to(tl.int64)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.arange(0, KP)
    rmask = r < N
    cmask = col < K
    return r, col, rmask, cmask, rmask[:, None] & cmask[None, :]


@triton.jit
def _codec_sort_kernel(
    # inputs
    X_ptr, W_ptr,
    # outputs
    Sorted_ptr, Code_ptr,
    # sizes and strides
    N, K, E, stride_xr, stride_xk,
    # constexprs
    KP: tl.constexpr, SHIFT: tl.constexpr, KEEP: tl.constexpr, INV: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    r, col, rmask, cmask, m2 = _row_block(N, K, KP, BLOCK_R)
    v = tl.load(X_ptr + r[:, None] * stride_xr + col[None, :].to(tl.int64) * stride_xk,
                mask=m2, other=0).to(tl.int64)
    v = tl.where(v < 0, E, v)
    # padding slots sort last: their key is above every real key
    big = (E.to(tl.int64) + 1) << SHIFT
    key = tl.where(cmask[None, :], (v << SHIFT) | col[None, :].to(tl.int64), big)
    key = tl.sort(key, dim=1)
    srt = key >> SHIFT
    tl.store(Sorted_ptr + r[:, None] * K + col[None, :],
             srt.to(Sorted_ptr.dtype.element_ty), mask=m2)
    if KEEP:
        if INV:
            # c_s = #{s' > s, s' < K : key_s' < key_s} on the keys in slot order, which for
            # s' > s is v_s' < v_s (equal ids: the later slot's key is the larger); the ids
            # (<= E < 2^31) as int32, like p
            p = v.to(tl.int32)
        else:
            p = (key & ((1 << SHIFT) - 1)).to(tl.int32)
        # c_j = #{i > j, i < K : p_i < p_j}
        pj = p[:, :, None]
        pi = p[:, None, :]
        later = (col[None, :, None] < col[None, None, :]) & (col[None, None, :] < K)
        c = tl.sum(((pi < pj) & later).to(tl.int64), axis=2)
        w = tl.load(W_ptr + col, mask=cmask, other=0)
        code = tl.sum(tl.where(cmask[None, :], c * w[None, :], 0), axis=1)
        tl.store(Code_ptr + r, code, mask=rmask)


@triton.jit
def _codec_unsort_kernel(
    # inputs
    Sorted_ptr, Digits_ptr,
    # outputs
    Out_ptr,
    # sizes and strides
    N, K, E, stride_or, stride_ok,
    # constexprs
    KP: tl.constexpr, KEEP: tl.constexpr, INV: tl.constexpr, BLOCK_R: tl.constexpr,
):
    r, col, rmask, cmask, m2 = _row_block(N, K, KP, BLOCK_R)
    srt = tl.load(Sorted_ptr + r[:, None] * K + col[None, :], mask=m2, other=0).to(tl.int64)
    val = tl.where(srt == E, -1, srt)
    if KEEP:
        p = tl.load(Digits_ptr + r[:, None] * K + col[None, :], mask=m2, other=0).to(tl.int32)
        for jj in tl.static_range(KP - 1):
            j = KP - 2 - jj  # from the back
            if j < K - 1:
                pjv = tl.sum(tl.where(col[None, :] == j, p, 0), axis=1)
                move = (col[None, :] > j) & (p >= pjv[:, None]) & cmask[None, :]
                p = tl.where(move, p + 1, p)
        if INV:
            # p holds q: slot s takes the q[s]-th sorted id
            hit = (p[:, :, None] == col[None, None, :]) & cmask[None, None, :]
            val = tl.sum(tl.where(hit, val[:, None, :], 0), axis=2)
            dst = col[None, :].to(tl.int64) + tl.zeros([BLOCK_R, KP], tl.int64)
        else:
            dst = p.to(tl.int64)
    else:
        dst = col[None, :].to(tl.int64) + tl.zeros([BLOCK_R, KP], tl.int64)
    tl.store(Out_ptr + r[:, None] * stride_or + dst * stride_ok,
             val.to(Out_ptr.dtype.element_ty), mask=m2)


def _block_rows(kp: int) -> int:
    """Rows per program: about 1024 ids in registers (the keep kernels hold a KP x KP
    comparison per row, so fewer rows when K is wide)."""
    return max(1, min(128, 1024 // (kp * kp) * 8 if kp > 8 else 1024 // kp))


def _weights(k: int, device) -> torch.Tensor:
    return torch.tensor([math.factorial(k - 1 - j) for j in range(k)], dtype=torch.int64,
                        device=device)


def _kp(k: int) -> int:
    return 1 << max(0, (k - 1).bit_length())


def sort_rows(routing: torch.Tensor, num_experts: int, order: str, sorted_dtype=None,
              inverse: bool = False):
    """[N, K] integer routing (-1 = empty; any strides) -> (sorted [N, K] canonical ids
    (-1 as num_experts) in `sorted_dtype` (default: the codec's narrow type, uint8 for
    E <= 255), code [N] int64 Lehmer codes or None for order="set"). `inverse`: the code
    of the slot order q (format version 2) instead of the sorted order p."""
    if routing.dim() != 2:
        raise ValueError(f"sort_rows: routing must be [N, K], got {tuple(routing.shape)}")
    N, K = routing.shape
    keep = order == "keep" and K > 1
    if keep and K > MAX_LEHMER_K:
        raise ValueError(f"sort_rows: order='keep' supports K <= {MAX_LEHMER_K} here, got K={K}")
    if sorted_dtype is None:
        sorted_dtype = (torch.uint8 if num_experts <= 255 else
                        torch.int32 if num_experts <= 0x7FFFFFFF else torch.int64)
    srt = torch.empty(N, K, dtype=sorted_dtype, device=routing.device)
    code = torch.zeros(N, dtype=torch.int64, device=routing.device) if keep else None
    if N == 0 or K == 0:
        return srt, code
    kp = _kp(K)
    # the factorial weights of the Lehmer code ("keep" only: K <= 20, 19! < 2^63)
    w = _weights(K, routing.device) if keep else torch.zeros(kp, dtype=torch.int64,
                                                             device=routing.device)
    br = _block_rows(kp)
    with device_ctx(routing):
        _codec_sort_kernel[(triton.cdiv(N, br),)](
            routing, w, srt, code if keep else w, N, K, num_experts, routing.stride(0),
            routing.stride(1), KP=kp, SHIFT=max(0, (K - 1).bit_length()), KEEP=keep,
            INV=bool(inverse) and keep, BLOCK_R=br, **LAUNCH_OPTIONS,
        )
    return srt, code


def unsort_rows(sorted_ids: torch.Tensor, digits: torch.Tensor | None, num_experts: int,
                out: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Inverse of `sort_rows`, written into `out` [N, K] (any integer dtype, any strides):
    the ids in their original slots (`digits` [N, K] uint8: the Lehmer digits of each row's
    code, `codec.lehmer_digits`) or sorted (digits None), -1 for empty. `inverse`: the
    digits are those of the slot order q (format version 2).

    NOTE: the digits come from the host (K bytes per row, the size of the int64 code at
    K = 8): splitting the code on the GPU takes 64-bit divisions, a subroutine call each
    (tools/triton_compile_check.py refuses them)."""
    N, K = sorted_ids.shape
    if tuple(out.shape) != (N, K):
        raise ValueError(f"unsort_rows: out has shape {tuple(out.shape)}, expected {(N, K)}")
    if N == 0 or K == 0:
        return out
    keep = digits is not None and K > 1
    sorted_ids = sorted_ids.contiguous()
    digits = digits.contiguous() if keep else sorted_ids
    kp = _kp(K)
    br = _block_rows(kp)
    with device_ctx(out):
        _codec_unsort_kernel[(triton.cdiv(N, br),)](
            sorted_ids, digits, out, N, K, num_experts,
            out.stride(0), out.stride(1), KP=kp, KEEP=keep, INV=bool(inverse) and keep,
            BLOCK_R=br, **LAUNCH_OPTIONS,
        )
    return out
