"""verl: its own int16 `[B, S, L, K]` routing (zero rows where there is no data) with the
batch's `attention_mask`, and the key under which the rollout's routing travels in a batch."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ..._validate import signed_routing
from .layout import ModelShape, ReplayBatch, RoutingMismatchError, as_tensor, to_moe


def from_verl_padded(
    routed,
    attention_mask,
    layout: ModelShape,
) -> ReplayBatch:
    """verl's own int16 `[B, S, L, K]` (zero rows where there is no data; any integer
    dtype, tensor or array, is accepted) plus its
    `attention_mask [B, S]`: rows outside the mask and the last real token of each row
    become -1 with replay_mask False, so a zero row is never read as expert 0."""
    routed, dtype = signed_routing(routed, "from_verl_padded", "routed", RoutingMismatchError)
    attention_mask = as_tensor(attention_mask, "from_verl_padded")
    if routed.dim() != 4 or attention_mask.shape != routed.shape[:2]:
        raise RoutingMismatchError(
            f"from_verl_padded: routed must be [B, S, L, K] and attention_mask [B, S]; got "
            f"{tuple(routed.shape)} and {tuple(attention_mask.shape)}"
        )
    B, S, L, K = routed.shape
    am = attention_mask.to(torch.bool).cpu()
    pos = torch.arange(S).expand(B, S)
    last = torch.where(am, pos, -1).max(dim=1).values  # [B]
    mask = am & (pos != last[:, None])
    flat = routed.detach().cpu().reshape(B * S, L, K)
    idx = torch.where(mask.reshape(B * S, 1, 1), flat, -1)
    try:
        moe, mapping = to_moe(layout, idx, "from_verl_padded", arrived_as=dtype)
    except RoutingMismatchError as e:
        raise RoutingMismatchError(f"{e} (flattened token index = b * S + s, S={S})") from None
    return ReplayBatch(moe.reshape(B, S, layout.num_moe_layers, K), mask, None,
                       [mapping] * B)


def routing_from_batch(batch: Mapping, key: str = "routed_experts") -> Any:
    """`batch[key]`, raising a clear error when the key was dropped on the way from the
    generator to the trainer (R3 must never silently run without routing)."""
    if key not in batch or batch[key] is None:
        keys = sorted(map(str, batch.keys()))
        raise RoutingMismatchError(
            f"the training batch has no {key!r} (keys: {keys}); rollout routing replay (R3) "
            f"needs the rollout's routing to reach the trainer"
        )
    return batch[key]
