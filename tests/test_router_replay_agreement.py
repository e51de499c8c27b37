"""`RouterReplay.agreement()`: per MoE layer, the fraction of replayed tokens whose replayed
set of experts is the model's own selection from the current logits, counted from the
gate's `plan.agreement` (no host read until asked); and the gate options of `route` as one
`GateOptions` value."""
from __future__ import annotations

import pytest
import torch

import replay_ops
from replay_ops.options import GateOptions
from replay_ops.router_replay import ReplayAction, RouterReplay, RouterReplayConfig

E, K, T = 8, 2, 12
MOE = (1, 3)


def make(agreement=True, **kw):
    return RouterReplay(RouterReplayConfig(mode="R3", agreement=agreement, **kw),
                        num_experts=E, top_k=K, moe_layer_ids=MOE, num_hidden_layers=4)


def logits_for(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g) * 2  # tie-free


def own(x):
    return torch.topk(x, K, dim=1).indices


def other_set(row):
    """A set of K experts that is not `row`'s (one expert swapped)."""
    out = row.clone()
    out[-1] = [e for e in range(E) if e not in row.tolist()][0]
    return out


def routing_and_expected(xs, agree_rows):
    """[T, L, K] routing: layer l's rows in agree_rows[l] are the own set (another slot
    order), the others one expert off."""
    layers = []
    for x, rows in zip(xs, agree_rows):
        o = own(x)
        r = torch.stack([o[t].flip(0) if t in rows else other_set(o[t]) for t in range(T)])
        layers.append(r)
    return torch.stack(layers, dim=1)


def test_agreement_per_layer_counts_replayed_tokens_only():
    rr = make()
    xs = [logits_for(1), logits_for(2)]
    agree = [set(range(0, T, 2)), set(range(T)) - {5}]
    routing = routing_and_expected(xs, agree)
    mask = torch.ones(T, dtype=torch.bool)
    mask[[0, 5, 7]] = False  # not replayed: selected by the gate, not counted
    rr.set_routing(routing, replay_mask=mask)
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    plans = {lid: rr.route(lid, x) for lid, x in zip(MOE, xs)}
    replayed = [t for t in range(T) if mask[t]]
    want = {lid: sum(t in rows for t in replayed) / len(replayed)
            for lid, rows in zip(MOE, agree)}
    assert rr.agreement() == pytest.approx(want)
    assert want[1] != want[3]
    # the plans carry the per-row values; a row the gate selected agrees
    for lid, x, rows in zip(MOE, xs, agree):
        exp = torch.tensor([t in rows or not bool(mask[t]) for t in range(T)])
        assert torch.equal(plans[lid].agreement, exp)
        assert plans[lid].set_logprob is not None
    # a second forward adds to the counts, clear() keeps them; clear_agreement forgets them
    rr.route(1, xs[0])
    assert rr.agreement()[1] == pytest.approx(want[1])
    rr.clear()
    rr.set_routing(routing, replay_mask=torch.ones(T, dtype=torch.bool))
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    rr.route(3, xs[1])  # 9 replayed rows counted before, 12 now
    n3 = sum(t in agree[1] for t in replayed)
    assert rr.agreement()[3] == pytest.approx((n3 + len(agree[1])) / (len(replayed) + T))
    rr.clear_agreement()
    assert rr.agreement() == {}


def test_agreement_is_opt_in_per_call():
    rr = make(agreement=False)
    x = logits_for(3)
    rr.set_routing(routing_and_expected([x, x], [set(range(T)), set()]))
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    plan = rr.route(1, x)
    assert plan.agreement is None and rr.agreement() == {}
    plan = rr.route(3, x, return_agreement=True)
    assert plan.agreement is not None and not plan.agreement.any()
    assert rr.agreement() == {3: 0.0}


def test_dropping_disagreeing_tokens_from_the_loss():
    """The documented use: the replayed tokens whose routes disagree leave the loss."""
    rr = make()
    x = logits_for(4).requires_grad_(True)
    rr.set_routing(routing_and_expected([x.detach(), x.detach()], [{0, 1, 2}, {0}]))
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    plan = rr.route(1, x)
    token_loss = (plan.weights ** 2).sum(1)
    keep = plan.agreement
    loss = (token_loss * keep).sum() / keep.sum().clamp_min(1)
    (g,) = torch.autograd.grad(loss, x)
    assert keep.tolist() == [t in {0, 1, 2} for t in range(T)]
    assert (g[~keep] == 0).all() and (g[keep] != 0).any()


def test_route_takes_gate_options_as_one_value():
    rr = make(agreement=False)
    x = logits_for(5)
    rr.set_routing(routing_and_expected([x, x], [set(), set()]))
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    opts = GateOptions(score_func="sigmoid", normalize=False, scaling_factor=2.0)
    a = rr.route(1, x, options=opts)
    b = rr.route(1, x, score_func="sigmoid", normalize=False, scaling_factor=2.0)
    assert torch.equal(a.weights, b.weights)
    want = replay_ops.gate(x, rr.routing_for(1), options=opts, validate=False)
    assert torch.equal(a.weights, want.weights)
    # an explicit keyword beside options= is refused by name, even at its default
    for kw in (dict(normalize=True), dict(score_func="softmax"), dict(return_agreement=False),
               dict(selection=replay_ops.Selection()), dict(align=1)):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=rf"RouterReplay.route: .*not both .*{name}="):
            rr.route(1, x, options=opts, **kw)
    # config.agreement applies to an options= call too
    rr2 = make(agreement=True)
    rr2.set_routing(routing_and_expected([x, x], [set(range(T)), set()]))
    rr2.set_action(ReplayAction.REPLAY_FORWARD)
    assert rr2.route(1, x, options=GateOptions()).agreement.all()
