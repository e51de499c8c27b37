"""Fused replayed gate + dispatch plan, and the gate backward, in Triton.

Public launchers: `gate_fwd`, `gate_bwd` (and the block-size heuristics `gate_config`,
`gate_bwd_config`). The kernels are private.

Forward math, per token t (fp32, or fp64 for fp64 logits), with valid slots k (0 <= idx < E;
any other value, -1 included, is an empty slot):

    softmax, normalize=False:  w[t,k] = s * softmax(x[t,:])[idx[t,k]]
    softmax, normalize=True:   w[t,k] = s * exp(x[t,idx[t,k]]) / sum_valid exp(x[t,idx[t,j]])
    sigmoid / sqrtsoftplus:    c[t,k] = f(x[t,idx[t,k]]);  w = s * c / (sum_valid c + 1e-20)
                               when normalize and more than one slot is valid, else s * c
    empty slots:               w = 0, expert_indices = -1, row_id_map = -1, no row

Every sum over a row (the softmax denominators over E or K, the normalising sums) runs in
a fixed pairwise order (`_common.row_sum`), so a token's results do not depend on the batch
size or the block shape.

Plan, over flat slots f = t*K + k (no atomics anywhere, so the order never depends on
thread timing):

    rank[f]   = #{valid f' < f : idx[f'] == idx[f]}            (one-hot running counts)
    counts[e] = #{valid f : idx[f] == e}
    offsets   = exclusive prefix sum of round_up(counts, align)
    row[f]    = offsets[idx[f]] + rank[f]
    sorted_slots[row[f]] = f;  padding rows and the tail hold -1

Launches:
    T*K <= SINGLE_PROGRAM_MAX_SLOTS: one program does everything (1 launch).
    otherwise: (1) per-chunk weights, ranks and histograms, (2) one program scans the
    chunk histograms into chunk bases and writes counts, offsets and padding, (3) per-chunk
    scatter of rows (3 launches).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import triton
import triton.language as tl

from replay_ops import scores
from replay_ops.plan import plan_capacity

from . import select as _sel
from ._common import (LAUNCH_OPTIONS, ROW_SUM_MAX_WIDTH, cast_rne, chunk_rows, compute_type,
                      device_ctx, fdiv, fsqrt, precise_exp, row_sum, row_tile)

# Score function ids, from the one table (replay_ops/scores.py).
_SOFTMAX: tl.constexpr = tl.constexpr(scores.SOFTMAX.id)
_SIGMOID: tl.constexpr = tl.constexpr(scores.SIGMOID.id)
_SQRTSOFTPLUS: tl.constexpr = tl.constexpr(scores.SQRTSOFTPLUS.id)
_SOFTPLUS_THRESHOLD: tl.constexpr = tl.constexpr(scores.SOFTPLUS_THRESHOLD)
_NORM_EPS: tl.constexpr = tl.constexpr(scores.NORM_EPS)
# Below this logit, sqrt(softplus(z)) is computed as exp(z / 2): softplus(z) = exp(z) to
# working precision there (fp64 included: exp(-40) < 2^-53), and exp(z) itself becomes
# subnormal below -87.3 in fp32 (5 significant bits left at z = -100) or 0, while the score
# exp(z / 2) is still a normal number.
_SQRTSP_LOW: tl.constexpr = tl.constexpr(-40.0)

# The largest K of the Triton gate kernels: the sums over a row's slots (`row_sum`) take
# rows of at most 1024. The backend registry hands larger K to another backend.
MAX_TOPK = ROW_SUM_MAX_WIDTH.value

# NOTE: above ~4K slots a single program serialises too much work; the 3-launch path keeps
# every program's share to BLOCK_T*K ~ 1K slots.
SINGLE_PROGRAM_MAX_SLOTS = 4096
CHUNK_SLOTS = 1024
# NOTE: size of the [SLOT_BLOCK, E_HIST] one-hot tiles of the plan (and [CHUNK_BLOCK,
# E_HIST] of the scan): at 8192 the scan spilled 36 B on sm_80.
ONE_HOT_ELEMS = 4096
# NOTE: BLOCK_T * E_BLOCK, the logits tile of the softmax statistics (softmax with
# normalize=False, forward and backward) that a program holds with its exp. BLOCK_T was
# up to 256 with E_BLOCK 128: the forward spilled 52 B-2.6 KB, and 20-22 KB at E=384;
# the backward (BLOCK_T 64, fp64) 2.5 KB (tools/triton_compile_check.py). At 2048 no
# specialisation spills more than the check's budget of 8 bytes
# (bench/results/triton_compile_sm80_sm90.md).
STATS_TILE_ELEMS = 2048
GRAD_TILE_ELEMS = 8192  # BLOCK_T * K_PAD * E_BLOCK: the work of one column block of the backward


@dataclasses.dataclass(frozen=True)
class GateConfig:
    """Block sizes of the forward kernels (`gate_config`; pinned by the tests)."""

    single: bool  # one program for everything
    BLOCK_T: int  # token rows per block
    K_PAD: int  # next_pow2(K)
    E_HIST: int  # next_pow2(E): width of the histograms
    E_BLOCK: int  # experts per block of the softmax statistics
    SLOT_BLOCK: int  # slots per block of the one-hot ranks
    PAD_J: int  # padding rows written per step
    TAIL_BLOCK: int  # -1 entries of the tail written per step
    CHUNK_BLOCK: int  # chunks per step of the scan
    num_chunks: int  # programs of launches (1) and (3)


@dataclasses.dataclass(frozen=True)
class GateBwdConfig:
    BLOCK_T: int
    K_PAD: int
    E_BLOCK: int


def check_top_k(K: int, op: str) -> None:
    if K > MAX_TOPK:
        raise ValueError(
            f"replay_ops {op} (Triton): K={K} slots per token is above the Triton gate's "
            f"limit of {MAX_TOPK} (its per-row sums take at most {MAX_TOPK} slots); use "
            f"the torch or native backend"
        )


def gate_config(T: int, K: int, E: int, align: int) -> GateConfig:
    """Block sizes for the forward kernels. E_BLOCK depends on E only (the blocked softmax
    statistics then add in the same order whatever T); BLOCK_T is capped so that the
    statistics tile BLOCK_T x E_BLOCK stays within STATS_TILE_ELEMS."""
    check_top_k(K, "gate")
    K_PAD = triton.next_power_of_2(K)
    E_HIST = triton.next_power_of_2(E)
    E_BLOCK = min(E_HIST, 128)
    single = T * K <= SINGLE_PROGRAM_MAX_SLOTS
    BLOCK_T = max(1, min(triton.next_power_of_2(max(1, CHUNK_SLOTS // K)), 256,
                         STATS_TILE_ELEMS // E_BLOCK))
    BLOCK_T = min(BLOCK_T, triton.next_power_of_2(max(T, 1)))
    return GateConfig(
        single=single,
        BLOCK_T=BLOCK_T,
        K_PAD=K_PAD,
        E_HIST=E_HIST,
        E_BLOCK=E_BLOCK,
        SLOT_BLOCK=max(1, min(64, ONE_HOT_ELEMS // E_HIST)),
        PAD_J=max(1, min(triton.next_power_of_2(max(align - 1, 1)), ONE_HOT_ELEMS // E_HIST)),
        TAIL_BLOCK=1024,
        CHUNK_BLOCK=max(1, min(64, ONE_HOT_ELEMS // E_HIST)),
        num_chunks=1 if single else triton.cdiv(T, BLOCK_T),
    )


def gate_bwd_config(T: int, K: int, E: int) -> GateBwdConfig:
    check_top_k(K, "gate backward")
    # At least 2 slot columns (the padding column is masked; its zero adds nothing): with
    # K = 1 and one column, Triton 3.6 crashes compiling the softmax backward for E_BLOCK
    # <= 16 (an assertion `loopResult.hasOneUse()` in its TritonGPUOptimizeThreadLocality
    # pass; tools/triton_compile_check.py under Triton 3.6, `make check-triton`).
    K_PAD = max(2, triton.next_power_of_2(K))
    E_BLOCK = min(triton.next_power_of_2(E), 128)
    BLOCK_T = max(1, min(64, GRAD_TILE_ELEMS // (K_PAD * E_BLOCK), STATS_TILE_ELEMS // E_BLOCK))
    BLOCK_T = min(BLOCK_T, triton.next_power_of_2(max(T, 1)))
    return GateBwdConfig(BLOCK_T=BLOCK_T, K_PAD=K_PAD, E_BLOCK=E_BLOCK)


def split_scale(scaling_factor: float) -> tuple[float, float]:
    """scaling_factor as an fp32 pair (hi, lo) with hi + lo ~= scaling_factor to ~48 bits.
    A Python float kernel argument is passed as fp32; the pair keeps fp64 gates exact
    enough for gradcheck, and in fp32 hi + lo rounds back to hi = fp32(scaling_factor)."""
    hi = float(np.float32(scaling_factor))
    return hi, float(np.float32(scaling_factor - hi))


# ----------------------------------------------------------------------------- math
@triton.jit
def _log1p(u):
    # log(1+u) accurate for tiny u (the classic w = 1+u correction).
    w = 1.0 + u
    return tl.where(w == 1.0, u, fdiv(tl.log(w) * u, w - 1.0))


@triton.jit
def _scale(scale_hi, scale_lo, CDT: tl.constexpr):
    return tl.cast(scale_hi, CDT) + tl.cast(scale_lo, CDT)


@triton.jit
def _sigmoid(z):
    # 1 / (1 + exp(-z)) with the denominator in [1, 2]: exp(-|z|) <= 1 never overflows
    e = precise_exp(-tl.abs(z))
    return tl.where(z >= 0, fdiv(1.0, 1.0 + e), fdiv(e, 1.0 + e))


@triton.jit
def _score(z, SCORE: tl.constexpr):
    """The element-wise score functions of the table (softmax is row-wise, elsewhere)."""
    if SCORE == _SIGMOID:
        return _sigmoid(z)
    elif SCORE == _SQRTSOFTPLUS:
        # sqrt(softplus(z)), softplus linear above 20 like torch.nn.functional.softplus;
        # exp(z / 2) below _SQRTSP_LOW, where softplus(z) = exp(z) may be subnormal
        # (tl.minimum/maximum drop a NaN on the GPU: it is put back at the end)
        zc = tl.minimum(tl.maximum(z, _SQRTSP_LOW), _SOFTPLUS_THRESHOLD)
        sp = tl.where(z > _SOFTPLUS_THRESHOLD, z, _log1p(precise_exp(zc)))
        c = tl.where(z < _SQRTSP_LOW, precise_exp(0.5 * z), fsqrt(sp))
        return tl.where(z != z, z, c)
    else:
        tl.static_assert(False, "replay_ops gate: no element-wise score function of this id")


@triton.jit
def _score_grad(z, c, SCORE: tl.constexpr):
    """d score / dz given the score c."""
    if SCORE == _SIGMOID:
        return c * (1.0 - c)
    elif SCORE == _SQRTSOFTPLUS:
        # sigmoid(z) / (2 c); below _SQRTSP_LOW, where c = exp(z / 2), the derivative c / 2
        slope = tl.where(z > _SOFTPLUS_THRESHOLD, 1.0, _sigmoid(z))
        dc = tl.where(c > 0.0, fdiv(slope, 2.0 * tl.where(c > 0.0, c, 1.0)), 0.0)
        return tl.where(z < _SQRTSP_LOW, 0.5 * c, dc)
    else:
        tl.static_assert(False, "replay_ops gate: no element-wise score function of this id")


@triton.jit
def _row_softmax_stats(Logits_ptr, rows, rmask, stride_lt, stride_le, E,
                       CDT: tl.constexpr, BLOCK_T: tl.constexpr, E_BLOCK: tl.constexpr):
    """Online max and sum(exp(x - max)) over all E for a block of rows. A row of -inf logits
    keeps its max of -inf, so its weights are NaN, as torch.softmax's (the shift of the sum
    is 0 there, and the sum 0)."""
    m = tl.full([BLOCK_T], float("-inf"), CDT)
    s = tl.zeros([BLOCK_T], CDT)
    for e0 in range(0, E, E_BLOCK):
        ecols = e0 + tl.arange(0, E_BLOCK)
        lmask = rmask[:, None] & (ecols < E)[None, :]
        x = tl.load(Logits_ptr + rows[:, None] * stride_lt
                    + ecols.to(tl.int64)[None, :] * stride_le,
                    mask=lmask, other=float("-inf")).to(CDT)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * precise_exp(m - shift) + row_sum(precise_exp(x - shift[:, None]), BLOCK_T,
                                                 E_BLOCK)
        m = m_new
    return m, s


@triton.jit
def _masked_softmax(x, valid, BLOCK_T: tl.constexpr, K_PAD: tl.constexpr):
    """Softmax of each row over its valid entries (0 elsewhere; an all-empty row is 0). A
    max of -inf (no valid entry, or all -inf) is taken as 0, so such a row is 0."""
    z = tl.where(valid, x, float("-inf"))
    m = tl.max(z, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    e = tl.where(valid, precise_exp(z - m[:, None]), 0.0)
    s = row_sum(e, BLOCK_T, K_PAD)
    return fdiv(e, tl.where(s == 0.0, 1.0, s)[:, None])


@triton.jit
def _load_slots(Idx_ptr, rows, cols, m2, stride_it, stride_ik, E):
    """(int32 expert of each slot, -1 where empty; valid mask) for a [rows, cols] block. The
    range is tested on the index's own width (int64 included) before the narrowing."""
    raw = tl.load(Idx_ptr + rows[:, None] * stride_it + cols.to(tl.int64)[None, :] * stride_ik,
                  mask=m2, other=-1)
    valid = m2 & (raw >= 0) & (raw < E)
    return tl.where(valid, raw, -1).to(tl.int32), valid


@triton.jit
def _gate_weights_block(
    Logits_ptr, Idx_ptr, Mask_ptr, Bias_ptr, W_ptr, IdxOut_ptr, Agree_ptr, Lp_ptr,
    r0, T, E, K, stride_lt, stride_le, stride_it, stride_ik, scale_hi, scale_lo,
    num_groups, group_topk, group_topn,
    SCORE: tl.constexpr, NORMALIZE: tl.constexpr, CDT: tl.constexpr,
    HAS_MASK: tl.constexpr, PAD_SELECT: tl.constexpr, AGREE: tl.constexpr,
    SRC_LOGITS: tl.constexpr, ROUND: tl.constexpr, HAS_BIAS: tl.constexpr,
    RANKS_LOGITS: tl.constexpr, GROUPED: tl.constexpr,
    BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, E_BLOCK: tl.constexpr,
    E_HIST: tl.constexpr, G_PAD: tl.constexpr,
):
    rows, cols, rmask, m2 = row_tile(r0, T, K, BLOCK_T, K_PAD)
    idx, valid = _load_slots(Idx_ptr, rows, cols, m2, stride_it, stride_ik, E)
    if HAS_MASK or PAD_SELECT or AGREE:
        # the rows without a usable route take the model's own selection (select.py)
        need = rows < 0
        if HAS_MASK:
            need = need | (tl.load(Mask_ptr + rows, mask=rmask, other=1).to(tl.int32) == 0)
        if PAD_SELECT:
            need = need | (_sel.row_flags(Idx_ptr, rows, rmask, cols, E, K, stride_it,
                                          stride_ik) != 0)
        idx, agree = _sel.select_rows(idx, need, rows, rmask, Logits_ptr, Bias_ptr, E, K,
                                      stride_lt, stride_le, num_groups, group_topk,
                                      group_topn, SCORE, SRC_LOGITS, ROUND, HAS_BIAS,
                                      RANKS_LOGITS, GROUPED, AGREE, CDT, BLOCK_T, K_PAD,
                                      E_HIST, G_PAD)
        idx = tl.where(m2, idx, -1)
        valid = m2 & (idx >= 0)
        if AGREE:
            tl.store(Agree_ptr + rows, agree.to(tl.uint8), mask=rmask)
            lp = _set_logprob(idx, Logits_ptr, rows, rmask, cols, E, K, stride_lt, stride_le,
                              SCORE, CDT, BLOCK_T, K_PAD, E_BLOCK)
            tl.store(Lp_ptr + rows, lp, mask=rmask)
    w = _slot_weights(idx, valid, Logits_ptr, rows, rmask, E, stride_lt, stride_le, scale_hi,
                      scale_lo, SCORE, NORMALIZE, CDT, BLOCK_T, K_PAD, E_BLOCK)
    out = rows[:, None] * K + cols[None, :]
    tl.store(W_ptr + out, cast_rne(w, W_ptr.dtype.element_ty), mask=m2)
    tl.store(IdxOut_ptr + out, idx, mask=m2)


@triton.jit
def _slot_experts(Idx_ptr, f, fmask, K, stride_it, stride_ik, E):
    """Expert of flat slot f: -1 for empty slots (any value outside [0, E)) and past the end.
    The division is 32-bit (a 64-bit one is a subroutine on the GPU): f < T*K < 2^31."""
    f = f.to(tl.int32)
    t = f // K
    k = f - t * K
    raw = tl.load(Idx_ptr + t.to(tl.int64) * stride_it + k.to(tl.int64) * stride_ik,
                  mask=fmask, other=-1)
    return tl.where((raw >= 0) & (raw < E), raw, -1).to(tl.int32)


@triton.jit
def _one_hot_ranks(e, running, E_HIST: tl.constexpr):
    """For a block of slots with experts e (-1 = none): rank of each slot among earlier
    slots of the same expert (running counts carried in), and the updated counts."""
    hit = (e[:, None] == tl.arange(0, E_HIST)[None, :]).to(tl.int32)
    before = tl.cumsum(hit, axis=0) - hit + running[None, :]
    rank = tl.sum(before * hit, axis=1)
    return rank, running + tl.sum(hit, axis=0)


@triton.jit
def _write_offsets_and_padding(
    counts, Tpe_ptr, Offsets_ptr, Sorted_ptr, E, align, n_sorted,
    E_HIST: tl.constexpr, PAD_J: tl.constexpr, TAIL_BLOCK: tl.constexpr,
):
    """Store counts and aligned offsets, fill padding rows and the tail of sorted_slots
    with -1. Returns the exclusive offsets [E_HIST]."""
    ecols = tl.arange(0, E_HIST)
    emask = ecols < E
    counts = tl.where(emask, counts, 0)
    padded = (counts + align - 1) // align * align
    incl = tl.cumsum(padded, axis=0)
    offsets = incl - padded
    total = tl.sum(padded, axis=0)
    tl.store(Tpe_ptr + ecols, counts, mask=emask)
    tl.store(Offsets_ptr + ecols, offsets, mask=emask)
    tl.store(Offsets_ptr + E, total)
    # padding rows: [offsets[e] + counts[e], offsets[e] + padded[e])
    start = (offsets + counts).to(tl.int64)
    npad = padded - counts
    for j0 in range(0, align - 1, PAD_J):
        j = j0 + tl.arange(0, PAD_J)
        pm = emask[:, None] & (j[None, :] < npad[:, None])
        tl.store(Sorted_ptr + start[:, None] + j[None, :],
                 tl.full([E_HIST, PAD_J], -1, tl.int32), mask=pm)
    # 64-bit: p0 + TAIL_BLOCK passes 2^31 when n_sorted is close to it
    for p0 in range(total.to(tl.int64), n_sorted, TAIL_BLOCK):
        p = p0 + tl.arange(0, TAIL_BLOCK)
        tl.store(Sorted_ptr + p, tl.full([TAIL_BLOCK], -1, tl.int32), mask=p < n_sorted)
    return offsets


@triton.jit
def _plan_of_slots(
    Idx_ptr, stride_it, stride_ik, RowMap_ptr, ChunkCounts_ptr, Tpe_ptr, Offsets_ptr,
    Sorted_ptr, pid, f_begin, f_end, E, K, align, n_sorted,
    SINGLE: tl.constexpr, E_HIST: tl.constexpr, SLOT_BLOCK: tl.constexpr,
    PAD_J: tl.constexpr, TAIL_BLOCK: tl.constexpr,
):
    """The plan over the slots [f_begin, f_end) of the experts at Idx_ptr (both gate
    kernels): with SINGLE (every slot) the whole plan, a histogram pass then a rank-and-
    scatter pass; else this chunk's slot ranks (kept in row_id_map) and its expert
    histogram (row `pid` of ChunkCounts) for the scan and scatter kernels."""
    running = tl.zeros([E_HIST], tl.int32)
    if SINGLE:
        # pass 1: histogram
        for f0 in range(f_begin, f_end, SLOT_BLOCK):
            f = f0 + tl.arange(0, SLOT_BLOCK)
            e = _slot_experts(Idx_ptr, f, f < f_end, K, stride_it, stride_ik, E)
            hit = (e[:, None] == tl.arange(0, E_HIST)[None, :]).to(tl.int32)
            running += tl.sum(hit, axis=0)
        offsets = _write_offsets_and_padding(running, Tpe_ptr, Offsets_ptr, Sorted_ptr, E,
                                             align, n_sorted, E_HIST, PAD_J, TAIL_BLOCK)
        # pass 2: ranks and scatter
        running = tl.zeros([E_HIST], tl.int32)
        for f0 in range(f_begin, f_end, SLOT_BLOCK):
            f = f0 + tl.arange(0, SLOT_BLOCK)
            fmask = f < f_end
            e = _slot_experts(Idx_ptr, f, fmask, K, stride_it, stride_ik, E)
            rank, running = _one_hot_ranks(e, running, E_HIST)
            base = tl.sum(tl.where(e[:, None] == tl.arange(0, E_HIST)[None, :],
                                   offsets[None, :], 0), axis=1)
            valid = fmask & (e >= 0)
            row = tl.where(valid, base + rank, -1)
            tl.store(RowMap_ptr + f, row, mask=fmask)
            tl.store(Sorted_ptr + row, f.to(tl.int32), mask=valid)
    else:
        for f0 in range(f_begin, f_end, SLOT_BLOCK):
            f = f0 + tl.arange(0, SLOT_BLOCK)
            fmask = f < f_end
            e = _slot_experts(Idx_ptr, f, fmask, K, stride_it, stride_ik, E)
            rank, running = _one_hot_ranks(e, running, E_HIST)
            tl.store(RowMap_ptr + f, tl.where(e >= 0, rank, -1), mask=fmask)
        ecols = tl.arange(0, E_HIST)
        tl.store(ChunkCounts_ptr + pid * E + ecols, running, mask=ecols < E)


@triton.jit
def _gate_fwd_kernel(
    # inputs
    Logits_ptr, Idx_ptr, Mask_ptr, Bias_ptr,
    # outputs
    W_ptr, IdxOut_ptr, RowMap_ptr, ChunkCounts_ptr, Tpe_ptr, Offsets_ptr, Sorted_ptr,
    Agree_ptr, Lp_ptr,
    # sizes and strides
    T, E, K, stride_lt, stride_le, stride_it, stride_ik, scale_hi, scale_lo, align, n_sorted,
    num_groups, group_topk, group_topn,
    # constexprs
    SCORE: tl.constexpr, NORMALIZE: tl.constexpr, CDT: tl.constexpr, SINGLE: tl.constexpr,
    BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, E_BLOCK: tl.constexpr, E_HIST: tl.constexpr,
    SLOT_BLOCK: tl.constexpr, PAD_J: tl.constexpr, TAIL_BLOCK: tl.constexpr,
    HAS_MASK: tl.constexpr, PAD_SELECT: tl.constexpr, AGREE: tl.constexpr,
    SRC_LOGITS: tl.constexpr, ROUND: tl.constexpr, HAS_BIAS: tl.constexpr,
    RANKS_LOGITS: tl.constexpr, GROUPED: tl.constexpr, G_PAD: tl.constexpr,
):
    """Weights for this program's rows (the flagged rows first take the model's own
    selection, select.py), then either the whole plan (SINGLE) or this chunk's slot ranks
    (kept in row_id_map) and expert histogram (multi-chunk). With a selection the plan
    reads the experts this program wrote."""
    pid, row_begin, row_end = chunk_rows(T, SINGLE, BLOCK_T)
    for r0 in range(row_begin, row_end, BLOCK_T):
        _gate_weights_block(Logits_ptr, Idx_ptr, Mask_ptr, Bias_ptr, W_ptr, IdxOut_ptr,
                            Agree_ptr, Lp_ptr, r0, T, E, K,
                            stride_lt, stride_le, stride_it, stride_ik, scale_hi, scale_lo,
                            num_groups, group_topk, group_topn,
                            SCORE, NORMALIZE, CDT, HAS_MASK, PAD_SELECT, AGREE, SRC_LOGITS,
                            ROUND, HAS_BIAS, RANKS_LOGITS, GROUPED, BLOCK_T, K_PAD, E_BLOCK,
                            E_HIST, G_PAD)
    if HAS_MASK or PAD_SELECT:
        tl.debug_barrier()  # the experts this program wrote are read back below
        _plan_of_slots(IdxOut_ptr, K, 1, RowMap_ptr, ChunkCounts_ptr, Tpe_ptr,
                       Offsets_ptr, Sorted_ptr, pid, row_begin * K, row_end * K, E, K, align,
                       n_sorted, SINGLE, E_HIST, SLOT_BLOCK, PAD_J, TAIL_BLOCK)
    else:
        _plan_of_slots(Idx_ptr, stride_it, stride_ik, RowMap_ptr, ChunkCounts_ptr, Tpe_ptr,
                       Offsets_ptr, Sorted_ptr, pid, row_begin * K, row_end * K, E, K, align,
                       n_sorted, SINGLE, E_HIST, SLOT_BLOCK, PAD_J, TAIL_BLOCK)


@triton.jit
def _plan_scan_kernel(
    ChunkCounts_ptr, Tpe_ptr, Offsets_ptr, Sorted_ptr,
    num_chunks, E, align, n_sorted,
    E_HIST: tl.constexpr, CHUNK_BLOCK: tl.constexpr, PAD_J: tl.constexpr,
    TAIL_BLOCK: tl.constexpr,
):
    """One program: chunk histograms -> exclusive chunk bases (in place), then counts,
    aligned offsets and padding."""
    ecols = tl.arange(0, E_HIST)
    emask = ecols < E
    running = tl.zeros([E_HIST], tl.int32)
    for c0 in range(0, num_chunks, CHUNK_BLOCK):
        c = (c0 + tl.arange(0, CHUNK_BLOCK)).to(tl.int64)
        m = (c < num_chunks)[:, None] & emask[None, :]
        ptr = ChunkCounts_ptr + c[:, None] * E + ecols[None, :]
        cnt = tl.load(ptr, mask=m, other=0)
        tl.store(ptr, tl.cumsum(cnt, axis=0) - cnt + running[None, :], mask=m)
        running += tl.sum(cnt, axis=0)
    _write_offsets_and_padding(running, Tpe_ptr, Offsets_ptr, Sorted_ptr, E, align,
                               n_sorted, E_HIST, PAD_J, TAIL_BLOCK)


@triton.jit
def _plan_scatter_kernel(
    IdxOut_ptr, RowMap_ptr, ChunkCounts_ptr, Offsets_ptr, Sorted_ptr,
    T, E, K,
    BLOCK_T: tl.constexpr, SLOT_BLOCK: tl.constexpr,
):
    """row = offsets[e] + chunk_base[chunk, e] + rank, for this chunk's slots (the int32
    experts written by launch (1): -1 or in [0, E))."""
    pid = tl.program_id(0).to(tl.int64)
    f_begin = pid * BLOCK_T * K
    f_end = tl.minimum(f_begin + BLOCK_T * K, T * K)
    for f0 in range(f_begin, f_end, SLOT_BLOCK):
        f = f0 + tl.arange(0, SLOT_BLOCK)
        fmask = f < f_end
        e = tl.load(IdxOut_ptr + f, mask=fmask, other=-1)
        valid = fmask & (e >= 0)
        rank = tl.load(RowMap_ptr + f, mask=valid, other=0)
        es = tl.where(valid, e, 0).to(tl.int64)
        base = tl.load(Offsets_ptr + es, mask=valid, other=0) + \
            tl.load(ChunkCounts_ptr + pid * E + es, mask=valid, other=0)
        row = tl.where(valid, base + rank, -1)
        tl.store(RowMap_ptr + f, row, mask=fmask)
        tl.store(Sorted_ptr + row, f.to(tl.int32), mask=valid)


@triton.jit
def _slot_weights(idx, valid, Logits_ptr, rows, rmask, E, stride_lt, stride_le, scale_hi,
                  scale_lo, SCORE: tl.constexpr, NORMALIZE: tl.constexpr, CDT: tl.constexpr,
                  BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, E_BLOCK: tl.constexpr):
    """Scaled gate weights [BLOCK_T, K_PAD] of the rows' valid slots (0 elsewhere), in the
    compute dtype; shared by the gate's and the dense gate's forward kernels."""
    x = tl.load(Logits_ptr + rows[:, None] * stride_lt + idx.to(tl.int64) * stride_le,
                mask=valid, other=0.0).to(CDT)
    if SCORE == _SOFTMAX:
        if NORMALIZE:
            w = _masked_softmax(x, valid, BLOCK_T, K_PAD)
        else:
            m, s = _row_softmax_stats(Logits_ptr, rows, rmask, stride_lt, stride_le, E,
                                      CDT, BLOCK_T, E_BLOCK)
            w = fdiv(precise_exp(x - m[:, None]), tl.where(s == 0.0, 1.0, s)[:, None])
    else:
        c = tl.where(valid, _score(x, SCORE), 0.0)
        if NORMALIZE:
            nvalid = tl.sum(valid.to(tl.int32), axis=1)
            denom = row_sum(c, BLOCK_T, K_PAD) + _NORM_EPS
            w = tl.where((nvalid > 1)[:, None], fdiv(c, denom[:, None]), c)
        else:
            w = c
    w = tl.where(valid, w * _scale(scale_hi, scale_lo, CDT), 0.0)
    return w


@triton.jit
def _elementwise_total(Logits_ptr, rows, rmask, E, stride_lt, stride_le, SCORE: tl.constexpr,
                       CDT: tl.constexpr, BLOCK_T: tl.constexpr, E_BLOCK: tl.constexpr):
    """sum over all E of f(x_j) [BLOCK_T]: blocks of E_BLOCK in order, each a pairwise
    row_sum."""
    tot = tl.zeros([BLOCK_T], CDT)
    for e0 in range(0, E, E_BLOCK):
        ecols = e0 + tl.arange(0, E_BLOCK)
        lmask = rmask[:, None] & (ecols < E)[None, :]
        x = tl.load(Logits_ptr + rows[:, None] * stride_lt
                    + ecols.to(tl.int64)[None, :] * stride_le, mask=lmask, other=0.0).to(CDT)
        tot += row_sum(tl.where(lmask, _score(x, SCORE), 0.0), BLOCK_T, E_BLOCK)
    return tot


@triton.jit
def _set_parts(idx, Logits_ptr, rows, rmask, cols, E, K, stride_lt, stride_le,
               SCORE: tl.constexpr, CDT: tl.constexpr, BLOCK_T: tl.constexpr,
               K_PAD: tl.constexpr, E_BLOCK: tl.constexpr):
    """The parts of the set log-prob of the rows' distinct used experts S (docs/ops.md):
    (members [BLOCK_T, K_PAD], the members' logits, a, b, ok [BLOCK_T]) with, for softmax,
    a = lse_S and b = lse over all E; element-wise, a = sum_S f(x_e) and b = sum_E f(x_j);
    ok False where S is empty, max x_S is -inf or the mass is 0."""
    mem = _sel.members(idx, cols, K)
    x = tl.load(Logits_ptr + rows[:, None] * stride_lt + tl.where(mem, idx, 0).to(tl.int64)
                * stride_le, mask=mem, other=0.0).to(CDT)
    if SCORE == _SOFTMAX:
        z = tl.where(mem, x, float("-inf"))
        ms = tl.max(z, axis=1)
        ok = ms != float("-inf")
        sh = tl.where(ok, ms, 0.0)
        ss = row_sum(tl.where(mem, precise_exp(z - sh[:, None]), 0.0), BLOCK_T, K_PAD)
        a = sh + tl.log(tl.where(ok, ss, 1.0))
        m, s = _row_softmax_stats(Logits_ptr, rows, rmask, stride_lt, stride_le, E, CDT,
                                  BLOCK_T, E_BLOCK)
        b = m + tl.log(s)
    else:
        a = row_sum(tl.where(mem, _score(x, SCORE), 0.0), BLOCK_T, K_PAD)
        ok = a > 0.0
        b = _elementwise_total(Logits_ptr, rows, rmask, E, stride_lt, stride_le, SCORE, CDT,
                               BLOCK_T, E_BLOCK)
    return mem, x, a, b, ok


@triton.jit
def _set_logprob(idx, Logits_ptr, rows, rmask, cols, E, K, stride_lt, stride_le,
                 SCORE: tl.constexpr, CDT: tl.constexpr, BLOCK_T: tl.constexpr,
                 K_PAD: tl.constexpr, E_BLOCK: tl.constexpr):
    """set_logprob [BLOCK_T] of the rows' used experts: softmax lse_S - lse, element-wise
    log(mass_S) - log(mass_E); -inf where `ok` is False."""
    mem, x, a, b, ok = _set_parts(idx, Logits_ptr, rows, rmask, cols, E, K, stride_lt,
                                  stride_le, SCORE, CDT, BLOCK_T, K_PAD, E_BLOCK)
    if SCORE == _SOFTMAX:
        lp = a - b
    else:
        lp = tl.log(tl.where(ok, a, 1.0)) - tl.log(b)
    return tl.where(ok, lp, float("-inf"))


@triton.jit
def _col(x, cols, k):
    """Column k of a [R, K_PAD] tile (a masked sum with one term is exact)."""
    return tl.sum(tl.where(cols[None, :] == k, x, 0), axis=1)


@triton.jit
def _slot_sums(idx, v, cols, ecols, K, R: tl.constexpr, E_BLOCK: tl.constexpr,
               CDT: tl.constexpr):
    """The [R, E_BLOCK] tile of dense columns ecols: column e is the sum of v's slots routed
    to e, added in column order k = 0..K-1 (a loop, not unrolled: see `_gate_bwd_kernel`)."""
    acc = tl.zeros([R, E_BLOCK], CDT)
    for k in range(0, K):
        acc += tl.where(_col(idx, cols, k)[:, None] == ecols[None, :],
                        _col(v, cols, k)[:, None], 0.0)
    return acc


@triton.jit
def _store_logit_grad(g, idx, valid, Logits_ptr, DLogits_ptr, GLp_ptr, rows, cols, rmask, E,
                      K, stride_lt, stride_le, SCORE: tl.constexpr, NORMALIZE: tl.constexpr,
                      DENSE: tl.constexpr, HAS_GLP: tl.constexpr, CDT: tl.constexpr,
                      BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, E_BLOCK: tl.constexpr):
    """The rows' dense [T, E] logits gradient from the scaled slot gradients g
    [BLOCK_T, K_PAD] (the math of `_gate_bwd_kernel`'s docstring), plus (HAS_GLP) the
    gradient of set_logprob for the upstream gradient at GLp_ptr [T]:
        softmax:      gl * ([j in S] exp(x_j - lse_S) - exp(x_j - lse))
        element-wise: gl * f'(x_j) * ([j in S] / mass_S - 1 / mass_E)
    (0 for a row whose set_logprob is -inf), written once per element; shared by the
    gate's and the dense gate's backward kernels."""
    x = tl.load(Logits_ptr + rows[:, None] * stride_lt + idx.to(tl.int64) * stride_le,
                mask=valid, other=0.0).to(CDT)
    if DENSE:
        m, s = _row_softmax_stats(Logits_ptr, rows, rmask, stride_lt, stride_le, E,
                                  CDT, BLOCK_T, E_BLOCK)
        s = tl.where(s == 0.0, 1.0, s)
        dz = tl.where(valid, g * fdiv(precise_exp(x - m[:, None]), s[:, None]), 0.0)
        c = row_sum(dz, BLOCK_T, K_PAD)
    else:
        if SCORE == _SOFTMAX:
            q = _masked_softmax(x, valid, BLOCK_T, K_PAD)
            dz = q * (g - row_sum(g * q, BLOCK_T, K_PAD)[:, None])
        else:
            c = tl.where(valid, _score(x, SCORE), 0.0)
            dc = _score_grad(x, c, SCORE)
            if NORMALIZE:
                nvalid = tl.sum(valid.to(tl.int32), axis=1)
                S = row_sum(c, BLOCK_T, K_PAD) + _NORM_EPS
                D = row_sum(g * c, BLOCK_T, K_PAD)
                gn = fdiv(g, S[:, None]) - fdiv(fdiv(D, S), S)[:, None]
                g = tl.where((nvalid > 1)[:, None], gn, g)
            dz = g * dc
        dz = tl.where(valid, dz, 0.0)
    if HAS_GLP:
        # the members' part of the set log-prob gradient joins the slot sums
        mem, xs, a, b, ok = _set_parts(idx, Logits_ptr, rows, rmask, cols, E, K, stride_lt,
                                       stride_le, SCORE, CDT, BLOCK_T, K_PAD, E_BLOCK)
        gl = tl.load(GLp_ptr + rows, mask=rmask, other=0.0).to(CDT)
        gl = tl.where(ok, gl, 0.0)
        if SCORE == _SOFTMAX:
            inside = gl[:, None] * precise_exp(xs - a[:, None])
        else:
            inside = fdiv(gl[:, None] * _score_grad(xs, _score(xs, SCORE), SCORE),
                          tl.where(ok, a, 1.0)[:, None])
        dz = dz + tl.where(mem & ok[:, None], inside, 0.0)
    for e0 in range(0, E, E_BLOCK):
        ecols = e0 + tl.arange(0, E_BLOCK)
        emask = rmask[:, None] & (ecols < E)[None, :]
        acc = _slot_sums(idx, dz, cols, ecols, K, BLOCK_T, E_BLOCK, CDT)
        if HAS_GLP:
            xa = tl.load(Logits_ptr + rows[:, None] * stride_lt
                         + ecols.to(tl.int64)[None, :] * stride_le,
                         mask=emask, other=0.0).to(CDT)
            if SCORE == _SOFTMAX:
                out = gl[:, None] * precise_exp(xa - b[:, None])
            else:
                out = fdiv(gl[:, None] * _score_grad(xa, _score(xa, SCORE), SCORE),
                           tl.where(ok, b, 1.0)[:, None])
            acc = acc - tl.where(ok[:, None] & emask, out, 0.0)
        if DENSE:
            xl = tl.load(Logits_ptr + rows[:, None] * stride_lt
                         + ecols.to(tl.int64)[None, :] * stride_le,
                         mask=emask, other=float("-inf")).to(CDT)
            acc = acc - fdiv(precise_exp(xl - m[:, None]), s[:, None]) * c[:, None]
        tl.store(DLogits_ptr + rows[:, None] * E + ecols[None, :],
                 cast_rne(acc, DLogits_ptr.dtype.element_ty), mask=emask)


@triton.jit
def _gate_bwd_kernel(
    # inputs
    G_ptr, Logits_ptr, Idx_ptr, GLp_ptr,
    # outputs
    DLogits_ptr,
    # sizes and strides
    T, E, K, stride_lt, stride_le, scale_hi, scale_lo,
    # constexprs
    SCORE: tl.constexpr, NORMALIZE: tl.constexpr, DENSE: tl.constexpr, HAS_GLP: tl.constexpr,
    CDT: tl.constexpr, BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, E_BLOCK: tl.constexpr,
):
    """Dense [T, E] logits gradient from the [T, K] weight gradient g (s = scaling):

        softmax, no norm:  dx_j = sum_k a_k [j == i_k] - p_j * sum_k a_k,  a_k = s g_k p_{i_k}
        softmax, norm:     dz_k = s q_k (g_k - sum_j g_j q_j)
        sigmoid/sqrtsp:    dz_k = f'(z_k) * s (g_k / S - (D / S) / S)   (normalised;
                           D = sum_j g_j c_j)
                           dz_k = f'(z_k) * s g_k                       (otherwise)
    The slot gradients of a column are added in column order k = 0..K-1 (a loop, not
    unrolled: unrolled, K = 200 took 9 s to compile and spilled 2.8 KB). Each output element
    is written exactly once; no atomics."""
    rows, cols, rmask, m2 = row_tile(tl.program_id(0).to(tl.int64) * BLOCK_T, T, K, BLOCK_T,
                                     K_PAD)
    kk = rows[:, None] * K + cols[None, :]
    idx, valid = _load_slots(Idx_ptr, rows, cols, m2, K, 1, E)
    g = tl.load(G_ptr + kk, mask=valid, other=0.0).to(CDT) * _scale(scale_hi, scale_lo, CDT)
    _store_logit_grad(g, idx, valid, Logits_ptr, DLogits_ptr, GLp_ptr, rows, cols, rmask, E,
                      K, stride_lt, stride_le, SCORE, NORMALIZE, DENSE, HAS_GLP, CDT, BLOCK_T,
                      K_PAD, E_BLOCK)


# -------------------------------------------------------------------------- launchers
@dataclasses.dataclass(frozen=True)
class SelectArgs:
    """The kernels' arguments of a replay_ops.Selection for K slots (`select_args`)."""

    bias: torch.Tensor | None
    src_logits: bool
    round_scores: bool
    ranks_logits: bool
    num_groups: int
    group_topk: int
    group_topn: int

    def kernel_args(self, logits):
        """(Bias pointer, num_groups, group_topk, group_topn) and the constexprs."""
        bias = self.bias.contiguous() if self.bias is not None else logits
        return ((bias, self.num_groups, self.group_topk, self.group_topn),
                dict(SRC_LOGITS=self.src_logits, ROUND=self.round_scores,
                     HAS_BIAS=self.bias is not None, RANKS_LOGITS=self.ranks_logits,
                     GROUPED=self.num_groups > 0,
                     G_PAD=triton.next_power_of_2(max(self.num_groups, 1))))


def select_args(selection, K: int) -> SelectArgs:
    """The kernel arguments of a replay_ops.Selection (None: the default selection)."""
    if selection is None:
        return SelectArgs(None, False, False, True, 0, 0, 0)
    grouped = selection.grouped
    return SelectArgs(selection.expert_bias, selection.source == "logits",
                      bool(selection.round_scores), bool(selection.ranks_logits),
                      int(selection.num_groups) if grouped else 0,
                      int(selection.group_topk) if grouped else 0,
                      int(selection.group_topn(K)) if grouped else 0)


def agreement_outputs(logits, T: int, on: bool):
    """(agreement bool [T], set_logprob [T] in the compute dtype), or two empty tensors."""
    n = T if on else 0
    return (torch.empty(n, dtype=torch.bool, device=logits.device),
            torch.empty(n, dtype=torch.float64 if logits.dtype == torch.float64
                        else torch.float32, device=logits.device))


def gate_fwd(logits, expert_indices, score_func, normalize, scaling_factor, align,
             config: GateConfig | None = None, *, replay_mask=None, pad_select: bool = False,
             selection=None, return_agreement: bool = False, weights_dtype=None):
    """Gate weights + dispatch plan + (agreement, set_logprob) (the backend contract's
    gate_fwd); `config` overrides the block sizes. Rows with replay_mask False, and with
    pad_select the rows with a -1 slot, an id out of range or a repeated expert, take the
    model's own `selection` (replay_ops.Selection) inside the kernel. `weights_dtype`: the
    weights' dtype (None: the logits'; the compute type stores them unrounded)."""
    T, E = logits.shape
    K = expert_indices.shape[1]
    dev = logits.device
    agree, lp = agreement_outputs(logits, T, return_agreement)
    i32 = dict(dtype=torch.int32, device=dev)
    n_sorted = plan_capacity(T, K, E, align)
    weights = torch.empty(T, K, dtype=weights_dtype or logits.dtype, device=dev)
    idx_out = torch.empty(T, K, **i32)
    row_id_map = torch.empty(T, K, **i32)
    tpe = torch.empty(E, **i32)
    offsets = torch.empty(E + 1, **i32)
    sorted_slots = torch.empty(n_sorted, **i32)
    if T == 0:
        return (weights, idx_out, tpe.zero_(), offsets.zero_(), row_id_map,
                sorted_slots.fill_(-1), agree, lp)
    cfg = config or gate_config(T, K, E, align)
    chunk_counts = torch.empty(1 if cfg.single else cfg.num_chunks, E, **i32)
    sel_ptrs, sel_const = select_args(selection, K).kernel_args(logits)
    mask = replay_mask if replay_mask is not None else idx_out  # a placeholder pointer
    with device_ctx(logits):
        _gate_fwd_kernel[(cfg.num_chunks,)](
            logits, expert_indices, mask, sel_ptrs[0],
            weights, idx_out, row_id_map, chunk_counts, tpe, offsets, sorted_slots,
            agree.view(torch.uint8), lp,
            T, E, K, logits.stride(0), logits.stride(1),
            expert_indices.stride(0), expert_indices.stride(1),
            *split_scale(scaling_factor), align, n_sorted, *sel_ptrs[1:],
            SCORE=scores.get(score_func).id, NORMALIZE=bool(normalize),
            CDT=compute_type(logits.dtype), SINGLE=cfg.single, BLOCK_T=cfg.BLOCK_T,
            K_PAD=cfg.K_PAD, E_BLOCK=cfg.E_BLOCK, E_HIST=cfg.E_HIST, SLOT_BLOCK=cfg.SLOT_BLOCK,
            PAD_J=cfg.PAD_J, TAIL_BLOCK=cfg.TAIL_BLOCK, HAS_MASK=replay_mask is not None,
            PAD_SELECT=bool(pad_select), AGREE=bool(return_agreement), **sel_const,
            **LAUNCH_OPTIONS,
        )
        if not cfg.single:
            launch_plan_scan_scatter(cfg, idx_out, row_id_map, chunk_counts, tpe, offsets,
                                     sorted_slots, T, E, K, align, n_sorted)
    return weights, idx_out, tpe, offsets, row_id_map, sorted_slots, agree, lp


def launch_plan_scan_scatter(cfg: GateConfig, idx_out, row_id_map, chunk_counts, tpe, offsets,
                             sorted_slots, T, E, K, align, n_sorted):
    """Launches (2) and (3) of a multi-chunk plan (both gate forwards): the scan of the
    chunks' histograms, then the scatter of every chunk's slots to their rows."""
    _plan_scan_kernel[(1,)](
        chunk_counts, tpe, offsets, sorted_slots, cfg.num_chunks, E, align, n_sorted,
        E_HIST=cfg.E_HIST, CHUNK_BLOCK=cfg.CHUNK_BLOCK, PAD_J=cfg.PAD_J,
        TAIL_BLOCK=cfg.TAIL_BLOCK, **LAUNCH_OPTIONS,
    )
    _plan_scatter_kernel[(cfg.num_chunks,)](
        idx_out, row_id_map, chunk_counts, offsets, sorted_slots, T, E, K,
        BLOCK_T=cfg.BLOCK_T, SLOT_BLOCK=cfg.SLOT_BLOCK, **LAUNCH_OPTIONS,
    )


def gate_bwd(grad_weights, logits, expert_indices, score_func, normalize, scaling_factor,
             grad_set_logprob=None):
    """Dense [T, E] logits gradient (the backend contract's gate_bwd), plus the set
    log-prob's for its upstream gradient `grad_set_logprob` [T] when given."""
    return launch_logit_grad(_gate_bwd_kernel, "gate_backward", grad_weights.contiguous(), (),
                             logits, expert_indices, score_func, normalize, scaling_factor,
                             grad_set_logprob)


def launch_logit_grad(kernel, op, grad, grad_strides, logits, expert_indices, score_func,
                      normalize, scaling_factor, grad_set_logprob=None):
    """Both gates' backward launch: `kernel` (this module's or gate_dense's) writes the dense
    [T, E] logits gradient from `grad` (its strides `grad_strides` passed after T, E, K
    where the kernel reads them), one program per BLOCK_T rows; with `grad_set_logprob`
    [T] the set log-prob's gradient is added in the same pass."""
    T, E = logits.shape
    K = expert_indices.shape[1]
    check_top_k(K, op)
    out = torch.empty(T, E, dtype=logits.dtype, device=logits.device)
    if T == 0:
        return out
    sf = scores.get(score_func)
    cfg = gate_bwd_config(T, K, E)
    with device_ctx(logits):
        glp = grad_set_logprob.contiguous() if grad_set_logprob is not None else logits
        kernel[(triton.cdiv(T, cfg.BLOCK_T),)](
            grad, logits, expert_indices.contiguous(), glp, out,
            T, E, K, *grad_strides, logits.stride(0), logits.stride(1),
            *split_scale(scaling_factor), SCORE=sf.id, NORMALIZE=bool(normalize),
            DENSE=(sf is scores.SOFTMAX and not normalize),
            HAS_GLP=grad_set_logprob is not None, CDT=compute_type(logits.dtype),
            BLOCK_T=cfg.BLOCK_T, K_PAD=cfg.K_PAD, E_BLOCK=cfg.E_BLOCK, **LAUNCH_OPTIONS,
        )
    return out
