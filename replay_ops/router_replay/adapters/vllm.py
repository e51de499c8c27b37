"""vLLM (`enable_return_routed_experts`): per request, `routed_experts` is an array
`[prompt_len + gen_len - 1, L, K]` of int16 or int32 (the last token has no route), with L
the number of all hidden layers or of the MoE layers, depending on the version."""
from __future__ import annotations

from typing import Any, Sequence

from .layout import (
    ModelShape,
    MultiTurnRouting,
    ReplayBatch,
    RoutingMismatchError,
    SequenceRouting,
    as_tensor,
    check_batch,
    missing_sequence,
    pack,
)


def vllm_sequences(
    routed_experts: Sequence[Any | None],
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    layout: ModelShape,
    *,
    allow_missing: bool = False,
) -> list[SequenceRouting]:
    """Per-request routing from vLLM: `routed_experts[i]` is `[prompt_lens[i] +
    response_lens[i] - 1, L, K]` (int16/int32), or None for a request without routing
    (an error unless `allow_missing`). A multi-turn request is a list of turns, each
    `(routed_experts, seq_len)` for the turn's whole request, appended in order."""
    who = "vllm routed_experts"
    B = len(prompt_lens)
    if len(response_lens) != B:
        raise RoutingMismatchError(f"{who}: {len(prompt_lens)} prompt lengths but "
                                   f"{len(response_lens)} response lengths")
    check_batch(routed_experts, B, who, allow_missing)
    out = []
    for i, (r, P, G) in enumerate(zip(routed_experts, prompt_lens, response_lens)):
        P, G = int(P), int(G)
        if P < 0 or G < 0 or P + G < 1:
            raise RoutingMismatchError(f"request {i}: prompt_len={P}, response_len={G} is empty")
        if r is None:
            out.append(missing_sequence(layout, P + G))
            continue
        acc = MultiTurnRouting(layout, request=i)
        if isinstance(r, list) and r and isinstance(r[0], tuple):
            for turn, seq_len in r:
                acc.add_turn(turn, int(seq_len), 0)
        else:
            t = as_tensor(r, f"request {i}")
            if t.dim() == 3 and t.shape[0] != P + G - 1:
                raise RoutingMismatchError(
                    f"request {i}: vLLM routed_experts has {t.shape[0]} token rows but "
                    f"prompt_len + response_len - 1 = {P + G - 1} (prompt_len={P}, "
                    f"response_len={G})"
                )
            acc.add_turn(t, P + G, 0)
        out.append(acc.sequence(P + G))
    return out


def vllm_batch(routed_experts, prompt_lens, response_lens, layout, *, layout_kind="padded",
               max_prompt_len=None, max_response_len=None, allow_missing=False) -> ReplayBatch:
    """`vllm_sequences` then `pack_padded` (layout_kind="padded") or `pack_thd` ("thd")."""
    seqs = vllm_sequences(routed_experts, prompt_lens, response_lens, layout,
                          allow_missing=allow_missing)
    return pack(seqs, prompt_lens, layout_kind, max_prompt_len, max_response_len)
