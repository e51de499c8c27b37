"""The dense gate (Megatron-Core's probs [T, E] and bool routing map written by the gate
itself) and the permuted probs, in Triton.

Public launchers: `gate_dense_fwd`, `gate_dense_bwd`, `permute_probs_fwd`,
`permute_probs_bwd` (block sizes: `gate_dense_config`). The kernels are private; the math
helpers and the plan kernels are gate.py's.

Forward, per token row t (each program owns whole rows: no memset, no scatter):

    flags[t]   ROW_* bits of the recorded row: 1 a -1 slot, 2 an id outside [-1, E),
               4 a repeated expert, 8 replay_mask False (then nothing else is looked at)
    idx[t, k]  the recorded id when flags[t] == 0; else by the padding mode: "empty" (its
               ids in [0, E), nothing for a masked row), "spread" (the per-row formula of
               replay_ops.reference.spread_expert), "fallback" (the fallback row); a masked
               row takes its fallback row whenever there is one
    w[t, k]    the gate weight of gate.py at idx[t, k] (compute type)
    probs[t,e] 0 + sum of w[t, k] over the slots routed to e, in slot order, rounded once;
               with the underflow guard a routed entry that rounds to 0 is the dtype's
               smallest normal value
    map[t, e]  any slot routed to e
    plan       over idx (gate.py's plan kernels), only with with_plan

Backward: the gate backward of gate.py with the slot gradient g[t, k] read from the dense
probs gradient at (t, idx[t, k]) (any strides). Permuted probs: row r holds probs[t, e] of its
slot; the backward writes each token row of the dense [T, E] gradient whole (a repeated
expert's row gradients summed in slot order).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from replay_ops import scores
from replay_ops.plan import PADDING_MODES, plan_capacity

from . import gate as _gate  # its plan launches: the kernels are looked up there (tools patch them)
from . import select as _sel
from ._common import (LAUNCH_OPTIONS, cast_rne, chunk_rows, compute_type, device_ctx,
                      row_tile, sorted_row_tokens)
from .gate import (
    _load_slots,
    _plan_of_slots,
    _set_logprob,
    _slot_weights,
    _col,
    _store_logit_grad,
    _scale,
    _slot_sums,
    agreement_outputs,
    check_top_k,
    gate_bwd_config,
    gate_config,
    launch_logit_grad,
    select_args,
    split_scale,
)

_PAD_SPREAD: tl.constexpr = tl.constexpr(PADDING_MODES["spread"])
_PAD_FALLBACK: tl.constexpr = tl.constexpr(PADDING_MODES["fallback"])
_PAD_SELECT: tl.constexpr = tl.constexpr(PADDING_MODES["select"])
_SPREAD_HASH: tl.constexpr = tl.constexpr(2654435769)

# NOTE: the row pass holds [ROW_BLOCK, K_PAD] slot tiles beside gate.py's
# [BLOCK_T, E_BLOCK] tiles; 4096 slots per block compile without spills for K up to
# gate.MAX_TOPK (tools/triton_compile_check.py).
SLOT_TILE_ELEMS = 4096


@dataclasses.dataclass(frozen=True)
class DenseConfig:
    plan: object  # gate.py's GateConfig (chunks, plan block sizes)
    ROW_BLOCK: int  # rows per step of the dense row pass (divides plan.BLOCK_T)


def gate_dense_config(T: int, K: int, E: int, align: int) -> DenseConfig:
    plan = gate_config(T, K, E, align)
    k_pad = triton.next_power_of_2(K)
    row_block = max(1, min(plan.BLOCK_T, SLOT_TILE_ELEMS // k_pad))
    return DenseConfig(plan=plan, ROW_BLOCK=row_block)


# ----------------------------------------------------------------------------- rows
@triton.jit
def _tiny(DT: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """[R, C] of DT's smallest normal value, from its bits (a float kernel argument is fp32,
    which cannot hold fp64's)."""
    if DT == tl.float16:
        return tl.full([R, C], 0x0400, tl.int16).to(tl.float16, bitcast=True)
    elif DT == tl.bfloat16:
        return tl.full([R, C], 0x0080, tl.int16).to(tl.bfloat16, bitcast=True)
    elif DT == tl.float32:
        return tl.full([R, C], 0x00800000, tl.int32).to(tl.float32, bitcast=True)
    else:
        return tl.full([R, C], 0x0010000000000000, tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _resolve_rows(Idx_ptr, Mask_ptr, Fb_ptr, rows, rmask, cols, T, E, K,
                  stride_it, stride_ik, stride_ft, stride_fk, ep_size, offset_mod,
                  HAS_MASK: tl.constexpr, HAS_FB: tl.constexpr, PADDING: tl.constexpr):
    """(int32 experts [R, K_PAD] (-1 empty), flags int32 [R]) of a block of rows."""
    m2 = rmask[:, None] & (cols < K)[None, :]
    raw = tl.load(Idx_ptr + rows[:, None] * stride_it + cols.to(tl.int64)[None, :] * stride_ik,
                  mask=m2, other=-1).to(tl.int64)
    inr = m2 & (raw >= 0) & (raw < E)
    empty = tl.max((m2 & (raw == -1)).to(tl.int32), axis=1)
    oor = tl.max((m2 & (raw != -1) & ~inr).to(tl.int32), axis=1)
    # a repeat: some later slot holds the id of slot j (a loop over j, not a [K, K] tile,
    # which spills for large K)
    rep = tl.zeros_like(empty)
    for j in range(0, K):
        cj = tl.sum(tl.where(cols[None, :] == j, raw, 0), axis=1)
        later = inr & (cols[None, :] > j) & (raw == cj[:, None]) & ((cj >= 0) & (cj < E))[:, None]
        rep = tl.maximum(rep, tl.max(later.to(tl.int32), axis=1))
    flags = empty * 1 + oor * 2 + rep * 4
    if HAS_MASK:
        keep = tl.load(Mask_ptr + rows, mask=rmask, other=1).to(tl.int32)
        flags = tl.where(keep != 0, flags, 8)
    rec = tl.where(inr, raw, -1)
    if HAS_FB:
        fbr = tl.load(Fb_ptr + rows[:, None] * stride_ft + cols.to(tl.int64)[None, :] * stride_fk,
                      mask=m2, other=-1).to(tl.int64)
        fbr = tl.where(m2 & (fbr >= 0) & (fbr < E), fbr, -1)
    else:
        fbr = rec
    if PADDING == _PAD_SPREAD:
        # 32-bit divisions (t*K < 2^31, every value below 4E): a 64-bit one is a subroutine
        s = (rows * K).to(tl.int32)
        c = s // E
        w = (((c.to(tl.int64) * _SPREAD_HASH) & 0xFFFFFFFF) * E >> 32).to(tl.int32)
        i = (s % E + offset_mod + w)[:, None] + cols[None, :]
        i = i % E
        fill = ((i % ep_size) * (E // ep_size) + i // ep_size).to(tl.int64)
    elif PADDING == _PAD_FALLBACK:
        fill = fbr
    else:
        fill = tl.where((flags == 8)[:, None], -1, rec)
    out = tl.where((flags != 0)[:, None], fill, rec)
    if HAS_FB:
        out = tl.where((flags == 8)[:, None], fbr, out)
    out = tl.where(m2, out, -1)
    return out.to(tl.int32), flags


@triton.jit
def _dense_rows(
    Logits_ptr, Idx_ptr, Mask_ptr, Fb_ptr, Bias_ptr, Probs_ptr, Map_ptr, Flags_ptr,
    IdxOut_ptr, Agree_ptr, Lp_ptr,
    r0, T, E, K, stride_lt, stride_le, stride_it, stride_ik, stride_ft, stride_fk,
    scale_hi, scale_lo, ep_size, offset_mod, num_groups, group_topk, group_topn,
    SCORE: tl.constexpr, NORMALIZE: tl.constexpr, CDT: tl.constexpr, PADDING: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_FB: tl.constexpr, GUARD: tl.constexpr, AGREE: tl.constexpr,
    SRC_LOGITS: tl.constexpr, ROUND: tl.constexpr, HAS_BIAS: tl.constexpr,
    RANKS_LOGITS: tl.constexpr, GROUPED: tl.constexpr,
    ROW_BLOCK: tl.constexpr, K_PAD: tl.constexpr, E_BLOCK: tl.constexpr,
    E_HIST: tl.constexpr, G_PAD: tl.constexpr,
):
    rows, cols, rmask, m2 = row_tile(r0, T, K, ROW_BLOCK, K_PAD)
    idx, flags = _resolve_rows(Idx_ptr, Mask_ptr, Fb_ptr, rows, rmask, cols, T, E, K,
                               stride_it, stride_ik, stride_ft, stride_fk, ep_size,
                               offset_mod, HAS_MASK, HAS_FB, PADDING)
    if PADDING == _PAD_SELECT or AGREE:
        # padding="select": a flagged row takes the model's own selection (select.py),
        # except a masked row with a fallback row
        need = flags < 0
        if PADDING == _PAD_SELECT:
            need = flags != 0
            if HAS_FB:
                need = need & (flags != 8)
        idx, agree = _sel.select_rows(idx, need, rows, rmask, Logits_ptr, Bias_ptr, E, K,
                                      stride_lt, stride_le, num_groups, group_topk,
                                      group_topn, SCORE, SRC_LOGITS, ROUND, HAS_BIAS,
                                      RANKS_LOGITS, GROUPED, AGREE, CDT, ROW_BLOCK, K_PAD,
                                      E_HIST, G_PAD)
        idx = tl.where(m2, idx, -1)
        if AGREE:
            tl.store(Agree_ptr + rows, agree.to(tl.uint8), mask=rmask)
            lp = _set_logprob(idx, Logits_ptr, rows, rmask, cols, E, K, stride_lt, stride_le,
                              SCORE, CDT, ROW_BLOCK, K_PAD, E_BLOCK)
            tl.store(Lp_ptr + rows, lp, mask=rmask)
    valid = idx >= 0
    w = _slot_weights(idx, valid, Logits_ptr, rows, rmask, E, stride_lt, stride_le, scale_hi,
                      scale_lo, SCORE, NORMALIZE, CDT, ROW_BLOCK, K_PAD, E_BLOCK)
    tl.store(IdxOut_ptr + rows[:, None] * K + cols[None, :], idx, mask=m2)
    tl.store(Flags_ptr + rows, flags.to(tl.uint8), mask=rmask)
    for e0 in range(0, E, E_BLOCK):
        ecols = e0 + tl.arange(0, E_BLOCK)
        emask = rmask[:, None] & (ecols < E)[None, :]
        acc = tl.zeros([ROW_BLOCK, E_BLOCK], CDT)
        hit = tl.zeros([ROW_BLOCK, E_BLOCK], tl.int32)
        for k in range(0, K):  # a loop, not unrolled (see gate.py's backward)
            on = _col(idx, cols, k)[:, None] == ecols[None, :]
            acc += tl.where(on, _col(w, cols, k)[:, None], 0.0)
            hit = tl.maximum(hit, on.to(tl.int32))
        v = cast_rne(acc, Probs_ptr.dtype.element_ty)
        if GUARD:
            v = tl.where((hit != 0) & (v == 0.0),
                         _tiny(Probs_ptr.dtype.element_ty, ROW_BLOCK, E_BLOCK), v)
        out = rows[:, None] * E + ecols[None, :]
        tl.store(Probs_ptr + out, v, mask=emask)
        tl.store(Map_ptr + out, hit.to(tl.uint8), mask=emask)


@triton.jit
def _gate_dense_fwd_kernel(
    # inputs
    Logits_ptr, Idx_ptr, Mask_ptr, Fb_ptr, Bias_ptr,
    # outputs
    Probs_ptr, Map_ptr, Flags_ptr, IdxOut_ptr, RowMap_ptr, ChunkCounts_ptr, Tpe_ptr,
    Offsets_ptr, Sorted_ptr, Agree_ptr, Lp_ptr,
    # sizes, strides and options
    T, E, K, stride_lt, stride_le, stride_it, stride_ik, stride_ft, stride_fk,
    scale_hi, scale_lo, ep_size, offset_mod, align, n_sorted,
    num_groups, group_topk, group_topn,
    # constexprs
    SCORE: tl.constexpr, NORMALIZE: tl.constexpr, CDT: tl.constexpr, PADDING: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_FB: tl.constexpr, GUARD: tl.constexpr, PLAN: tl.constexpr,
    SINGLE: tl.constexpr, BLOCK_T: tl.constexpr, ROW_BLOCK: tl.constexpr,
    K_PAD: tl.constexpr, E_BLOCK: tl.constexpr, E_HIST: tl.constexpr,
    SLOT_BLOCK: tl.constexpr, PAD_J: tl.constexpr, TAIL_BLOCK: tl.constexpr,
    AGREE: tl.constexpr, SRC_LOGITS: tl.constexpr, ROUND: tl.constexpr,
    HAS_BIAS: tl.constexpr, RANKS_LOGITS: tl.constexpr, GROUPED: tl.constexpr,
    G_PAD: tl.constexpr,
):
    """The dense rows of this program's chunk (every row with SINGLE), then the plan over
    the int32 experts it wrote: the whole plan (SINGLE), or the chunk's ranks (kept in
    row_id_map) and expert histogram for gate.py's scan and scatter kernels."""
    pid, row_begin, row_end = chunk_rows(T, SINGLE, BLOCK_T)
    for r0 in range(row_begin, row_end, ROW_BLOCK):
        _dense_rows(Logits_ptr, Idx_ptr, Mask_ptr, Fb_ptr, Bias_ptr, Probs_ptr, Map_ptr,
                    Flags_ptr, IdxOut_ptr, Agree_ptr, Lp_ptr, r0, row_end, E, K, stride_lt,
                    stride_le, stride_it, stride_ik, stride_ft, stride_fk, scale_hi, scale_lo,
                    ep_size, offset_mod, num_groups, group_topk, group_topn,
                    SCORE, NORMALIZE, CDT, PADDING, HAS_MASK, HAS_FB, GUARD, AGREE,
                    SRC_LOGITS, ROUND, HAS_BIAS, RANKS_LOGITS, GROUPED,
                    ROW_BLOCK, K_PAD, E_BLOCK, E_HIST, G_PAD)
    if PLAN:
        tl.debug_barrier()  # the experts this program wrote are read back below
        _plan_of_slots(IdxOut_ptr, K, 1, RowMap_ptr, ChunkCounts_ptr, Tpe_ptr, Offsets_ptr,
                       Sorted_ptr, pid, row_begin * K, row_end * K, E, K, align, n_sorted,
                       SINGLE, E_HIST, SLOT_BLOCK, PAD_J, TAIL_BLOCK)


@triton.jit
def _gate_dense_bwd_kernel(
    # inputs
    G_ptr, Logits_ptr, Idx_ptr, GLp_ptr,
    # outputs
    DLogits_ptr,
    # sizes and strides
    T, E, K, stride_gt, stride_ge, stride_lt, stride_le, scale_hi, scale_lo,
    # constexprs
    SCORE: tl.constexpr, NORMALIZE: tl.constexpr, DENSE: tl.constexpr, HAS_GLP: tl.constexpr,
    CDT: tl.constexpr, BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, E_BLOCK: tl.constexpr,
):
    """gate.py's _gate_bwd_kernel with g[t, k] = s * grad_probs[t, idx[t, k]]: the slot
    gradients of a column added in column order; each output element written once."""
    rows, cols, rmask, m2 = row_tile(tl.program_id(0).to(tl.int64) * BLOCK_T, T, K, BLOCK_T,
                                     K_PAD)
    idx, valid = _load_slots(Idx_ptr, rows, cols, m2, K, 1, E)
    g = tl.load(G_ptr + rows[:, None] * stride_gt + idx.to(tl.int64) * stride_ge, mask=valid,
                other=0.0).to(CDT) * _scale(scale_hi, scale_lo, CDT)
    _store_logit_grad(g, idx, valid, Logits_ptr, DLogits_ptr, GLp_ptr, rows, cols, rmask, E,
                      K, stride_lt, stride_le, SCORE, NORMALIZE, DENSE, HAS_GLP, CDT, BLOCK_T,
                      K_PAD, E_BLOCK)


@triton.jit
def _permute_probs_fwd_kernel(
    # inputs
    Probs_ptr, Sorted_ptr, Idx_ptr,
    # outputs
    Out_ptr,
    # sizes and strides
    num_rows, n_sorted, T, E, K, stride_pt, stride_pe,
    # constexprs
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < num_rows
    slot, tok, has = sorted_row_tokens(Sorted_ptr, r, rmask, n_sorted, T, K)
    e = tl.load(Idx_ptr + tl.where(has, slot, 0).to(tl.int64), mask=has, other=-1).to(tl.int64)
    ok = has & (e >= 0) & (e < E)
    v = tl.load(Probs_ptr + tok * stride_pt + e * stride_pe, mask=ok, other=0.0)
    tl.store(Out_ptr + r, v, mask=rmask)


@triton.jit
def _permute_probs_bwd_kernel(
    # inputs
    G_ptr, RowMap_ptr, Idx_ptr,
    # outputs
    Out_ptr,
    # sizes
    T, E, K, R,
    # constexprs
    CDT: tl.constexpr, BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, E_BLOCK: tl.constexpr,
):
    rows, cols, rmask, m2 = row_tile(tl.program_id(0).to(tl.int64) * BLOCK_T, T, K, BLOCK_T,
                                     K_PAD)
    flat = rows[:, None] * K + cols[None, :]
    row = tl.load(RowMap_ptr + flat, mask=m2, other=-1).to(tl.int64)
    idx = tl.load(Idx_ptr + flat, mask=m2, other=-1)
    ok = (row >= 0) & (row < R) & (idx >= 0) & (idx < E)
    idx = tl.where(ok, idx, -1)
    g = tl.load(G_ptr + tl.where(ok, row, 0), mask=ok, other=0.0).to(CDT)
    for e0 in range(0, E, E_BLOCK):
        ecols = e0 + tl.arange(0, E_BLOCK)
        emask = rmask[:, None] & (ecols < E)[None, :]
        acc = _slot_sums(idx, g, cols, ecols, K, BLOCK_T, E_BLOCK, CDT)
        tl.store(Out_ptr + rows[:, None] * E + ecols[None, :],
                 cast_rne(acc, Out_ptr.dtype.element_ty), mask=emask)


# -------------------------------------------------------------------------- launchers
def gate_dense_fwd(logits, expert_indices, replay_mask, fallback, score_func, normalize,
                   scaling_factor, padding, ep_size, spread_offset, underflow_guard, align,
                   with_plan, config: DenseConfig | None = None, *, selection=None,
                   return_agreement: bool = False):
    """The backend contract's gate_dense_fwd (with padding="select" the flagged rows take
    the model's own `selection`; with return_agreement the last two outputs hold the
    agreement and the set log-prob, else they are empty); `config` overrides the block
    sizes."""
    T, E = logits.shape
    K = expert_indices.shape[1]
    check_top_k(K, "gate_dense")
    dev = logits.device
    i32 = dict(dtype=torch.int32, device=dev)
    probs = torch.empty(T, E, dtype=logits.dtype, device=dev)
    rmap = torch.empty(T, E, dtype=torch.bool, device=dev)
    flags = torch.empty(T, dtype=torch.uint8, device=dev)
    idx_out = torch.empty(T, K, **i32)
    n_sorted = plan_capacity(T, K, E, align)
    if with_plan:
        tpe, offsets = torch.empty(E, **i32), torch.empty(E + 1, **i32)
        row_id_map, sorted_slots = torch.empty(T, K, **i32), torch.empty(n_sorted, **i32)
    else:
        tpe, offsets = torch.empty(0, **i32), torch.empty(0, **i32)
        row_id_map, sorted_slots = torch.empty(0, K, **i32), torch.empty(0, **i32)
    agree, lp = agreement_outputs(logits, T, return_agreement)
    if T == 0:
        if with_plan:
            tpe.zero_(), offsets.zero_(), sorted_slots.fill_(-1)
        return probs, rmap, flags, idx_out, tpe, offsets, row_id_map, sorted_slots, agree, lp
    cfg = config or gate_dense_config(T, K, E, align)
    pc = cfg.plan
    chunk_counts = torch.empty(1 if pc.single or not with_plan else pc.num_chunks, E, **i32)
    mask = replay_mask if replay_mask is not None else flags  # a placeholder pointer
    fb = fallback if fallback is not None else expert_indices
    sel_ptrs, sel_const = select_args(selection, K).kernel_args(logits)
    with device_ctx(logits):
        _gate_dense_fwd_kernel[(pc.num_chunks,)](
            logits, expert_indices, mask, fb, sel_ptrs[0],
            probs, rmap.view(torch.uint8), flags, idx_out, row_id_map, chunk_counts, tpe,
            offsets, sorted_slots, agree.view(torch.uint8), lp,
            T, E, K, logits.stride(0), logits.stride(1),
            expert_indices.stride(0), expert_indices.stride(1), fb.stride(0), fb.stride(1),
            *split_scale(scaling_factor), ep_size, spread_offset, align, n_sorted,
            *sel_ptrs[1:],
            SCORE=scores.get(score_func).id, NORMALIZE=bool(normalize),
            CDT=compute_type(logits.dtype), PADDING=PADDING_MODES[padding],
            HAS_MASK=replay_mask is not None, HAS_FB=fallback is not None,
            GUARD=bool(underflow_guard), PLAN=bool(with_plan), SINGLE=pc.single,
            BLOCK_T=pc.BLOCK_T, ROW_BLOCK=cfg.ROW_BLOCK, K_PAD=pc.K_PAD, E_BLOCK=pc.E_BLOCK,
            E_HIST=pc.E_HIST, SLOT_BLOCK=pc.SLOT_BLOCK, PAD_J=pc.PAD_J,
            TAIL_BLOCK=pc.TAIL_BLOCK, AGREE=bool(return_agreement), **sel_const,
            **LAUNCH_OPTIONS,
        )
        if with_plan and not pc.single:
            _gate.launch_plan_scan_scatter(pc, idx_out, row_id_map, chunk_counts, tpe, offsets,
                                           sorted_slots, T, E, K, align, n_sorted)
    return probs, rmap, flags, idx_out, tpe, offsets, row_id_map, sorted_slots, agree, lp


def gate_dense_bwd(grad_probs, logits, expert_indices, score_func, normalize, scaling_factor,
                   grad_set_logprob=None):
    # the probs gradient is read in place, any strides
    return launch_logit_grad(_gate_dense_bwd_kernel, "gate_dense_backward", grad_probs,
                             (grad_probs.stride(0), grad_probs.stride(1)), logits,
                             expert_indices, score_func, normalize, scaling_factor,
                             grad_set_logprob)


PROBS_BLOCK_R = 1024


def permute_probs_fwd(probs, sorted_slots, expert_indices, num_rows):
    T, E = probs.shape
    K = expert_indices.shape[1]
    out = torch.empty(num_rows, dtype=probs.dtype, device=probs.device)
    if num_rows == 0:
        return out
    if T == 0:
        return out.zero_()
    sorted_slots = sorted_slots.contiguous()
    with device_ctx(probs):
        _permute_probs_fwd_kernel[(triton.cdiv(num_rows, PROBS_BLOCK_R),)](
            probs, sorted_slots, expert_indices.contiguous(), out, num_rows,
            sorted_slots.shape[0], T, E, K, probs.stride(0), probs.stride(1),
            BLOCK_R=PROBS_BLOCK_R, **LAUNCH_OPTIONS,
        )
    return out


def permute_probs_bwd(grad, row_id_map, expert_indices, num_experts):
    T, K = row_id_map.shape
    check_top_k(K, "permute_probs_backward")
    E = num_experts
    out = torch.empty(T, E, dtype=grad.dtype, device=grad.device)
    if T == 0 or E == 0:
        return out
    cfg = gate_bwd_config(T, K, E)
    with device_ctx(grad):
        _permute_probs_bwd_kernel[(triton.cdiv(T, cfg.BLOCK_T),)](
            grad.contiguous(), row_id_map.contiguous(), expert_indices.contiguous(), out,
            T, E, K, grad.shape[0], CDT=compute_type(grad.dtype), BLOCK_T=cfg.BLOCK_T,
            K_PAD=cfg.K_PAD, E_BLOCK=cfg.E_BLOCK, **LAUNCH_OPTIONS,
        )
    return out
