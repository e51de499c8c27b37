"""The `triton` backend: launchers for the kernels in `replay_ops.triton_kernels`.

CUDA tensors run compiled kernels. CPU tensors run only under TRITON_INTERPRET=1 (Triton's
numpy interpreter), which is how CI checks these kernels on a machine without a GPU.
No launcher reads device memory on the host: the gate path is sync-free.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_kernels import gate as _gate
from .triton_kernels import permute as _permute
from .triton_kernels import unpermute as _unpermute

NAME = "triton"
DEVICES = ("cuda", "cpu")


def available(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_available()
    if device_type == "cpu":
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return False


def _cdt(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _device_ctx(t: torch.Tensor):
    # launch on the tensor's device (Triton uses the current stream of that device)
    if t.is_cuda:
        return torch.cuda.device(t.device)
    import contextlib

    return contextlib.nullcontext()


def gate_fwd(logits, expert_indices, score_func, normalize, scaling_factor, align,
             config=None):
    T, E = logits.shape
    K = expert_indices.shape[1]
    dev = logits.device
    i32 = dict(dtype=torch.int32, device=dev)
    n_sorted = T * K + E * (align - 1)
    weights = torch.empty(T, K, dtype=logits.dtype, device=dev)
    idx_out = torch.empty(T, K, **i32)
    row_id_map = torch.empty(T, K, **i32)
    tpe = torch.empty(E, **i32)
    offsets = torch.empty(E + 1, **i32)
    sorted_slots = torch.empty(n_sorted, **i32)
    if T == 0:
        return (weights, idx_out, tpe.zero_(), offsets.zero_(), row_id_map,
                sorted_slots.fill_(-1))
    cfg = config or _gate.gate_config(T, K, E, align)
    C = cfg["num_chunks"]
    chunk_counts = torch.empty(C if not cfg["single"] else 1, E, **i32)
    common = dict(
        SCORE=_gate.SCORE_IDS[score_func], NORMALIZE=bool(normalize), CDT=_cdt(logits.dtype),
        SINGLE=cfg["single"], BLOCK_T=cfg["BLOCK_T"], K_PAD=cfg["K_PAD"],
        E_BLOCK=cfg["E_BLOCK"], E_HIST=cfg["E_HIST"], SLOT_BLOCK=cfg["SLOT_BLOCK"],
        PAD_J=cfg["PAD_J"], TAIL_BLOCK=cfg["TAIL_BLOCK"],
    )
    with _device_ctx(logits):
        _gate._gate_fwd_kernel[(C,)](
            logits, expert_indices,
            weights, idx_out, row_id_map, chunk_counts, tpe, offsets, sorted_slots,
            T, E, K, logits.stride(0), logits.stride(1),
            expert_indices.stride(0), expert_indices.stride(1),
            *_gate.split_scale(scaling_factor), align, n_sorted,
            **common,
        )
        if not cfg["single"]:
            _gate._plan_scan_kernel[(1,)](
                chunk_counts, tpe, offsets, sorted_slots, C, E, align, n_sorted,
                E_HIST=cfg["E_HIST"], CHUNK_BLOCK=cfg["CHUNK_BLOCK"], PAD_J=cfg["PAD_J"],
                TAIL_BLOCK=cfg["TAIL_BLOCK"],
            )
            _gate._plan_scatter_kernel[(C,)](
                idx_out, row_id_map, chunk_counts, offsets, sorted_slots, T, E, K,
                BLOCK_T=cfg["BLOCK_T"], SLOT_BLOCK=cfg["SLOT_BLOCK"],
            )
    return weights, idx_out, tpe, offsets, row_id_map, sorted_slots


def gate_bwd(grad_weights, logits, idx, score_func, normalize, scaling_factor):
    T, E = logits.shape
    K = idx.shape[1]
    grad = torch.empty(T, E, dtype=logits.dtype, device=logits.device)
    if T == 0:
        return grad
    cfg = _gate.gate_bwd_config(T, K, E)
    with _device_ctx(logits):
        _gate._gate_bwd_kernel[(triton.cdiv(T, cfg["BLOCK_T"]),)](
            grad_weights.contiguous(), logits, idx.contiguous(), grad,
            T, E, K, logits.stride(0), logits.stride(1), *_gate.split_scale(scaling_factor),
            SCORE=_gate.SCORE_IDS[score_func], NORMALIZE=bool(normalize),
            DENSE=(score_func == "softmax" and not normalize), CDT=_cdt(logits.dtype),
            **cfg,
        )
    return grad


def permute_fwd(hidden, sorted_slots, row_id_map, num_rows):
    T, H = hidden.shape
    K = row_id_map.shape[1]
    out = torch.empty(num_rows, H, dtype=hidden.dtype, device=hidden.device)
    if num_rows == 0 or H == 0:
        return out
    if T == 0:
        return out.zero_()
    cfg = _permute.permute_config(H)
    with _device_ctx(hidden):
        _permute._permute_fwd_kernel[(triton.cdiv(num_rows, cfg["BLOCK_R"]),)](
            hidden, sorted_slots, out, num_rows, sorted_slots.shape[0], H, K,
            hidden.stride(0), hidden.stride(1), **cfg,
        )
    return out


def _gather_sum(src, row_id_map, weights):
    """[T, H] = sum_k [weights[t,k] *] src[row_id_map[t,k]] (see _gather_sum_kernel)."""
    R, H = src.shape
    T, K = row_id_map.shape
    out = torch.empty(T, H, dtype=src.dtype, device=src.device)
    if T == 0 or H == 0:
        return out
    cfg = _permute.permute_config(H)
    with _device_ctx(src):
        _permute._gather_sum_kernel[(triton.cdiv(T, cfg["BLOCK_R"]),)](
            src, row_id_map, src if weights is None else weights.contiguous(), out,
            T, H, K, R, src.stride(0), src.stride(1),
            WEIGHTED=weights is not None, CDT=_cdt(src.dtype),
            BLOCK_T=cfg["BLOCK_R"], BLOCK_H=cfg["BLOCK_H"],
        )
    return out


def permute_bwd(grad_out, row_id_map):
    return _gather_sum(grad_out, row_id_map, None)


def unpermute_fwd(expert_out, row_id_map, weights):
    return _gather_sum(expert_out, row_id_map, weights)


def unpermute_bwd(grad_out, expert_out, row_id_map, sorted_slots, weights):
    R, H = expert_out.shape
    T, K = row_id_map.shape
    grad_out = grad_out.contiguous()
    weights = weights.contiguous()
    grad_x = torch.empty(R, H, dtype=expert_out.dtype, device=expert_out.device)
    grad_w = torch.empty(T, K, dtype=weights.dtype, device=weights.device)
    cdt = _cdt(expert_out.dtype)
    with _device_ctx(expert_out):
        if R > 0 and H > 0:
            cfg = _permute.permute_config(H)
            _unpermute._unpermute_bwd_dx_kernel[(triton.cdiv(R, cfg["BLOCK_R"]),)](
                grad_out, sorted_slots, weights, grad_x, R, sorted_slots.shape[0], H, K,
                CDT=cdt, **cfg,
            )
        if T > 0:
            if H == 0:
                return grad_x, grad_w.zero_()
            cfg = _permute.permute_config(H)
            _unpermute._unpermute_bwd_dw_kernel[(triton.cdiv(T, cfg["BLOCK_R"]),)](
                grad_out, expert_out, row_id_map, grad_w, T, H, K, R,
                expert_out.stride(0), expert_out.stride(1), CDT=cdt,
                BLOCK_T=cfg["BLOCK_R"], BLOCK_H=cfg["BLOCK_H"],
            )
    return grad_x, grad_w
