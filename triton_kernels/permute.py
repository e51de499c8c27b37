"""Permute (token-major -> expert-major rows) and its backward, in Triton.

    forward:   out[r] = hidden[sorted_slots[r] // K]       (0 where sorted_slots[r] == -1,
                                                            or r >= len(sorted_slots))
    backward:  dh[t]  = sum_{k valid} dout[row_id_map[t, k]]  in column order, fp32
               (`_gather_sum_kernel`, unweighted: a gather-sum per token, no atomics)
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import cast_rne

TILE_ELEMS = 4096


def permute_config(H: int) -> dict:
    BLOCK_H = min(triton.next_power_of_2(max(H, 1)), 256)
    return dict(BLOCK_H=BLOCK_H, BLOCK_R=max(1, min(64, TILE_ELEMS // BLOCK_H)))


@triton.jit
def _permute_fwd_kernel(
    # inputs
    X_ptr, Sorted_ptr,
    # outputs
    Out_ptr,
    # sizes and strides
    num_rows, n_sorted, H, K, stride_xt, stride_xh,
    # constexprs
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < num_rows
    slot = tl.load(Sorted_ptr + r, mask=rmask & (r < n_sorted), other=-1).to(tl.int64)
    has = slot >= 0
    tok = tl.where(has, slot // K, 0)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = (h < H)[None, :]
        v = tl.load(X_ptr + tok[:, None] * stride_xt + h[None, :] * stride_xh,
                    mask=has[:, None] & hm, other=0.0)
        tl.store(Out_ptr + r[:, None] * H + h[None, :], v, mask=rmask[:, None] & hm)


@triton.jit
def _gather_sum_kernel(
    # inputs
    Src_ptr, RowMap_ptr, W_ptr,
    # outputs
    Out_ptr,
    # sizes and strides
    T, H, K, R, stride_sr, stride_sh,
    # constexprs
    WEIGHTED: tl.constexpr, CDT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t] = sum_{k valid} [w[t,k] *] src[row_id_map[t,k]], in column order k = 0..K-1,
    accumulated in fp32 (fp64 for fp64). Unweighted it is the permute backward; weighted it
    is the unpermute forward. One program owns each output row: no atomics."""
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = (h < H)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_H], CDT)
        for k in range(0, K):
            row = tl.load(RowMap_ptr + t * K + k, mask=tmask, other=-1).to(tl.int64)
            ok = (row >= 0) & (row < R)
            v = tl.load(Src_ptr + row[:, None] * stride_sr + h[None, :] * stride_sh,
                        mask=ok[:, None] & hm, other=0.0).to(CDT)
            if WEIGHTED:
                w = tl.load(W_ptr + t * K + k, mask=ok, other=0.0).to(CDT)
                v = v * w[:, None]
            acc += v
        tl.store(Out_ptr + t[:, None] * H + h[None, :], cast_rne(acc, Out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & hm)
