"""The gate with the permute of the hidden states in one op (`replay_ops.gate(...,
hidden=x)`, replay::gate_permute and replay::gate_permute_backward): parity with the
reference and with the gate and permute ops run in turn (bitwise, integer outputs exact),
gradcheck, determinism, the fake kernels, opcheck, torch.compile, and the composition a
backend without the fused kernels gets."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import replay_ops
from replay_ops import reference
from replay_ops.backends import OpShape
from replay_ops.backends import native as native_backend
from replay_ops.options import GATE_FIELDS, GateOptions, Selection

from _helpers import PLAN_INT_FIELDS, backend_params, is_interpreted, make_indices, make_logits

BACKENDS = backend_params()


def _case(device, T=9, E=6, K=2, H=5, dtype=torch.float32, seed=0, empty=0.2):
    g = torch.Generator().manual_seed(seed)
    logits = make_logits(T, E, dtype=dtype, device=device).requires_grad_(True)
    x = torch.randn(T, H, generator=g, dtype=torch.float32).to(dtype).to(device)
    idx = make_indices(T, E, K, device=device, empty=empty)
    return logits, x.requires_grad_(True), idx


# (options, replay_mask) variants: plain softmax with align; sigmoid unnormalized with a
# mask and the selection of flagged rows; the agreement outputs
VARIANTS = [
    (dict(align=4), False),
    (dict(score_func="sigmoid", normalize=False, scaling_factor=2.5), True),
    (dict(score_func="softmax", padding="select", return_agreement=True,
          selection=Selection(num_groups=3, group_topk=2)), True),
]


def _mask(T, device, on):
    if not on:
        return None
    m = torch.ones(T, dtype=torch.bool, device=device)
    m[1] = m[4] = False
    return m


def _loss(plan, gw, gr):
    loss = (plan.weights.float() * gw).sum() + (plan.rows.float() * gr).sum()
    if plan.set_logprob is not None:
        fin = plan.set_logprob.isfinite()
        loss = loss + torch.where(fin, plan.set_logprob, 0.0).sum()
    return loss


@pytest.mark.parametrize("dev_backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_matches_gate_then_permute_bitwise_and_the_reference(dev_backend, dtype, variant):
    device, backend = dev_backend
    kw, masked = VARIANTS[variant]
    logits, x, idx = _case(device, dtype=dtype)
    mask = _mask(logits.shape[0], device, masked)
    plan = replay_ops.gate(logits, idx, replay_mask=mask, hidden=x, backend=backend, **kw)
    assert plan.rows.shape == (plan.max_rows, x.shape[1]) and plan.rows.dtype == dtype
    # the two ops in turn, same backend: every output and gradient bitwise
    l2 = logits.detach().clone().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    p2 = replay_ops.gate(l2, idx, replay_mask=mask, backend=backend, **kw)
    rows2 = replay_ops.permute(x2, p2, p2.max_rows, backend=backend)
    for f in PLAN_INT_FIELDS + ("weights",):
        assert torch.equal(getattr(plan, f), getattr(p2, f)), f
    assert torch.equal(plan.rows, rows2)
    if plan.agreement is not None:
        assert torch.equal(plan.agreement, p2.agreement)
        assert torch.equal(plan.set_logprob, p2.set_logprob)
    gen = torch.Generator().manual_seed(1)
    gw = torch.randn(plan.weights.shape, generator=gen).to(device)
    gr = torch.randn(plan.rows.shape, generator=gen).to(device)
    _loss(plan, gw, gr).backward()
    _loss(p2._replace(rows=rows2), gw, gr).backward()
    assert torch.equal(logits.grad, l2.grad)
    assert torch.equal(x.grad, x2.grad)
    # the reference, written from the math: integer outputs and rows exact
    ref = reference.gate(logits.detach(), idx, replay_mask=mask, hidden=x.detach(),
                         validate=True, **{k: v for k, v in kw.items()
                                           if k != "selection"},
                         **({"selection": kw["selection"]} if "selection" in kw else {}))
    for f in PLAN_INT_FIELDS:
        assert torch.equal(getattr(plan, f), getattr(ref, f)), f
    assert torch.equal(plan.rows, ref.rows)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plan.weights, ref.weights, **tol)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_hidden_gradient_is_the_slot_sum_in_order(dev_backend):
    """x's gradient: per token, the sum over its K slots of its rows' gradients (the
    reference's combine with weight 1, fp32 accumulation in slot order)."""
    device, backend = dev_backend
    logits, x, idx = _case(device, T=11, E=5, K=3, H=4, dtype=torch.bfloat16)
    plan = replay_ops.gate(logits, idx, hidden=x, backend=backend)
    gr = torch.randn(plan.rows.shape, generator=torch.Generator().manual_seed(2)).to(
        device, torch.bfloat16)
    (plan.rows.float() * gr.float()).sum().backward()
    ones = torch.where(plan.row_id_map >= 0, 1.0, 0.0)
    assert torch.equal(x.grad, reference.combine(gr, plan.row_id_map, ones))


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_gradcheck_float64(dev_backend):
    """fp64 gradcheck of the weights, the rows and set_logprob to the logits and the hidden
    states. Under the Triton interpreter (each launch costs a fraction of a second) in
    gradcheck's fast mode (random projections of the Jacobian): there the op runs the gate and
    the permute kernels in turn, each with its full gradcheck in its own tests."""
    device, backend = dev_backend
    logits, x, idx = _case(device, T=5, E=4, K=2, H=3, dtype=torch.float64)
    for kw in (dict(), dict(score_func="sigmoid", return_agreement=True)):
        def f(lg, h):
            p = replay_ops.gate(lg, idx, hidden=h, backend=backend, **kw)
            out = (p.weights, p.rows)
            if p.set_logprob is not None:
                out += (torch.where(p.set_logprob.isfinite(), p.set_logprob, 0.0),)
            return out
        assert torch.autograd.gradcheck(f, (logits, x),
                                        fast_mode=is_interpreted(device, backend))


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_one_input_needs_grad(dev_backend):
    """Only the logits or only the hidden states require grad: the other backward runs
    alone, with the same gradient."""
    device, backend = dev_backend
    logits, x, idx = _case(device)
    full = replay_ops.gate(logits, idx, hidden=x, backend=backend)
    (full.weights.sum() + full.rows.sum()).backward()
    lg, xd = logits.detach().requires_grad_(True), x.detach()
    p = replay_ops.gate(lg, idx, hidden=xd, backend=backend)
    (p.weights.sum() + p.rows.sum()).backward()
    assert torch.equal(lg.grad, logits.grad)
    xg = x.detach().requires_grad_(True)
    p = replay_ops.gate(logits.detach(), idx, hidden=xg, backend=backend)
    p.rows.sum().backward()
    assert torch.equal(xg.grad, x.grad)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_deterministic(dev_backend):
    device, backend = dev_backend
    outs = []
    for _ in range(2):
        logits, x, idx = _case(device, T=33, E=8, K=3, H=16, dtype=torch.bfloat16)
        p = replay_ops.gate(logits, idx, hidden=x, align=2, backend=backend)
        (p.weights.float().sum() + (p.rows.float() ** 2).sum()).backward()
        outs.append((p.weights, p.rows, logits.grad, x.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_num_rows_and_bad_input():
    logits, x, idx = _case("cpu")
    p = replay_ops.gate(logits, idx, hidden=x, num_rows=40)
    assert p.rows.shape == (40, x.shape[1])
    assert torch.equal(p.rows[p.max_rows:], torch.zeros(40 - p.max_rows, x.shape[1]))
    with pytest.raises(ValueError, match="num_rows=1 is too small"):
        replay_ops.gate(logits, idx, hidden=x, num_rows=1)
    with pytest.raises(ValueError, match="num_rows is the size of plan.rows and needs hidden"):
        replay_ops.gate(logits, idx, num_rows=4)
    with pytest.raises(ValueError, match="hidden has 8 rows but the plan has 9"):
        replay_ops.gate(logits, idx, hidden=x[:8])
    with pytest.raises(TypeError, match="hidden must be floating point"):
        replay_ops.gate(logits, idx, hidden=torch.zeros(9, 3, dtype=torch.int32))


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_opcheck(dev_backend):
    device, backend = dev_backend
    logits, x, idx = _case(device)
    for kw, masked in VARIANTS:
        opts = GateOptions(**kw)
        for n in (0, 30):
            args = (logits, idx, _mask(logits.shape[0], device, masked),
                    *opts.flat(GATE_FIELDS), x, n, True, backend)
            torch.library.opcheck(torch.ops.replay.gate_permute.default, args)
    T, E, K, H = 9, 6, 2, 5
    plan = replay_ops.gate(logits, idx, backend=backend)
    for glp in (None, torch.randn(T, device=device)):
        torch.library.opcheck(torch.ops.replay.gate_permute_backward.default,
                              (torch.randn(T, K, device=device), torch.randn(30, H, device=device),
                               logits.detach(), plan.expert_indices, plan.row_id_map,
                               "softmax", True, 1.0, glp, backend))


def test_fake_kernel_matches_real():
    logits, x, idx = _case("cpu", T=7, E=6, K=3, H=4)
    opts = GateOptions(align=3, return_agreement=True)
    args = (logits.detach(), idx, None, *opts.flat(GATE_FIELDS), x.detach(), 25, True, "auto")
    real = torch.ops.replay.gate_permute(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.replay.gate_permute(*(mode.from_tensor(a) if isinstance(a, torch.Tensor)
                                               else a for a in args))
    assert len(real) == len(fake) == 9
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device)


def test_compile_fullgraph_matches_eager():
    def step(lg, h, idx):
        p = replay_ops.gate(lg, idx, hidden=h, validate=False)
        y = p.rows * 2.0
        return replay_ops.unpermute(y, p, validate=False)

    logits, x, idx = _case("cpu", T=6, E=5, K=2, H=4)
    out = step(logits, x, idx)
    out.square().sum().backward()
    ge = (logits.grad, x.grad)
    l2, x2 = logits.detach().requires_grad_(True), x.detach().requires_grad_(True)
    torch._dynamo.reset()
    cout = torch.compile(step, fullgraph=True, backend="aot_eager")(l2, x2, idx)
    cout.square().sum().backward()
    assert torch.equal(out, cout)
    assert torch.equal(ge[0], l2.grad) and torch.equal(ge[1], x2.grad)


def test_backend_without_the_fused_kernels_composes(monkeypatch):
    """A backend that refuses the fused kernels (supports() says why) gets the gate and the
    permute kernels in turn, with the same outputs and gradients."""
    shape = OpShape(4, 8, 2, 16)
    if native_backend.FUSED_CPU:
        assert native_backend.supports("gate_permute_fwd", "cpu", shape, torch.float32)
    why = native_backend.supports("gate_permute_bwd", "cuda", shape, torch.float32)
    assert not why and "no fused gate + permute" in why.reason
    logits, x, idx = _case("cpu", dtype=torch.bfloat16)
    fused = replay_ops.gate(logits, idx, hidden=x, backend="native")
    (fused.weights.float().sum() + fused.rows.float().square().sum()).backward()
    calls = []
    real_gate_fwd = native_backend.gate_fwd
    monkeypatch.setattr(native_backend, "FUSED_CPU", False)
    monkeypatch.setattr(native_backend, "gate_fwd",
                        lambda *a: calls.append("gate_fwd") or real_gate_fwd(*a))
    assert not native_backend.supports("gate_permute_fwd", "cpu", shape, torch.float32)
    l2, x2 = logits.detach().requires_grad_(True), x.detach().requires_grad_(True)
    comp = replay_ops.gate(l2, idx, hidden=x2, backend="native")
    (comp.weights.float().sum() + comp.rows.float().square().sum()).backward()
    assert calls == ["gate_fwd"]
    assert torch.equal(fused.rows, comp.rows) and torch.equal(fused.weights, comp.weights)
    assert torch.equal(logits.grad, l2.grad) and torch.equal(x.grad, x2.grad)
