"""Unpermute (weighted combine back to tokens) and its backward, in Triton.

    forward:   out[t] = sum_{k valid} w[t,k] * x[row_id_map[t,k]]   column order, fp32
               (`permute._gather_sum_kernel`, weighted)
    backward:  dx[r]  = w[s] * dout[s // K]  for s = sorted_slots[r]  (0 for padding)
               dw[t,k] = <dout[t], x[row_id_map[t,k]]>                fp32, 0 for empty
Every output element is produced by exactly one program: no atomics.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import cast_rne



@triton.jit
def _unpermute_bwd_dx_kernel(
    # inputs
    G_ptr, Sorted_ptr, W_ptr,
    # outputs
    DX_ptr,
    # sizes
    R, n_sorted, H, K,
    # constexprs
    CDT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    slot = tl.load(Sorted_ptr + r, mask=rmask & (r < n_sorted), other=-1).to(tl.int64)
    has = slot >= 0
    s = tl.where(has, slot, 0)
    w = tl.load(W_ptr + s, mask=has, other=0.0).to(CDT)
    tok = s // K
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = (h < H)[None, :]
        g = tl.load(G_ptr + tok[:, None] * H + h[None, :], mask=has[:, None] & hm,
                    other=0.0).to(CDT)
        tl.store(DX_ptr + r[:, None] * H + h[None, :],
                 cast_rne(g * w[:, None], DX_ptr.dtype.element_ty), mask=rmask[:, None] & hm)


@triton.jit
def _unpermute_bwd_dw_kernel(
    # inputs
    G_ptr, X_ptr, RowMap_ptr,
    # outputs
    DW_ptr,
    # sizes and strides
    T, H, K, R, stride_xr, stride_xh,
    # constexprs
    CDT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    for k in range(0, K):
        row = tl.load(RowMap_ptr + t * K + k, mask=tmask, other=-1).to(tl.int64)
        ok = (row >= 0) & (row < R)
        acc = tl.zeros([BLOCK_T], CDT)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            hm = (h < H)[None, :]
            g = tl.load(G_ptr + t[:, None] * H + h[None, :], mask=tmask[:, None] & hm,
                        other=0.0).to(CDT)
            x = tl.load(X_ptr + row[:, None] * stride_xr + h[None, :] * stride_xh,
                        mask=ok[:, None] & hm, other=0.0).to(CDT)
            acc += tl.sum(g * x, axis=1)
        tl.store(DW_ptr + t * K + k, cast_rne(acc, DW_ptr.dtype.element_ty), mask=tmask)
