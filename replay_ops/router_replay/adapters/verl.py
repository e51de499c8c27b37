"""verl: its own int16 `[B, S, L, K]` routing (zero rows where there is no data) with the
batch's `attention_mask` (and, optionally, verl's replay mask), and the key under which the
rollout's routing travels in a batch."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ..._validate import signed_routing
from .batch import (ModelShape, ReplayBatch, RoutingMismatchError, _mark_checked, as_tensor,
                    first_unrouted, to_moe)
from ..._deprecated import renamed_keyword


ZERO_ROWS = ("error", "missing", "expert0")


@renamed_keyword("layout", "model_shape", "from_verl_padded")
def from_verl_padded(
    routed,
    attention_mask,
    model_shape: ModelShape,
    *,
    replay_mask=None,
    zero_rows: str = "error",
) -> ReplayBatch:
    """verl's own `[B, S, L, K]` routing (int16 in verl; any integer dtype, tensor or
    array, is accepted) plus its `attention_mask [B, S]` -> a `ReplayBatch` (-1 and
    replay_mask False where nothing is replayed).

    The rows replayed are inside the attention mask, are not the last real token of a
    row (the rollout has no route for it) and, when `replay_mask` is given, are True in
    it (`[B, S]` bool, or verl's jagged mask over the unpadded tokens, such as
    `build_r3_replay_mask`'s). Other rows become -1 with replay_mask False: they keep
    the model's own top-k, as rows outside verl's replay mask do in verl.

    verl leaves all-zero rows where the rollout recorded nothing (multi-turn: the tokens
    after the last generation). An all-zero row (every MoE layer, every slot) among the
    rows replayed is refused, naming the row, unless `zero_rows` says what it is:

    * `"missing"` (top_k >= 2): no route; the row runs with the model's own top-k (-1, mask
      False). With top_k >= 2 a zero row repeats expert 0, so it can never be a route.
    * `"expert0"` (top_k == 1): a route to expert 0 in every MoE layer. With top_k=1 a
      zero row is also exactly that, so the data cannot tell; pass a `replay_mask` that
      leaves out the rows without routing (verl's `build_r3_replay_mask` does not: it
      covers the trailing zero rows) and say that the zero rows left are routes.

    `"missing"` with top_k=1 (it would drop real expert-0 routes) and `"expert0"` with
    top_k >= 2 are refused.
    """
    who = "from_verl_padded"
    if zero_rows not in ZERO_ROWS:
        raise ValueError(f"{who}: zero_rows must be one of {ZERO_ROWS}, got {zero_rows!r}")
    routed, dtype = signed_routing(routed, who, "routed", RoutingMismatchError)
    am = as_tensor(attention_mask, who)
    if routed.dim() != 4 or tuple(am.shape) != tuple(routed.shape[:2]):
        raise RoutingMismatchError(
            f"{who}: routed must be [B, S, L, K] and attention_mask [B, S]; got "
            f"{tuple(routed.shape)} and {tuple(am.shape)}"
        )
    B, S, L, K = routed.shape
    if K != model_shape.top_k:
        raise RoutingMismatchError(f"{who}: routed has K={K} experts per token, the model has "
                                   f"top_k={model_shape.top_k} (shape {tuple(routed.shape)})")
    if zero_rows == "missing" and K == 1:
        raise ValueError(
            f"{who}: zero_rows='missing' needs top_k >= 2: with top_k=1 an all-zero row is "
            f"also a route to expert 0 in every MoE layer, and real routes would be dropped. "
            f"Leave the rows without routing out with replay_mask, and pass "
            f"zero_rows='expert0'")
    if zero_rows == "expert0" and K > 1:
        raise ValueError(
            f"{who}: zero_rows='expert0' needs top_k=1: with top_k={K} an all-zero row "
            f"repeats expert 0 and is never a route; pass zero_rows='missing' to run such "
            f"rows with the model's own top-k")
    am = am.to(torch.bool).cpu()
    pos = torch.arange(S).expand(B, S)
    last = torch.where(am, pos, -1).max(dim=1).values  # [B]
    mask = am & (pos != last[:, None])
    if replay_mask is not None:
        mask &= _padded_mask(replay_mask, am, who)
    flat = routed.detach().cpu().reshape(B * S, L, K)
    cols = model_shape.columns(model_shape.mapping_for(L, who, error=RoutingMismatchError))
    zero = (flat[:, cols, :] == 0).all(dim=2).all(dim=1).view(B, S) & mask
    if zero_rows == "missing":
        mask &= ~zero
    elif zero_rows == "error" and bool(zero.any()):
        b, s = (int(v) for v in zero.nonzero()[0])
        raise RoutingMismatchError(
            f"{who}: row (b={b}, s={s}) is all zeros in every MoE layer but is among the rows "
            f"to replay ({int(zero.sum())} such rows); verl leaves zero rows where the "
            f"rollout recorded nothing (multi-turn: tokens after the last generation). "
            + (f"With top_k={K} it repeats expert 0 and is not a route: pass "
               f"zero_rows='missing' to run such rows with the model's own top-k, or a "
               f"replay_mask that leaves them out" if K > 1 else
               "With top_k=1 it is also a route to expert 0 in every MoE layer, and the "
               "data cannot tell which: pass a replay_mask that leaves out the rows without "
               "routing, and zero_rows='expert0' to replay the zero rows left as expert 0"))
    idx = torch.where(mask.reshape(B * S, 1, 1), flat, -1)
    try:
        moe, mapping = to_moe(model_shape, idx, who, arrived_as=dtype)
    except RoutingMismatchError as e:
        raise RoutingMismatchError(f"{e} (flattened token index = b * S + s, S={S})") from None
    hit = first_unrouted(moe, mask.reshape(-1))
    if hit is not None:
        b, s = divmod(hit[0], S)
        layers = [model_shape.moe_layer_ids[j] for j in hit[1]]
        raise RoutingMismatchError(
            f"{who}: row (b={b}, s={s}) is among the rows to replay but has no route (every "
            f"slot -1) in MoE layers {layers}; replayed, it would get no expert there. Leave "
            f"it out with replay_mask, or route it in every MoE layer")
    # every row was scanned against model_shape (`to_moe`), every row to replay is routed
    return _mark_checked(ReplayBatch(moe.reshape(B, S, model_shape.num_moe_layers, K), mask,
                                     None, [mapping] * B), model_shape)


def _padded_mask(replay_mask, am: torch.Tensor, who: str) -> torch.Tensor:
    """`replay_mask` as bool [B, S]: as given, or verl's jagged mask over the unpadded
    tokens (one sequence per row, the tokens of the attention mask in order)."""
    if isinstance(replay_mask, torch.Tensor) and replay_mask.is_nested:
        vals = replay_mask.values().to(torch.bool).cpu()
        lens = replay_mask.offsets().diff().tolist()
        have = am.sum(dim=1).tolist()
        if lens != have:
            raise RoutingMismatchError(f"{who}: the jagged replay_mask has sequence lengths "
                                       f"{lens} but the attention mask has {have}")
        out = torch.zeros_like(am)
        out[am] = vals
        return out
    rm = as_tensor(replay_mask, who)
    if rm.dtype != torch.bool or tuple(rm.shape) != tuple(am.shape):
        raise RoutingMismatchError(f"{who}: replay_mask must be bool [B, S]={tuple(am.shape)} "
                                   f"(or verl's jagged mask), got {rm.dtype} {tuple(rm.shape)}")
    outside = rm.cpu() & ~am
    if bool(outside.any()):
        b, s = (int(v) for v in outside.nonzero()[0])
        raise RoutingMismatchError(f"{who}: replay_mask is True at row (b={b}, s={s}), outside "
                                   f"the attention mask (padding has no routing)")
    return rm.cpu()


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
