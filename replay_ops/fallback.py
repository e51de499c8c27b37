"""The `replay_mask` fallback: rows without a recorded route (False in the mask) use the
native top-k of the scores, in `torch.topk` order (descending score).

The scores are the score function's dense scores over all E experts in the compute dtype
(`scores.TABLE[name].forward`): softmax probabilities, sigmoid or sqrt-softplus. Models
whose selection adds a bias or groups (DeepSeek-V3) pass their own top-k instead
(`RouterReplayConfig(fallback="topk_fn")`).
"""
from __future__ import annotations

import torch

from . import scores


def fallback_topk(logits: torch.Tensor, top_k: int, score_func: str) -> torch.Tensor:
    """int32 [T, top_k]: the top-k experts of each row's scores."""
    sf = scores.get(score_func)
    x = logits.to(scores.compute_dtype(logits.dtype))
    return torch.topk(sf.forward(x), top_k, dim=-1).indices.to(torch.int32)


def in_range_or_empty(expert_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 copy of the indices with every value outside [0, E) set to -1 (an empty slot).
    The range is tested on the full-width values, before the narrowing to int32."""
    idx = expert_indices
    ok = (idx >= 0) & (idx < num_experts)
    return torch.where(ok, idx, -1).to(torch.int32)


def resolve_indices(
    logits: torch.Tensor,
    expert_indices: torch.Tensor,
    replay_mask: torch.Tensor,
    score_func: str,
    sync_free: bool,
) -> torch.Tensor:
    """int32 [T, K] contiguous indices actually used: the recorded rows (values outside
    [0, E) become -1), and the top-k of the scores where `replay_mask` is False.

    With `sync_free=False` the top-k runs only on the fallback rows (finding them is a host
    sync). With `sync_free=True` it runs on every row and a `where` keeps the recorded rows:
    the same result (top-k is per row) with no host sync, for CUDA graphs."""
    E, K = logits.shape[1], expert_indices.shape[1]
    idx = in_range_or_empty(expert_indices, E)
    if sync_free:
        native = fallback_topk(logits, K, score_func)
        return torch.where(replay_mask[:, None], idx, native).contiguous()
    rows = (~replay_mask).nonzero().flatten()
    if rows.numel():
        idx[rows] = fallback_topk(logits[rows], K, score_func)
    return idx.contiguous()
