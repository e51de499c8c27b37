"""The `torch` backend: vectorised eager PyTorch on any device, the last resort of every
device's order (and the backend of CPU tensors when the native extension is not built).

It is written for speed and independence from the oracle (`replay_ops.reference`, which
the tests compare it with): the weights come from per-row statistics and the score table
(`replay_ops.scores`), the plan from one stable sort, the backward ops from the closed-form
vector-Jacobian products of the table. Nothing here reads device memory on the host.

The model's own selection ranks with torch.topk of unique int64 keys (the value's bits
made monotone, then the expert id, which makes the tie rule exact; a stable sort for fp64).
Which rows it ranks (`_select_flagged`):
  * CPU tensors: the flagged rows only (rows without a usable route: replay_mask False,
    and with padding="select" a -1 slot, an id outside [0, E) or a repeated expert). Their
    positions are read on the host (`nonzero`), which costs nothing on the CPU, so the cost
    is proportional to the flagged rows and an unflagged call ranks nothing.
  * Other devices: every row, and a `where` keeps the recorded rows, so that no host read
    waits for the device (the native CUDA and Triton kernels select inside the gate pass,
    for the flagged rows only; this backend is their portable last resort there).
The agreement outputs (return_agreement) need the selection of every row on every device.
"""
from __future__ import annotations

import torch

from .. import scores
from ..plan import plan_capacity, spread_rows
from .protocol import YES, Support

NAME = "torch"


def available(device_type: str) -> Support:
    return YES


def supports(op, device_type, shape, dtype) -> Support:
    return YES


def describe() -> dict:
    return {}


def in_range_or_empty(expert_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 copy of the indices with every value outside [0, E) set to -1 (an empty slot).
    The range is tested on the full-width values, before the narrowing to int32."""
    idx = expert_indices
    ok = (idx >= 0) & (idx < num_experts)
    return torch.where(ok, idx, -1).to(torch.int32)


# -------------------------------------------------------------------- the model's selection
def selection_values(x, logits_dtype, sf, sel) -> torch.Tensor:
    """[T, E] compute dtype: the values the selection ranks (replay_ops.Selection), from the
    logits `x` in the compute dtype."""
    if sel.ranks_logits:  # increasing scores rank as the logits (replay_ops.Selection)
        return x
    u = x if sel.source == "logits" else sf.forward(x)
    if sel.round_scores:
        u = u.to(logits_dtype).to(x.dtype)
    if sel.expert_bias is not None:
        u = u + sel.expert_bias.to(x.dtype)
    return u


def _rank_keys(v: torch.Tensor) -> torch.Tensor:
    """int64 keys of fp32 values `v` [..., n], one per element, all distinct in a row, whose
    descending order is the selection's order: larger value first, NaN above every number,
    equal values by ascending index. The value's float bits, made monotone as an integer
    (-0.0 and every NaN made one value first), shifted up 32 bits, plus n-1-index."""
    v = torch.where(torch.isnan(v), float("nan"), v + 0.0)  # one NaN; -0.0 + 0.0 is +0.0
    b = v.view(torch.int32)
    key = torch.where(b < 0, b ^ 0x7FFFFFFF, b).to(torch.int64)
    n = v.shape[-1]
    return key * (1 << 32) + (n - 1 - torch.arange(n, device=v.device))


def _top(v: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [..., k]: the indices of the k first elements of `v` along the last dimension in
    the selection's order (torch.topk of unique keys for fp32, a stable descending sort for
    fp64), among the `allowed` ones (bool, same shape) when given."""
    if v.dtype == torch.float32:
        keys = _rank_keys(v)
        if allowed is not None:  # below every key of a value (NaN and -0.0 were folded)
            keys = torch.where(allowed, keys, torch.iinfo(torch.int64).min)
        return torch.topk(keys, k, dim=-1).indices
    order = torch.sort(v, dim=-1, descending=True, stable=True).indices
    if allowed is not None:  # allowed first, each part still in the value order
        again = torch.sort(allowed.gather(-1, order).to(torch.uint8), dim=-1,
                           descending=True, stable=True).indices
        order = order.gather(-1, again)
    return order[..., :k]


def select_topk(v: torch.Tensor, top_k: int, sel) -> torch.Tensor:
    """int64 [T, K]: the K experts the selection picks from the values `v` [T, E], in its
    order (every row; one torch.topk of unique keys, per group too)."""
    T, E = v.shape
    if not sel.grouped:
        return _top(v, top_k)
    G, size = sel.num_groups, E // sel.num_groups
    vg = v.reshape(T, G, size)
    top = vg.gather(2, _top(vg, sel.group_topn(top_k)))
    gs = top[..., 0]
    for i in range(1, top.shape[-1]):  # the largest first, as the kernels sum
        gs = gs + top[..., i]
    keep_g = torch.zeros(T, G, dtype=torch.bool, device=v.device).scatter(
        1, _top(gs, sel.group_topk), True)
    return _top(v, top_k, keep_g[:, :, None].expand(T, G, size).reshape(T, E))


def padding_rows(expert_indices, E: int) -> torch.Tensor:
    """bool [T]: rows with a -1 slot, an id outside [0, E) or a repeated expert."""
    return row_flags(expert_indices, None, E) != 0


def _same_set(idx, sel) -> torch.Tensor:
    """bool [T]: the K entries of idx (-1 never matches) are the K distinct experts of sel."""
    eq = idx.long()[:, :, None] == sel[:, None, :]
    return eq.any(dim=2).all(dim=1) & eq.any(dim=1).all(dim=1)


def _members(idx, E) -> torch.Tensor:
    """bool [T, E]: the experts of each row (its ids in [0, E))."""
    T = idx.shape[0]
    col = torch.where(idx >= 0, idx.long(), E)
    return torch.zeros(T, E + 1, dtype=torch.bool, device=idx.device).scatter(
        1, col, True)[:, :E]


def _set_logprob_parts(x, idx, sf):
    """(lp [T], ok [T], member [T, E], the per-row values the gradient needs)."""
    member = _members(idx, x.shape[1])
    if sf is scores.SOFTMAX:
        part = torch.where(member, x, float("-inf"))
        ok = part.amax(dim=1) != float("-inf")
        lse_s = torch.logsumexp(torch.where(ok[:, None], part, 0.0), dim=1)
        lse = torch.logsumexp(x, dim=1)
        return lse_s - lse, ok, member, (lse_s, lse)
    if sf.elementwise:
        f = sf.forward(x)
        mass = torch.where(member, f, 0.0).sum(dim=1)
        total = f.sum(dim=1)
        ok = mass > 0
        lp = torch.log(torch.where(ok, mass, 1.0)) - torch.log(total)
        return lp, ok, member, (f, mass, total)
    raise NotImplementedError(f"torch backend: no set log-prob for score function {sf}")


def set_logprob(x, idx, sf) -> torch.Tensor:
    lp, ok, _, _ = _set_logprob_parts(x, idx, sf)
    return torch.where(ok, lp, float("-inf"))


def set_logprob_grad(g, x, idx, sf) -> torch.Tensor:
    """[T, E] compute dtype: the gradient of sum_t g[t] * set_logprob[t] to the logits."""
    _, ok, member, parts = _set_logprob_parts(x, idx, sf)
    g = torch.where(ok, g.to(x.dtype), 0.0)[:, None]
    if sf is scores.SOFTMAX:
        lse_s, lse = parts
        inside = torch.where(member, torch.exp(x - lse_s[:, None]), 0.0)
        return g * (inside - torch.exp(x - lse[:, None]))
    f, mass, total = parts
    inv = torch.where(member, 1.0 / torch.where(ok, mass, 1.0)[:, None], 0.0)
    return sf.vjp(x, f, g * (inv - 1.0 / total[:, None]))


def _selected(x, logits_dtype, sf, opts, K):
    return select_topk(selection_values(x, logits_dtype, sf, opts.selection), K,
                       opts.selection)


def _select_flagged(x, logits_dtype, sf, opts, K, flagged) -> torch.Tensor:
    """int64 [T, K]: the selection's experts in the flagged rows (bool [T]), -1 in the
    others. On the CPU only the flagged rows are ranked; elsewhere every row (see the
    module's docstring). Each row's selection depends on that row alone, so both give the
    same values."""
    T = x.shape[0]
    if x.device.type != "cpu":
        return torch.where(flagged[:, None], _selected(x, logits_dtype, sf, opts, K), -1)
    out = torch.full((T, K), -1, dtype=torch.long, device=x.device)
    rows = flagged.nonzero().squeeze(1)
    if rows.numel():
        out[rows] = _selected(x[rows], logits_dtype, sf, opts, K)
    return out


# ------------------------------------------------------------------------------- gate
def _slot_logits(x: torch.Tensor, idx: torch.Tensor):
    """(z [T,K] the logits at the slots, valid [T,K], safe int64 indices) for int32 indices
    that are -1 or in [0, E)."""
    valid = idx >= 0
    safe = idx.clamp_min(0).long()
    return x.gather(1, safe), valid, safe


def _selected_softmax(z, valid) -> torch.Tensor:
    """Softmax over the valid selected logits of each row: torch.softmax (the bits of
    Megatron's own), except that a row whose max is -inf (no valid slot, or every valid
    logit -inf) gets weights 0, as in the kernels and the oracle, not torch.softmax's NaN."""
    zs = torch.where(valid, z, float("-inf"))
    none = zs.amax(dim=1, keepdim=True) == float("-inf")
    return torch.where(none, 0.0, torch.softmax(zs, dim=1))


def _weights(x, idx, sf, normalize: bool) -> torch.Tensor:
    """Unscaled gate weights [T, K] in the compute dtype (0 for empty slots)."""
    z, valid, safe = _slot_logits(x, idx)
    if sf is scores.SOFTMAX and not normalize:
        w = sf.forward(x).gather(1, safe)  # softmax over all E, then gather
    elif sf is scores.SOFTMAX:
        w = _selected_softmax(z, valid)
    elif sf.elementwise:
        w = torch.where(valid, sf.forward(z), 0.0)
        if normalize:
            many = valid.sum(dim=1, keepdim=True) > 1
            w = torch.where(many, w / (w.sum(dim=1, keepdim=True) + scores.NORM_EPS), w)
    else:
        raise NotImplementedError(f"torch backend: no gate weights for score function {sf}")
    return torch.where(valid, w, 0.0)


def build_plan(idx: torch.Tensor, num_experts: int, align: int):
    """(tokens_per_expert, expert_offsets, row_id_map, sorted_slots) for int32 indices
    [T, K] that are -1 or in [0, E), from one stable sort by expert (empty slots sort
    last). Only sort, gather, scatter and cumsum: no host read."""
    T, K = idx.shape
    E, N, dev = num_experts, idx.numel(), idx.device
    n_sorted = plan_capacity(T, K, E, align)
    key = torch.where(idx.reshape(-1) >= 0, idx.reshape(-1).long(), E)
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add(
        0, key, torch.ones_like(key))[:E]
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    offsets = torch.cat([zero, ((counts + align - 1) // align * align).cumsum(0)])
    first = torch.cat([zero, counts.cumsum(0)])  # unpadded start of each key in sort order
    order = torch.sort(key, stable=True).indices  # ascending flat slot within an expert
    key_sorted = key[order]
    taken = key_sorted < E
    rows = torch.where(taken, offsets[key_sorted] + torch.arange(N, device=dev)
                       - first[key_sorted], -1)
    row_id_map = torch.empty(N, dtype=torch.long, device=dev).scatter(0, order, rows)
    # every empty slot writes -1 to one extra entry past the end, which is cut off
    sorted_slots = torch.full((n_sorted + 1,), -1, dtype=torch.long, device=dev).scatter(
        0, torch.where(taken, rows, n_sorted), torch.where(taken, order, -1))[:n_sorted]
    i32 = torch.int32
    return counts.to(i32), offsets.to(i32), row_id_map.view(T, K).to(i32), sorted_slots.to(i32)


def _agreement_outputs(x, idx, sel_idx, sf, opts):
    """(agreement, set_logprob), or two empty tensors without return_agreement."""
    if not opts.return_agreement:
        return (torch.empty(0, dtype=torch.bool, device=x.device),
                torch.empty(0, dtype=x.dtype, device=x.device))
    return _same_set(idx, sel_idx), set_logprob(x, idx, sf)


def gate_fwd(logits, expert_indices, replay_mask, opts):
    sf = scores.get(opts.score_func)
    T, E = logits.shape
    K = expert_indices.shape[1]
    x = logits.to(scores.compute_dtype(logits.dtype))
    idx = in_range_or_empty(expert_indices, E)
    flagged = None if replay_mask is None else ~replay_mask
    if opts.padding == "select":
        pad = padding_rows(expert_indices, E)
        flagged = pad if flagged is None else flagged | pad
    sel_idx = None
    if opts.return_agreement:
        sel_idx = _selected(x, logits.dtype, sf, opts, K)
        if flagged is not None:
            idx = torch.where(flagged[:, None], sel_idx.to(torch.int32), idx)
    elif flagged is not None:
        fill = _select_flagged(x, logits.dtype, sf, opts, K, flagged)
        idx = torch.where(flagged[:, None], fill.to(torch.int32), idx)
    idx = idx.contiguous()
    weights = (_weights(x, idx, sf, opts.normalize) * opts.scaling_factor).to(
        opts.weights_dtype or logits.dtype)
    return (weights, idx, *build_plan(idx, E, opts.align),
            *_agreement_outputs(x, idx, sel_idx, sf, opts))


def gate_bwd(grad_weights, logits, idx, opts, grad_set_logprob=None):
    sf = scores.get(opts.score_func)
    normalize, scaling_factor = opts.normalize, opts.scaling_factor
    x = logits.to(scores.compute_dtype(logits.dtype))
    idx = in_range_or_empty(idx, x.shape[1])
    grad = _weights_grad(grad_weights, x, idx, sf, normalize, scaling_factor)
    if grad_set_logprob is not None:
        grad = grad + set_logprob_grad(grad_set_logprob, x, idx, sf)
    return grad.to(logits.dtype)


def _weights_grad(grad_weights, x, idx, sf, normalize, scaling_factor):
    """[T, E] compute dtype: the gradient of the weights to the logits."""
    z, valid, safe = _slot_logits(x, idx)
    g = torch.where(valid, grad_weights.to(x.dtype), 0.0) * scaling_factor
    if sf is scores.SOFTMAX and not normalize:
        # w_k = p[idx_k] with p = softmax over all E: scatter dL/dp, then the softmax vjp
        dp = torch.zeros_like(x).scatter_add(1, safe, g)
        return sf.vjp(x, sf.forward(x), dp)
    if sf is scores.SOFTMAX:
        q = torch.where(valid, _selected_softmax(z, valid), 0.0)
        dz = sf.vjp(z, q, g)
    elif sf.elementwise:
        c = torch.where(valid, sf.forward(z), 0.0)
        if normalize:  # w = c / S with S = sum c + eps: dL/dc_k = g_k / S - (sum_j g_j c_j) / S^2
            many = valid.sum(dim=1, keepdim=True) > 1
            S = c.sum(dim=1, keepdim=True) + scores.NORM_EPS
            D = (g * c).sum(dim=1, keepdim=True)
            g = torch.where(many, g / S - (D / S) / S, g)
        dz = sf.vjp(z, c, g)
    else:
        raise NotImplementedError(f"torch backend: no gate backward for score function {sf}")
    dz = torch.where(valid, dz, 0.0)
    return torch.zeros_like(x).scatter_add(1, safe, dz)


# ---------------------------------------------------------------- permute / unpermute
def _rows_of_slots(sorted_slots, num_rows: int, K: int, T: int):
    """(token [num_rows] int64 clamped into [0, T), has [num_rows] bool) of the rows of a
    plan: row r holds token sorted_slots[r] // K, or nothing (-1, past the end, or a token
    outside [0, T))."""
    slot = torch.full((num_rows,), -1, dtype=torch.long, device=sorted_slots.device)
    n = min(num_rows, sorted_slots.shape[0])
    slot[:n] = sorted_slots[:n]
    tok = torch.div(slot, K, rounding_mode="floor")
    has = (slot >= 0) & (tok < T)
    return tok.clamp(0, max(T - 1, 0)), has, slot.clamp_min(0)


def _gather_rows(x, row_id_map):
    """(x rows [T, K, H] at row_id_map, valid [T, K]); rows outside [0, R) are invalid."""
    R = x.shape[0]
    row = row_id_map.long()
    valid = (row >= 0) & (row < R)
    if R == 0:
        return x.new_zeros(*row.shape, x.shape[1]), valid
    return x[row.clamp(0, R - 1)], valid


def _sum_slots(rows, valid, w=None):
    """sum over k = 0..K-1, in that order, of [w[:, k] *] rows[:, k] (compute dtype)."""
    cdt = scores.compute_dtype(rows.dtype)
    acc = torch.zeros(rows.shape[0], rows.shape[2], dtype=cdt, device=rows.device)
    for k in range(rows.shape[1]):
        v = rows[:, k].to(cdt)
        if w is not None:
            v = w[:, k, None].to(cdt) * v
        acc = acc + torch.where(valid[:, k, None], v, 0.0)
    return acc


def gate_permute_fwd(logits, expert_indices, replay_mask, opts, hidden, num_rows):
    out = gate_fwd(logits, expert_indices, replay_mask, opts)
    return (*out, permute_fwd(hidden, out[5], out[4], num_rows))


def gate_permute_bwd(grad_weights, grad_rows, logits, idx, row_id_map, opts,
                     grad_set_logprob=None):
    return (gate_bwd(grad_weights, logits, idx, opts, grad_set_logprob),
            permute_bwd(grad_rows, row_id_map))


def permute_fwd(hidden, sorted_slots, row_id_map, num_rows):
    T, H = hidden.shape
    tok, has, _ = _rows_of_slots(sorted_slots, num_rows, row_id_map.shape[1], T)
    if T == 0:
        return hidden.new_zeros(num_rows, H)
    return torch.where(has[:, None], hidden[tok], 0.0)


def permute_bwd(grad_out, row_id_map):
    rows, valid = _gather_rows(grad_out, row_id_map)
    return _sum_slots(rows, valid).to(grad_out.dtype)


def unpermute_fwd(expert_out, row_id_map, weights):
    rows, valid = _gather_rows(expert_out, row_id_map)
    return _sum_slots(rows, valid, weights).to(expert_out.dtype)


def unpermute_bwd(grad_out, expert_out, row_id_map, sorted_slots, weights):
    T, K = row_id_map.shape
    cdt = scores.compute_dtype(expert_out.dtype)
    go = grad_out.to(cdt)
    # grad_expert_out[r] = weights[s] * grad_out[s // K] for the slot s of row r
    tok, has, slot = _rows_of_slots(sorted_slots, expert_out.shape[0], K, T)
    if T == 0:
        grad_x = torch.zeros_like(expert_out)
    else:
        w = weights.to(cdt).reshape(-1)[slot.clamp(0, T * K - 1)]
        grad_x = torch.where(has[:, None], w[:, None] * go[tok], 0.0).to(expert_out.dtype)
    # grad_weights[t, k] = <grad_out[t], expert_out[row_id_map[t, k]]>, 0 for empty slots
    rows, valid = _gather_rows(expert_out, row_id_map)
    grad_w = torch.where(valid, (go[:, None, :] * rows.to(cdt)).sum(dim=-1), 0.0)
    return grad_x, grad_w.to(weights.dtype)


# ------------------------------------------------------------------------- dense mode
# The row flags of replay_ops.plan (ROW_EMPTY_SLOT, ROW_OUT_OF_RANGE, ROW_REPEAT, ROW_MASKED).
_EMPTY, _RANGE, _REPEAT, _MASKED = 1, 2, 4, 8


def row_flags(expert_indices, replay_mask, E: int) -> torch.Tensor:
    """uint8 [T]: the ROW_* bits of each recorded row (ROW_MASKED alone where the mask is
    False)."""
    idx = expert_indices.long()
    T, K = idx.shape
    ok = (idx >= 0) & (idx < E)
    flags = (idx == -1).any(dim=1).to(torch.uint8) * _EMPTY
    flags |= ((idx < -1) | (idx >= E)).any(dim=1).to(torch.uint8) * _RANGE
    if K > 1:
        # ids outside [0, E) get distinct negative stand-ins, so only real experts can repeat
        key = torch.where(ok, idx, -1 - torch.arange(K, device=idx.device))
        s = key.sort(dim=1).values
        flags |= (s[:, 1:] == s[:, :-1]).any(dim=1).to(torch.uint8) * _REPEAT
    if replay_mask is not None:
        flags = torch.where(replay_mask, flags, _MASKED).to(torch.uint8)
    return flags


def dense_experts(expert_indices, replay_mask, fallback, E, padding, ep_size, offset,
                  selected=None, flags=None):
    """(row_flags uint8 [T], int32 [T, K] experts routed: -1 or in [0, E)). `selected`: the
    model's own selection (int64 [T, K]) of at least the rows `selection_rows` names, for
    padding="select"; `flags`: row_flags(expert_indices, replay_mask, E) when known."""
    T, K = expert_indices.shape
    if flags is None:
        flags = row_flags(expert_indices, replay_mask, E)
    rec = in_range_or_empty(expert_indices, E).long()
    fb = None if fallback is None else in_range_or_empty(fallback, E).long()
    if padding == "spread":
        fill = spread_rows(T, E, K, ep_size, offset, expert_indices.device)
    elif padding == "fallback":
        fill = fb
    elif padding == "select":
        fill = selected
    else:  # "empty": the row's ids in [0, E); nothing for a masked row
        fill = rec if replay_mask is None else torch.where(replay_mask[:, None], rec, -1)
    out = torch.where((flags != 0)[:, None], fill, rec)
    if replay_mask is not None and fb is not None:
        out = torch.where(replay_mask[:, None], out, fb)
    return flags, out.to(torch.int32).contiguous()


def selection_rows(flags, replay_mask, fallback) -> torch.Tensor:
    """bool [T]: the rows dense_experts routes by the selection with padding="select": the
    flagged ones, except masked rows where a fallback routes them."""
    need = flags != 0
    if replay_mask is not None and fallback is not None:
        need = need & replay_mask
    return need


def _per_expert_sum(v, idx):
    """[T, K]: for each valid slot, the sum of v over the slots of its row with the same
    expert, in slot order; and the mask of the first slot of each expert in its row."""
    K = idx.shape[1]
    valid = idx >= 0
    same = (idx[:, :, None] == idx[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    tot = torch.zeros_like(v)
    for j in range(K):  # slot order, so a repeated expert adds up as the kernels do
        tot = tot + torch.where(same[:, :, j], v[:, j:j + 1], 0.0)
    earlier = torch.tril(same, diagonal=-1).any(dim=2)
    return tot, valid & ~earlier


def _scatter_rows(vals, idx, first, E, dtype):
    """[T, E] of dtype: vals[t, k] at (t, idx[t, k]) for the first slots, 0 elsewhere."""
    T = idx.shape[0]
    safe = torch.where(first, idx, E).long()  # other slots write into a column cut off below
    out = torch.zeros(T, E + 1, dtype=dtype, device=idx.device)
    return out.scatter(1, safe, torch.where(first, vals, 0.0).to(dtype))[:, :E].contiguous()


def gate_dense_fwd(logits, expert_indices, replay_mask, fallback, opts):
    sf = scores.get(opts.score_func)
    T, E = logits.shape
    x = logits.to(scores.compute_dtype(logits.dtype))
    K = expert_indices.shape[1]
    flags = row_flags(expert_indices, replay_mask, E)
    sel_idx = fill = None
    if opts.return_agreement:
        sel_idx = fill = _selected(x, logits.dtype, sf, opts, K)
    elif opts.padding == "select":
        fill = _select_flagged(x, logits.dtype, sf, opts, K,
                               selection_rows(flags, replay_mask, fallback))
    flags, idx = dense_experts(expert_indices, replay_mask, fallback, E, opts.padding,
                               opts.ep_size, opts.spread_offset, fill, flags)
    w = _weights(x, idx, sf, opts.normalize) * opts.scaling_factor
    tot, first = _per_expert_sum(w, idx)
    probs = _scatter_rows(tot, idx, first, E, logits.dtype)
    rmap = _scatter_rows(torch.ones_like(tot), idx, first, E, torch.uint8).bool()
    if opts.underflow_guard:
        probs = torch.where(rmap & (probs == 0), torch.finfo(logits.dtype).tiny, probs)
    if opts.with_plan:
        plan = build_plan(idx, E, opts.align)
    else:
        plan = empty_plan(logits.device, idx.shape[1])
    return (probs, rmap, flags, idx, *plan, *_agreement_outputs(x, idx, sel_idx, sf, opts))


def empty_plan(device, K: int):
    """The plan outputs of gate_dense_fwd with with_plan=False (sizes 0)."""
    i32 = dict(dtype=torch.int32, device=device)
    return (torch.empty(0, **i32), torch.empty(0, **i32), torch.empty(0, K, **i32),
            torch.empty(0, **i32))


def gate_dense_bwd(grad_probs, logits, idx, opts, grad_set_logprob=None):
    idx = in_range_or_empty(idx, logits.shape[1])  # an id outside [0, E) is no expert
    valid = idx >= 0
    g = grad_probs.gather(1, idx.clamp_min(0).long())
    return gate_bwd(torch.where(valid, g, 0.0), logits, idx, opts, grad_set_logprob)


def permute_probs_fwd(probs, sorted_slots, expert_indices, num_rows):
    T, E = probs.shape
    K = expert_indices.shape[1]
    tok, has, slot = _rows_of_slots(sorted_slots, num_rows, K, T)
    if T == 0:
        return probs.new_zeros(num_rows)
    e = expert_indices.reshape(-1)[slot.clamp(0, T * K - 1)].long()
    ok = has & (e >= 0) & (e < E)
    return torch.where(ok, probs[tok, e.clamp(0, max(E - 1, 0))], 0.0)


def permute_probs_bwd(grad, row_id_map, expert_indices, num_experts):
    R = grad.shape[0]
    row = row_id_map.long()
    ok = (row >= 0) & (row < R) & (expert_indices >= 0)
    idx = torch.where(ok, expert_indices, -1)
    cdt = scores.compute_dtype(grad.dtype)
    v = grad.to(cdt)[row.clamp(0, max(R - 1, 0))] if R else torch.zeros_like(row, dtype=cdt)
    tot, first = _per_expert_sum(torch.where(ok, v, 0.0), idx)
    return _scatter_rows(tot, idx, first, num_experts, grad.dtype)
