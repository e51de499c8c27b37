"""What the replay router's real clients hand it, in one process and without verl's
patch applied: verl's `RouterReplayAction` members and `RouterReplay` objects (imported from
the installed verl package, whose patch module only defines them at import), verl's replay
mask and its FIFO, MTP routers under a global action, the router attributes Megatron's
own tests change after construction, and the weights' agreement with Megatron's replay
path on the CPU. The whole verl flow, patch applied, is in tests/test_verl_clients.py."""
from __future__ import annotations

import enum

import pytest
import torch

from _helpers import require_client

require_client("megatron.core", "megatron-core")

from replay_ops.testing import megatron_cpu as env  # noqa: E402

env.install_cpu_shims()
env.set_torch_cuda_shims(False)  # on only while this module runs (fixture below)

from megatron.core.transformer.moe.router_replay import RouterReplayAction  # noqa: E402

from replay_ops.integrations import megatron as rom  # noqa: E402
from _megatron_env import cuda_stand_ins, single_world  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.usefixtures("single_world")

E = env.E_DEFAULT
S, B, H = 6, 2, 16
T = S * B


def verl_patch_module():
    require_client("verl.utils.megatron.router_replay_patch", "verl")
    from verl.utils.megatron import router_replay_patch

    return router_replay_patch


def hidden(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, H, generator=g)


def dense(idx):
    return torch.zeros(idx.shape[0], E, dtype=torch.bool).scatter(1, idx.long(), True)


def router_pair(**kw):
    ref, ours = env.build_pair(env.moe_config(**kw))
    return ref.router, ours.router


def native_rows(router, x):
    """Megatron's own selection for the router's logits of `x` (what a row outside the
    replay mask must route to)."""
    with torch.no_grad():
        logits = router.gating(x).view(-1, E)
        return router.own_topk(logits)


# ----------------------------------------------------------------------------- actions
@pytest.mark.parametrize("action", ["REPLAY_FORWARD", "REPLAY_BACKWARD", "RECORD"])
def test_verl_enum_members_are_recognised(action):
    """verl's RouterReplayAction is its own Enum: `==` against Megatron's is False, so a
    comparison by identity routed natively in silence."""
    verl = verl_patch_module()
    va = getattr(verl.RouterReplayAction, action)
    assert va != getattr(RouterReplayAction, action)
    assert rom.replay_action(type("R", (), {"router_replay_action": va})()) is \
        getattr(RouterReplayAction, action)
    _, ours = router_pair()
    rr = ours.router_replay
    target = env.random_routes(T, E, 2, seed=1)
    rr.clear_indices()
    if action != "RECORD":
        rr.set_target_indices(target)
    rr.router_replay_action = va
    _, rmap = ours(hidden(1))
    if action == "RECORD":
        assert rr.recorded_topk_idx is not None
        assert torch.equal(rmap, dense(rr.recorded_topk_idx))
    else:
        assert torch.equal(rmap, dense(target))


@pytest.mark.parametrize("bad", ["replay_forward", 2,
                                 enum.Enum("Other", {"REPLAY_FORWARD": "replay"}).REPLAY_FORWARD,
                                 enum.Enum("Other2", {"FORWARD": "replay_forward"}).FORWARD])
def test_unknown_action_raises_never_native(bad):
    _, ours = router_pair()
    ours.router_replay.set_target_indices(env.random_routes(T, E, 2, seed=2))
    ours.router_replay.router_replay_action = bad
    with pytest.raises(rom.ReplayRoutingError, match=r"layer 1\).*is not a replay action this "
                                                     r"router recognises.*Refusing to route"):
        ours(hidden(2))


# ----------------------------------------------------------------------------- replay mask
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("padding", ["topk", "spread", "error"])
@pytest.mark.parametrize("validate", [True, False])
def test_verl_replay_mask_rows_route_natively(k, padding, validate):
    """Rows verl's mask leaves out keep Megatron's native selection and their recorded
    values are never read: a zero placeholder row (with k=1, expert 0), and real routes
    of a sample without response tokens. Rows in the mask replay exactly."""
    verl = verl_patch_module()
    _, ours = router_pair(moe_router_topk=k, moe_router_pre_softmax=k == 1)
    ours.replay_options = rom.ReplayOptions(padding=padding, validate=validate)
    ours.router_replay = verl.RouterReplay()
    target = env.random_routes(T, E, k, seed=3)
    mask = torch.ones(T, dtype=torch.bool)
    mask[[2, 7, 11]] = False
    target[[7, 11]] = 0  # verl's zero placeholder rows
    target[2] = (torch.arange(k) + 5) % E  # a real route of an unreplayed sample
    x = hidden(3)
    native = native_rows(ours, x)
    assert not torch.equal(native[2], target[2])  # else the row would not tell
    ours.router_replay.set_target_indices(target, replay_mask=mask)
    ours.router_replay.set_router_replay_action(verl.RouterReplayAction.REPLAY_FORWARD)
    _, rmap = ours(x)
    want = torch.where(mask[:, None], target, native)
    assert torch.equal(rmap, dense(want))
    assert rmap.sum() == T * k


def test_verl_replay_mask_integer_dtype_and_shape_errors():
    verl = verl_patch_module()
    _, ours = router_pair()
    ours.router_replay = verl.RouterReplay()
    ours.router_replay.set_router_replay_action(verl.RouterReplayAction.REPLAY_FORWARD)
    target = env.random_routes(T, E, 2, seed=4)
    x = hidden(4)
    ours.router_replay.set_target_indices(target, replay_mask=torch.ones(1, T, dtype=torch.int64))
    _, rmap = ours(x)  # [1, T] int64 reads as verl reads it (`!= 0`)
    assert torch.equal(rmap, dense(target))
    ours.router_replay.set_target_indices(target, replay_mask=torch.ones(T - 1, dtype=torch.bool))
    with pytest.raises(rom.ReplayRoutingError, match=r"replay mask has shape \(11,\).*T=12"):
        ours(x)
    ours.router_replay.set_target_indices(target, replay_mask=torch.ones(T))
    with pytest.raises(rom.ReplayRoutingError, match=r"replay mask must be bool.*float32"):
        ours(x)


def test_verl_mask_hides_out_of_range_values_in_unreplayed_rows():
    """validate=True checks the rows that replay; a row outside the mask is never read."""
    verl = verl_patch_module()
    _, ours = router_pair()
    ours.router_replay = verl.RouterReplay()
    target = env.random_routes(T, E, 2, seed=5)
    target[4] = torch.tensor([E + 3, 1])
    mask = torch.ones(T, dtype=torch.bool)
    ours.router_replay.set_target_indices(target, replay_mask=mask)
    ours.router_replay.set_router_replay_action(verl.RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises(rom.ReplayRoutingError, match=r"token 4, slot 0 holds expert id 11"):
        ours(hidden(5))
    mask[4] = False
    ours.router_replay.set_target_indices(target, replay_mask=mask)
    _, rmap = ours(hidden(5))
    assert rmap[4].sum() == 2


def test_verl_backward_pops_both_fifos_in_order():
    verl = verl_patch_module()
    _, ours = router_pair()
    rr = ours.router_replay = verl.RouterReplay()
    t1, t2 = env.random_routes(T, E, 2, seed=6), env.random_routes(T, E, 2, seed=7)
    m1 = torch.ones(T, dtype=torch.bool)
    m2 = torch.ones(T, dtype=torch.bool)
    m2[:4] = False
    rr.set_target_indices(t1, replay_mask=m1)
    rr.set_target_indices(t2, replay_mask=m2)
    rr.set_router_replay_action(verl.RouterReplayAction.REPLAY_BACKWARD)
    x1, x2 = hidden(6), hidden(7)
    _, r1 = ours(x1)
    _, r2 = ours(x2)
    assert rr.replay_backward_list == [] and rr.replay_backward_mask_list == []
    assert torch.equal(r1, dense(t1))
    assert torch.equal(r2, dense(torch.where(m2[:, None], t2, native_rows(ours, x2))))
    rr.set_target_indices(t1, replay_mask=m1)
    rr.replay_backward_mask_list.clear()  # popped elsewhere: the FIFOs drifted apart
    with pytest.raises(rom.ReplayRoutingError, match=r"holds 1 entries but the replay-mask "
                                                     r"list holds 0"):
        ours(x1)


# ----------------------------------------------------------------------------- attributes
@pytest.mark.parametrize("sf,k,pre", [("sigmoid", 3, False), ("softmax", 3, True),
                                      ("softmax", 1, True), ("sigmoid", 1, False)])
def test_router_attributes_changed_after_construction(sf, k, pre):
    """Megatron's routing reads `router.score_function` and `router.topk` (its own tests
    change them after construction) and the other flags from the config at each call."""
    ref, ours = router_pair()
    for r in (ref, ours):
        r.score_function = sf
        r.topk = k
        r.config.moe_router_pre_softmax = pre  # the config object both routers share
    target = env.random_routes(T, E, k, seed=8)
    out = {}
    for tag, r in (("ref", ref), ("ours", ours)):
        r.router_replay.clear_indices()
        r.router_replay.set_target_indices(target)
        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        out[tag] = r(hidden(8))
    torch.testing.assert_close(out["ours"][0], out["ref"][0], rtol=4e-6, atol=1e-7)
    assert torch.equal(out["ours"][1], out["ref"][1])


# -------------------------------------------------------------------- agreement with Megatron
CASES = {"softmax": dict(), "pre-softmax": dict(moe_router_pre_softmax=True),
         "sigmoid": dict(moe_router_score_function="sigmoid", moe_router_topk=4),
         "scaled": dict(moe_router_topk_scaling_factor=2.5)}


@pytest.mark.parametrize("case", list(CASES))
def test_weights_against_megatrons_replay_on_the_cpu(case):
    """backend='torch' gives Megatron's replay weights bit for bit (fp32 logits: the same
    torch ops in the same order); the default native CPU kernel evaluates exp with its own
    deterministic scalar code, not torch's vectorised exp, and stays within 2 ulp of fp32
    (documented in docs/megatron.md)."""
    ref, ours = router_pair(**CASES[case])
    k = ref.topk
    target = env.random_routes(T, E, k, seed=9)
    res = {}
    for tag, r, backend in (("ref", ref, None), ("native", ours, None), ("torch", ours, "torch")):
        if backend is not None:
            r.replay_options = rom.ReplayOptions(backend=backend)
        r.router_replay.clear_indices()
        r.router_replay.set_target_indices(target)
        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        res[tag] = r(hidden(9))[0].detach()
    assert torch.equal(res["torch"], res["ref"])
    ulp = torch.finfo(torch.float32).eps * res["ref"].abs()
    assert ((res["native"] - res["ref"]).abs() <= 2 * ulp).all()
