"""The replay router's fast path in one gate launch: the rows that take Megatron's own
selection (replay mask False, padding rows) are selected inside the gate kernel by the
config's rule (`megatron_selection`), equal to Megatron-Core's own
`topk_routing_with_score_function` on tie-free inputs; no top-k of the replayed rows; the
agreement outputs per router.

Megatron-Core is real; only the CPU stand-ins of `replay_ops.testing.megatron_cpu` are
installed."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _helpers import require_client  # noqa: E402

require_client("megatron.core", "megatron-core")

from replay_ops.testing import megatron_cpu as env  # noqa: E402

env.install_cpu_shims()
env.set_torch_cuda_shims(False)  # on only while this module runs (fixture below)

from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplayAction  # noqa: E402

import replay_ops  # noqa: E402
from replay_ops.integrations import megatron as rom  # noqa: E402

from _megatron_env import cuda_stand_ins, single_world  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.usefixtures("single_world")

E = 16
T = 24

CONFIGS = {
    "softmax": dict(moe_router_topk=2),
    "softmax-k4": dict(moe_router_topk=4, moe_router_topk_scaling_factor=2.0),
    "presoftmax": dict(moe_router_topk=2, moe_router_pre_softmax=True),
    "softmax-groups": dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2),
    "presoftmax-groups": dict(moe_router_topk=4, moe_router_pre_softmax=True,
                              moe_router_num_groups=4, moe_router_group_topk=2),
    "sigmoid": dict(moe_router_topk=2, moe_router_score_function="sigmoid"),
    "sigmoid-bias": dict(moe_router_topk=4, moe_router_score_function="sigmoid",
                         moe_router_enable_expert_bias=True),
    "sigmoid-bias-groups": dict(moe_router_topk=4, moe_router_score_function="sigmoid",
                                moe_router_enable_expert_bias=True, moe_router_num_groups=8,
                                moe_router_group_topk=2, moe_router_topk_scaling_factor=1.5),
}

# Ops that launch nothing: views, metadata, allocations.
_NO_KERNEL = {"detach", "alias", "empty", "empty_like", "empty_strided", "new_empty",
              "lift_fresh", "_local_scalar_dense", "sym_size", "sym_numel"}


class OpLog(TorchDispatchMode):
    """The ops dispatched under it (views and allocations left out), by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if not func.is_view and name not in _NO_KERNEL:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def make_router(cfg_kw, options=None, seed=0):
    cfg = env.moe_config(num_moe_experts=E, **cfg_kw)
    torch.manual_seed(seed)
    router = rom.ReplayTopKRouter(cfg, moe_utils.get_default_pg_collection(), options=options)
    router.set_layer_number(1)
    if router.expert_bias is not None:  # a bias that changes the selection
        g = torch.Generator().manual_seed(seed + 7)
        router.expert_bias.copy_(torch.rand(E, generator=g) * 0.4 - 0.2)
    return router


def tie_free_logits(seed=1, t=T):
    """fp32 logits whose scores, group sums and biased scores have no ties (distinct
    random values, far apart in fp32)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, E, generator=g) * 2


def targets(k, seed=3, t=T):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])


def replay(router, logits, target, mask=None):
    rr = router.router_replay
    rr.clear_indices()
    rr.set_target_indices(target)
    if mask is not None:
        rr.target_replay_mask = mask  # verl's RouterReplay field (the router reads it)
    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    return router.routing(logits.view(logits.shape[0], 1, E))


def megatron_own(router, logits):
    """Megatron-Core's own routing of `logits` for this router's config."""
    cfg = router.config
    return moe_utils.topk_routing_with_score_function(
        logits, router.topk, use_pre_softmax=cfg.moe_router_pre_softmax,
        num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk,
        scaling_factor=cfg.moe_router_topk_scaling_factor,
        score_function=router.score_function, expert_bias=router.expert_bias)


def test_tie_free_inputs_are_tie_free():
    """The inputs of the equality tests have no ties in what Megatron ranks."""
    x = tie_free_logits()
    for scores in (x, torch.softmax(x, -1), torch.sigmoid(x)):
        s = scores.sort(dim=1).values
        assert (s[:, 1:] > s[:, :-1]).all()


# ----------------------------------------------------------------------------- selection
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("validate", [False, True])
def test_flagged_rows_take_megatrons_own_selection(name, validate):
    router = make_router(CONFIGS[name], rom.ReplayOptions(validate=validate))
    k = router.topk
    x = tie_free_logits()
    target = targets(k)
    mask = torch.ones(T, dtype=torch.bool)
    mask[1::3] = False  # not replayed: Megatron's own selection
    target[2] = -1  # a padding row (padding="topk"): Megatron's own selection too
    target[5, 1] = target[5, 0]  # a repeated expert: the same
    with torch.no_grad():
        probs, rmap = replay(router, x, target, mask)
        want_probs, want_map = megatron_own(router, x)
    own = ~mask
    own[2] = own[5] = True
    assert torch.equal(rmap[own], want_map[own].bool()), name
    torch.testing.assert_close(probs[own], want_probs[own], rtol=1e-6, atol=1e-7)
    # the replayed rows are the recorded experts
    rep = ~own
    want_rep = torch.zeros(T, E, dtype=torch.bool).scatter(1, target.clamp_min(0), True)
    assert torch.equal(rmap[rep], want_rep[rep])
    # and the Selection is the one Megatron's own top-k of the router makes
    idx = router.own_topk(x)
    assert torch.equal(torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True),
                       want_map.bool())


@pytest.mark.parametrize("name", ["softmax-groups", "sigmoid-bias-groups", "presoftmax"])
def test_group_limited_rows_equal_group_limited_topk(name):
    """Every row not replayed: the selection equals Megatron's `group_limited_topk` (or
    torch.topk) of the scores it ranks, whole-row."""
    router = make_router(CONFIGS[name], rom.ReplayOptions(validate=False))
    cfg, k = router.config, router.topk
    x = tie_free_logits(seed=11)
    with torch.no_grad():
        _, rmap = replay(router, x, targets(k), torch.zeros(T, dtype=torch.bool))
    if router.score_function == "sigmoid":
        scores = torch.sigmoid(x.float()).type_as(x) + router.expert_bias
    elif cfg.moe_router_pre_softmax:
        scores = torch.softmax(x, -1, dtype=torch.float32).type_as(x)
    else:
        scores = x
    if cfg.moe_router_group_topk:
        _, idx = moe_utils.group_limited_topk(scores, k, T, E, cfg.moe_router_num_groups,
                                              cfg.moe_router_group_topk)
    else:
        _, idx = torch.topk(scores, k, dim=1)
    assert torch.equal(rmap, torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True))


def test_gate_semantics_is_gate_options():
    router = make_router(CONFIGS["sigmoid-bias-groups"])
    opts = rom.gate_semantics(router.config, expert_bias=router.expert_bias)
    assert isinstance(opts, replay_ops.GateOptions)
    assert opts.score_func == "sigmoid" and opts.normalize and opts.scaling_factor == 1.5
    sel = opts.selection
    assert (sel.source, sel.round_scores, sel.num_groups, sel.group_topk) == \
        ("scores", True, 8, 2)
    assert sel.expert_bias is router.expert_bias
    soft = rom.gate_semantics(make_router(CONFIGS["softmax"]).config)
    assert soft.selection.source == "logits" and soft.normalize
    pre = rom.gate_semantics(make_router(CONFIGS["presoftmax"]).config, padding="select")
    assert pre.selection.source == "scores" and pre.selection.round_scores
    assert not pre.normalize and pre.padding == "select"


# ----------------------------------------------------------------------------- launches
@pytest.mark.parametrize("name", ["softmax", "presoftmax-groups", "sigmoid-bias-groups"])
@pytest.mark.parametrize("masked", [False, True])
def test_fast_path_forward_is_one_op(name, masked):
    """validate=False, default padding: the forward dispatches the gate alone (no top-k,
    sort or softmax of any row), with or without a replay mask and padding rows."""
    router = make_router(CONFIGS[name], rom.ReplayOptions(validate=False))
    x = tie_free_logits()
    target = targets(router.topk)
    target[0] = -1
    mask = None
    if masked:
        mask = torch.ones(T, dtype=torch.bool)
        mask[::4] = False
    with torch.no_grad(), OpLog() as log:
        replay(router, x, target, mask)
    assert log.ops == ["replay.gate_dense"], log.ops


@pytest.mark.parametrize("masked", [False, True])
def test_fast_path_forward_and_backward_at_most_three_launches(masked):
    router = make_router(CONFIGS["presoftmax-groups"], rom.ReplayOptions(validate=False))
    x = tie_free_logits().requires_grad_(True)
    target = targets(router.topk)
    mask = None
    if masked:
        mask = torch.ones(T, dtype=torch.bool)
        mask[::4] = False
    gout = torch.randn(T, E)
    with OpLog() as log:
        probs, _ = replay(router, x, target, mask)
        (g,) = torch.autograd.grad(probs, x, gout)
    assert len(log.ops) <= 3, log.ops
    assert log.ops[0] == "replay.gate_dense" and "replay.gate_dense_backward" in log.ops, log.ops
    assert not any(o.split(".")[-1] in ("topk", "sort", "softmax", "_softmax") for o in log.ops)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


# ----------------------------------------------------------------------------- agreement
def test_router_agreement_and_set_logprob():
    router = make_router(CONFIGS["softmax-k4"], rom.ReplayOptions(validate=False,
                                                                  agreement=True))
    k = router.topk
    x = tie_free_logits(seed=5)
    own = torch.topk(x, k, dim=1).indices
    target = targets(k, seed=9)
    agree_rows = torch.arange(T) % 2 == 0
    target[agree_rows] = own[agree_rows].flip(1)  # the same set, another slot order
    target[1] = own[1]
    target[1, -1] = [e for e in range(E) if e not in own[1].tolist()][0]  # one expert off
    mask = torch.ones(T, dtype=torch.bool)
    mask[3] = False  # selected by the kernel: not counted
    xg = x.clone().requires_grad_(True)
    probs, _ = replay(router, xg, target, mask)
    want = torch.tensor([set(target[t].tolist()) == set(own[t].tolist()) for t in range(T)])
    want[3] = True
    assert torch.equal(router.last_agreement, want)
    replayed = mask.clone()
    assert router.agreement_fraction() == pytest.approx(
        float((want & replayed).sum()) / float(replayed.sum()))
    # log of the softmax mass on the replayed set (the own set on the masked row)
    sets = target.clone()
    sets[3] = own[3]
    lp = (torch.logsumexp(x.gather(1, sets), 1) - torch.logsumexp(x, 1))
    torch.testing.assert_close(router.last_set_logprob.detach(), lp, rtol=1e-5, atol=1e-6)
    (g,) = torch.autograd.grad(router.last_set_logprob.sum(), xg, retain_graph=True)
    xr = x.clone().requires_grad_(True)
    (gr,) = torch.autograd.grad(
        (torch.logsumexp(xr.gather(1, sets), 1) - torch.logsumexp(xr, 1)).sum(), xr)
    torch.testing.assert_close(g, gr, rtol=1e-5, atol=1e-6)


def test_agreement_off_by_default():
    router = make_router(CONFIGS["softmax"], rom.ReplayOptions(validate=False))
    with torch.no_grad():
        replay(router, tie_free_logits(), targets(router.topk))
    assert router.last_agreement is None and router.last_set_logprob is None
    assert router.agreement_fraction() is None


def test_sqrtsoftplus_rows_take_the_routers_own_topk():
    """sqrtsoftplus (newer Megatron-Core; 0.16's routing has no such score function): the
    in-kernel selection equals the router's `own_topk`, which follows Megatron's op order
    (fp32 scores rounded to the logits dtype, group-limited top-k; megatron-core 0.16
    allows the expert bias with sigmoid only)."""
    try:
        router = make_router(dict(moe_router_topk=4, moe_router_score_function="sqrtsoftplus",
                                  moe_router_num_groups=4, moe_router_group_topk=2),
                             rom.ReplayOptions(validate=False))
    except (ValueError, AssertionError) as e:  # a TransformerConfig that refuses the name
        pytest.skip(f"this megatron-core does not build a sqrtsoftplus router: {e}")
    x = tie_free_logits(seed=13)
    with torch.no_grad():
        _, rmap = replay(router, x, targets(4), torch.zeros(T, dtype=torch.bool))
    idx = router.own_topk(x)
    assert torch.equal(rmap, torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True))


def test_routing_agreement_of_a_model():
    """`routing_agreement(model)`: every replay router's latest fraction, by layer id."""
    cfg = env.moe_config(num_moe_experts=E, moe_router_topk=2)
    layer = env.build_moe_layer(cfg, replay=True,
                                options=rom.ReplayOptions(validate=False, agreement=True),
                                layer_number=3)
    assert rom.routing_agreement(layer) == {}  # nothing replayed yet
    x = torch.randn(T, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        own = torch.topk(layer.router.gating(x).view(T, E), 2, dim=1).indices
    target = own.clone()
    target[:6] = targets(2, seed=4, t=6)  # other routes on the first rows
    env.run_layer(layer, x, target)
    want = sum(set(target[t].tolist()) == set(own[t].tolist()) for t in range(T)) / T
    assert want < 1
    assert rom.routing_agreement(layer) == {2: pytest.approx(want)}
    assert layer.router.agreement_fraction() == pytest.approx(want)


def test_backend_without_in_kernel_selection_takes_megatrons_topk_first(monkeypatch):
    """Where the gate's backend would hand a selecting call to another backend (e.g. the
    native CUDA kernels past K = MAX_TOPK), the router runs Megatron's own top-k before the
    gate instead of moving the call; the routing is the same."""
    from replay_ops.integrations.megatron import router as rmod

    x = tie_free_logits(seed=21)
    mask = torch.ones(T, dtype=torch.bool)
    mask[1::3] = False
    for validate in (False, True):
        cfg = CONFIGS["sigmoid-bias-groups"]
        target = targets(4)
        target[2] = -1
        fast = make_router(cfg, rom.ReplayOptions(validate=validate))
        with torch.no_grad():
            want = replay(fast, x, target, mask)
        monkeypatch.setattr(rmod, "gate_selects_in_kernel", lambda *a: False)
        slow = make_router(cfg, rom.ReplayOptions(validate=validate))
        with torch.no_grad(), OpLog() as log:
            got = replay(slow, x, target, mask)
        monkeypatch.undo()
        assert "aten.topk" in log.ops and log.ops.count("replay.gate_dense") == 1, log.ops
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)


def test_cuda_gate_selects_in_kernel_with_the_native_library(monkeypatch):
    """On a GPU with the native library the router's gate selects inside the native CUDA
    kernel (the one-launch path), for K <= MAX_TOPK; a larger K would hand a selecting call
    on, so the router keeps its own top-k there. (The availability of CUDA is simulated:
    the decision is the registry's; tests/test_gpu_selection.py runs it on a GPU.)"""
    from replay_ops import backends
    from replay_ops.api import selects_in_kernel
    from replay_ops.backends import Support
    from replay_ops.integrations.megatron import router as rmod

    native = backends.load("native")
    if native is None:
        pytest.skip("the native extension is not built")
    monkeypatch.setattr(native, "available", lambda d: Support(True))
    monkeypatch.setattr(rmod, "_SELECTS", {})
    for op in ("gate", "gate_dense"):
        assert selects_in_kernel(op, "cuda", T, E, 2, torch.bfloat16)
        assert selects_in_kernel(op, "cuda", T, E, 2, torch.bfloat16, "native")
    assert rmod.gate_selects_in_kernel("cuda", T, E, 2, torch.bfloat16)
    big = native.MAX_TOPK + 1
    assert not selects_in_kernel("gate_dense", "cuda", T, 64, big, torch.float32, "native")


def test_cpu_gate_selects_in_kernel():
    from replay_ops.api import selects_in_kernel
    from replay_ops.integrations.megatron import router as rmod

    assert rmod.gate_selects_in_kernel("cpu", T, E, 2, torch.float32)
    for op in ("gate", "gate_dense"):
        assert selects_in_kernel(op, "cpu", T, E, 2, torch.float32)
        assert selects_in_kernel(op, "cpu", T, E, 2, torch.float32, "torch")
