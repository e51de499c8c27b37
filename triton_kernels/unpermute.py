"""Unpermute (weighted combine back to tokens) and its backward, in Triton.

Public launchers: `unpermute_fwd`, `unpermute_bwd`, and `gather_sum` (which also serves
the permute backward).

    forward:   out[t] = sum_{k valid} w[t,k] * x[row_id_map[t,k]]   column order, fp32
    backward:  dx[r]  = w[s] * dout[s // K]  for s = sorted_slots[r]  (0 for padding, and
                                                                       for tokens past T)
               dw[t,k] = <dout[t], x[row_id_map[t,k]]>                fp32, 0 for empty
A row id outside [0, R) is an empty slot. The dot products of dw add their terms in a fixed
pairwise order (`_common.row_sum`). Every output element is produced by exactly one
program: no atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (LAUNCH_OPTIONS, cast_rne, compute_type, device_ctx, row_config, row_sum,
                      sorted_row_tokens)

# NOTE: [BLOCK_T, K_PAD] accumulators of the dw kernel (one per slot of a token block): with
# them grad_out is read once per column block instead of once per slot. 1024 fp32 values are
# 8 registers a thread at 4 warps.
DW_ACC_ELEMS = 1024


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
    accumulated in fp32 (fp64 for fp64). Weighted it is the unpermute forward; unweighted it
    is the permute backward."""
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
            v = tl.load(Src_ptr + row[:, None] * stride_sr + h.to(tl.int64)[None, :] * stride_sh,
                        mask=ok[:, None] & hm, other=0.0).to(CDT)
            if WEIGHTED:
                w = tl.load(W_ptr + t * K + k, mask=ok, other=0.0).to(CDT)
                v = v * w[:, None]
            acc += v
        tl.store(Out_ptr + t[:, None] * H + h[None, :], cast_rne(acc, Out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & hm)


@triton.jit
def _unpermute_bwd_dx_kernel(
    # inputs
    G_ptr, Sorted_ptr, W_ptr,
    # outputs
    DX_ptr,
    # sizes
    R, n_sorted, T, H, K,
    # constexprs
    CDT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    slot, tok, has = sorted_row_tokens(Sorted_ptr, r, rmask, n_sorted, T, K)
    # the slot's weight (slot t*K + k is weights' flat index)
    w = tl.load(W_ptr + tl.where(has, slot, 0).to(tl.int64), mask=has, other=0.0).to(CDT)
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
    CDT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, K_PAD: tl.constexpr,
):
    """dw[t,k] = <dout[t], x[row_id_map[t,k]]>: per column block, the dout tile is loaded
    once and each slot's partial dot product (a fixed-order row_sum) is added to its
    accumulator, so each dw[t,k] adds its column blocks in order h0 = 0, BLOCK_H, ..."""
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    cols = tl.arange(0, K_PAD)
    acc = tl.zeros([BLOCK_T, K_PAD], CDT)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = (h < H)[None, :]
        g = tl.load(G_ptr + t[:, None] * H + h[None, :], mask=tmask[:, None] & hm,
                    other=0.0).to(CDT)
        for k in range(0, K):
            row = tl.load(RowMap_ptr + t * K + k, mask=tmask, other=-1).to(tl.int64)
            ok = (row >= 0) & (row < R)
            x = tl.load(X_ptr + row[:, None] * stride_xr + h.to(tl.int64)[None, :] * stride_xh,
                        mask=ok[:, None] & hm, other=0.0).to(CDT)
            # adding 0 to the other columns leaves them exact
            acc += tl.where(cols[None, :] == k, row_sum(g * x, BLOCK_T, BLOCK_H)[:, None], 0.0)
    out = t[:, None] * K + cols[None, :]
    tl.store(DW_ptr + out, cast_rne(acc, DW_ptr.dtype.element_ty),
             mask=tmask[:, None] & (cols < K)[None, :])


def gather_sum(src, row_id_map, weights):
    """[T, H] = sum_k [weights[t,k] *] src[row_id_map[t,k]] (see _gather_sum_kernel)."""
    R, H = src.shape
    T, K = row_id_map.shape
    out = torch.empty(T, H, dtype=src.dtype, device=src.device)
    if T == 0 or H == 0:
        return out
    row_id_map = row_id_map.contiguous()
    cfg = row_config(H)
    with device_ctx(src):
        _gather_sum_kernel[(triton.cdiv(T, cfg.BLOCK_R),)](
            src, row_id_map, src if weights is None else weights.contiguous(), out,
            T, H, K, R, src.stride(0), src.stride(1),
            WEIGHTED=weights is not None, CDT=compute_type(src.dtype),
            BLOCK_T=cfg.BLOCK_R, BLOCK_H=cfg.BLOCK_H, **LAUNCH_OPTIONS,
        )
    return out


def unpermute_fwd(expert_out, row_id_map, weights):
    return gather_sum(expert_out, row_id_map, weights)


def unpermute_bwd(grad_out, expert_out, row_id_map, sorted_slots, weights):
    R, H = expert_out.shape
    T, K = row_id_map.shape
    grad_out = grad_out.contiguous()
    weights = weights.contiguous()
    row_id_map = row_id_map.contiguous()
    sorted_slots = sorted_slots.contiguous()
    grad_x = torch.empty(R, H, dtype=expert_out.dtype, device=expert_out.device)
    grad_w = torch.empty(T, K, dtype=weights.dtype, device=weights.device)
    if T > 0 and H == 0:
        grad_w.zero_()
    cdt = compute_type(expert_out.dtype)
    cfg = row_config(H)
    with device_ctx(expert_out):
        if R > 0 and H > 0:
            _unpermute_bwd_dx_kernel[(triton.cdiv(R, cfg.BLOCK_R),)](
                grad_out, sorted_slots, weights, grad_x, R, sorted_slots.shape[0], T, H, K,
                CDT=cdt, BLOCK_R=cfg.BLOCK_R, BLOCK_H=cfg.BLOCK_H, **LAUNCH_OPTIONS,
            )
        if T > 0 and H > 0:
            K_PAD = triton.next_power_of_2(max(K, 1))
            # two tiles live (dout and x): half the rows of the other row kernels
            block_t = max(1, min(cfg.BLOCK_R // 2, DW_ACC_ELEMS // K_PAD))
            _unpermute_bwd_dw_kernel[(triton.cdiv(T, block_t),)](
                grad_out, expert_out, row_id_map, grad_w, T, H, K, R,
                expert_out.stride(0), expert_out.stride(1), CDT=cdt,
                BLOCK_T=block_t, BLOCK_H=cfg.BLOCK_H, K_PAD=K_PAD, **LAUNCH_OPTIONS,
            )
    return grad_x, grad_w
