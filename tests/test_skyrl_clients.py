"""SkyRL 0.4.0, R3 on Megatron-Core: its own replay chain (routed-expert trace, collate,
router padding mask, token-metadata layout, `setup_per_microbatch_replay_forward`, the
REPLAY_BACKWARD switch) driving GPT models built with the replay router, installed from the
package index and unmodified (tests/_client_loaders.py: how it imports on Python 3.11).
Every check runs in fresh processes (SkyRL patches Megatron's `TopKRouter` process-wide) and
compares with Megatron's router under the same calls: losses and gradients within fp32
tolerance, and every token routed to the rollout's row. See tests/_skyrl_workers.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import _client_loaders
from _helpers import require_client

require_client("megatron.core", "megatron-core")
require_client("skyrl.backends.skyrl_train.utils.replay_utils", "skyrl 0.4.0",
               load=_client_loaders.skyrl)

from replay_ops.testing import megatron_cpu as env  # noqa: E402
import _skyrl_workers as workers  # noqa: E402


@pytest.mark.parametrize("variant", ["plain", "fusion", "recompute"])
def test_skyrl_chain_matches_megatron(variant):
    out = env.spawn(workers.chain, 1, 2, variant, timeout=300)[0]
    assert out["N"] == 19
    if variant == "recompute":
        assert "backward replay list is empty" in out["empty_queue_error"]


def test_skyrl_chain_top1():
    assert env.spawn(workers.chain, 1, 1, "plain", timeout=300)[0]["N"] == 19


def test_skyrl_expert_bias_with_padding_mask():
    """Item 1: a sigmoid router with expert bias under SkyRL's padding mask. Megatron's own
    router fails in `_apply_expert_bias` (the flattened [T] mask against the [T, E] map);
    ours routes and counts the real tokens only."""
    out = env.spawn(workers.chain, 1, 2, "bias", timeout=300)[0]
    assert out["masked_rows"] == 2  # one uncaptured last token per trajectory
    assert out["megatron_error"] is not None and "broadcast" in out["megatron_error"], out


def test_skyrl_unpacked_batch_first_warns_once():
    """Item 2: an unpacked micro-batch (B = 2) replays SkyRL's batch-first rows against
    Megatron's sequence-first tokens; the router warns once, naming the order."""
    out = env.spawn(workers.unpacked, 1, 2, "warn", timeout=300)[0]
    assert out["error"] is None
    assert len(out["warnings"]) == 1 and "sequence-first" in out["warnings"][0]
    assert out["misrouted"] > out["real"] // 2, out  # what the warning is about
    print(f"unpacked B=2: {out['misrouted']} of {out['real']} real tokens replayed another "
          f"token's route")


def test_skyrl_unpacked_batch_first_strict_raises():
    out = env.spawn(workers.unpacked, 1, 2, "error", timeout=300)[0]
    assert out["error"] is not None and "ReplayRoutingError" in out["error"]
    assert "B=2" in out["error"] and "[S, B]" in out["error"]


# ------------------------------------------------------------ item 4: the vLLM adapter
def _vllm_rows(n, E, k=2, seed=0, high=None):
    """vLLM's routing of n tokens for a model with layers 0, 2, 3 MoE and layer 1 dense:
    [n, 4, K], K distinct ids below `high` per (token, MoE layer), the dense column 0."""
    rng = np.random.default_rng(seed)
    out = np.zeros((n, 4, k), dtype=np.int32)
    for t in range(n):
        for c in (0, 2, 3):
            out[t, c] = rng.choice(high or E, size=k, replace=False)
    return out


def _layout(E):
    from replay_ops.router_replay.adapters import ModelShape

    return ModelShape(num_experts=E, top_k=2, moe_layer_ids=(0, 2, 3), num_hidden_layers=4)


def test_skyrl_narrowed_uint8_routes_for_more_than_256_experts():
    """SkyRL's generate endpoint compacts routes by the largest id seen
    (`compact_routed_expert_indices`): a 300-expert model whose ids were all below 256 this
    time arrives as uint8. Accepted when the caller says narrowed=True; vLLM's own uint8
    for such a model is still refused."""
    from replay_ops.router_replay.adapters import RoutingMismatchError, vllm_sequences

    s = _client_loaders.skyrl()
    P, G = 5, 4
    rows = _vllm_rows(P + G - 1, 300, high=256)
    sent = s.routed_experts.compact_routed_expert_indices(rows)
    assert sent.dtype == np.uint8
    with pytest.raises(RoutingMismatchError, match="narrowed=True"):
        vllm_sequences([sent], [P], [G], _layout(300))
    seq = vllm_sequences([sent], [P], [G], _layout(300), narrowed=True)[0]
    assert torch.equal(seq.indices[:-1].long(), torch.from_numpy(rows[:, [0, 2, 3]]).long())
    assert seq.mask.tolist() == [True] * (P + G - 1) + [False]
    # an id SkyRL would not narrow (>= 256) goes to int16, accepted as before
    wide = s.routed_experts.compact_routed_expert_indices(_vllm_rows(P + G - 1, 300, seed=1))
    assert wide.dtype == np.int16
    vllm_sequences([wide], [P], [G], _layout(300))
    # ids out of range are refused whatever narrowed says
    bad = sent.copy()
    bad[0, 0, 0] = 255
    with pytest.raises(RoutingMismatchError):
        vllm_sequences([bad], [P], [G], _layout(200), narrowed=True)


def test_skyrl_truncated_response_keeps_one_more_row():
    """SkyRL's batched generator cuts an over-long response to max_tokens and keeps
    `prompt_len + len(response)` route rows (skyrl_gym_generator.py, generate_batched): the
    last kept token was forwarded, so its route is real. SkyRL's own collate takes that
    payload; ours takes it with truncated=[True] and routes the last token with it."""
    from replay_ops.router_replay.adapters import RoutingMismatchError, vllm_sequences

    s = _client_loaders.skyrl()
    P, generated, max_tokens = 4, 9, 6
    full = _vllm_rows(P + generated - 1, 8, seed=2)  # what vLLM returned
    kept = s.routed_experts.compact_routed_expert_indices(full[: P + max_tokens])
    prompts, responses = [[1] * P], [[2] * max_tokens]
    out = s.preprocess.convert_prompts_responses_to_batch_tensors(
        0, prompts, responses, [[0.0] * max_tokens], [[1] * max_tokens],
        rollout_expert_indices=[kept])
    assert out[6].values.shape[0] == P + max_tokens  # every token captured, none padded
    with pytest.raises(RoutingMismatchError, match="token rows"):
        vllm_sequences([kept], [P], [max_tokens], _layout(8))
    seq = vllm_sequences([kept], [P], [max_tokens], _layout(8), truncated=[True])[0]
    assert seq.indices.shape[0] == P + max_tokens and bool(seq.mask.all())
    assert torch.equal(seq.indices.long(), torch.from_numpy(full[: P + max_tokens][:, [0, 2, 3]]).long())
    # an untruncated response keeps its usual rule
    with pytest.raises(RoutingMismatchError, match="truncated"):
        vllm_sequences([kept[:-1]], [P], [max_tokens], _layout(8), truncated=[True])


def test_skyrl_masked_rows_as_spread_padding():
    """Item 5: opt-in, the rows SkyRL marks in its padding mask (uncaptured tokens, routed
    0..K-1 by SkyRL) become padding rows spread over the experts (ReplayOptions(
    padding="spread", masked_rows="padding")); the real rows are untouched."""
    assert env.spawn(workers.chain, 1, 2, "spread", timeout=300)[0]["N"] == 19


@pytest.mark.parametrize("kind", ["cp2", "tp2sp"])
def test_skyrl_cp2_and_tp2_sp_splits(kind):
    out = env.spawn(workers.dist, 2, kind, timeout=300)
    n = sum(out[0]["padded"])
    assert sorted(out[0]["rows"] + out[1]["rows"]) == list(range(n))  # a partition
