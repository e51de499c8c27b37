"""Permute (token-major -> expert-major rows) and its backward, in Triton.

Public launchers: `permute_fwd`, `permute_bwd` (block sizes: `_common.row_config`).

    forward:   out[r] = hidden[sorted_slots[r] // K]       (0 where sorted_slots[r] == -1,
                                                            r >= len(sorted_slots), or the
                                                            token is outside [0, T))
    backward:  dh[t]  = sum_{k valid} dout[row_id_map[t, k]]  in column order, fp32
               (the unweighted gather-sum of unpermute.py: one program per token row, no
               atomics)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LAUNCH_OPTIONS, device_ctx, row_config, sorted_row_tokens
from .unpermute import gather_sum


@triton.jit
def _permute_fwd_kernel(
    # inputs
    X_ptr, Sorted_ptr,
    # outputs
    Out_ptr,
    # sizes and strides
    num_rows, n_sorted, T, H, K, stride_xt, stride_xh,
    # constexprs
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < num_rows
    _, tok, has = sorted_row_tokens(Sorted_ptr, r, rmask, n_sorted, T, K)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = (h < H)[None, :]
        # 64-bit column offsets: H * stride_xh passes 2^31 for a column-major [T, H] input
        v = tl.load(X_ptr + tok[:, None] * stride_xt + h.to(tl.int64)[None, :] * stride_xh,
                    mask=has[:, None] & hm, other=0.0)
        tl.store(Out_ptr + r[:, None] * H + h[None, :], v, mask=rmask[:, None] & hm)


def permute_fwd(hidden, sorted_slots, row_id_map, num_rows):
    T, H = hidden.shape
    K = row_id_map.shape[1]
    out = torch.empty(num_rows, H, dtype=hidden.dtype, device=hidden.device)
    if num_rows == 0 or H == 0:
        return out
    if T == 0:
        return out.zero_()
    sorted_slots = sorted_slots.contiguous()
    cfg = row_config(H)
    with device_ctx(hidden):
        _permute_fwd_kernel[(triton.cdiv(num_rows, cfg.BLOCK_R),)](
            hidden, sorted_slots, out, num_rows, sorted_slots.shape[0], T, H, K,
            hidden.stride(0), hidden.stride(1), BLOCK_R=cfg.BLOCK_R, BLOCK_H=cfg.BLOCK_H,
            **LAUNCH_OPTIONS,
        )
    return out


def permute_bwd(grad_out, row_id_map):
    return gather_sum(grad_out, row_id_map, None)
