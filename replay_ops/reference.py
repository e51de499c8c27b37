"""Pure-PyTorch reference: the numerical oracle for every backend.

Written from the math in docs/ops.md (and Megatron-Core's gate semantics under replay),
never from a kernel. It is differentiable through ordinary autograd, so it is the oracle
for the backward ops too. It favours clarity over speed.

    T tokens, E experts, K slots per token, H hidden size.
    flat slot s = t*K + k.  expert_indices[t, k] == -1 marks an empty slot.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._validate import (
    check_gate_inputs,
    check_gate_padding,
    check_index_values,
    check_selection,
    check_weights_dtype,
)
from .options import DEFAULT_SELECTION, Selection
from .plan import (
    PADDING_MODES,
    ROW_EMPTY_SLOT,
    ROW_MASKED,
    ROW_OUT_OF_RANGE,
    ROW_REPEAT,
    DenseRouting,
    RoutingPlan,
    plan_capacity,
)

NORM_EPS = 1e-20


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Math runs in fp32, or in fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(x)). Where softplus underflows to 0 (x below about -103 in fp32) the
    value is 0 and so is the gradient (the true one, ~exp(x/2)/2, is below fp32's range);
    plain autograd through sqrt(0) would give inf * 0 = NaN there."""
    sp = F.softplus(x)
    pos = sp > 0
    return torch.where(pos, torch.where(pos, sp, 1.0).sqrt(), 0.0)


def scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """Dense scores over all experts in the compute dtype (used for the fallback top-k)."""
    x = logits.to(compute_dtype(logits.dtype))
    if score_func == "softmax":
        return torch.softmax(x, dim=-1)
    if score_func == "sigmoid":
        return torch.sigmoid(x)
    if score_func == "sqrtsoftplus":
        return sqrt_softplus(x)
    raise ValueError(f"unknown score_func {score_func!r}")


# ------------------------------------------------------------------- the model's selection
def selection_values(logits: torch.Tensor, score_func: str,
                     selection: Selection = DEFAULT_SELECTION) -> torch.Tensor:
    """[T, E] compute dtype: the values v the model's selection ranks (replay_ops.Selection):
    the scores (or the logits), rounded to the logits dtype if asked, plus the bias."""
    cdt = compute_dtype(logits.dtype)
    if selection.ranks_logits:
        # every score function increases with the logit: without bias, rounding or groups
        # the exact scores rank as the logits do (rounded scores could tie where the exact
        # ones do not)
        return logits.to(cdt)
    u = logits.to(cdt) if selection.source == "logits" else scores(logits, score_func)
    if selection.round_scores:
        u = u.to(logits.dtype).to(cdt)
    if selection.expert_bias is not None:
        u = u + selection.expert_bias.to(cdt)
    return u


def _ranked(values: list, ids) -> list:
    """`ids` in the selection's order: larger value first, NaN larger than every number,
    the lower id first among equal values."""
    def key(j):
        v = values[j]
        return (0, 0.0, j) if math.isnan(v) else (1, -v, j)

    return sorted(ids, key=key)


def select_row(v: torch.Tensor, top_k: int, selection: Selection = DEFAULT_SELECTION) -> list:
    """The K experts the selection picks from one row of values `v` [E] (compute dtype), in
    the selection's order; straight from the definition, one group at a time."""
    E = v.shape[0]
    vals = v.tolist()
    candidates = range(E)
    if selection.grouped:
        G, size = selection.num_groups, E // selection.num_groups
        n = selection.group_topn(top_k)
        group_scores = []
        for g in range(G):
            members = _ranked(vals, range(g * size, (g + 1) * size))[:n]
            acc = torch.zeros((), dtype=v.dtype)
            for j in members:  # the largest first, in the compute dtype
                acc = acc + v[j]
            group_scores.append(float(acc))
        kept = sorted(_ranked(group_scores, range(G))[:selection.group_topk])
        candidates = [j for g in kept for j in range(g * size, (g + 1) * size)]
    return _ranked(vals, candidates)[:top_k]


def select_experts(logits: torch.Tensor, top_k: int, score_func: str,
                   selection: Selection = DEFAULT_SELECTION) -> torch.Tensor:
    """int32 [T, top_k]: the model's own selection of every row, row by row."""
    v = selection_values(logits.detach(), score_func, selection)
    rows = [select_row(v[t], top_k, selection) for t in range(v.shape[0])]
    return torch.tensor(rows, dtype=torch.int32, device=logits.device).view(-1, top_k)


def padding_row(row: list, num_experts: int) -> bool:
    """A row without a usable route under padding="select": a -1 slot, an id outside
    [0, E), or an expert twice."""
    ids = [v for v in row if 0 <= v < num_experts]
    return len(ids) < len(row) or len(set(ids)) < len(ids)


def resolve_indices(
    logits: torch.Tensor,
    expert_indices: torch.Tensor,
    replay_mask: torch.Tensor | None,
    score_func: str,
    padding: str = "empty",
    selection: Selection = DEFAULT_SELECTION,
) -> torch.Tensor:
    """int32 [T, K] indices actually used: the recorded rows, with every value outside
    [0, E) an empty slot (-1); the model's own selection in each row where replay_mask is
    False, and with padding="select" in each padding row (`padding_row`)."""
    E, K = logits.shape[1], expert_indices.shape[1]
    wide = expert_indices.to(torch.int64)  # the range test sees the full value
    out = torch.where((wide >= 0) & (wide < E), wide, -1).to(torch.int32)
    rows = wide.tolist()
    mask = None if replay_mask is None else replay_mask.tolist()
    for t in range(len(rows)):
        flagged = (mask is not None and not mask[t]) or (
            padding == "select" and padding_row(rows[t], E))
        if flagged:
            out[t] = select_experts(logits[t:t + 1], K, score_func, selection)[0]
    return out


# --------------------------------------------------------------- agreement, set log-prob
def agreement(logits: torch.Tensor, idx: torch.Tensor, score_func: str,
              selection: Selection = DEFAULT_SELECTION) -> torch.Tensor:
    """bool [T]: the experts of row t (its ids in [0, E), as a set) are the set the model's
    selection picks from the logits (slot order ignored)."""
    K = idx.shape[1]
    want = select_experts(logits, K, score_func, selection).tolist()
    used = idx.to(torch.int64).tolist()
    E = logits.shape[1]
    out = [len(r) == len(set(r)) and all(0 <= v < E for v in r) and set(r) == set(w)
           for r, w in zip(used, want)]
    return torch.tensor(out, dtype=torch.bool, device=logits.device).view(-1)


def set_logprob(logits: torch.Tensor, idx: torch.Tensor, score_func: str) -> torch.Tensor:
    """[T] compute dtype, differentiable: log of the router's probability mass on the set S
    of row t's experts (its distinct ids in [0, E)). Softmax: log sum_{e in S} softmax(x)_e
    = logsumexp(x_S) - logsumexp(x). Sigmoid and sqrt-softplus: the log of the score mass
    on S over the score mass of all E experts, log(sum_S f(x_e) / sum_j f(x_j)). An empty
    set, or a mass of 0, gives -inf with a gradient of 0."""
    cdt = compute_dtype(logits.dtype)
    x = logits.to(cdt)
    T, E = x.shape
    member = torch.zeros(T, E, dtype=torch.bool, device=x.device)
    for t, row in enumerate(idx.to(torch.int64).tolist()):
        for v in row:
            if 0 <= v < E:
                member[t, v] = True
    if score_func == "softmax":
        part = torch.where(member, x, float("-inf"))
        top = part.amax(dim=1, keepdim=True)
        ok = (top != float("-inf")).squeeze(1)
        safe = torch.where(ok[:, None], part, 0.0)
        lp = torch.logsumexp(safe, dim=1) - torch.logsumexp(x, dim=1)
    else:
        f = scores(x, score_func)
        mass = torch.where(member, f, 0.0).sum(dim=1)
        ok = mass > 0
        lp = torch.log(torch.where(ok, mass, 1.0)) - torch.log(f.sum(dim=1))
    return torch.where(ok, lp, float("-inf"))


def gate_weights(
    logits: torch.Tensor,
    idx: torch.Tensor,
    score_func: str,
    normalize: bool,
    scaling_factor: float,
    weights_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Gate weights [T, K] from the dense logits at the given indices (differentiable), in
    `weights_dtype` (the logits' dtype when None)."""
    cdt = compute_dtype(logits.dtype)
    x = logits.to(cdt)
    valid = (idx >= 0) & (idx < logits.shape[1])
    safe = torch.where(valid, idx, 0).long()
    if score_func == "softmax" and not normalize:
        # softmax over all E, then gather (Megatron pre-softmax, HF norm_topk_prob=False)
        w = torch.softmax(x, dim=-1).gather(1, safe)
    elif score_func == "softmax":
        # softmax over the selected valid logits only
        z = torch.where(valid, x.gather(1, safe), float("-inf"))
        m = z.amax(dim=-1, keepdim=True)
        m = torch.where(m == float("-inf"), 0.0, m)  # no valid slot, or all -inf
        e = torch.exp(z - m)
        s = e.sum(dim=-1, keepdim=True)
        w = e / torch.where(s == 0, 1.0, s)
    else:
        z = x.gather(1, safe)
        sc = torch.sigmoid(z) if score_func == "sigmoid" else sqrt_softplus(z)
        sc = torch.where(valid, sc, 0.0)
        if normalize:
            many = valid.sum(dim=-1, keepdim=True) > 1
            w = torch.where(many, sc / (sc.sum(dim=-1, keepdim=True) + NORM_EPS), sc)
        else:
            w = sc
    w = w * scaling_factor
    return torch.where(valid, w, 0.0).to(weights_dtype or logits.dtype)


def build_plan(idx: torch.Tensor, num_experts: int, align: int):
    """(tokens_per_expert, expert_offsets, row_id_map, sorted_slots) for int indices [T, K]
    (-1 or in [0, E)), straight from the definition: expert by expert, its slots in
    ascending flat-slot order take the next rows, then padding rows up to a multiple of
    `align`."""
    T, K = idx.shape
    dev = idx.device
    flat = idx.reshape(-1).long()
    row_id_map = torch.full((T * K,), -1, dtype=torch.long, device=dev)
    sorted_slots = torch.full((plan_capacity(T, K, num_experts, align),), -1,
                              dtype=torch.long, device=dev)
    counts, offsets = [], [0]
    for e in range(num_experts):
        slots = (flat == e).nonzero().flatten()  # ascending
        first = offsets[-1]
        rows = torch.arange(first, first + slots.numel(), device=dev)
        row_id_map[slots] = rows
        sorted_slots[rows] = slots
        counts.append(slots.numel())
        offsets.append(first + -(-slots.numel() // align) * align)
    i32 = dict(dtype=torch.int32, device=dev)
    return (
        torch.tensor(counts, **i32),
        torch.tensor(offsets, **i32),
        row_id_map.view(T, K).to(torch.int32),
        sorted_slots.to(torch.int32),
    )


def gate(
    logits: torch.Tensor,
    expert_indices: torch.Tensor,
    *,
    score_func: str = "softmax",
    normalize: bool = True,
    scaling_factor: float = 1.0,
    align: int = 1,
    replay_mask: torch.Tensor | None = None,
    padding: str = "empty",
    selection: Selection = DEFAULT_SELECTION,
    return_agreement: bool = False,
    weights_dtype: torch.dtype | None = None,
    hidden: torch.Tensor | None = None,
    num_rows: int | None = None,
    validate: bool = True,
) -> RoutingPlan:
    """The plan of replay_ops.gate; with `hidden`, `plan.rows` = permute(hidden, plan,
    num_rows) (num_rows: plan.max_rows when None)."""
    check_gate_inputs(logits, expert_indices, replay_mask, score_func, align)
    check_gate_padding(padding)
    _check_selection("gate", logits, expert_indices.shape[1], score_func, selection)
    check_weights_dtype("gate", logits, weights_dtype)
    if validate:
        check_index_values(expert_indices, logits.shape[1], replay_mask,
                           repeats=padding != "select")
    idx = resolve_indices(logits.detach(), expert_indices, replay_mask, score_func, padding,
                          selection)
    weights = gate_weights(logits, idx, score_func, normalize, scaling_factor, weights_dtype)
    plan = RoutingPlan(weights, idx, *build_plan(idx, logits.shape[1], align))
    if return_agreement:
        plan = plan._replace(agreement=agreement(logits, idx, score_func, selection),
                             set_logprob=set_logprob(logits, idx, score_func))
    if hidden is not None:
        plan = plan._replace(rows=permute(hidden, plan,
                                          plan.max_rows if num_rows is None else num_rows))
    return plan


def _check_selection(op, logits, top_k, score_func, sel: Selection) -> None:
    check_selection(op, logits, top_k, score_func, sel.source, sel.expert_bias,
                    sel.round_scores, sel.num_groups, sel.group_topk, sel.group_score_topn)


def permute_rows(
    hidden: torch.Tensor, sorted_slots: torch.Tensor, top_k: int, num_rows: int
) -> torch.Tensor:
    """[num_rows, H]: row r is hidden[sorted_slots[r] // top_k], zero where the slot is -1
    or r is past the end of sorted_slots."""
    out = hidden.new_zeros(num_rows, hidden.shape[1])
    slots = sorted_slots[:num_rows].long()
    rows = (slots >= 0).nonzero().flatten()
    out[rows] = hidden[slots[rows] // top_k]
    return out


def combine(expert_out: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor):
    """[T, H]: sum_k weights[t, k] * expert_out[row_id_map[t, k]], accumulated in fp32 (fp64
    for fp64) in column order k = 0..K-1; empty slots (-1) contribute nothing."""
    T, K = row_id_map.shape
    R, H = expert_out.shape
    cdt = compute_dtype(expert_out.dtype)
    acc = torch.zeros(T, H, dtype=cdt, device=expert_out.device)
    for k in range(K):
        row = row_id_map[:, k].long()
        tokens = ((row >= 0) & (row < R)).nonzero().flatten()
        term = weights[tokens, k].to(cdt)[:, None] * expert_out[row[tokens]].to(cdt)
        acc = acc.index_put((tokens,), acc[tokens] + term)
    return acc.to(expert_out.dtype)


def permute(hidden: torch.Tensor, plan: RoutingPlan, num_rows: int | None = None) -> torch.Tensor:
    """Row r of the result is hidden[sorted_slots[r] // K]; padding rows are zero.
    The result has expert_offsets[E] rows, or num_rows (which must be large enough)."""
    used = plan.num_rows()
    if num_rows is not None and num_rows < used:
        raise ValueError(
            f"replay_ops.permute: num_rows={num_rows} is smaller than the {used} rows the plan "
            f"needs (expert_offsets[E])"
        )
    return permute_rows(hidden, plan.sorted_slots, plan.top_k, used if num_rows is None else num_rows)


def unpermute(expert_out: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * expert_out[row_id_map[t, k]]."""
    return combine(expert_out, plan.row_id_map, plan.weights)


# ----------------------------------------------------------------------------- dense mode
# Multiplier of the per-cycle rotation of the spread padding (2^32 / golden ratio).
SPREAD_HASH = 2654435769


def spread_expert(t: int, k: int, top_k: int, num_experts: int, ep_size: int,
                  offset: int = 0) -> int:
    """Expert of slot k of padding row t under padding="spread".

    Row t takes the K consecutive values i = offset + t*K + k + W(c) (mod E), where
    c = (t*K) // E counts how often the rows before it have cycled through the E values and
    W(c) = ((c * 2654435769) mod 2^32) * E // 2^32 rotates each cycle. Value i is expert
    (i mod ep) * (E / ep) + i // ep: consecutive values sit on consecutive EP ranks."""
    E = num_experts
    s = t * top_k
    c = s // E
    w = ((c * SPREAD_HASH) % 2**32) * E >> 32
    i = (offset + s + k + w) % E
    local = E // ep_size
    return (i % ep_size) * local + i // ep_size


def dense_row_experts(expert_indices: torch.Tensor, num_experts: int,
                      replay_mask: torch.Tensor | None = None,
                      fallback: torch.Tensor | None = None, padding: str = "empty",
                      ep_size: int = 1, spread_offset: int = 0,
                      logits: torch.Tensor | None = None, score_func: str = "softmax",
                      selection: Selection = DEFAULT_SELECTION):
    """(row_flags uint8 [T], int32 [T, K] experts actually routed) by the definitions of
    `replay_ops.gate_dense`, one row at a time (padding="select" needs the `logits`)."""
    E = num_experts
    rows = expert_indices.to(torch.int64).tolist()
    mask = None if replay_mask is None else replay_mask.tolist()
    fb = None if fallback is None else fallback.to(torch.int64).tolist()
    T, K = expert_indices.shape
    flags, out = [], []

    def in_range(row):
        return [v if 0 <= v < E else -1 for v in row]

    for t in range(T):
        rec = rows[t]
        if mask is not None and not mask[t]:
            f = ROW_MASKED
        else:
            f = 0
            if any(v == -1 for v in rec):
                f |= ROW_EMPTY_SLOT
            if any(v < -1 or v >= E for v in rec):
                f |= ROW_OUT_OF_RANGE
            ids = [v for v in rec if 0 <= v < E]
            if len(set(ids)) < len(ids):
                f |= ROW_REPEAT
        if f & ROW_MASKED and fb is not None:
            row = in_range(fb[t])
        elif f == 0:
            row = rec
        elif padding == "spread":
            row = [spread_expert(t, k, K, E, ep_size, spread_offset) for k in range(K)]
        elif padding == "fallback":
            row = in_range(fb[t])
        elif padding == "select":
            row = select_experts(logits[t:t + 1], K, score_func, selection)[0].tolist()
        elif f & ROW_MASKED:
            row = [-1] * K
        else:
            row = in_range(rec)
        flags.append(f)
        out.append(row)
    dev = expert_indices.device
    return (torch.tensor(flags, dtype=torch.uint8, device=dev).view(T),
            torch.tensor(out, dtype=torch.int32, device=dev).view(T, K))


def dense_probs(weights: torch.Tensor, idx: torch.Tensor, num_experts: int):
    """(probs [T, E], routing_map bool [T, E]) from the [T, K] gate weights (compute
    dtype): probs[t, e] = the sum of the weights of the slots of row t routed to e, in slot
    order (0 where none is). Differentiable in `weights`."""
    T, K = idx.shape
    acc = torch.zeros(T, num_experts, dtype=weights.dtype, device=weights.device)
    rmap = torch.zeros(T, num_experts, dtype=torch.bool, device=weights.device)
    for k in range(K):
        rows = (idx[:, k] >= 0).nonzero().flatten()
        cols = idx[rows, k].long()
        acc = acc.index_put((rows, cols), weights[rows, k], accumulate=True)
        rmap[rows, cols] = True
    return acc, rmap


def gate_dense(
    logits: torch.Tensor,
    expert_indices: torch.Tensor,
    *,
    score_func: str = "softmax",
    normalize: bool = True,
    scaling_factor: float = 1.0,
    replay_mask: torch.Tensor | None = None,
    padding: str = "empty",
    fallback: torch.Tensor | None = None,
    ep_size: int = 1,
    spread_offset: int = 0,
    underflow_guard: bool = False,
    align: int = 1,
    selection: Selection = DEFAULT_SELECTION,
    return_agreement: bool = False,
) -> DenseRouting:
    """Megatron's dense routing (probs, routing_map), the row flags and the plan: the
    experts of each row by `dense_row_experts`, their weights by `gate_weights` (compute
    dtype), summed per expert by `dense_probs` and rounded once to the logits dtype. With
    `underflow_guard` a routed entry that rounds to exactly 0 becomes the dtype's smallest
    normal value; its gradient passes through unchanged."""
    check_gate_inputs(logits, expert_indices, replay_mask, score_func, align)
    if padding not in PADDING_MODES:
        raise ValueError(f"unknown padding {padding!r}")
    _check_selection("gate_dense", logits, expert_indices.shape[1], score_func, selection)
    E = logits.shape[1]
    flags, idx = dense_row_experts(expert_indices, E, replay_mask, fallback, padding, ep_size,
                                   spread_offset, logits.detach(), score_func, selection)
    cdt = compute_dtype(logits.dtype)
    w = gate_weights(logits.to(cdt), idx, score_func, normalize, scaling_factor)
    acc, rmap = dense_probs(w, idx, E)
    probs = acc.to(logits.dtype)
    if underflow_guard:
        tiny = torch.finfo(logits.dtype).tiny
        probs = probs + torch.where(rmap & (probs == 0), tiny, 0.0).to(logits.dtype).detach()
    plan = RoutingPlan(None, idx, *build_plan(idx, E, align))
    if return_agreement:
        return DenseRouting(probs, rmap, flags, idx, plan,
                            agreement(logits, idx, score_func, selection),
                            set_logprob(logits, idx, score_func))
    return DenseRouting(probs, rmap, flags, idx, plan)


def permute_probs(probs: torch.Tensor, plan: RoutingPlan, num_rows: int) -> torch.Tensor:
    """[num_rows]: row r holds probs[t, e] of its slot s = sorted_slots[r] (t = s // K,
    e = expert_indices[t, s % K]); 0 for padding rows and past the end. Differentiable."""
    K = plan.top_k
    out = probs.new_zeros(num_rows)
    slots = plan.sorted_slots[:num_rows].long()
    rows = (slots >= 0).nonzero().flatten()
    t = slots[rows] // K
    e = plan.expert_indices.reshape(-1)[slots[rows]].long()
    return out.index_put((rows,), probs[t, e])
