"""The `torch` backend: vectorised eager PyTorch, used for CPU tensors until a native
CPU kernel is available, and on any device as a last resort.

Forward math *is* the reference (`reference.py`). Backward ops are explicit closed-form
gradients written here, so the test suite checks them against autograd through the
reference and against gradcheck.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import reference as ref

NAME = "torch"
DEVICES = ("cpu", "cuda")


def available(device_type: str) -> bool:
    return True


def gate_fwd(logits, expert_indices, score_func, normalize, scaling_factor, align):
    E = logits.shape[1]
    idx = expert_indices.to(torch.int32, copy=True).contiguous()
    weights = ref.gate_weights(logits, idx, score_func, normalize, scaling_factor)
    return (weights, idx, *ref.build_plan(idx, E, align))


def gate_bwd(grad_weights, logits, idx, score_func, normalize, scaling_factor):
    cdt = ref.compute_dtype(logits.dtype)
    x = logits.to(cdt)
    valid = idx >= 0
    safe = idx.clamp_min(0).long()
    g = torch.where(valid, grad_weights.to(cdt), 0.0) * scaling_factor
    if score_func == "softmax" and not normalize:
        p = torch.softmax(x, dim=-1)
        a = torch.where(valid, g * p.gather(1, safe), 0.0)  # d/dx_j of p_i: p_i(δ_ij - p_j)
        grad = -p * a.sum(dim=-1, keepdim=True)
        grad = grad.scatter_add(1, safe, a)
        return grad.to(logits.dtype)
    z = x.gather(1, safe)
    if score_func == "softmax":
        zm = torch.where(valid, z, float("-inf"))
        m = zm.amax(dim=-1, keepdim=True)
        e = torch.exp(zm - torch.where(torch.isfinite(m), m, 0.0))
        s = e.sum(dim=-1, keepdim=True)
        q = e / torch.where(s > 0, s, 1.0)
        dz = q * (g - (g * q).sum(dim=-1, keepdim=True))
    else:
        if score_func == "sigmoid":
            sc = torch.sigmoid(z)
            dsc = sc * (1 - sc)
        else:
            sc = F.softplus(z).sqrt()
            # d sqrt(softplus(z)) / dz = sigmoid(z) / (2 sqrt(softplus(z)))
            # (F.softplus is linear above its threshold of 20, so its slope is 1 there)
            slope = torch.where(z > 20, 1.0, torch.sigmoid(z))
            dsc = torch.where(sc > 0, slope / (2 * sc), 0.0)
        sc = torch.where(valid, sc, 0.0)
        if normalize:
            many = valid.sum(dim=-1, keepdim=True) > 1
            S = sc.sum(dim=-1, keepdim=True) + ref.NORM_EPS
            gn = g / S - (g * sc).sum(dim=-1, keepdim=True) / (S * S)
            g = torch.where(many, gn, g)
        dz = g * dsc
    dz = torch.where(valid, dz, 0.0)
    grad = torch.zeros_like(x).scatter_add(1, safe, dz)
    return grad.to(logits.dtype)


def permute_fwd(hidden, sorted_slots, row_id_map, num_rows):
    return ref.permute_rows(hidden, sorted_slots, row_id_map.shape[1], num_rows)


def _gather_rows(x, row_id_map):
    """[T, K, H] rows of x at row_id_map (fp32/fp64) and the [T, K] validity mask."""
    R = x.shape[0]
    row = row_id_map.long()
    valid = (row >= 0) & (row < R)
    if R == 0:
        return x.new_zeros(*row.shape, x.shape[1]), valid
    return x[row.clamp(0, R - 1)], valid


def permute_bwd(grad_out, row_id_map):
    cdt = ref.compute_dtype(grad_out.dtype)
    rows, valid = _gather_rows(grad_out, row_id_map)
    acc = torch.zeros(rows.shape[0], rows.shape[2], dtype=cdt, device=grad_out.device)
    for k in range(rows.shape[1]):  # column order, fp32 accumulation
        acc = acc + torch.where(valid[:, k, None], rows[:, k].to(cdt), 0.0)
    return acc.to(grad_out.dtype)


def unpermute_fwd(expert_out, row_id_map, weights):
    return ref.combine(expert_out, row_id_map, weights)


def unpermute_bwd(grad_out, expert_out, row_id_map, sorted_slots, weights):
    T, K = row_id_map.shape
    R = expert_out.shape[0]
    cdt = ref.compute_dtype(expert_out.dtype)
    go = grad_out.to(cdt)
    # grad_expert_out[r] = weights[t, k] * grad_out[t] for the slot s = t*K + k in row r.
    slot = torch.full((R,), -1, dtype=torch.long, device=expert_out.device)
    n = min(R, sorted_slots.shape[0])
    slot[:n] = sorted_slots[:n].long()
    has = slot >= 0
    s = slot.clamp_min(0)
    if T == 0:
        grad_x = torch.zeros_like(expert_out)
    else:
        w = weights.to(cdt).reshape(-1)[s]
        grad_x = torch.where(has[:, None], w[:, None] * go[s // K], 0.0).to(expert_out.dtype)
    rows, valid = _gather_rows(expert_out, row_id_map)
    grad_w = (go[:, None, :] * rows.to(cdt)).sum(dim=-1)
    grad_w = torch.where(valid, grad_w, 0.0).to(weights.dtype)
    return grad_x, grad_w
