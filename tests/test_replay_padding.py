"""RouterReplayConfig.padding: a replayed row with a -1 slot routes to its other experts
("empty", the default) or takes the model's own selection inside the gate ("select"), in
RouterReplay.route and through a patched Hugging Face model."""
import pytest
import torch

import replay_ops
from replay_ops.router_replay import (
    ConfigError,
    ReplayAction,
    RouterReplay,
    RouterReplayConfig,
)

E, K, T = 8, 2, 6
HOLE = 2  # the row whose second slot is -1


def _replay(padding=None):
    cfg = RouterReplayConfig(mode="R3") if padding is None else \
        RouterReplayConfig(mode="R3", padding=padding)
    rr = RouterReplay(cfg, num_experts=E, top_k=K, moe_layer_ids=[0])
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    idx[HOLE, 1] = -1
    rr.set_routing(idx[:, None, :])
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    logits = torch.randn(T, E, generator=g)  # continuous: no ties
    return rr, idx, logits


def _own(logits):
    """The model's own choice, from the math: top-k of the softmax, weights renormalized."""
    p = torch.softmax(logits.double(), dim=-1)
    w, i = torch.topk(p, K, dim=-1)
    return i, w / w.sum(-1, keepdim=True)


def test_config_refuses_an_unknown_padding():
    with pytest.raises(ConfigError, match="unknown padding='spread'"):
        RouterReplay(RouterReplayConfig(mode="R3", padding="spread"), num_experts=E, top_k=K,
                     moe_layer_ids=[0])


def _row_set(plan, t):
    return sorted(plan.expert_indices[t].tolist())


def test_select_gives_the_holed_row_the_model_own_choice():
    rr, idx, logits = _replay("select")
    plan = rr.route(0, logits)
    own_i, own_w = _own(logits)
    assert _row_set(plan, HOLE) == sorted(own_i[HOLE].tolist())
    # weights of the selected row: the renormalized softmax at its experts, slot by slot
    want = {int(e): float(w) for e, w in zip(own_i[HOLE], own_w[HOLE])}
    got = {int(e): float(w) for e, w in zip(plan.expert_indices[HOLE], plan.weights[HOLE])}
    assert got.keys() == want.keys()
    for e in want:
        assert got[e] == pytest.approx(want[e], rel=1e-6)
    # every other row is replayed as set
    rows = [t for t in range(T) if t != HOLE]
    assert torch.equal(plan.expert_indices[rows].to(torch.int32), idx[rows])


def test_empty_default_leaves_the_slot_empty():
    rr, idx, logits = _replay()
    assert rr.config.padding == "empty"
    plan = rr.route(0, logits)
    # the row goes to its one recorded expert, with all of the weight (normalized)
    assert int(plan.expert_indices[HOLE, 0]) == int(idx[HOLE, 0])
    assert float(plan.weights[HOLE, 1]) == 0.0
    assert float(plan.weights[HOLE, 0]) == pytest.approx(1.0)
    assert int(plan.row_id_map[HOLE, 1]) == -1
    assert int(plan.tokens_per_expert.sum()) == T * K - 1


def test_the_call_overrides_the_config():
    rr, idx, logits = _replay("select")
    plan = rr.route(0, logits, padding="empty")
    assert float(plan.weights[HOLE, 1]) == 0.0
    rr2, _, _ = _replay()
    plan2 = rr2.route(0, logits, options=replay_ops.GateOptions(padding="select"))
    assert _row_set(plan2, HOLE) == sorted(_own(logits)[0][HOLE].tolist())
    # options at the default padding take the config's
    plan3 = rr.route(0, logits, options=replay_ops.GateOptions())
    assert _row_set(plan3, HOLE) == sorted(_own(logits)[0][HOLE].tolist())


def test_patched_model_select_reproduces_the_unpatched_model():
    """A recording that lost one slot of one token: with padding="select" the patched
    model routes that token as the model itself does (its output equals the unpatched
    model's); with "empty" it goes to one expert, and the output differs."""
    pytest.importorskip("transformers")
    from replay_ops.integrations import hf
    from replay_ops.testing import tiny

    model = tiny.tiny_model("qwen3_moe", seed=1234)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(4))
    blocks = hf.find_moe_blocks(model).blocks
    seen, hooks = {}, []
    for lid, blk in blocks.items():
        hooks.append(blk.gate.register_forward_hook(
            lambda m, i, o, lid=lid: seen.__setitem__(lid, o[2])))
    with torch.no_grad():
        ref = model(ids).logits
    for h in hooks:
        h.remove()
    routing = torch.stack([seen[lid] for lid in sorted(seen)], dim=1).to(torch.int32)
    holed = routing.clone()
    holed[3, 0, 1] = -1
    outs = {}
    for padding in ("select", "empty"):
        with hf.patch_model(model, RouterReplayConfig(mode="R3", padding=padding)) as patch:
            patch.replay.set_routing(holed)
            patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
            with torch.no_grad():
                outs[padding] = model(ids).logits
            used = patch.last_routing()
        if padding == "select":
            assert sorted(used[3, 0].tolist()) == sorted(routing[3, 0].tolist())
    torch.testing.assert_close(outs["select"], ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(outs["empty"], ref, rtol=1e-3, atol=1e-3)


def test_verl_override_sets_padding():
    from replay_ops.router_replay import load_config

    cfg = load_config(overrides=["actor_rollout_ref.actor.router_replay.mode=R3",
                                 "actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
                                 "actor_rollout_ref.actor.router_replay.padding=select"])
    assert cfg.padding == "select"
    with pytest.raises(ConfigError, match="padding"):
        load_config(overrides=["actor_rollout_ref.actor.router_replay.mode=R3",
                               "actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
                               "actor_rollout_ref.actor.router_replay.padding=zero"])
