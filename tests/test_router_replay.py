"""RouterReplay: modes, actions, the recompute FIFO, layer mapping, and R2 round trips."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import replay_ops
from replay_ops.router_replay import (
    ConfigError,
    ReplayAction,
    ReplayMode,
    RouterReplay,
    RouterReplayConfig,
    RouterReplayError,
)

E, K = 8, 2
# DeepSeek-V3 style: dense first layer, then MoE layers with a dense one in between.
LAYER_KINDS = ("dense", "moe", "moe", "dense", "moe")
MOE_IDS = [i for i, k in enumerate(LAYER_KINDS) if k == "moe"]  # [1, 2, 4]
NUM_LAYERS = len(LAYER_KINDS)


def softmax_topk(logits: torch.Tensor) -> torch.Tensor:
    return torch.topk(torch.softmax(logits.float(), dim=-1), K, dim=-1).indices


def make(mode="R2", moe_ids=MOE_IDS, num_layers=NUM_LAYERS, **cfg) -> RouterReplay:
    return RouterReplay(RouterReplayConfig(mode=mode, **cfg), num_experts=E, top_k=K,
                        moe_layer_ids=moe_ids, num_hidden_layers=num_layers)


def distinct_rows(T: int, L: int, seed: int) -> torch.Tensor:
    """[T, L, K] int32, K distinct experts per (token, layer)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T * L)]).view(
        T, L, K).to(torch.int32)


# ------------------------------------------------------------------ a tiny MoE model
class TinyMoE(nn.Module):
    """Dense and MoE layers; MoE layers route through RouterReplay when given one."""

    def __init__(self, H=16, kinds=LAYER_KINDS, replay: RouterReplay | None = None, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.kinds = kinds
        self.replay = replay
        self.dense = nn.ParameterDict()
        self.router = nn.ParameterDict()
        self.experts = nn.ParameterDict()
        for i, k in enumerate(kinds):
            if k == "dense":
                self.dense[str(i)] = nn.Parameter(torch.randn(H, H, generator=g) / H**0.5)
            else:
                self.router[str(i)] = nn.Parameter(torch.randn(H, E, generator=g))
                self.experts[str(i)] = nn.Parameter(torch.randn(E, H, H, generator=g) / H**0.5)
        self.plans: dict[int, replay_ops.RoutingPlan] = {}

    def moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        logits = x @ self.router[str(i)]
        plan = None
        if self.replay is not None:
            plan = self.replay.route(i, logits, topk_fn=softmax_topk, score_func="softmax",
                                     normalize=True)
        if plan is None:  # native path
            plan = replay_ops.gate(logits, softmax_topk(logits), score_func="softmax")
        self.plans[i] = plan
        h = replay_ops.permute(x, plan)
        offs = plan.expert_offsets.tolist()
        w = self.experts[str(i)]
        rows = torch.cat([h[offs[e]:offs[e + 1]] @ w[e] for e in range(E)])
        return x + replay_ops.unpermute(rows, plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, k in enumerate(self.kinds):
            x = torch.tanh(x @ self.dense[str(i)]) + x if k == "dense" else self.moe(i, x)
        return x


# ------------------------------------------------------------------ disabled mode
def test_disabled_returns_none_and_never_calls_gate(monkeypatch):
    rr = make("disabled")
    assert not rr.enabled and rr.mode is ReplayMode.DISABLED

    def boom(*a, **k):
        raise AssertionError("gate called in disabled mode")

    monkeypatch.setattr(replay_ops, "gate", boom)
    logits = torch.randn(5, E)
    assert rr.route(1, logits, topk_fn=softmax_topk, score_func="softmax", normalize=True) is None
    with pytest.raises(ConfigError, match="disabled"):
        rr.set_action(ReplayAction.RECORD)
    with pytest.raises(ConfigError, match="disabled"):
        rr.set_routing(distinct_rows(5, 3, 0))
    assert rr.record_calls(1) == 0 and rr.queue_depth(1) == 0


def test_enabled_without_action_is_native(monkeypatch):
    rr = make("R3")
    monkeypatch.setattr(replay_ops, "gate", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    assert rr.action is None
    assert rr.route(1, torch.randn(3, E), topk_fn=softmax_topk) is None


def test_disabled_model_matches_model_without_replay():
    x = torch.randn(7, 16)
    out_plain = TinyMoE()(x)
    out_disabled = TinyMoE(replay=make("disabled"))(x)
    assert torch.equal(out_plain, out_disabled)


# ------------------------------------------------------------------ RECORD
def test_record_stores_native_indices_in_moe_order():
    rr = make("R2")
    rr.set_action(ReplayAction.RECORD)
    model = TinyMoE(replay=rr)
    x = torch.randn(6, 16)
    model(x)
    rec = rr.recorded()
    assert rec.dtype == torch.int32 and rec.shape == (6, len(MOE_IDS), K)
    # Independently recompute each MoE layer's native top-k from its router logits.
    h = x
    for i, k in enumerate(LAYER_KINDS):
        if k == "dense":
            h = torch.tanh(h @ model.dense[str(i)]) + h
        else:
            ref_idx = softmax_topk(h @ model.router[str(i)]).to(torch.int32)
            assert torch.equal(rec[:, MOE_IDS.index(i)], ref_idx)
            h = model.moe(i, h)
    # recorded() concatenates several RECORD forwards along T
    rr.clear()
    rr.set_action("record")
    TinyMoE(replay=rr)(x[:2])
    TinyMoE(replay=rr)(x[2:])
    assert rr.recorded().shape == (6, 3, K)


def test_record_requires_topk_fn_and_checks_its_output():
    rr = make("R2")
    rr.set_action(ReplayAction.RECORD)
    logits = torch.randn(4, E)
    with pytest.raises(ValueError, match="RECORD needs topk_fn"):
        rr.route(1, logits)
    with pytest.raises(ValueError, match=r"layer 1: topk_fn must return \[T, K\]=\(4, 2\)"):
        rr.route(1, logits, topk_fn=lambda l: torch.topk(l, 3).indices)
    with pytest.raises(RouterReplayError, match="layer_id=0 is not a MoE layer"):
        rr.route(0, logits, topk_fn=softmax_topk)


def test_recorded_errors_when_a_layer_was_skipped():
    rr = make("R2")
    rr.set_action(ReplayAction.RECORD)
    with pytest.raises(RouterReplayError, match="nothing was recorded"):
        rr.recorded()
    logits = torch.randn(4, E)
    rr.route(1, logits, topk_fn=softmax_topk)
    rr.route(2, logits, topk_fn=softmax_topk)
    with pytest.raises(RouterReplayError, match="bypassed"):
        rr.recorded()
    with pytest.raises(RouterReplayError, match=r"MoE layers \[4\]"):
        rr.check_all_layers_routed()


# ------------------------------------------------------------------ REPLAY_FORWARD
def test_replay_forward_uses_set_routing_view_without_copy(monkeypatch):
    rr = make("R3")
    T = 5
    buf = distinct_rows(T, NUM_LAYERS, 1)  # absolute layout: dense rows present
    rr.set_routing(buf)
    assert rr.layer_mapping == "absolute"
    seen = []
    real_gate = replay_ops.gate

    def spy(logits, idx, **kw):
        seen.append(idx)
        return real_gate(logits, idx, **kw)

    monkeypatch.setattr(replay_ops, "gate", spy)
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    logits = torch.randn(T, E)
    for lid in MOE_IDS:
        plan = rr.route(lid, logits, topk_fn=softmax_topk, score_func="sigmoid", normalize=True)
        idx = seen[-1]
        # a view of the buffer at the layer's absolute column, no copy
        assert idx.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert idx.data_ptr() == buf[:, lid, :].data_ptr() and idx.stride() == buf.stride()[::2]
        assert torch.equal(plan.expert_indices, buf[:, lid, :])
        # sigmoid + normalize from the math, at the replayed indices
        s = torch.sigmoid(logits.gather(1, buf[:, lid, :].long()))
        ref_w = s / (s.sum(-1, keepdim=True) + 1e-20)
        torch.testing.assert_close(plan.weights, ref_w, rtol=1e-6, atol=0)


def test_layer_mapping_moe_vs_absolute_picks_the_right_rows():
    T = 4
    moe = distinct_rows(T, len(MOE_IDS), 2)
    absolute = torch.full((T, NUM_LAYERS, K), -1, dtype=torch.int32)
    for n, lid in enumerate(MOE_IDS):
        absolute[:, lid] = moe[:, n]
    logits = torch.randn(T, E)
    outs = {}
    for name, buf in (("moe", moe), ("absolute", absolute)):
        rr = make("R3")
        rr.set_routing(buf)
        assert rr.layer_mapping == name
        rr.set_action(ReplayAction.REPLAY_FORWARD)
        outs[name] = [rr.route(lid, logits).expert_indices for lid in MOE_IDS]
    for a, b, n in zip(outs["moe"], outs["absolute"], range(3)):
        assert torch.equal(a, b) and torch.equal(a, moe[:, n])
    rr = make("R3")
    with pytest.raises(ValueError, match=r"L=4 layers.*3 MoE layers.*5 hidden layers"):
        rr.set_routing(distinct_rows(T, 4, 0))
    with pytest.raises(ValueError, match="layer_index='absolute' needs L=num_hidden_layers=5"):
        rr.set_routing(moe, layer_index="absolute")
    # all layers MoE: L matches both, treated as MoE ordinal == absolute id
    rr = make("R3", moe_ids=[0, 1, 2], num_layers=3)
    rr.set_routing(moe)
    assert rr.layer_mapping == "moe"


def test_replay_forward_is_loud_when_routing_is_missing_or_misaligned():
    rr = make("R3")
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    with pytest.raises(RouterReplayError, match="no routing is set.*R3"):
        rr.route(1, torch.randn(3, E))
    rr.set_routing(distinct_rows(4, 3, 0))
    with pytest.raises(RouterReplayError, match="4 tokens but the logits have T=3"):
        rr.route(1, torch.randn(3, E))
    with pytest.raises(ValueError, match="K=3 slots per token but the model has top_k=2"):
        rr.set_routing(torch.zeros(4, 3, 3, dtype=torch.int32))


def test_replay_mask_falls_back_and_empty_rows_are_masked():
    T = 4
    buf = distinct_rows(T, 3, 3)
    buf[2] = -1  # token 2 has no route in any layer (e.g. padding)
    rr = make("R3")
    rr.set_routing(buf)
    assert rr.replay_mask.tolist() == [True, True, False, True]
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    logits = torch.randn(T, E)
    plan = rr.route(2, logits, topk_fn=softmax_topk)
    ref_native = torch.topk(torch.softmax(logits[2], -1), K).indices.to(torch.int32)
    assert torch.equal(plan.expert_indices[2], ref_native)
    assert torch.equal(plan.expert_indices[[0, 1, 3]], buf[[0, 1, 3], 1])
    # a token empty in only some MoE layers is a broken recording
    bad = distinct_rows(T, 3, 4)
    bad[1, 2] = -1
    with pytest.raises(RouterReplayError, match=r"token 1 has no route .* MoE layers \[4\]"):
        make("R3").set_routing(bad)


def test_fallback_topk_fn_uses_the_layers_selection():
    T = 3
    buf = distinct_rows(T, 3, 5)
    mask = torch.tensor([True, False, True])
    rr = make("R3", fallback="topk_fn")
    rr.set_routing(buf, mask)
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    logits = torch.randn(T, E)
    biased = lambda l: torch.topk(-l, K).indices  # noqa: E731 - a "biased" native selection
    plan = rr.route(1, logits, topk_fn=biased)
    assert torch.equal(plan.expert_indices[1], torch.topk(-logits[1], K).indices.to(torch.int32))
    assert torch.equal(plan.expert_indices[0], buf[0, 0])


def test_replayed_experts_get_router_gradient():
    """The live top-k would not pick the replayed experts; their logits still get grad."""
    T = 3
    logits = torch.randn(T, E, dtype=torch.float64)
    live = softmax_topk(logits)
    worst = torch.topk(-logits, K).indices.to(torch.int32)  # disjoint from the live top-k
    assert not (worst[:, :, None] == live[:, None, :]).any()
    rr = make("R3")
    rr.set_routing(worst[:, None, :].expand(T, 3, K).contiguous())
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    x = logits.clone().requires_grad_(True)
    plan = rr.route(1, x, topk_fn=softmax_topk)
    (plan.weights * torch.arange(1.0, K + 1, dtype=torch.float64)).sum().backward()
    g = x.grad.gather(1, worst.long())
    assert (g.abs() > 0).all()
    # and it matches autograd through the math (softmax over the gathered logits)
    y = logits.clone().requires_grad_(True)
    w = torch.softmax(y.gather(1, worst.long()), -1)
    (w * torch.arange(1.0, K + 1, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------ recompute FIFO
def test_replay_backward_pops_fifo_in_order():
    rr = make("R3")
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    bufs = [distinct_rows(4, 3, s) for s in (10, 11, 12)]
    for b in bufs:  # three micro-batches forward before any recompute (pipeline)
        rr.set_routing(b)
        for lid in MOE_IDS:
            rr.route(lid, torch.randn(4, E))
    assert rr.queue_depth(1) == 3
    rr.set_action(ReplayAction.REPLAY_BACKWARD)
    for b in bufs:  # recompute: first in, first out, whatever the new logits say
        for n, lid in enumerate(MOE_IDS):
            plan = rr.route(lid, torch.randn(4, E) * 100)
            assert torch.equal(plan.expert_indices, b[:, n])
    assert rr.queue_depth(1) == 0
    with pytest.raises(RouterReplayError, match="layer 1: REPLAY_BACKWARD but the layer's queue "
                                                "is empty"):
        rr.route(1, torch.randn(4, E))


def test_fifo_holds_indices_after_fallback_and_checks_length():
    rr = make("R3")
    buf = distinct_rows(3, 3, 6)
    rr.set_routing(buf, torch.tensor([True, False, True]))
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    logits = torch.randn(3, E)
    fwd = rr.route(1, logits)
    rr.set_action(ReplayAction.REPLAY_BACKWARD)
    bwd = rr.route(1, logits + 5 * torch.randn(3, E))
    assert torch.equal(bwd.expert_indices, fwd.expert_indices)
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    rr.route(2, logits)
    rr.set_action(ReplayAction.REPLAY_BACKWARD)
    with pytest.raises(RouterReplayError, match="pops 3 tokens but the recomputed logits have T=2"):
        rr.route(2, logits[:2])


def test_fifo_not_filled_without_grad_or_recompute_and_bounded():
    rr = make("R3", max_queue=2)
    rr.set_routing(distinct_rows(2, 3, 7))
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    with torch.no_grad():  # forward-only (old log-prob) passes are never recomputed
        rr.route(1, torch.randn(2, E))
    assert rr.queue_depth(1) == 0
    rr.route(1, torch.randn(2, E))
    rr.route(1, torch.randn(2, E))
    with pytest.raises(RouterReplayError, match="max_queue=2"):
        rr.route(1, torch.randn(2, E))
    rr.clear_queues()
    assert rr.queue_depth(1) == 0
    rr2 = make("R3", recompute=False)
    rr2.set_routing(distinct_rows(2, 3, 7))
    rr2.set_action(ReplayAction.REPLAY_FORWARD)
    rr2.route(1, torch.randn(2, E))
    assert rr2.queue_depth(1) == 0


def test_fifo_entry_lives_as_long_as_its_forward_graph():
    """With logits in the autograd graph, an entry dies when its forward's graph is freed:
    a dropped forward is never replayed by a later recompute, and forwards without
    activation recompute cannot fill the queue. Pipelined forwards still pop in order."""
    rr = make("R3", max_queue=2)
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    a, b = distinct_rows(2, 3, 7), distinct_rows(2, 3, 8)
    logits = torch.randn(2, E, requires_grad=True)
    rr.set_routing(a)
    for _ in range(5):  # more than max_queue: each plan (and its graph) is dropped at once
        rr.route(1, logits * 1.0)
    assert rr.queue_depth(1) == 0
    kept_a = rr.route(1, logits * 1.0)  # two live forwards, then the recompute
    rr.set_routing(b)
    kept_b = rr.route(1, logits * 1.0)
    assert rr.queue_depth(1) == 2
    rr.set_action(ReplayAction.REPLAY_BACKWARD)
    assert torch.equal(rr.route(1, logits).expert_indices, a[:, 0])
    del kept_b  # the second forward is dropped before its recompute
    assert rr.queue_depth(1) == 0
    with pytest.raises(RouterReplayError, match="queue is empty"):
        rr.route(1, logits)
    del kept_a


# ------------------------------------------------------------------ R2 in memory, state
def test_r2_record_then_replay_under_router_drift():
    """R2: record in the forward-only pass, replay in the update pass. The router drifted
    (as between passes in RL), so native routing would differ; replay keeps it."""
    torch.manual_seed(0)
    rr = make("R2")
    model = TinyMoE(replay=rr)
    x = torch.randn(32, 16)
    rr.set_action(ReplayAction.RECORD)
    with torch.no_grad():
        ref_out = model(x)
    rec = rr.recorded()
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    out = model(x)  # replays what RECORD stored (routing_source "recorded")
    assert rr.routing_source == "recorded"
    assert torch.equal(out, ref_out)
    with torch.no_grad():
        for p in model.router.values():
            p.add_(0.3 * torch.randn_like(p))
    rr.reset_calls()
    model(x)
    rr.check_all_layers_routed(expected=1)
    for n, lid in enumerate(MOE_IDS):
        assert torch.equal(model.plans[lid].expert_indices, rec[:, n])
    native = TinyMoE(replay=None)
    native.load_state_dict(model.state_dict())
    native(x)
    assert any(not torch.equal(native.plans[lid].expert_indices, rec[:, n])
               for n, lid in enumerate(MOE_IDS)), "drift too small to change native routing"


def test_two_models_do_not_share_state_and_clear_is_explicit():
    a, b = make("R2"), make("R2")
    a.set_action(ReplayAction.RECORD)
    a.route(1, torch.randn(3, E), topk_fn=softmax_topk)
    assert a.record_calls(1) == 1 and b.record_calls(1) == 0 and b.action is None
    a.clear()
    assert a.record_calls(1) == 0 and a.layer_mapping is None
    assert a.action is ReplayAction.RECORD  # clear() forgets data, not the action


def test_constructor_and_action_validation():
    with pytest.raises(ValueError, match="moe_layer_ids must be ascending"):
        make(moe_ids=[2, 1])
    with pytest.raises(ValueError, match="num_hidden_layers=3 but moe_layer_ids contains layer 4"):
        make(num_layers=3)
    with pytest.raises(ValueError, match="top_k must be an integer in 1..num_experts=8"):
        RouterReplay(RouterReplayConfig("R2"), num_experts=8, top_k=9, moe_layer_ids=[0])
    with pytest.raises(ConfigError, match="unknown action='replay'"):
        make().set_action("replay")
    with pytest.raises(ConfigError, match="unknown mode='R4'"):
        RouterReplayConfig(mode="R4")


# ------------------------------------------------------------------ R2 file round trip
R2_SCRIPT = textwrap.dedent(
    """
    import importlib.util, sys, torch
    spec = importlib.util.spec_from_file_location("trr", sys.argv[1])
    trr = importlib.util.module_from_spec(spec); spec.loader.exec_module(trr)
    from replay_ops.router_replay import RouterReplay, RouterReplayConfig, ReplayAction
    work = sys.argv[2]
    saved = torch.load(work + "/ref.pt")
    rr = RouterReplay(RouterReplayConfig(mode="R2", replay_file=work + "/routing.safetensors"),
                      num_experts=trr.E, top_k=trr.K, moe_layer_ids=trr.MOE_IDS,
                      num_hidden_layers=trr.NUM_LAYERS)
    model = trr.TinyMoE(replay=rr)
    model.load_state_dict(saved["state"])
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    out = model(saved["x"])
    routing = torch.stack([model.plans[l].expert_indices for l in trr.MOE_IDS], 1)
    torch.save({"out": out.detach(), "routing": routing, "source": rr.routing_source,
                "mapping": rr.layer_mapping}, work + "/replayed.pt")
    """
)


def test_r2_round_trip_through_file_in_new_process(tmp_path):
    torch.manual_seed(1)
    rr = make("R2", record_file=str(tmp_path / "routing.safetensors"))
    model = TinyMoE(replay=rr, seed=3)
    x = torch.randn(24, 16, dtype=torch.float32)
    rr.set_action(ReplayAction.RECORD)
    with torch.no_grad():
        ref_out = model(x)
    ref_routing = rr.recorded()
    rr.save(cu_seqlens=[0, 10, 24], model_name="tiny")
    torch.save({"state": model.state_dict(), "x": x}, tmp_path / "ref.pt")
    script = tmp_path / "replay.py"
    script.write_text(R2_SCRIPT)
    env = dict(os.environ, PYTHONHASHSEED="0")
    subprocess.run([sys.executable, str(script), __file__, str(tmp_path)], check=True,
                   env=env, timeout=300)
    got = torch.load(tmp_path / "replayed.pt")
    assert got["source"].startswith("file:") and got["mapping"] == "moe"
    assert torch.equal(got["routing"], ref_routing)
    assert torch.equal(got["out"], ref_out)  # bit for bit


# ------------------------------------------------------------------ R2 without clear()
def test_r2_two_steps_without_clear_replay_each_steps_own_recording():
    """R2 step 1: record, replay. Step 2, without clear(): a new RECORD pass after a replay
    starts a new recording, so step 2 replays step 2's routing (not step 1's)."""
    torch.manual_seed(0)
    rr = make("R2")
    model = TinyMoE(replay=rr)
    x1, x2 = torch.randn(8, 16), torch.randn(8, 16)  # same token count: no shape error
    recs = []
    for x in (x1, x2):
        rr.set_action(ReplayAction.RECORD)
        with torch.no_grad():
            model(x)
        recs.append(rr.recorded())
        rr.set_action(ReplayAction.REPLAY_FORWARD)
        model(x)
        rr.clear_queues()
        for n, lid in enumerate(MOE_IDS):
            assert torch.equal(model.plans[lid].expert_indices, recs[-1][:, n])
    assert not torch.equal(recs[0], recs[1])
    assert rr.step == 1 and rr.routing_source == "recorded"
    assert rr.recorded().shape[0] == 8  # step 2's recording alone, not both steps



def _record_then_replay(rr, model, x):
    rr.set_action(ReplayAction.RECORD)
    with torch.no_grad():
        model(x)
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    model(x)
    rr.clear_queues()


def test_r2_set_action_record_after_a_replay_starts_the_new_recording_at_once():
    """set_action(RECORD) after a replay starts the next step then, before any layer runs
    (a compiled model reads no Python state in its layers)."""
    torch.manual_seed(2)
    rr = make("R2")
    _record_then_replay(rr, TinyMoE(replay=rr), torch.randn(8, 16))
    assert rr.step == 0 and rr.routing_source == "recorded"
    rr.set_action(ReplayAction.RECORD)
    assert rr.step == 1 and rr.routing_source is None


def test_r2_record_by_argument_after_a_replay_starts_a_new_recording():
    """The same without set_action: the default action stays REPLAY_FORWARD and the layers
    pass action=RECORD to route(); the first such route starts the new recording, so the
    recording holds the new pass alone."""
    torch.manual_seed(3)
    rr = make("R2")
    _record_then_replay(rr, TinyMoE(replay=rr), torch.randn(8, 16))
    logits = torch.randn(5, E)
    with torch.no_grad():
        for lid in MOE_IDS:
            rr.route(lid, logits, action="RECORD", topk_fn=softmax_topk)
    assert rr.step == 1
    rec = rr.recorded()
    assert rec.shape[0] == 5  # the new pass alone, not 8 + 5 rows
    for n in range(len(MOE_IDS)):
        assert torch.equal(rec[:, n].long(), softmax_topk(logits).long())

def test_r2_micro_batches_without_clear_replay_each_steps_own_recording():
    """Micro-batched R2 slices the recording and sets each slice (set_routing), so the
    routing source is not "recorded". Without clear(), the next step's RECORD must still
    start a new recording; before, it appended to the old one and recorded()[0:T] gave
    the previous step's routes."""
    torch.manual_seed(1)
    rr = make("R2")
    model = TinyMoE(replay=rr)
    T = 4
    for step in range(2):
        mbs = [torch.randn(T, 16), torch.randn(T, 16)]
        rr.set_action(ReplayAction.RECORD)
        this_step = []  # the indices each micro-batch's RECORD used, per layer
        with torch.no_grad():
            for x in mbs:
                model(x)
                this_step.append({lid: model.plans[lid].expert_indices for lid in MOE_IDS})
        rec = rr.recorded()
        assert rec.shape[0] == 2 * T, f"step {step}: {rec.shape[0]} recorded rows"
        rr.set_action(ReplayAction.REPLAY_FORWARD)
        for i, x in enumerate(mbs):
            rr.set_routing(rec[i * T:(i + 1) * T])
            model(x)
            for n, lid in enumerate(MOE_IDS):
                assert torch.equal(model.plans[lid].expert_indices, this_step[i][lid]), (
                    f"step {step}, micro-batch {i}, layer {lid}: replayed another step's route")
        rr.clear_queues()
    assert rr.step == 1


# ------------------------------------------------------------------ errors name the layer
def test_bad_replayed_routing_names_the_layer_and_the_source(tmp_path):
    T = 4
    bad = distinct_rows(T, 3, 9)
    bad[2, 1] = torch.tensor([5, 5])  # MoE ordinal 1 = layer 2 repeats expert 5
    with pytest.raises(RouterReplayError, match=r"routing from set_routing\(\) cannot be "
                                                r"replayed: token 2, MoE layer 2 repeats an "
                                                r"expert \[5, 5\]"):
        make("R3").set_routing(bad)
    bad = distinct_rows(T, NUM_LAYERS, 9)
    bad[3, 4, 1] = E + 1  # absolute layout: layer 4
    with pytest.raises(RouterReplayError, match=r"token 3, MoE layer 4 \(slot 1\) routes to "
                                                rf"expert {E + 1}, out of range"):
        make("R3").set_routing(bad)
    # a file: the message names it. The writer refuses bad values, so the file is made as
    # another writer would have made it: valid checksums, a repeated expert inside.
    import numpy as np

    from replay_ops.router_replay import files

    p = tmp_path / "routing.safetensors"
    meta = files.RecordMeta(num_experts=E, top_k=K, moe_layer_ids=MOE_IDS,
                            num_hidden_layers=NUM_LAYERS)
    arr = distinct_rows(T, 3, 10).numpy().astype(np.uint8)
    arr[1, 2] = [3, 3]
    files._write(p, meta, np.array([0, T]), [arr], 3)
    with pytest.raises(RouterReplayError, match=r"record file '.*routing.safetensors' cannot "
                                                r"be replayed: token 1, MoE layer 4 repeats"):
        make("R3").load(p)
    # a recording: the layer whose topk_fn returned a repeated expert
    rr = make("R2")
    rr.set_action(ReplayAction.RECORD)
    logits = torch.randn(3, E)
    for lid in MOE_IDS:
        fn = (lambda l: torch.tensor([[1, 2], [4, 4], [0, 1]])) if lid == 4 else softmax_topk
        rr.route(lid, logits, topk_fn=fn)
    with pytest.raises(RouterReplayError, match=r"the recording .* token 1, MoE layer 4 "
                                                r"repeats an expert \[4, 4\]"):
        rr.recorded()
