"""The torch.library registration: opcheck on all six ops, fake kernels against the real
outputs, and torch.compile(fullgraph=True) of gate -> permute -> expert -> unpermute,
forward and backward, against eager."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import replay_ops
from replay_ops.options import GATE_FIELDS, GateOptions, Selection

from _helpers import (
    PLAN_INT_FIELDS,
    backend_params,
    capture_cuda_graph,
    is_interpreted,
    make_indices,
    make_logits,
    strided_indices,
)

BACKENDS = backend_params()
OPS = replay_ops.ops.OPS


def test_all_ops_registered():
    for name in OPS:
        op = getattr(torch.ops.replay, name)
        assert op.default._schema.name == f"replay::{name}"
    # and the list names every op the namespace holds (the dense ops included)
    registered = {n for n in dir(torch.ops.replay)
                  if isinstance(getattr(torch.ops.replay, n), torch._ops.OpOverloadPacket)}
    assert registered == set(OPS), sorted(registered ^ set(OPS))
    assert {"gate_dense", "permute_probs", "gate_dense_backward"} <= set(OPS)


def _gate_args(device, backend, *, T=6, E=5, K=2, align=4, dtype=torch.float32, mask=False,
               score_func="softmax", normalize=True, idx=None, grad=True, **options):
    logits = make_logits(T, E, dtype=dtype, device=device).requires_grad_(grad)
    if idx is None:
        idx = make_indices(T, E, K, device=device, empty=0.2)
    m = None
    if mask:
        m = torch.ones(T, dtype=torch.bool, device=device)
        m[1] = False
    opts = GateOptions(score_func=score_func, normalize=normalize, scaling_factor=1.5,
                       align=align, **options)
    return (logits, idx, m, *opts.flat(GATE_FIELDS), True, backend)


def _gate_variants(device, backend):
    _, view = strided_indices(7, 6, 3, dtype=torch.int16, device=device, empty=0.2)
    return [
        _gate_args(device, backend),
        _gate_args(device, backend, mask=True, score_func="sigmoid", normalize=False),
        _gate_args(device, backend, T=7, E=6, K=3, idx=view, score_func="sqrtsoftplus", align=1),
        _gate_args(device, backend, dtype=torch.bfloat16),
        _gate_args(device, backend, T=0, grad=False),
        # the model's own selection of flagged rows, with bias and groups; the agreement
        # outputs (set_logprob is differentiable)
        _gate_args(device, backend, T=7, E=6, K=2, mask=True, score_func="sigmoid",
                   padding="select", return_agreement=True,
                   selection=Selection(expert_bias=torch.linspace(-0.3, 0.3, 6, device=device),
                                       num_groups=3, group_topk=2, round_scores=True)),
        _gate_args(device, backend, T=0, grad=False, return_agreement=True),
    ]


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_opcheck_gate(dev_backend):
    device, backend = dev_backend
    variants = _gate_variants(device, backend)
    if is_interpreted(device, backend):
        variants = variants[:2] + variants[-2:-1]
    for args in variants:
        torch.library.opcheck(torch.ops.replay.gate.default, args)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_opcheck_gate_backward(dev_backend):
    device, backend = dev_backend
    T, E, K = 6, 5, 2
    logits = make_logits(T, E, device=device)
    idx = make_indices(T, E, K, device=device, empty=0.2)
    modes = (("softmax", False), ("softmax", True), ("sigmoid", True), ("sqrtsoftplus", False))
    for sf, norm in modes:
        gw = torch.randn(T, K, device=device)
        for glp in (None, torch.randn(T, device=device)):
            torch.library.opcheck(torch.ops.replay.gate_backward.default,
                                  (gw, logits, idx, sf, norm, 2.0, glp, backend))


def _plan(device, backend, T=6, E=5, K=2, align=4, dtype=torch.float32):
    logits = make_logits(T, E, dtype=dtype, device=device)
    return replay_ops.gate(logits, make_indices(T, E, K, device=device, empty=0.2), align=align,
                           backend=backend)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_opcheck_permute(dev_backend):
    device, backend = dev_backend
    plan = _plan(device, backend)
    for n in (plan.num_rows(), plan.max_rows + 3):
        h = torch.randn(6, 7, device=device, requires_grad=True)
        torch.library.opcheck(torch.ops.replay.permute.default,
                              (h, plan.sorted_slots, plan.row_id_map, n, backend))
    g = torch.randn(plan.max_rows, 7, device=device)
    torch.library.opcheck(torch.ops.replay.permute_backward.default, (g, plan.row_id_map, backend))


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_opcheck_unpermute(dev_backend):
    device, backend = dev_backend
    plan = _plan(device, backend)
    n = plan.max_rows
    x = torch.randn(n, 7, device=device, requires_grad=True)
    w = plan.weights.detach().clone().requires_grad_(True)
    torch.library.opcheck(torch.ops.replay.unpermute.default,
                          (x, plan.row_id_map, plan.sorted_slots, w, backend))
    g = torch.randn(6, 7, device=device)
    torch.library.opcheck(torch.ops.replay.unpermute_backward.default,
                          (g, x.detach(), plan.row_id_map, plan.sorted_slots, w.detach(), backend))


# ------------------------------------------------------------------- fake kernels
@pytest.mark.parametrize("dev_backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 5, 2, 1), (1, 1, 1, 16), (9, 7, 3, 4), (13, 64, 2, 128)])
def test_fake_kernels_match_real_outputs(dev_backend, shape):
    """Shapes, dtypes and devices of every op under FakeTensorMode equal the real ones."""
    device, backend = dev_backend
    T, E, K, align = shape
    logits = make_logits(T, E, device=device)
    idx = make_indices(T, E, K, dtype=torch.int16, device=device)
    H = 5
    hidden = torch.randn(T, H, device=device)

    def run(logits, idx, hidden):
        plan = replay_ops.gate(logits, idx, align=align, backend=backend)
        x = replay_ops.permute(hidden, plan, plan.max_rows, backend=backend)
        y = replay_ops.unpermute(x, plan, backend=backend)
        gl = torch.ops.replay.gate_backward(plan.weights, logits, plan.expert_indices, "softmax",
                                            True, 1.0, None, backend)
        gp = torch.ops.replay.permute_backward(x, plan.row_id_map, backend)
        gx, gw = torch.ops.replay.unpermute_backward(y, x, plan.row_id_map, plan.sorted_slots,
                                                     plan.weights, backend)
        return (*plan[:6], x, y, gl, gp, gx, gw)

    real = run(logits, idx, hidden)
    with FakeTensorMode() as mode:
        fake = run(mode.from_tensor(logits), mode.from_tensor(idx), mode.from_tensor(hidden))
    assert len(real) == len(fake)
    for i, (r, f) in enumerate(zip(real, fake)):
        assert tuple(r.shape) == tuple(f.shape), (i, r.shape, f.shape)
        assert r.dtype == f.dtype, (i, r.dtype, f.dtype)
        assert r.device == f.device, (i, r.device, f.device)
    plan = replay_ops.RoutingPlan(*real[:6])
    assert plan.max_rows == T * K + E * (align - 1)
    for name in PLAN_INT_FIELDS:
        assert getattr(plan, name).dtype == torch.int32


def test_meta_tensors_give_plan_shapes():
    plan = replay_ops.gate(torch.empty(10, 8, device="meta", dtype=torch.bfloat16),
                           torch.empty(10, 3, device="meta", dtype=torch.int16), align=16)
    assert plan.weights.shape == (10, 3) and plan.weights.dtype == torch.bfloat16
    assert plan.tokens_per_expert.shape == (8,) and plan.expert_offsets.shape == (9,)
    assert plan.sorted_slots.shape == (10 * 3 + 8 * 15,)
    assert plan.max_rows == 150 and plan.align == 16


# ------------------------------------------------------------------ torch.compile
def _moe_step(backend, align, score_func):
    def step(logits, idx, hidden, w):
        plan = replay_ops.gate(logits, idx, score_func=score_func, align=align, backend=backend)
        x = replay_ops.permute(hidden, plan, plan.max_rows, backend=backend)
        y = torch.tanh(x @ w)
        return replay_ops.unpermute(y, plan, backend=backend), plan.tokens_per_expert

    return step


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_compile_fullgraph_matches_eager(dev_backend):
    device, backend = dev_backend
    torch._dynamo.reset()
    T, E, K, H = 11, 7, 2, 8
    g = torch.Generator().manual_seed(5)
    logits0 = make_logits(T, E, device=device)
    idx = make_indices(T, E, K, dtype=torch.int16, device=device, empty=0.2)
    hidden0 = torch.randn(T, H, generator=g).to(device)
    w0 = (torch.randn(H, H, generator=g) / H**0.5).to(device)
    grad_out = torch.randn(T, H, generator=g).to(device)
    step = _moe_step(backend, 4, "sigmoid")
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="inductor")

    results = []
    for fn in (step, compiled):
        leaves = [t.detach().clone().requires_grad_(True) for t in (logits0, hidden0, w0)]
        logits, hidden, w = leaves
        out, counts = fn(logits, idx, hidden, w)
        out.backward(grad_out)
        results.append((out.detach(), counts, *[t.grad for t in leaves]))
    eager, comp = results
    names = ("out", "tokens_per_expert", "grad logits", "grad hidden", "grad w")
    for name, a, b in zip(names, eager, comp):
        assert a.dtype == b.dtype, name
        if a.dtype == torch.int32:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_compile_no_graph_break_with_static_rows(dev_backend):
    """gate -> permute(num_rows=plan.max_rows) -> unpermute traces as one graph."""
    device, backend = dev_backend
    torch._dynamo.reset()
    step = _moe_step(backend, 16, "softmax")
    explain = torch._dynamo.explain(step)(
        make_logits(5, 4, device=device), make_indices(5, 4, 2, device=device),
        torch.randn(5, 3, device=device), torch.randn(3, 3, device=device),
    )
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1


# ----------------------------------------------------------------- backend routing
KERNELS = ("gate_fwd", "gate_bwd", "permute_fwd", "permute_bwd", "unpermute_fwd", "unpermute_bwd")


def _count_calls(monkeypatch, names):
    """Wrap every kernel of every listed backend module with a call counter."""
    from replay_ops import backends as rb

    calls = {}
    for name in names:
        mod = rb.load(name)
        for k in KERNELS:
            fn = getattr(mod, k)

            def wrapper(*a, _fn=fn, _key=(name, k), **kw):
                calls[_key] = calls.get(_key, 0) + 1
                return _fn(*a, **kw)

            monkeypatch.setattr(mod, k, wrapper)
    return calls


def _forward_backward(backend):
    logits = make_logits(6, 5).requires_grad_(True)
    hidden = torch.randn(6, 3, requires_grad=True)
    plan = replay_ops.gate(logits, make_indices(6, 5, 2), align=2, backend=backend)
    x = replay_ops.permute(hidden, plan, plan.max_rows, backend=backend)
    replay_ops.unpermute(x * 2, plan, backend=backend).sum().backward()


def test_backend_argument_runs_that_backend(monkeypatch):
    """Every parity test forces a backend with backend=...; make sure the request reaches
    that backend's six kernels and no other (or the parity tests would test nothing)."""
    from _helpers import usable_backends

    names = usable_backends("cpu")
    calls = _count_calls(monkeypatch, names)
    for name in names:
        calls.clear()
        _forward_backward(name)
        assert set(calls) == {(name, k) for k in KERNELS}, (name, calls)
        assert all(v == 1 for v in calls.values()), calls


def test_backend_environment_variable_and_auto_order(monkeypatch):
    from _helpers import usable_backends
    from replay_ops import backends as rb

    names = usable_backends("cpu")
    calls = _count_calls(monkeypatch, names)
    for name in names:
        calls.clear()
        monkeypatch.setenv(rb.ENV_VAR, name)
        _forward_backward(None)
        assert {b for b, _ in calls} == {name}, (name, calls)
    monkeypatch.delenv(rb.ENV_VAR)
    calls.clear()
    _forward_backward(None)
    # CPU auto order: native, then torch; Triton only when asked for
    want = "native" if "native" in names else "torch"
    assert {b for b, _ in calls} == {want}, calls
    assert replay_ops.backends()["active"]["cpu"] == want


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_compile_dynamic_shapes_sync_free(dev_backend):
    """dynamic=True, replay_mask fallback rows and validate=False (the CUDA-graph path):
    one graph serves several token counts, forward and backward match eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    device, backend = dev_backend
    torch._dynamo.reset()

    def step(logits, idx, mask, hidden):
        plan = replay_ops.gate(logits, idx, replay_mask=mask, score_func="sqrtsoftplus",
                               align=4, validate=False, backend=backend)
        x = replay_ops.permute(hidden, plan, plan.max_rows, validate=False, backend=backend)
        return replay_ops.unpermute(x * 2.0, plan, validate=False, backend=backend)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    frames = None
    for T in (7, 11, 13):
        g = torch.Generator().manual_seed(T)
        logits0 = make_logits(T, 6, device=device, seed=T)
        idx = make_indices(T, 6, 2, device=device, seed=T + 1)
        mask = (torch.rand(T, generator=g) > 0.4).to(device)
        hidden0 = torch.randn(T, 5, generator=g).to(device)
        res = []
        for fn in (step, compiled):
            lg = logits0.clone().requires_grad_(True)
            h = hidden0.clone().requires_grad_(True)
            out = fn(lg, idx, mask, h)
            out.backward(torch.ones_like(out))
            res.append((out.detach(), lg.grad, h.grad))
        for name, a, b in zip(("out", "grad logits", "grad hidden"), *res):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=f"T={T} {name}")
        if frames is None:
            frames = counter.frame_count
        assert counter.frame_count == frames, f"T={T} recompiled ({counter.frame_count} frames)"


# ------------------------------------------------------------------- CUDA graphs
def _cuda_backends():
    from _helpers import usable_backends

    return usable_backends("cuda") if torch.cuda.is_available() else []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", _cuda_backends())
def test_cuda_graph_capture_and_replay(backend):
    """validate=False + a static num_rows: gate -> permute -> unpermute captures in a CUDA
    graph (no host sync), and replays with new inputs copied into the static buffers."""
    from replay_ops import reference as ref

    T, E, K, H = 64, 8, 2, 32
    logits = make_logits(T, E, device="cuda", seed=1)
    idx = make_indices(T, E, K, dtype=torch.int16, device="cuda", seed=2, empty=0.1)
    hidden = torch.randn(T, H, device="cuda")

    def step():
        plan = replay_ops.gate(logits, idx, align=16, validate=False, backend=backend)
        x = replay_ops.permute(hidden, plan, plan.max_rows, validate=False, backend=backend)
        return replay_ops.unpermute(torch.tanh(x), plan, validate=False, backend=backend)

    graph, static_out = capture_cuda_graph(step, warmup=3)

    for seed in (3, 4):
        new_logits = make_logits(T, E, device="cuda", seed=seed)
        new_idx = make_indices(T, E, K, dtype=torch.int16, device="cuda", seed=seed + 10, empty=0.1)
        new_hidden = torch.randn(T, H, device="cuda")
        logits.copy_(new_logits)
        idx.copy_(new_idx)
        hidden.copy_(new_hidden)
        graph.replay()
        torch.cuda.synchronize()
        plan = ref.gate(new_logits, new_idx, align=16)
        want = ref.unpermute(torch.tanh(ref.permute(new_hidden, plan, plan.max_rows)), plan)
        torch.testing.assert_close(static_out, want, rtol=1e-5, atol=1e-6)
