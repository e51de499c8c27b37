"""The replay router inside Megatron-Core's MoE layer (local spec, CPU, one process):
parity with Megatron's own replay path, the padding policies, moe_router_fusion,
construction-time errors, the plan dispatcher, determinism.

Megatron-Core is real; only the CPU stand-ins of `replay_ops.testing.megatron_cpu` are
installed."""
from __future__ import annotations

import pytest
import torch

from _helpers import require_client  # noqa: E402

require_client("megatron.core", "megatron-core")

from replay_ops.testing import megatron_cpu as env  # noqa: E402
from _helpers import HostSyncCounter  # noqa: E402

env.install_cpu_shims()
env.set_torch_cuda_shims(False)  # on only while this module runs (fixture below)

from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplayAction  # noqa: E402

from replay_ops.integrations import megatron as rom  # noqa: E402

E, K = env.E_DEFAULT, 2
S, B, H = 6, 2, 16
T = S * B


from _megatron_env import cuda_stand_ins, single_world  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.usefixtures("single_world")


def hidden(seed=0, s=S, b=B):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, H, generator=g)


# ----------------------------------------------------------------------------- parity
PARITY = {
    "softmax-alltoall": dict(),
    "softmax-allgather": dict(moe_token_dispatcher_type="allgather"),
    "presoftmax-scaled": dict(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5),
    "sigmoid-bias-groups": dict(moe_router_score_function="sigmoid", moe_router_topk=4,
                                moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                                moe_router_group_topk=2, moe_router_topk_scaling_factor=1.5),
    "aux-zloss": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                      moe_z_loss_coeff=0.001),
    "seq-aux-loss": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.02),
    "capacity-drop": dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs"),
    "capacity-pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
}


@pytest.mark.parametrize("name", list(PARITY))
@pytest.mark.parametrize("action", ["REPLAY_FORWARD", "RECORD"])
def test_parity_with_megatron_replay(name, action):
    cfg = env.moe_config(**PARITY[name])
    ref, ours = env.build_pair(cfg)
    if cfg.moe_router_enable_expert_bias:
        bias = torch.linspace(-0.3, 0.3, E)
        ref.router.expert_bias.copy_(bias)
        ours.router.expert_bias.copy_(bias)
    k = cfg.moe_router_topk
    target = env.random_routes(T, E, k, seed=3) if action == "REPLAY_FORWARD" else None
    x = hidden(1)
    a = env.run_layer(ref, x, target, action)
    b = env.run_layer(ours, x, target, action)
    env.assert_runs_match(a, b, what=name)
    assert "router.weight" in b["grads"] and b["grads"]["router.weight"].abs().sum() > 0
    if action == "RECORD":
        assert torch.equal(a["recorded"], b["recorded"])  # ours records what Megatron records
    else:
        rmap = b["meta"].get("routing_map", b["meta"].get("local_map"))
        assert rmap is not None
        if cfg.moe_expert_capacity_factor is None:  # dropless: the replayed experts exactly
            want = torch.zeros(T, E, dtype=torch.bool).scatter(1, target, True)
            assert torch.equal(rmap, want)
    if cfg.moe_router_enable_expert_bias:
        assert torch.equal(ref.router.local_tokens_per_expert, ours.router.local_tokens_per_expert)
        assert ours.router.local_tokens_per_expert.sum() == T * k


def test_replay_backward_fifo_matches_megatron():
    """REPLAY_BACKWARD pops Megatron's FIFO (the recompute of each micro-batch replays the
    indices set for it, first in, first out)."""
    cfg = env.moe_config()
    ref, ours = env.build_pair(cfg)
    t1, t2 = env.random_routes(T, E, K, seed=5), env.random_routes(T, E, K, seed=6)
    outs = {}
    for tag, layer in (("ref", ref), ("ours", ours)):
        rr = layer.router.router_replay
        rr.clear_indices()
        rr.set_target_indices(t1)
        rr.set_target_indices(t2)  # two micro-batches queued
        rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        p1, m1 = layer.router(hidden(2))
        p2, m2 = layer.router(hidden(3))
        outs[tag] = (p1, m1, p2, m2)
        assert rr.replay_backward_list == []
    for a, b in zip(outs["ref"], outs["ours"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert torch.equal(outs["ours"][1], torch.zeros(T, E, dtype=torch.bool).scatter(1, t1, True))
    assert torch.equal(outs["ours"][3], torch.zeros(T, E, dtype=torch.bool).scatter(1, t2, True))
    with pytest.raises(rom.ReplayRoutingError, match=r"layer 1\).*REPLAY_BACKWARD but the backward "
                                                     r"replay list is empty"):
        ours.router(hidden(2))


def test_deterministic_bitwise():
    cfg = env.moe_config(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)
    _, ours = env.build_pair(cfg)
    target = env.random_routes(T, E, K, seed=9)
    a = env.run_layer(ours, hidden(4), target)
    b = env.run_layer(ours, hidden(4), target)
    assert torch.equal(a["out"], b["out"]) and torch.equal(a["dx"], b["dx"])
    assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])


def test_no_action_is_megatron_native_routing():
    cfg = env.moe_config()
    ref, ours = env.build_pair(cfg)
    a = env.run_layer(ref, hidden(5), None, None)
    b = env.run_layer(ours, hidden(5), None, None)
    assert torch.equal(a["out"], b["out"]) and torch.equal(a["dx"], b["dx"])
    assert ours.router.last_plan is None


# ----------------------------------------------------------------------------- padding rows
def bad_target():
    """Rows 0-3: zero-filled padding ([0, 0]); rows 4-5: -1 slots; the rest real routes."""
    t = env.random_routes(T, E, K, seed=11)
    t[0:4] = 0
    t[4] = torch.tensor([-1, -1])
    t[5] = torch.tensor([3, -1])
    return t


def check_k_distinct(probs, rmap, k=K):
    n = rmap.sum()
    assert int(n) == rmap.shape[0] * k, f"routing_map.sum()={int(n)}, want T*K={rmap.shape[0] * k}"
    assert (rmap.sum(dim=1) == k).all()
    assert (probs[rmap] > 0).all(), "a routed weight is zero"
    assert (probs[~rmap] == 0).all()
    # the flex dispatcher's recovery of the indices: torch.topk over the dense probs
    got = torch.zeros_like(rmap).scatter(1, torch.topk(probs, k, dim=-1).indices, True)
    assert torch.equal(got, rmap)


@pytest.mark.parametrize("dispatcher,validate", [("alltoall", True), ("allgather", True),
                                                 ("alltoall", False)])
def test_padding_topk_default_is_megatron_native_for_bad_rows(dispatcher, validate):
    cfg = env.moe_config(moe_token_dispatcher_type=dispatcher)
    ref, ours = env.build_pair(cfg, options=rom.ReplayOptions(validate=validate))
    t = bad_target()
    x = hidden(6)
    # Megatron's native routing of the same tokens (no replay)
    ref.router.router_replay.clear_router_replay_action()
    _, native_map = ref.router(x)
    ours.router.router_replay.clear_indices()
    ours.router.router_replay.set_target_indices(t)
    ours.router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, rmap = ours.router(x)
    check_k_distinct(probs, rmap)
    assert torch.equal(rmap[:6], native_map[:6])
    want = torch.zeros(T - 6, E, dtype=torch.bool).scatter(1, t[6:].long(), True)
    assert torch.equal(rmap[6:], want)
    # the dispatchers accept it unchanged: a full forward/backward
    res = env.run_layer(ours, x, t)
    assert torch.isfinite(res["out"]).all()


def test_padding_spread_over_ep_ranks():
    ep = 4
    cfg = env.moe_config(expert_model_parallel_size=ep, moe_router_topk=2)
    router = rom.ReplayTopKRouter(cfg, moe_utils.get_default_pg_collection(),
                                  options=rom.ReplayOptions(padding="spread"))
    router.set_layer_number(1)
    n = 40
    t = torch.zeros(n, K, dtype=torch.long)  # every row zero-filled padding
    router.router_replay.set_target_indices(t)
    router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, rmap = router(torch.randn(n, 1, H))
    check_k_distinct(probs, rmap)
    per_expert = rmap.sum(0)
    per_rank = per_expert.view(ep, E // ep).sum(1)
    assert per_expert.max() - per_expert.min() <= 1, per_expert.tolist()
    assert per_rank.max() - per_rank.min() <= K, per_rank.tolist()
    assert per_expert[0] <= per_expert.float().mean().ceil()
    # the two slots of a row sit on different ranks
    ranks = rmap.nonzero()[:, 1].view(n, K) // (E // ep)
    assert (ranks[:, 0] != ranks[:, 1]).all()


def test_padding_error_policy_names_row():
    cfg = env.moe_config()
    _, ours = env.build_pair(cfg, options=rom.ReplayOptions(padding="error"))
    t = env.random_routes(T, E, K, seed=2)
    t[7] = torch.tensor([5, 5])
    with pytest.raises(rom.ReplayRoutingError, match=r"layer 1\): REPLAY_FORWARD: row 7 has no "
                                                     r"usable route \[5, 5\]"):
        env.run_layer(ours, hidden(1), t)


# (padding, validate, host reads of one routing call)
HOST_READS = [("topk", True, 1), ("topk", False, 0), ("spread", True, 1), ("spread", False, 0),
              ("error", True, 1), ("error", False, 1)]


@pytest.mark.parametrize("padding,validate,reads", HOST_READS)
def test_host_reads_per_routing_call(padding, validate, reads):
    """The range check and the padding rows share one host read; a device-side policy
    without validation reads nothing (CUDA-graph safe). Counted on the router's routing
    step (no aux loss: no grad), with padding rows present where the policy allows them."""
    cfg = env.moe_config()
    _, ours = env.build_pair(cfg, options=rom.ReplayOptions(padding=padding, validate=validate))
    t = env.random_routes(T, E, K, seed=2) if padding == "error" else bad_target()
    rr = ours.router.router_replay
    rr.set_target_indices(t)
    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    logits = torch.randn(S, B, E, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), HostSyncCounter() as c:
        probs, rmap = ours.router.routing(logits)
    assert c.count == reads, c.events
    check_k_distinct(probs, rmap)


@pytest.mark.parametrize("padding", ["topk", "spread", "error"])
def test_out_of_range_and_shape_errors(padding):
    cfg = env.moe_config()
    _, ours = env.build_pair(cfg, options=rom.ReplayOptions(padding=padding))
    for bad_rows in (False, True):  # alone, and beside padding rows (the range error first)
        t = bad_target() if bad_rows else env.random_routes(T, E, K, seed=2)
        t[3, 1] = E  # a physical replica id, not a logical one
        with pytest.raises(rom.ReplayRoutingError, match=r"token 3, slot 1 holds expert id 8, "
                                                         r"outside 0..7.*logical expert ids"):
            env.run_layer(ours, hidden(1), t)
    with pytest.raises(rom.ReplayRoutingError, match=r"shape \(11, 2\) but this call routes T=12"):
        env.run_layer(ours, hidden(1), env.random_routes(T - 1, E, K))
    ours.router.router_replay.clear_indices()
    with pytest.raises(rom.ReplayRoutingError, match="no target indices were set"):
        env.run_layer(ours, hidden(1), None)


def test_underflowing_weight_stays_nonzero_fp16():
    """pre-softmax in fp16: a replayed expert with a far-off logit has softmax 0 in fp16.
    Megatron's path routes it with weight 0 (the flex dispatcher's topk then loses it);
    the replay router keeps it routed with the smallest normal weight."""
    cfg = env.moe_config(moe_router_pre_softmax=True, moe_router_dtype=None,
                         params_dtype=torch.float16, fp16=True)
    ref, ours = env.build_pair(cfg)
    logits = torch.zeros(4, E, dtype=torch.float16)
    logits[:, 7] = -30.0
    t = torch.tensor([[0, 7]] * 4)
    for layer in (ref, ours):
        layer.router.router_replay.clear_indices()
        layer.router.router_replay.set_target_indices(t)
        layer.router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    p_ref, m_ref = ref.router.routing(logits.view(4, 1, E))
    p_ours, m_ours = ours.router.routing(logits.view(4, 1, E))
    assert m_ref[:, 7].all() and (p_ref[:, 7] == 0).all()  # Megatron: routed, weight 0
    check_k_distinct(p_ours, m_ours)
    assert (p_ours[:, 7] == torch.finfo(torch.float16).tiny).all()


def test_flex_dispatcher_index_recovery_runs_megatrons_code():
    """MoEFlexTokenDispatcher needs DeepEP/HybridEP (CUDA); its index recovery
    (_DeepepManager.setup_metadata: torch.topk over the dense probs) is plain torch and is
    run here on the replay router's output, padding rows included."""
    from megatron.core.transformer.moe.token_dispatcher import _DeepepManager

    cfg = env.moe_config()
    _, ours = env.build_pair(cfg, options=rom.ReplayOptions(padding="spread"))
    t = bad_target()
    ours.router.router_replay.set_target_indices(t)
    ours.router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, rmap = ours.router(hidden(8))
    mgr = object.__new__(_DeepepManager)
    mgr.num_experts, mgr.router_topk, mgr.capacity_factor = E, K, None
    mgr.setup_metadata(rmap, probs)
    got = torch.zeros(T, E, dtype=torch.bool).scatter(1, mgr.token_indices, True)
    assert torch.equal(got, rmap)
    assert (mgr.token_probs > 0).all()


# ----------------------------------------------------------------------------- fusion, config
def test_router_fusion_with_replay_uses_the_replay_gate():
    """moe_router_fusion=True: Megatron returns TransformerEngine's fused top-k before it
    looks at replay (and on this CPU machine, without TransformerEngine, cannot run at all);
    the replay router serves the replay with replay_ops.gate. Checked by its result: equal
    to Megatron's unfused replay path, routing exactly the replayed experts."""
    base = env.moe_config()
    fused = env.moe_config(moe_router_fusion=True)
    ref = env.build_moe_layer(base, replay=False)
    ours = env.build_moe_layer(fused, replay=True)
    ours.load_state_dict(ref.state_dict())
    target = env.random_routes(T, E, K, seed=13)
    a = env.run_layer(ref, hidden(9), target)
    b = env.run_layer(ours, hidden(9), target)
    env.assert_runs_match(a, b, what="fusion")
    assert torch.equal(b["meta"]["routing_map"],
                       torch.zeros(T, E, dtype=torch.bool).scatter(1, target, True))
    # Megatron's own router with the flag: the fused path, which needs TransformerEngine
    stock = env.build_moe_layer(fused, replay=False)
    with pytest.raises(ValueError, match="fused_topk_with_score_function is not available"):
        env.run_layer(stock, hidden(9), target)
    # no action + fusion: the native selection through the fused gate == Megatron unfused
    c = env.run_layer(ref, hidden(10), None, None)
    d = env.run_layer(ours, hidden(10), None, None)
    env.assert_runs_match(c, d, what="fusion native")


def test_unsupported_combinations_raise_at_construction():
    with pytest.raises(rom.UnsupportedConfigError, match=r"moe_router_fusion=True with "
                                                         r"moe_router_load_balancing_type=\['aux_loss'\]"):
        env.build_moe_layer(env.moe_config(moe_router_fusion=True, moe_aux_loss_coeff=0.01,
                                           moe_router_load_balancing_type="aux_loss"), replay=True)
    with pytest.raises(rom.UnsupportedConfigError, match="moe_router_load_balancing_type='sinkhorn'"):
        env.build_moe_layer(env.moe_config(moe_router_load_balancing_type="sinkhorn"), replay=True)
    with pytest.raises(ValueError, match="unknown padding='zero'"):
        rom.ReplayOptions(padding="zero")
    layer = env.build_moe_layer(env.moe_config(moe_expert_capacity_factor=1.0), replay=True)
    with pytest.raises(rom.UnsupportedConfigError, match="moe_expert_capacity_factor=1.0 is not "
                                                         "supported by the plan dispatcher"):
        rom.enable_plan_dispatch(layer)
    layer = env.build_moe_layer(env.moe_config(moe_token_dispatcher_type="allgather"), replay=True)
    with pytest.raises(rom.UnsupportedConfigError, match="moe_token_dispatcher_type='allgather'"):
        rom.enable_plan_dispatch(layer)


# Each setting under which the plan dispatcher does not apply: the routing map is changed
# after the gate, or another component permutes. (The dispatcher type and token dropping
# are checked in the test above.) Megatron builds its own dispatcher on the CPU under the
# last two; moe_pad_expert_input_to_capacity needs a capacity factor (refused above) and
# moe_permute_fusion CUDA, to build a layer.
PLAN_DISPATCH_REFUSALS = {"moe_pad_expert_input_to_capacity": False, "moe_permute_fusion": False,
                          "moe_router_padding_for_quantization": True,
                          "moe_shared_expert_overlap": True}


@pytest.mark.parametrize("flag", sorted(PLAN_DISPATCH_REFUSALS))
def test_plan_dispatcher_refuses_each_setting(flag):
    """With the flag on: `plan_dispatch_problems` names it (and only it),
    `enable_plan_dispatch` raises naming it, and a replay layer built with it keeps
    Megatron's dispatcher. The flag is set on a validated config (moe_permute_fusion and
    the FP8 padding need TransformerEngine to pass Megatron's validation, and this CPU
    machine has none); the dispatcher's checks read the attribute either way."""
    import re

    cfg = env.moe_config()
    assert rom.plan_dispatch_problems(cfg) == []
    layer = env.build_moe_layer(cfg, replay=True)
    assert isinstance(layer.token_dispatcher, rom.PlanAlltoAllTokenDispatcher)
    setattr(cfg, flag, True)  # the layer's config: the same object
    assert layer.config is cfg
    assert [f for f, _ in rom.plan_dispatch_problems(cfg)] == [flag]
    with pytest.raises(rom.UnsupportedConfigError,
                       match=re.escape(f"enable_plan_dispatch(): {flag}=True is not supported "
                                       "by the plan dispatcher")):
        rom.enable_plan_dispatch(layer)
    if PLAN_DISPATCH_REFUSALS[flag]:
        other = env.build_moe_layer(cfg, replay=True)
        assert type(other).__name__ == "ReplayMoELayer"
        assert not isinstance(other.token_dispatcher, rom.PlanAlltoAllTokenDispatcher), flag


def test_install_converts_built_model():
    cfg = env.moe_config()
    ref = env.build_moe_layer(cfg, replay=False)
    other = env.build_moe_layer(cfg, replay=False)
    routers = rom.install(other, padding="spread")
    assert len(routers) == 1 and isinstance(other.router, rom.ReplayTopKRouter)
    assert other.router.replay_options.padding == "spread"
    target = env.random_routes(T, E, K, seed=4)
    env.assert_runs_match(env.run_layer(ref, hidden(2), target),
                          env.run_layer(other, hidden(2), target), what="install")


# ----------------------------------------------------------------------------- plan dispatcher
@pytest.mark.parametrize("action", ["REPLAY_FORWARD", "RECORD"])
def test_plan_dispatcher_parity(action):
    cfg = env.moe_config(moe_router_topk=3, moe_router_load_balancing_type="aux_loss",
                         moe_aux_loss_coeff=0.01)
    ref, ours = env.build_pair(cfg)
    assert rom.enable_plan_dispatch(ours) == 1
    assert type(ours.token_dispatcher).__name__ == "PlanAlltoAllTokenDispatcher"
    target = env.random_routes(T, E, 3, seed=21) if action == "REPLAY_FORWARD" else None
    a = env.run_layer(ref, hidden(11), target, action)
    b = env.run_layer(ours, hidden(11), target, action)
    env.assert_runs_match(a, b, what="plan dispatcher")
    # Megatron's permutation: token ids of each permuted row, equal exactly
    assert torch.equal(a["meta"]["reversed_local_input_permutation_mapping"],
                       b["meta"]["reversed_local_input_permutation_mapping"])
    # and the plan dispatcher really ran (not Megatron's permute)
    assert ours.router.last_plan is not None


# ----------------------------------------------------------------------------- fast path
def test_plan_dispatcher_on_by_default_where_it_applies():
    """replay_spec builds ReplayMoELayer, whose all-to-all dispatcher takes the router's
    plan when the settings allow it; elsewhere (all-gather, token dropping) and with
    plan_dispatch=False Megatron's dispatcher stays. install does the same for built
    models."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    layer = env.build_moe_layer(env.moe_config(), replay=True)
    assert type(layer).__name__ == "ReplayMoELayer"
    assert isinstance(layer.token_dispatcher, rom.PlanAlltoAllTokenDispatcher)
    assert layer.token_dispatcher.replay_router is layer.router
    for kw in (dict(moe_token_dispatcher_type="allgather"),
               dict(moe_expert_capacity_factor=1.0)):
        other = env.build_moe_layer(env.moe_config(**kw), replay=True)
        assert not isinstance(other.token_dispatcher, rom.PlanAlltoAllTokenDispatcher), kw
        assert rom.plan_dispatch_problems(other.config)
    off = env.build_moe_layer(env.moe_config(), replay=True,
                              options=rom.ReplayOptions(plan_dispatch=False))
    assert type(off.token_dispatcher) is MoEAlltoAllTokenDispatcher
    built = env.build_moe_layer(env.moe_config(), replay=False)
    rom.install(built)
    assert isinstance(built.token_dispatcher, rom.PlanAlltoAllTokenDispatcher)
    built = env.build_moe_layer(env.moe_config(), replay=False)
    rom.install(built, plan_dispatch=False)
    assert type(built.token_dispatcher) is MoEAlltoAllTokenDispatcher
    # the default path matches Megatron's replay: outputs, gradients, dispatch metadata
    ref = env.build_moe_layer(env.moe_config(), replay=False)
    target = env.random_routes(T, E, K, seed=31)
    a = env.run_layer(ref, hidden(12), target)
    b = env.run_layer(layer, hidden(12), target)
    env.assert_runs_match(a, b, what="default plan")
    assert torch.equal(a["meta"]["reversed_local_input_permutation_mapping"],
                       b["meta"]["reversed_local_input_permutation_mapping"])
    assert layer.router.last_plan is not None


def test_launch_counts_against_megatron():
    """The fast path's launch, sync and byte counts (bench/launch_counter.py, as
    bench_megatron.py reports them), at small sizes: the router forward is the gate kernel
    (plus the one read of its row flags with validate=True), forward + backward at most 6
    launches; the routing step (router + permute + unpermute, experts excluded) at most
    half of Megatron's launches, with no host read when validate=False."""
    import bench_megatron as bm  # bench/ (pyproject's pytest pythonpath)

    Tn, En, Kn, Hn = 64, 16, 4, 8
    routers, mu = bm.setup(En, Kn, Hn)
    logits, hidden_, ops = bm.make_fns(Tn, En, Kn, Hn, torch.float32, routers, mu)
    bm.check_same(ops, logits, hidden_)
    c = {(op, mode, n): bm.counts(bm.call(f, mode, logits, hidden_, op))
         for op, fns in ops.items() for n, f in fns.items() for mode in ("fwd", "full")}
    fwd = c[("route", "fwd", "replay-router")]
    assert fwd["launches"] <= bm.ROUTE_FWD_LAUNCHES and fwd["syncs"] == 1, fwd
    assert fwd["ops"] == {"replay_native.gate_dense_fwd": 1}, fwd
    assert c[("route", "fwd", "replay-router/novalidate")]["syncs"] == 0
    full = c[("route", "full", "replay-router")]
    assert full["launches"] <= bm.ROUTE_FULL_LAUNCHES, full
    assert c[("route", "fwd", "megatron")]["launches"] == 8
    meg, ours = c[("step", "full", "megatron")], c[("step", "full", "replay-router+plan")]
    assert ours["launches"] <= bm.STEP_LAUNCH_RATIO * meg["launches"], (ours, meg)
    assert c[("step", "full", "replay-router+plan/novalidate")]["syncs"] == 0
    assert ours["bytes"] < meg["bytes"]
    # no materialised zero gradients, no weight-gradient kernel, no separate probs gather
    assert not {"zeros", "zeros_like", "replay_native.unpermute_bwd", "index_select",
                "gather"} & set(ours["ops"]), ours["ops"]
