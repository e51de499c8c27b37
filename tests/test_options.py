"""`replay_ops.GateOptions`: the gate ops' options as one frozen value. A call with
`options=` gives the bitwise result of the same options as keywords, on every backend; both
at once, or a dense-only option given to `gate`, are refused by name; and the field lists
that flatten the value agree with the registered op schemas."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import replay_ops
from replay_ops import options as ro
from replay_ops.options import GateOptions

from _helpers import backend_params, make_indices, make_logits

BACKENDS = backend_params()


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is None and y is None
        else:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_gate_options_value_equals_keywords(dev_backend):
    device, backend = dev_backend
    T, E, K = 37, 12, 3
    kw = dict(score_func="sigmoid", normalize=False, scaling_factor=2.5, align=4)
    for seed in (1, 2):
        lg = make_logits(T, E, device=device, seed=seed).requires_grad_(True)
        lg2 = lg.detach().clone().requires_grad_(True)
        idx = make_indices(T, E, K, device=device, seed=seed + 10, empty=0.1)
        a = replay_ops.gate(lg, idx, backend=backend, **kw)
        b = replay_ops.gate(lg2, idx, backend=backend, options=GateOptions(**kw))
        _same(a, b)
        g = torch.randn(T, K, generator=torch.Generator().manual_seed(seed)).to(device)
        (a.weights * g).sum().backward()
        (b.weights * g).sum().backward()
        assert torch.equal(lg.grad, lg2.grad)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_gate_dense_options_value_equals_keywords(dev_backend):
    device, backend = dev_backend
    T, E, K = 29, 16, 4
    kw = dict(score_func="softmax", normalize=True, scaling_factor=0.5, padding="spread",
              ep_size=4, spread_offset=3, underflow_guard=True, align=2, with_plan=True)
    lg = make_logits(T, E, device=device, seed=3).requires_grad_(True)
    lg2 = lg.detach().clone().requires_grad_(True)
    idx = make_indices(T, E, K, device=device, seed=4, empty=0.2)
    a = replay_ops.gate_dense(lg, idx, backend=backend, validate=False, **kw)
    b = replay_ops.gate_dense(lg2, idx, backend=backend, validate=False,
                              options=GateOptions(**kw))
    _same(a[:4], b[:4])
    _same(a.plan, b.plan)
    g = torch.randn(T, E, generator=torch.Generator().manual_seed(5)).to(device)
    (a.probs * g).sum().backward()
    (b.probs * g).sum().backward()
    assert torch.equal(lg.grad, lg2.grad)
    # with_plan=False through the value: no plan, as with the keyword
    c = replay_ops.gate_dense(lg.detach(), idx, backend=backend, validate=False,
                              options=dataclasses.replace(GateOptions(**kw), with_plan=False))
    assert c.plan is None


def test_options_and_keywords_together_are_refused_by_name():
    lg, idx = make_logits(4, 8), make_indices(4, 8, 2)
    with pytest.raises(ValueError, match=r"gate: pass the options either as keywords or as "
                                         r"options=, not both \(got options= and align=2\)"):
        replay_ops.gate(lg, idx, align=2, options=GateOptions(align=2))
    with pytest.raises(ValueError, match=r"gate_dense: .*not both .*padding='spread'"):
        replay_ops.gate_dense(lg, idx, padding="spread", options=GateOptions())
    # an explicit keyword at its default is refused too: it must not be dropped in silence
    with pytest.raises(ValueError, match=r"gate: .*not both \(got options= and "
                                         r"normalize=True\)"):
        replay_ops.gate(lg, idx, normalize=True, options=GateOptions(normalize=False))


# A value of each option other than its default, valid for both gates where the option is
# theirs (E=8, K=2).
_OTHER = {"score_func": "sigmoid", "normalize": False, "scaling_factor": 2.0, "align": 4,
          "padding": "select", "selection": replay_ops.Selection(num_groups=2, group_topk=1),
          "return_agreement": True, "ep_size": 2, "spread_offset": 3,
          "underflow_guard": True, "with_plan": False, "weights_dtype": torch.float32}


@pytest.mark.parametrize("op, fields", [("gate", ro.GATE_OPTIONS),
                                        ("gate_dense", ro.DENSE_OPTIONS)])
def test_every_explicit_keyword_beside_options_is_refused_by_name(op, fields):
    """Both directions, for every option keyword of the op: the keyword at its default
    beside an `options` value that differs from it (the explicit keyword would be lost),
    and the keyword at another value beside default `options` (the value's field would be
    lost). Each is refused, naming the keyword; each side alone is accepted."""
    lg, idx = make_logits(4, 8), make_indices(4, 8, 2)
    fn = getattr(replay_ops, op)
    assert set(fields) == set(_OTHER) & set(fields) and set(fields) <= set(_OTHER)
    for f in fields:
        default, other = getattr(ro.DEFAULTS, f), _OTHER[f]
        for kw_value, opt_value in ((default, other), (other, default)):
            opts = dataclasses.replace(GateOptions(), **{f: opt_value})
            with pytest.raises(ValueError, match=rf"{op}: pass the options either as keywords "
                                                 rf"or as options=, not both \(got options= "
                                                 rf"and {f}=") as e:
                fn(lg, idx, options=opts, **{f: kw_value})
            assert f"{f}={kw_value!r}" in str(e.value)
            fn(lg, idx, options=opts)  # each side alone is a valid call
            fn(lg, idx, **{f: kw_value})


def test_explicit_keyword_rule_leaves_the_signature():
    import inspect

    for fn in (replay_ops.gate, replay_ops.gate_dense):
        params = inspect.signature(fn).parameters
        assert params["normalize"].default is True and params["options"].default is None


def test_dense_only_options_are_refused_by_gate():
    lg, idx = make_logits(4, 8), make_indices(4, 8, 2)
    with pytest.raises(ValueError, match=r"gate: options set ep_size, spread_offset, which "
                                         r"gate does not take"):
        replay_ops.gate(lg, idx, options=GateOptions(ep_size=2, spread_offset=1))
    # and the sparse gate's weights_dtype by gate_dense
    with pytest.raises(ValueError, match=r"gate_dense: options set weights_dtype, which "
                                         r"gate_dense does not take \(they belong to "
                                         r"replay_ops.gate\)"):
        replay_ops.gate_dense(lg, idx, options=GateOptions(weights_dtype=torch.float32))
    # padding is an option of both gates; gate refuses the dense gate's modes by name
    with pytest.raises(ValueError, match=r"gate: unknown padding='spread'; expected one of "
                                         r"\('empty', 'select'\)"):
        replay_ops.gate(lg, idx, options=GateOptions(padding="spread"))
    with pytest.raises(TypeError, match="options must be a replay_ops.GateOptions, got dict"):
        replay_ops.gate(lg, idx, options={"align": 2})


def test_bad_values_in_the_value_are_refused_by_the_ops_checks():
    lg, idx = make_logits(4, 8), make_indices(4, 8, 2)
    with pytest.raises(ValueError, match=r"align must be an integer >= 1, got align=0"):
        replay_ops.gate(lg, idx, options=GateOptions(align=0))
    with pytest.raises(ValueError, match="score_func"):
        replay_ops.gate(lg, idx, options=GateOptions(score_func="relu"))


def test_options_are_frozen_and_hashable():
    o = GateOptions(score_func="sigmoid")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.align = 2  # type: ignore[misc]
    assert hash(o) == hash(GateOptions(score_func="sigmoid"))
    assert replay_ops.GateOptions is GateOptions


def test_field_lists_match_the_registered_schemas():
    """The one flattening (GATE_FIELDS, DENSE_FIELDS, BACKWARD_FIELDS) names the schemas'
    option arguments in their order, and every field is an option of the value."""
    def names(op):
        return [a.name for a in op.default._schema.arguments]

    fields = {f.name for f in dataclasses.fields(GateOptions)}
    assert set(ro.DENSE_OPTIONS) | set(ro.GATE_OPTIONS) == fields
    assert ro.DENSE_FIELDS == ro.flat_fields(ro.DENSE_OPTIONS)
    assert names(torch.ops.replay.gate)[3:3 + len(ro.GATE_FIELDS)] == list(ro.GATE_FIELDS)
    assert names(torch.ops.replay.gate_dense)[4:4 + len(ro.DENSE_FIELDS)] == list(ro.DENSE_FIELDS)
    for op in (torch.ops.replay.gate_backward, torch.ops.replay.gate_dense_backward):
        assert names(op)[3:3 + len(ro.BACKWARD_FIELDS)] == list(ro.BACKWARD_FIELDS)
    # the selection's bias is the schemas' one optional Tensor among the options
    for op, fields_ in ((torch.ops.replay.gate, ro.GATE_FIELDS),
                        (torch.ops.replay.gate_dense, ro.DENSE_FIELDS)):
        arg = next(a for a in op.default._schema.arguments if a.name == "expert_bias")
        assert str(arg.type) == "Optional[Tensor]"
    bias = torch.zeros(8)
    sel = ro.Selection(source="scores", expert_bias=bias, round_scores=True, num_groups=4,
                       group_topk=2, group_score_topn=2)
    o = GateOptions(score_func="sqrtsoftplus", normalize=False, scaling_factor=3, align=8,
                    padding="fallback", ep_size=2, spread_offset=1, underflow_guard=True,
                    with_plan=False, selection=sel, return_agreement=True)
    flat = o.flat(ro.DENSE_FIELDS)
    assert flat == ("sqrtsoftplus", False, 3.0, "fallback", 2, 1, True, 8, False,
                    "scores", bias, True, 4, 2, 2, True)
    assert type(flat[2]) is float
    assert GateOptions.from_flat(ro.DENSE_FIELDS, flat) == o
    assert GateOptions.from_flat(ro.GATE_FIELDS, o.flat(ro.GATE_FIELDS)) == GateOptions(
        score_func="sqrtsoftplus", normalize=False, scaling_factor=3.0, align=8,
        padding="fallback", selection=sel, return_agreement=True)
    # a selection names its bias by identity: an equal copy is another value
    assert ro.Selection(expert_bias=bias) != ro.Selection(expert_bias=bias.clone())
