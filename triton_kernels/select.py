"""The model's own selection of a token row (replay_ops.Selection), the agreement test and
the replayed set's log-probability, as Triton device functions of the gate kernels
(gate.py, gate_dense.py). The math is csrc/include/replay_select.h's, rule for rule
(docs/ops.md, "The model's own selection"):

    values   v_j = x_j where the selection ranks the logits (`ranks_logits`); otherwise
             u_j = x_j (source "logits") or the score of x_j (softmax over all E, sigmoid,
             sqrt-softplus) in the compute type, rounded to the logits dtype with
             round_scores, plus expert_bias[j] when there is a bias;
    order    (a, i) before (b, j) when a > b, or a == b and i < j; NaN before every number,
             NaNs by ascending id;
    groups   size = E / G; a group's score is the sum of its n first values in rank order,
             added largest first; the group_topk first groups (by score, then group id) are
             kept; the K first experts of the kept groups;
    result   the K experts in rank order.

A row is selected by K picks over its [1, E_HIST] tile of values (each pick one max, one
min over the ids of the maxima and a masked sum: no sort, no float atomics, the order fixed
by the ids), plus G * n + group_topk picks with groups. The gate kernels call `select_row`
for one row at a time and only for the rows that need it (a flagged row, or every row with
return_agreement), so the selection costs nothing on the rows that are replayed as recorded.
"""
from __future__ import annotations

import triton
import triton.language as tl

from replay_ops import scores

from . import gate as _gate  # the element-wise score functions (one table), at compile time
from ._common import cast_rne, fdiv, precise_exp

_SOFTMAX: tl.constexpr = tl.constexpr(scores.SOFTMAX.id)

# An id above every expert and group id (the min over the candidates' ids).
_NO_ID: tl.constexpr = tl.constexpr(2147483647)


@triton.jit
def _pick(v, avail, ids):
    """The first of the available entries of v [1, W] in the selection's order: (its id [1],
    its value [1]). Needs an available entry."""
    isn = avail & (v != v)
    has_nan = tl.max(isn.to(tl.int32), axis=1) > 0
    vv = tl.where(avail & (v == v), v, float("-inf"))
    m = tl.max(vv, axis=1)
    cand = tl.where(has_nan[:, None], isn, avail & (vv == m[:, None]))
    j = tl.min(tl.where(cand, ids, _NO_ID), axis=1)
    val = tl.sum(tl.where(ids == j[:, None], v, 0.0), axis=1)
    return j, val


@triton.jit
def selection_values(Logits_ptr, Bias_ptr, row, E, stride_lt, stride_le,
                     SCORE: tl.constexpr, SRC_LOGITS: tl.constexpr,
                     ROUND: tl.constexpr, HAS_BIAS: tl.constexpr, RANKS_LOGITS: tl.constexpr,
                     CDT: tl.constexpr, E_HIST: tl.constexpr):
    """The values [1, E_HIST] the selection ranks for row `row` (int64; past E: -inf, never
    available), with the expert ids [1, E_HIST]."""
    ecols = tl.arange(0, E_HIST)[None, :]
    emask = ecols < E
    x = tl.load(Logits_ptr + row * stride_lt + ecols.to(tl.int64) * stride_le, mask=emask,
                other=float("-inf")).to(CDT)
    if RANKS_LOGITS:
        v = x
    else:
        if SRC_LOGITS:
            u = x
        elif SCORE == _SOFTMAX:
            # the row's softmax over all E (an all -inf row gives NaN, as torch.softmax)
            m = tl.max(x, axis=1)
            shift = tl.where(m == float("-inf"), 0.0, m)
            ex = precise_exp(x - shift[:, None])
            s = tl.sum(ex, axis=1)
            u = fdiv(ex, tl.where(s == 0.0, 1.0, s)[:, None])
            u = tl.where(m[:, None] == float("-inf"), float("nan"), u)
        else:
            u = _gate._score(x, SCORE)
        if ROUND:
            u = cast_rne(u, Logits_ptr.dtype.element_ty).to(CDT)
        if HAS_BIAS:
            u = u + tl.load(Bias_ptr + ecols, mask=emask, other=0.0).to(CDT)
        v = u
    return v, ecols


@triton.jit
def select_row(v, ecols, E, K, num_groups, group_topk, group_topn,
               GROUPED: tl.constexpr, K_PAD: tl.constexpr, G_PAD: tl.constexpr):
    """The K experts [1, K_PAD] (int32; -1 past K) the selection picks from the values
    v [1, E_HIST] of a row, in rank order."""
    avail = ecols < E
    if GROUPED:
        size = E // num_groups
        grp = ecols // size
        gids = tl.arange(0, G_PAD)[None, :]
        gscore = tl.zeros([1, G_PAD], v.dtype)
        for g in range(0, num_groups):
            left = avail & (grp == g)
            s = tl.zeros([1], v.dtype)
            for i in range(0, group_topn):
                j, val = _pick(v, left, ecols)
                s = tl.where(i == 0, val, s + val)  # the largest first
                left = left & (ecols != j[:, None])
            gscore = tl.where(gids == g, s[:, None], gscore)
        gleft = gids < num_groups
        kept = avail & (ecols < 0)
        for i in range(0, group_topk):
            gj, _ = _pick(gscore, gleft, gids)
            gleft = gleft & (gids != gj[:, None])
            kept = kept | (grp == gj[:, None])
        avail = avail & kept
    cols = tl.arange(0, K_PAD)[None, :]
    sel = tl.full([1, K_PAD], -1, tl.int32)
    for k in range(0, K):
        j, _ = _pick(v, avail, ecols)
        sel = tl.where(cols == k, j[:, None], sel)
        avail = avail & (ecols != j[:, None])
    return sel


@triton.jit
def row_of(tile, rows, row):
    """Row `row` of a [R, C] int tile as [1, C] (a masked sum with one term is exact)."""
    return tl.sum(tl.where((rows == row)[:, None], tile, 0), axis=0)[None, :]


@triton.jit
def same_set(used, sel, K, K_PAD: tl.constexpr):
    """[1] bool: the K used entries [1, K_PAD] (-1 for an empty slot) are the K distinct
    experts of sel [1, K_PAD] (replay_select.h same_set)."""
    cols = tl.arange(0, K_PAD)[None, :]
    ok = tl.full([1], 1, tl.int32)
    for k in range(0, K):
        sk = tl.sum(tl.where(cols == k, sel, 0), axis=1)
        found = tl.max(((cols < K) & (used == sk[:, None])).to(tl.int32), axis=1)
        ok = ok & found
    return ok != 0


@triton.jit
def row_flags(Idx_ptr, rows, rmask, cols, E, K, stride_it, stride_ik):
    """int32 [R]: nonzero for a row whose recorded ids hold a -1 (or any value outside
    [0, E), tested on the full-width value) or one expert twice (replay_ops.reference
    `padding_row`)."""
    m2 = rmask[:, None] & (cols < K)[None, :]
    raw = tl.load(Idx_ptr + rows[:, None] * stride_it + cols.to(tl.int64)[None, :] * stride_ik,
                  mask=m2, other=0).to(tl.int64)
    inr = (raw >= 0) & (raw < E)
    bad = tl.max((m2 & ~inr).to(tl.int32), axis=1)
    for j in range(0, K):
        cj = tl.sum(tl.where(cols[None, :] == j, raw, 0), axis=1)
        later = m2 & inr & (cols[None, :] > j) & (raw == cj[:, None])
        bad = tl.maximum(bad, tl.max(later.to(tl.int32), axis=1))
    return bad


@triton.jit
def select_rows(idx, need, rows, rmask, Logits_ptr, Bias_ptr, E, K, stride_lt, stride_le,
                num_groups, group_topk, group_topn,
                SCORE: tl.constexpr, SRC_LOGITS: tl.constexpr,
                ROUND: tl.constexpr, HAS_BIAS: tl.constexpr, RANKS_LOGITS: tl.constexpr,
                GROUPED: tl.constexpr, AGREE: tl.constexpr, CDT: tl.constexpr,
                BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, E_HIST: tl.constexpr,
                G_PAD: tl.constexpr):
    """The experts [BLOCK_T, K_PAD] of a block of rows after the selection of the rows with
    `need` (bool [BLOCK_T]: their slots become the selection's K experts), and (AGREE) the
    agreement [BLOCK_T] of every row (its final experts are the selection's set; rows past
    T are False). Only the rows that need the selection, and with AGREE every row, select."""
    agree = tl.zeros([BLOCK_T], tl.int32) != 0
    for i in range(0, BLOCK_T):
        row = tl.sum(tl.where(tl.arange(0, BLOCK_T) == i, rows, 0), axis=0)
        flagged = tl.sum(tl.where(tl.arange(0, BLOCK_T) == i, (need & rmask).to(tl.int32), 0),
                         axis=0)
        live = tl.sum(tl.where(tl.arange(0, BLOCK_T) == i, rmask.to(tl.int32), 0), axis=0)
        go = flagged != 0
        if AGREE:
            go = live != 0
        if go:
            v, ecols = selection_values(Logits_ptr, Bias_ptr, row, E, stride_lt, stride_le,
                                        SCORE, SRC_LOGITS, ROUND, HAS_BIAS,
                                        RANKS_LOGITS, CDT, E_HIST)
            sel = select_row(v, ecols, E, K, num_groups, group_topk, group_topn, GROUPED,
                             K_PAD, G_PAD)
            on = (rows == row) & (flagged != 0)
            idx = tl.where(on[:, None], sel, idx)
            if AGREE:
                a = same_set(row_of(idx, rows, row), sel, K, K_PAD)
                agree = tl.where(rows == row, a, agree)
    return idx, agree


@triton.jit
def members(idx, cols, K):
    """bool [R, K_PAD]: slot k holds the first occurrence of its expert (an id >= 0): the
    members of the row's set (replay_select.h first_of_expert)."""
    first = idx >= 0
    for j in range(0, K):
        cj = tl.sum(tl.where(cols[None, :] == j, idx, 0), axis=1)
        first = first & ~((cols[None, :] > j) & (idx == cj[:, None]))
    return first
