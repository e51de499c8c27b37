"""A replayed Hugging Face MoE block computes its router's logits only, and the gate selects
the rows without a route with the family's own rule.

For every shipped family (tiny random models, `replay_ops.testing.tiny`):

* the rows without a route (replay mask False) take the set of experts transformers' own
  router module picks for the block's very input (tie-free fp32 inputs), compared with
  the router's output in the same test;
* the REPLAY_FORWARD block dispatches no top-k, sort or softmax, and no sigmoid of the
  router logits (a TorchDispatchMode lists the ops; RECORD, which runs the router's own
  top-k, is the positive control);
* outputs and gradients are bitwise those of the block that runs the router module whole
  (`own_routing=True`, what every replayed block ran before);
* `return_agreement=True` keeps each layer's agreement and set log-probability, checked
  against the router's own choice and a log-probability written here from the math.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

import replay_ops  # noqa: E402
from replay_ops.integrations import hf  # noqa: E402
from replay_ops.router_replay import ReplayAction  # noqa: E402
from replay_ops.testing import tiny  # noqa: E402

ARCHS = sorted(hf.SUPPORTED)
E, K = 16, 4


def make_model(arch, seed=5):
    return tiny.tiny_model(arch, seed=seed, num_experts=E, top_k=K)


def make_ids(B=2, S=10, seed=0):
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(seed))


def random_routing(T, L, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T * L)]).view(T, L, K)


def block_inputs(patch):
    """Forward pre-hooks keeping each MoE block's input ([T, H], the router's input)."""
    seen, hooks = {}, []
    for lid, blk in patch.moe.blocks.items():
        hooks.append(blk.register_forward_pre_hook(
            lambda m, a, lid=lid: seen.__setitem__(lid, a[0].reshape(-1, a[0].shape[-1]))))
    return seen, hooks


def router_own(gate, x):
    """transformers' router module's own forward on `x`: (logits, weights, indices)."""
    with torch.no_grad():
        return type(gate).forward(gate, x)


def sets(idx):
    return idx.long().sort(-1).values


def test_every_shipped_family_declares_logits_and_selection():
    for arch in ARCHS:
        spec = hf.SUPPORTED[arch]
        assert spec.logits_only, arch
        assert spec.fallback == "gate", arch  # the gate selects; no top-k of every row


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_without_route_take_the_routers_own_choice(arch):
    model = make_model(arch)
    ids = make_ids(seed=3)
    T = ids.numel()
    patch = hf.patch_model(model, "R3")
    L = len(patch.moe_layer_ids)
    routing = random_routing(T, L, seed=11)
    mask = torch.arange(T) % 3 != 0  # a third of the rows have no route
    patch.replay.set_routing(routing, mask)
    patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
    seen, hooks = block_inputs(patch)
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    used = patch.last_routing()
    assert torch.equal(used[mask], routing[mask].to(torch.int32))
    for n, (lid, blk) in enumerate(sorted(patch.moe.blocks.items())):
        logits, _, own = router_own(blk.gate, seen[lid])
        # tie-free: no two values of a row within 1e-6 of each other
        gaps = logits.float().sort(-1).values.diff(dim=-1)
        assert bool((gaps > 1e-6).all()), "the test's inputs must be tie-free"
        assert torch.equal(sets(used[~mask, n]), sets(own[~mask])), (arch, lid)
        # and they differ from the replayed routing there: the selection did something
        assert not torch.equal(sets(used[~mask, n]), sets(routing[~mask, n]))
    patch.remove()


class OpLog(TorchDispatchMode):
    """The aten (and custom) ops dispatched, with the last dimension of their first
    tensor argument."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        last = first.shape[-1] if first is not None and first.dim() else None
        self.ops.append((func.overloadpacket.__name__, str(func.namespace), last))
        return func(*args, **(kwargs or {}))


# the replay gate ops (a grouped_mm block's gate also writes the experts' input rows)
GATE_OPS = ("gate", "gate_permute")

SELECTING = {"topk", "sort", "argsort", "msort", "kthvalue", "_softmax", "softmax",
             "log_softmax", "_log_softmax"}


def selecting_ops(log):
    """The ops that select or score every row of the router logits: a top-k, a sort, a
    softmax, or a sigmoid over the E experts (Qwen2-MoE's shared-expert gate is a sigmoid
    of [T, 1], which is not the router's)."""
    return [(name, last) for name, _, last in log.ops
            if name in SELECTING or (name.startswith("sigmoid") and last == E)]


def run_block(patch, lid, x, grad=None):
    blk = patch.moe.blocks[lid]
    with OpLog() as log:
        out = blk(x)
    if grad is not None:
        out.backward(grad)
    return out, log


@pytest.mark.parametrize("mode", ["R3", "R2"])
@pytest.mark.parametrize("arch", ARCHS)
def test_replayed_block_runs_no_topk_sort_or_router_softmax(arch, mode):
    model = make_model(arch)
    patch = hf.patch_model(model, mode)
    lid = patch.moe_layer_ids[0]
    H = model.config.hidden_size
    x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(2))
    T = 16
    # RECORD runs the router's own top-k (the control: the log does see it)
    patch.replay.set_action(ReplayAction.RECORD)
    with torch.no_grad():
        for other in patch.moe_layer_ids:  # every layer records (R2 replays the recording)
            _, rec = run_block(patch, other, x)
            assert any(name == "topk" for name, _ in selecting_ops(rec)), rec.ops
    if mode == "R3":
        routing = random_routing(T, len(patch.moe_layer_ids), seed=4)
        patch.replay.set_routing(routing, torch.arange(T) % 2 == 0)
    patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
    xr = x.detach().requires_grad_(True)
    _, rep = run_block(patch, lid, xr)
    assert selecting_ops(rep) == [], rep.ops
    assert any(ns == "replay" and name in GATE_OPS for name, ns, _ in rep.ops), rep.ops
    patch.remove()


class GateDtypes(TorchDispatchMode):
    """The replay gate ops' (logits dtype, weights dtype), and the casts of a [.., E] tensor
    (the router logits or their gradient) between floating dtypes."""

    def __init__(self):
        super().__init__()
        self.gates, self.casts = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.namespace == "replay" and name in GATE_OPS:
            self.gates.append((args[0].dtype, out[0].dtype))
        elif name == "_to_copy" and args[0].dim() and args[0].shape[-1] == E and \
                args[0].is_floating_point() and out.dtype != args[0].dtype:
            self.casts.append((args[0].dtype, out.dtype))
        return out


@pytest.mark.parametrize("arch", ARCHS)
def test_replayed_bf16_block_gives_the_routers_weight_dtype_without_a_cast(arch):
    """A bf16 model replayed: the gate's weights have the dtype of the router's own weights
    (fp32 for Mixtral and DeepSeek-V3, which keep them in fp32; bf16 for the others), and a
    family that keeps fp32 weights of bf16 logits gets them from the gate
    (`weights_dtype`), with no cast of the router logits or of their gradient, forward or
    backward."""
    model = tiny.tiny_model(arch, seed=5, num_experts=E, top_k=K, dtype=torch.bfloat16)
    patch = hf.patch_model(model, "R3")
    lid = patch.moe_layer_ids[0]
    blk = patch.moe.blocks[lid]
    x = torch.randn(2, 8, model.config.hidden_size,
                    generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    own_logits, own_w, _ = router_own(blk.gate, x.reshape(-1, x.shape[-1]))
    patch.replay.set_routing(random_routing(16, len(patch.moe_layer_ids), seed=4))
    patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
    xr = x.detach().requires_grad_(True)
    with GateDtypes() as log:
        out = blk(xr)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().sum().backward()
    (logits_dtype, weights_dtype), = log.gates
    assert weights_dtype == own_w.dtype, (arch, log.gates)
    assert logits_dtype == own_logits.dtype, (arch, log.gates)  # the router's, uncast
    if hf.SUPPORTED[arch].weights_fp32 and own_logits.dtype == torch.bfloat16:
        assert weights_dtype == torch.float32 and log.casts == [], (arch, log.casts)
    patch.remove()


def step(model, ids, mask_rows=None):
    model.zero_grad(set_to_none=True)
    out = model(ids).logits
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_only_replay_is_bitwise_the_whole_router_path(arch):
    """Outputs and gradients of a replayed forward + backward, logits only, equal bitwise
    those of the same forward with the router module run whole (the path replayed blocks
    took before), with and without rows that have no route."""
    ids = make_ids(seed=8)
    T = ids.numel()
    results = {}
    for own in (False, True):
        model = make_model(arch)
        patch = hf.patch_model(model, "R3", own_routing=own)
        routing = random_routing(T, len(patch.moe_layer_ids), seed=21)
        for masked in (False, True):
            mask = torch.arange(T) % 4 != 1 if masked else None
            patch.replay.set_routing(routing, mask)
            patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
            results[own, masked] = step(model, ids), patch.last_routing()
        if own:
            assert patch.last_own_routing().shape == (T, len(patch.moe_layer_ids), K)
        patch.remove()
    for masked in (False, True):
        (out_a, g_a), used_a = results[False, masked]
        (out_b, g_b), used_b = results[True, masked]
        assert torch.equal(used_a, used_b)
        assert torch.equal(out_a, out_b), (arch, masked)
        assert g_a.keys() == g_b.keys()
        for n in g_a:
            assert torch.equal(g_a[n], g_b[n]), (arch, masked, n)


def set_logprob_ref(arch, logits, idx):
    """log of the router's probability mass on each row's set, from the math (docs/ops.md):
    softmax routers logsumexp(x_S) - logsumexp(x); sigmoid routers log(sum_S s / sum s)."""
    x = logits.double()
    member = torch.zeros_like(x, dtype=torch.bool).scatter_(1, idx.long(), True)
    if hf.SUPPORTED[arch].score_func == "sigmoid":
        s = x.sigmoid()
        return (torch.where(member, s, 0).sum(-1) / s.sum(-1)).log()
    return torch.logsumexp(x.masked_fill(~member, float("-inf")), -1) - torch.logsumexp(x, -1)


@pytest.mark.parametrize("arch", ARCHS)
def test_agreement_per_layer_through_the_patch(arch):
    model = make_model(arch)
    ids = make_ids(seed=6)
    T = ids.numel()
    patch = hf.patch_model(model, "R3", return_agreement=True)
    with pytest.raises(RuntimeError, match="agreement"):
        patch.agreement()
    # the model's own routing for these ids (RECORD), then replay it on the even rows and a
    # random routing on the odd ones
    patch.replay.set_action(ReplayAction.RECORD)
    with torch.no_grad():
        model(ids)
    own = patch.last_routing()
    other = random_routing(T, own.shape[1], seed=9).to(torch.int32)
    agree_rows = torch.arange(T) % 2 == 0
    routing = torch.where(agree_rows[:, None, None], own.flip(-1), other)
    patch.replay.set_routing(routing)
    patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
    seen, hooks = block_inputs(patch)
    model.zero_grad(set_to_none=True)
    model(ids)
    for h in hooks:
        h.remove()
    got = patch.agreement()
    assert sorted(got) == patch.moe_layer_ids
    for n, lid in enumerate(patch.moe_layer_ids):
        gate = patch.moe.blocks[lid].gate
        logits, _, own_idx = router_own(gate, seen[lid])
        want = (sets(routing[:, n]) == sets(own_idx)).all(-1)
        a = got[lid]
        assert a.agreement.dtype == torch.bool and a.agreement.shape == (T,)
        assert torch.equal(a.agreement, want), (arch, lid)
        assert not bool(want[~agree_rows].all())
        if n == 0:  # the first MoE layer sees the recorded inputs: its own rows agree
            assert bool(want[agree_rows].all())
        assert a.set_logprob.dtype == torch.float32
        ref = set_logprob_ref(arch, logits, routing[:, n])
        torch.testing.assert_close(a.set_logprob.double(), ref, rtol=1e-5, atol=1e-5)
    # differentiable to the router: the log-probability's gradient reaches its weight
    lid = patch.moe_layer_ids[0]
    got[lid].set_logprob.sum().backward()
    g = patch.moe.blocks[lid].gate.weight.grad
    assert g is not None and bool(g.abs().sum() > 0)
    patch.remove()


def test_agreement_off_by_default_and_switchable():
    model = make_model("qwen3_moe")
    ids = make_ids(seed=1)
    patch = hf.patch_model(model, "R3")
    assert patch.return_agreement is False
    patch.replay.set_routing(random_routing(ids.numel(), len(patch.moe_layer_ids), seed=2))
    patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
    with torch.no_grad():
        model(ids)
    with pytest.raises(RuntimeError, match="return_agreement"):
        patch.agreement()
    patch.return_agreement = True
    with torch.no_grad():
        model(ids)
    assert set(patch.agreement()) == set(patch.moe_layer_ids)
    patch.remove()


def test_router_forward_is_installed_and_removed():
    model = make_model("olmoe")
    patch = hf.patch_model(model, "R3")
    gate = patch.moe.blocks[patch.moe_layer_ids[0]].gate
    assert "forward" in gate.__dict__
    x = torch.randn(5, model.config.hidden_size)
    # called as the unpatched block calls it: the router's own forward
    for a, b in zip(gate(x), type(gate).forward(gate, x)):
        assert torch.equal(a, b)
    logits, w, idx = gate(x, **{hf.block.LOGITS_KWARG: hf.linear_logits})
    assert w is None and idx is None and torch.equal(logits, type(gate).forward(gate, x)[0])
    patch.remove()
    assert "forward" not in gate.__dict__


# ------------------------------------------------------------------------------ register_family


def _olmoe_as(model_type, model):
    model.config.model_type = model_type
    return model


@pytest.mark.parametrize("how", ["selection_value", "selection_fn", "old_topk"])
def test_registered_family_selection_and_old_registrations(how):
    """A family registered with a Selection (a value or a function of the router) replays
    with the logits only; one registered the old way (topk, no selection) still works, with
    a DeprecationWarning, and runs the router module whole."""
    name = f"olmoe_{how}"
    kw = dict(block_class="OlmoeSparseMoeBlock", normalize=False)
    if how == "selection_value":
        kw.update(score_func="sigmoid", selection=replay_ops.Selection())
    elif how == "selection_fn":
        kw.update(selection=lambda gate: replay_ops.Selection(), logits=hf.linear_logits)
    else:
        kw.update(topk=hf.softmax_topk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = hf.register_family(name, **kw)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    try:
        assert bool(deprecations) == (how == "old_topk")
        assert spec.logits_only == (how != "old_topk")
        model = _olmoe_as(name, make_model("olmoe"))
        ids = make_ids(seed=4)
        T = ids.numel()
        patch = hf.patch_model(model, "R3")
        routing = random_routing(T, len(patch.moe_layer_ids), seed=3)
        mask = torch.arange(T) % 2 == 0
        patch.replay.set_routing(routing, mask)
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        seen, hooks = block_inputs(patch)
        lid = patch.moe_layer_ids[0]
        with OpLog() as log, torch.no_grad():
            model(ids)
        for h in hooks:
            h.remove()
        assert (selecting_ops(log) == []) == spec.logits_only
        used = patch.last_routing()
        logits, _, own = router_own(patch.moe.blocks[lid].gate, seen[lid])
        if spec.score_func == "softmax":  # the router's rule
            assert torch.equal(sets(used[~mask, 0]), sets(own[~mask]))
        else:  # top-k of the sigmoid scores: the same set as the logits' top-k
            assert torch.equal(sets(used[~mask, 0]), sets(logits[~mask].topk(K).indices))
        # the own top-k of a family registered with a selection alone is the gate's
        if how != "old_topk":
            assert isinstance(spec.topk, hf.SelectionTopK) or spec.topk is hf.softmax_topk
            assert torch.equal(sets(spec.topk(patch.moe.blocks[lid].gate, logits)),
                               sets(logits.topk(K).indices))
        patch.remove()
    finally:
        hf.unregister_family(name)


def test_agreement_comes_from_the_gate_that_routes():
    """With return_agreement the replayed block still runs one gate: the plan that routes
    the tokens carries the agreement (no second gate call over the same indices)."""
    model = make_model("qwen3_moe")
    patch = hf.patch_model(model, "R3")
    lid = patch.moe_layer_ids[0]
    x = torch.randn(2, 8, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    patch.replay.set_routing(random_routing(16, len(patch.moe_layer_ids), seed=5))
    counts = {}
    for flag in (False, True):
        patch.return_agreement = flag
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        with torch.no_grad():
            _, log = run_block(patch, lid, x)
        counts[flag] = sum(ns == "replay" and name in GATE_OPS for name, ns, _ in log.ops)
    assert counts == {False: 1, True: 1}, counts
    patch.remove()
