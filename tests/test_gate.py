"""replay_ops.gate: forward parity with the reference, the plan's structure, fallback rows,
and gradients (parity with autograd through the reference, and fp64 gradcheck)."""
from __future__ import annotations

import pytest
import torch

import replay_ops
from replay_ops import reference as ref

from _helpers import (
    INDEX_DTYPES,
    PLAN_INT_FIELDS,
    SCORE_FUNCS,
    assert_fa_close,
    assert_int_equal,
    assert_plan_ints_equal,
    backend_params,
    case_params,
    check_plan_structure,
    dense_by_loops,
    is_interpreted,
    make_indices,
    make_logits,
    strided_indices,
)

# (T, E, K): zero-sized, T=1, odd, K in {1, 2, E}, E in {1, 7, 64, 256}, a few hundred tokens.
SHAPES = [
    (0, 7, 2),
    (1, 1, 1),
    (1, 7, 7),
    (7, 7, 7),
    (1, 64, 2),
    (13, 64, 1),
    (37, 64, 2),
    (5, 256, 2),
    (301, 256, 8),
    (300, 7, 2),
    (1031, 64, 8),  # more than 4096 slots: multi-program plan paths
]
SHAPES_INTERP = [
    (0, 7, 2), (1, 1, 1), (7, 7, 7), (13, 64, 1), (37, 64, 2), (5, 256, 2), (300, 7, 2),
    (1031, 64, 8),
]

MODES = [
    (sf, norm, scale)
    for sf in SCORE_FUNCS
    for norm in (False, True)
    for scale in (1.0, 2.5)
]
MODES_INTERP = [(sf, norm, 2.5) for sf in SCORE_FUNCS for norm in (False, True)]

ALIGNS = [1, 16, 128]


def _mode_id(m):
    return f"{m[0]}-norm{int(m[1])}-s{m[2]}"


def _shape_id(s):
    return "T{}E{}K{}".format(*s)


def check_gate(logits, idx, backend, **kw):
    """Run the op and compare every output with the reference (weights by the FA rule,
    integer outputs exactly); returns the op's plan."""
    out = replay_ops.gate(logits, idx, backend=backend, **kw)
    ref_plan = ref.gate(logits, idx, **kw)
    used = ref_plan.expert_indices
    kw64 = {k: v for k, v in kw.items() if k in ("score_func", "normalize", "scaling_factor")}
    ref64 = ref.gate_weights(
        logits.detach().double(),
        used,
        kw64.get("score_func", "softmax"),
        kw64.get("normalize", True),
        kw64.get("scaling_factor", 1.0),
    )
    assert isinstance(out, replay_ops.RoutingPlan)
    assert_fa_close(out.weights, ref_plan.weights, ref64, "weights")
    assert_plan_ints_equal(out, ref_plan)
    for f in out._fields[:6]:  # agreement and set_logprob are None (not asked for)
        assert getattr(out, f).device == logits.device, f"{f} on {getattr(out, f).device}"
    return out


# ------------------------------------------------------------------- forward parity
@pytest.mark.parametrize(
    "device,backend,shape", case_params(SHAPES, SHAPES_INTERP, ids=_shape_id)
)
def test_gate_parity_shapes(device, backend, shape):
    T, E, K = shape
    logits = make_logits(T, E, device=device)
    idx = make_indices(T, E, K, device=device, empty=0.2 if K > 1 else 0.0)
    plan = check_gate(logits, idx, backend)
    check_plan_structure(plan, idx, E, 1)


@pytest.mark.parametrize("device,backend,mode", case_params(MODES, MODES_INTERP, ids=_mode_id))
def test_gate_parity_modes(device, backend, mode):
    sf, norm, scale = mode
    T, E, K = (29, 64, 4)
    logits = make_logits(T, E, device=device, seed=3)
    idx = make_indices(T, E, K, device=device, empty=0.25)
    idx[0, :] = torch.tensor([5, -1, -1, -1])  # one valid slot: sigmoid is not normalised
    check_gate(logits, idx, backend, score_func=sf, normalize=norm, scaling_factor=scale)


@pytest.mark.parametrize(
    "device,backend,case",
    case_params(
        [(a, s) for a in ALIGNS for s in [(0, 7, 2), (1, 7, 2), (29, 7, 2), (45, 64, 3)]]
        + [(16, (700, 64, 7)), (128, (700, 7, 7))],
        [(a, s) for a in ALIGNS for s in [(0, 7, 2), (29, 7, 2)]] + [(16, (700, 64, 7))],
        ids=lambda c: f"align{c[0]}-" + _shape_id(c[1]),
    ),
)
def test_gate_align(device, backend, case):
    align, (T, E, K) = case
    logits = make_logits(T, E, device=device, seed=4)
    idx = make_indices(T, E, K, device=device, empty=0.2)
    plan = check_gate(logits, idx, backend, align=align, score_func="sigmoid")
    check_plan_structure(plan, idx, E, align)
    assert plan.align == align


@pytest.mark.parametrize(
    "device,backend,case",
    case_params(
        [(d, m) for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
         for m in SCORE_FUNCS],
        [(d, "softmax") for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)]
        + [(torch.bfloat16, "sigmoid"), (torch.float16, "sqrtsoftplus")],
        ids=lambda c: f"{str(c[0])[6:]}-{c[1]}",
    ),
)
def test_gate_logit_dtypes(device, backend, case):
    dtype, sf = case
    T, E, K = (33, 64, 6)
    logits = make_logits(T, E, dtype=dtype, device=device, seed=5, scale=3.0)
    idx = make_indices(T, E, K, device=device, empty=0.1)
    # 0.7 is not exact in fp32: an fp64 path must not round the scaling factor to fp32
    for norm in (False, True):
        plan = check_gate(logits, idx, backend, score_func=sf, normalize=norm, scaling_factor=0.7)
        assert plan.weights.dtype == dtype


@pytest.mark.parametrize(
    "device,backend,case",
    case_params(
        [(d, m) for d in (torch.bfloat16, torch.float16) for m in SCORE_FUNCS]
        + [(torch.float32, "softmax"), (torch.float64, "sigmoid")],
        [(torch.bfloat16, "softmax"), (torch.float16, "sigmoid")],
        ids=lambda c: f"{str(c[0])[6:]}-{c[1]}",
    ),
)
def test_gate_weights_in_the_compute_dtype(device, backend, case):
    """weights_dtype = the logits' compute dtype: the weights unrounded, bitwise those the
    same backend computes from the logits cast to it (its math runs in that dtype either
    way), the plan unchanged, and the logits' gradient bitwise that of the cast path
    rounded to the logits' dtype; with a replay mask and with hidden= too. Compared with
    the reference as well."""
    from replay_ops.scores import compute_dtype

    dtype, sf = case
    cdt = compute_dtype(dtype)
    T, E, K = (45, 64, 6)
    logits = make_logits(T, E, dtype=dtype, device=device, seed=7, scale=3.0)
    idx = make_indices(T, E, K, device=device, empty=0.1)
    mask = (torch.arange(T, device=device) % 5 != 2)
    hidden = make_logits(T, 8, dtype=dtype, device=device, seed=8)
    g = torch.linspace(-1, 1, T * K, device=device).reshape(T, K).to(cdt)
    for kw in (dict(), dict(replay_mask=mask, validate=False), dict(hidden=hidden)):
        kw.update(score_func=sf, normalize=True, scaling_factor=0.7, backend=backend)
        x = logits.clone().requires_grad_(True)
        plan = replay_ops.gate(x, idx, weights_dtype=cdt, **kw)
        assert plan.weights.dtype == cdt
        xc = logits.to(cdt).requires_grad_(True)
        want = replay_ops.gate(xc, idx, **kw)
        assert torch.equal(plan.weights, want.weights), (plan.weights - want.weights).abs().max()
        assert_plan_ints_equal(plan, want)
        if "hidden" in kw:
            assert torch.equal(plan.rows, want.rows)
        (gx,) = torch.autograd.grad((plan.weights * g).sum(), x)
        (gc,) = torch.autograd.grad((want.weights * g).sum(), xc)
        assert gx.dtype == dtype and torch.equal(gx, gc.to(dtype))
        kw.pop("backend")
        ref_plan = ref.gate(logits, idx, weights_dtype=cdt, **kw)
        assert ref_plan.weights.dtype == cdt
        kw.pop("hidden", None)
        ref64 = ref.gate(logits.double(), idx, **kw)
        assert_fa_close(plan.weights, ref_plan.weights, ref64.weights,
                        f"{backend} {dtype} {sf} weights")
    # the logits' own dtype is the default; another dtype is refused by name
    assert replay_ops.gate(logits, idx, weights_dtype=dtype, backend=backend).weights.dtype == dtype
    other = torch.float16 if dtype != torch.float16 else torch.bfloat16
    with pytest.raises(ValueError, match=rf"gate: weights_dtype must be None, the logits' "
                                         rf"dtype \({dtype}\) or their compute dtype "
                                         rf"\({cdt}\), got {other}"):
        replay_ops.gate(logits, idx, weights_dtype=other, backend=backend)


@pytest.mark.parametrize(
    "device,backend,idx_dtype",
    case_params(list(INDEX_DTYPES), ids=lambda d: str(d)[6:]),
)
def test_gate_strided_index_view(device, backend, idx_dtype):
    """A layer sliced out of a [T, L, K] recording (int16 as in verl/vLLM) is read in place."""
    T, E, K = (23, 64, 3)
    rec, view = strided_indices(T, E, K, dtype=idx_dtype, device=device, empty=0.2)
    assert not view.is_contiguous()
    logits = make_logits(T, E, device=device, seed=6)
    out_plan = check_gate(logits, view, backend)
    # same result as the contiguous int32 copy
    out_plan2 = replay_ops.gate(logits, view.to(torch.int32).contiguous(), backend=backend)
    assert_plan_ints_equal(out_plan, out_plan2)
    assert torch.equal(out_plan.weights, out_plan2.weights)
    # the recording is not modified
    assert torch.equal(rec[:, 1, :], view)


@pytest.mark.parametrize("dev_backend", backend_params())
def test_gate_noncontiguous_logits(dev_backend):
    device, backend = dev_backend
    T, E, K = (19, 7, 2)
    wide = make_logits(T, 2 * E + 1, device=device, seed=7)
    logits = wide[:, 1 : 2 * E + 1 : 2]  # column stride 2
    t_logits = make_logits(E, T, device=device, seed=8).t()  # transposed
    idx = make_indices(T, E, K, device=device, empty=0.2)
    gw = torch.randn(T, K, generator=torch.Generator().manual_seed(9)).to(device)
    for lg in (logits, t_logits):
        assert not lg.is_contiguous()
        for sf in SCORE_FUNCS:
            for norm in (True, False):
                kw = dict(score_func=sf, normalize=norm)
                check_gate(lg, idx, backend, **kw)
                # backward reads the saved (strided) logits
                x = lg.detach().t().contiguous().t() if lg is t_logits else wide.detach()[:, 1::2]
                assert not x.is_contiguous() and torch.equal(x, lg)
                x.requires_grad_(True)
                (replay_ops.gate(x, idx, backend=backend, **kw).weights * gw).sum().backward()
                y = lg.detach().contiguous().requires_grad_(True)
                (ref.gate(y, idx, **kw).weights * gw).sum().backward()
                torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dev_backend", backend_params())
def test_gate_int16_extremes(dev_backend):
    """int16 recordings with E close to the int16 range and -1 slots."""
    device, backend = dev_backend
    T, E, K = (5, 300, 2)
    idx = torch.tensor([[299, 0], [-1, 298], [-1, -1], [150, 299], [0, 1]], dtype=torch.int16)
    logits = make_logits(T, E, device=device)
    plan = check_gate(logits, idx.to(device), backend)
    check_plan_structure(plan, idx, E, 1)


# ------------------------------------------------------------- semantic properties
@pytest.mark.parametrize("dev_backend", backend_params())
def test_gate_empty_slots(dev_backend):
    """-1 slots have weight 0, row -1, take no row, and are left out of normalisation."""
    device, backend = dev_backend
    T, E, K = (4, 7, 3)
    idx = torch.tensor([[2, -1, 5], [-1, -1, -1], [0, 1, 2], [-1, 6, -1]], device=device)
    logits = make_logits(T, E, device=device)
    for sf in SCORE_FUNCS:
        plan = replay_ops.gate(logits, idx, score_func=sf, normalize=True, backend=backend)
        empty = idx < 0
        assert (plan.weights[empty] == 0).all()
        assert (plan.row_id_map[empty] == -1).all()
        assert int(plan.tokens_per_expert.sum()) == int((~empty).sum()) == 6
        assert plan.num_rows() == 6
        # normalised over valid slots only: each row with >1 valid slot sums to 1
        # (single-slot rows too for softmax, where softmax of one logit is 1)
        s = plan.weights.float().sum(dim=1)
        assert torch.allclose(s[[0, 2]], torch.ones(2, device=device), atol=1e-6)
        assert s[1] == 0
        if sf == "softmax":
            assert s[3] == 1.0
        else:  # one valid slot: the raw score, not normalised
            x = logits[3, 6].double()
            want = torch.sigmoid(x) if sf == "sigmoid" else torch.nn.functional.softplus(x).sqrt()
            assert abs(s[3].item() - want.item()) < 1e-6


@pytest.mark.parametrize("dev_backend", backend_params())
def test_gate_all_rows_empty(dev_backend):
    device, backend = dev_backend
    T, E, K = (3, 5, 2)
    idx = torch.full((T, K), -1, dtype=torch.int16, device=device)
    for align in (1, 16):
        plan = check_gate(make_logits(T, E, device=device), idx, backend, align=align)
        assert plan.num_rows() == 0
        assert (plan.sorted_slots == -1).all()
        assert plan.sorted_slots.numel() == T * K + E * (align - 1)


@pytest.mark.parametrize("dev_backend", backend_params())
def test_gate_keeps_recorded_column_order(dev_backend):
    """Column order is the recorded order, never sorted; weights follow their column."""
    device, backend = dev_backend
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], device=device)
    a = replay_ops.gate(logits, torch.tensor([[3, 0]], device=device), backend=backend)
    b = replay_ops.gate(logits, torch.tensor([[0, 3]], device=device), backend=backend)
    assert a.expert_indices.tolist() == [[3, 0]] and b.expert_indices.tolist() == [[0, 3]]
    assert torch.equal(a.weights.flip(1), b.weights)
    assert a.weights[0, 0] > a.weights[0, 1]
    # the plan is expert-major: expert 0 first, so slot 1 of `a` gets row 0
    assert a.row_id_map.tolist() == [[1, 0]] and b.row_id_map.tolist() == [[0, 1]]


@pytest.mark.parametrize("dev_backend", backend_params())
def test_gate_to_dense(dev_backend):
    device, backend = dev_backend
    T, E, K = (11, 9, 3)
    logits = make_logits(T, E, device=device)
    idx = make_indices(T, E, K, device=device, empty=0.3)
    # empty slots land on expert 0's column: they must not hide or change a real expert 0
    idx[0] = torch.tensor([-1, 0, -1], dtype=idx.dtype)
    idx[1] = torch.tensor([0, -1, 5], dtype=idx.dtype)
    idx[2] = torch.tensor([-1, -1, -1], dtype=idx.dtype)
    plan = replay_ops.gate(logits, idx, score_func="sigmoid", backend=backend)
    probs, rmap = plan.to_dense()
    assert rmap[0].tolist() == [True] + [False] * (E - 1) and rmap[2].sum() == 0
    want_probs, want_map = dense_by_loops(plan.weights.cpu(), idx.cpu(), E)
    assert probs.dtype == plan.weights.dtype and rmap.dtype == torch.bool
    assert torch.equal(probs.cpu(), want_probs)
    assert torch.equal(rmap.cpu(), want_map)
    # Megatron consumes the dense probs: the gradient must flow through them to the logits
    x = logits.clone().requires_grad_(True)
    gd = torch.randn(T, E, generator=torch.Generator().manual_seed(19)).to(device)
    p = replay_ops.gate(x, idx, score_func="sigmoid", backend=backend)
    (p.to_dense()[0] * gd).sum().backward()
    y = logits.clone().requires_grad_(True)
    w = ref.gate(y, idx, score_func="sigmoid").weights
    (w * gd.gather(1, idx.clamp_min(0).long())).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------- replay_mask rows
@pytest.mark.parametrize(
    "device,backend,case",
    case_params(
        [(sf, dt) for sf in SCORE_FUNCS for dt in (torch.float32, torch.bfloat16)],
        [("softmax", torch.float32), ("sqrtsoftplus", torch.bfloat16)],
        ids=lambda c: f"{c[0]}-{str(c[1])[6:]}",
    ),
)
def test_gate_replay_mask_fallback(device, backend, case):
    """Rows with replay_mask False use torch.topk of the fp32 scores; their recorded content
    is ignored, not validated (here: out of range, duplicates, -1)."""
    sf, dtype = case
    T, E, K = (9, 16, 3)
    logits = make_logits(T, E, dtype=dtype, device=device, seed=11)
    idx = make_indices(T, E, K, dtype=torch.int16, device=device)
    mask = torch.tensor([True, False, True, False, False, True, True, False, True], device=device)
    idx[1] = torch.tensor([99, -7, 3])  # garbage in a fallback row
    idx[3] = torch.tensor([2, 2, 2])
    idx[4] = torch.tensor([-1, -1, -1])
    x = logits.float()
    scores = {
        "softmax": torch.softmax(x, -1),
        "sigmoid": torch.sigmoid(x),
        "sqrtsoftplus": torch.nn.functional.softplus(x).sqrt(),
    }[sf]
    want = torch.where(mask[:, None], idx.int(), torch.topk(scores, K, dim=-1).indices.int())
    for norm in (False, True):
        plan = check_gate(logits, idx, backend, score_func=sf, normalize=norm, replay_mask=mask)
        assert_int_equal(plan.expert_indices, want, "expert_indices")
        check_plan_structure(plan, want, E, 1)


@pytest.mark.parametrize("dev_backend", backend_params())
def test_gate_replay_mask_all_true_equals_no_mask(dev_backend):
    device, backend = dev_backend
    T, E, K = (8, 7, 2)
    logits = make_logits(T, E, device=device)
    idx = make_indices(T, E, K, device=device, empty=0.2)
    a = replay_ops.gate(logits, idx, backend=backend)
    b = replay_ops.gate(logits, idx, replay_mask=torch.ones(T, dtype=torch.bool, device=device),
                        backend=backend)
    assert_plan_ints_equal(a, b)
    assert torch.equal(a.weights, b.weights)


# ----------------------------------------------------------------------- backward
def _grad(fn, logits, gw):
    x = logits.detach().clone().requires_grad_(True)
    w = fn(x)
    if w.dtype == torch.float64:
        (w * gw.double()).sum().backward()
    else:
        (w.float() * gw).sum().backward()
    return x.grad


@pytest.mark.parametrize(
    "device,backend,case",
    case_params(
        [(m, d) for m in MODES for d in (torch.float32, torch.bfloat16)]
        + [((sf, n, 0.7), torch.float64) for sf in SCORE_FUNCS for n in (False, True)],
        [(m, torch.float32) for m in MODES_INTERP] + [(("softmax", True, 1.0), torch.bfloat16)]
        + [(("sigmoid", True, 0.7), torch.float64)],
        ids=lambda c: _mode_id(c[0]) + "-" + str(c[1])[6:],
    ),
)
def test_gate_backward_parity(device, backend, case):
    """d(logits) from the op's backward vs autograd through the reference (FA rule)."""
    (sf, norm, scale), dtype = case
    T, E, K = (21, 64, 4)
    logits = make_logits(T, E, dtype=dtype, device=device, seed=12)
    idx = make_indices(T, E, K, device=device, empty=0.25)
    idx[0] = torch.tensor([3, -1, -1, -1])
    gw = torch.randn(T, K, device=device)
    kw = dict(score_func=sf, normalize=norm, scaling_factor=scale)
    out_g = _grad(lambda x: replay_ops.gate(x, idx, backend=backend, **kw).weights, logits, gw)
    ref_g = _grad(lambda x: ref.gate(x, idx, **kw).weights, logits, gw)
    ref64 = _grad(lambda x: ref.gate(x, idx, **kw).weights, logits.double(), gw)
    assert_fa_close(out_g, ref_g, ref64, "grad logits")
    if sf != "softmax" or norm:
        # gradient only at the selected experts
        sel = torch.zeros(T, E, dtype=torch.bool, device=device)
        v = idx >= 0
        sel[torch.arange(T, device=device)[:, None].expand(T, K)[v], idx[v].long()] = True
        assert (out_g[~sel] == 0).all()


@pytest.mark.parametrize("dev_backend", backend_params())
def test_gate_backward_reaches_unlikely_replayed_experts(dev_backend):
    """Known bug class: gathering from a sparse, already-scattered probs tensor gives zero
    gradient to replayed experts that the live top-k would not pick."""
    device, backend = dev_backend
    logits = torch.tensor([[4.0, 3.0, -2.0, -3.0]], device=device)
    idx = torch.tensor([[2, 3]], device=device)  # neither would be picked by top-2
    for sf in SCORE_FUNCS:
        for norm in (False, True):
            x = logits.clone().requires_grad_(True)
            w = replay_ops.gate(x, idx, score_func=sf, normalize=norm, backend=backend).weights
            w[0, 0].backward()
            g = x.grad[0]
            assert g[2] != 0, (sf, norm, g)
            if not (sf == "softmax" and not norm):
                assert g[0] == 0 and g[1] == 0, (sf, norm, g)


@pytest.mark.parametrize("dev_backend", backend_params())
def test_gate_backward_with_fallback_rows(dev_backend):
    device, backend = dev_backend
    T, E, K = (6, 8, 2)
    logits = make_logits(T, E, device=device, seed=13)
    idx = make_indices(T, E, K, device=device)
    mask = torch.tensor([True, False, True, True, False, True], device=device)
    gw = torch.randn(T, K, device=device)
    for sf in SCORE_FUNCS:
        kw = dict(score_func=sf, replay_mask=mask, scaling_factor=0.5)
        out_g = _grad(lambda x: replay_ops.gate(x, idx, backend=backend, **kw).weights, logits, gw)
        ref_g = _grad(lambda x: ref.gate(x, idx, **kw).weights, logits, gw)
        ref64 = _grad(lambda x: ref.gate(x, idx, **kw).weights, logits.double(), gw)
        assert_fa_close(out_g, ref_g, ref64, f"grad logits ({sf})")


@pytest.mark.parametrize(
    "device,backend,mode",
    case_params(
        [(sf, n, 2.5) for sf in SCORE_FUNCS for n in (False, True)]
        + [("softmax", True, 1.0), ("sigmoid", True, 1.0)],
        ids=_mode_id,
    ),
)
def test_gate_gradcheck(device, backend, mode):
    sf, norm, scale = mode
    T, E, K = (4, 6, 3)
    logits = make_logits(T, E, dtype=torch.float64, device=device, seed=14, scale=1.5)
    idx = torch.tensor([[1, 4, 0], [5, -1, 2], [-1, 3, -1], [-1, -1, -1]], device=device)
    fn = lambda x: replay_ops.gate(  # noqa: E731
        x, idx, score_func=sf, normalize=norm, scaling_factor=scale, backend=backend
    ).weights
    x = logits.requires_grad_(True)
    assert torch.autograd.gradcheck(fn, (x,), fast_mode=is_interpreted(device, backend))


@pytest.mark.parametrize("dev_backend", backend_params())
def test_gate_gradcheck_sqrtsoftplus_large_logits(dev_backend):
    """sqrt(softplus(x)) is linear-regime above softplus's threshold (20); the analytic
    gradient must stay right there and for very negative logits."""
    device, backend = dev_backend
    logits = torch.tensor([[25.0, -30.0, 19.5, 0.3], [40.0, 21.0, -5.0, 2.0]],
                          dtype=torch.float64, device=device)
    idx = torch.tensor([[0, 2, 3], [1, 0, 2]], device=device)
    for norm in (False, True):
        fn = lambda x: replay_ops.gate(  # noqa: E731
            x, idx, score_func="sqrtsoftplus", normalize=norm, backend=backend
        ).weights
        assert torch.autograd.gradcheck(fn, (logits.clone().requires_grad_(True),))


@pytest.mark.parametrize("dev_backend", backend_params())
def test_gate_integer_outputs_have_no_grad(dev_backend):
    device, backend = dev_backend
    x = make_logits(5, 7, device=device).requires_grad_(True)
    plan = replay_ops.gate(x, make_indices(5, 7, 2, device=device), backend=backend)
    assert plan.weights.requires_grad
    for f in PLAN_INT_FIELDS:
        assert not getattr(plan, f).requires_grad, f


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_backends_cover_the_registry(where):
    """Guard: a backend that is present in the checkout must be usable where it claims to
    be, or its parity tests would silently not run (they are generated from the registry).
    The `cuda` copy is gpu-marked, so the GPU run (`pytest -m gpu`) runs it too: there the
    Triton backend must serve CUDA, and the native library, where one is built, must have
    its CUDA kernels (otherwise hundreds of CUDA parity cases would not exist and the GPU
    run would pass without them)."""
    import glob
    import importlib.util
    import os

    from _helpers import HAS_CUDA, usable_backends
    from replay_ops import backends as rb

    info = rb.backends()["backends"]
    pkg = os.path.dirname(replay_ops.__file__)
    has_lib = bool(glob.glob(os.path.join(pkg, "_C*.so"))
                   or glob.glob(os.path.join(pkg, "_C*.pyd")))
    has_triton = importlib.util.find_spec("replay_ops.backends.triton") is not None
    if where == "cuda":
        assert HAS_CUDA, "the gpu-marked copy runs on a machine with a CUDA device only"
        assert "torch" in usable_backends("cuda")
        assert has_triton and "triton" in usable_backends("cuda"), info.get("triton")
        if has_lib:
            assert "native" in usable_backends("cuda"), (
                f"the native library is built but serves no CUDA call ({info['native']}): a "
                "CPU-only build on a GPU machine (rebuild with REPLAY_OPS_CUDA=1)")
        return
    assert "torch" in usable_backends("cpu")
    checked = []
    if has_triton:
        if os.environ.get("TRITON_INTERPRET") == "1":
            assert "triton" in usable_backends("cpu"), info["triton"]
            checked.append("triton/cpu")
        if HAS_CUDA:
            assert "triton" in usable_backends("cuda"), info["triton"]
            checked.append("triton/cuda")
    if has_lib:
        assert "native" in usable_backends("cpu"), info["native"]
        checked.append("native/cpu")
    if not checked:
        pytest.skip("neither a Triton backend nor a built native extension in this checkout")


# ------------------------------------------------------ unusual layouts and extremes
@pytest.mark.parametrize("dev_backend", backend_params())
def test_gate_unusual_layouts_and_sizes(dev_backend):
    """Broadcast (stride-0) recordings and logits, a large top-k, a non-power-of-two E
    above 256, and an align larger than any expert's count."""
    device, backend = dev_backend
    T = 9
    cases = [
        ("stride-0 indices", make_logits(T, 7, device=device),
         torch.tensor([[3, 1]], device=device).expand(T, 2), {}),
        ("stride-0 logits", make_logits(1, 7, device=device).expand(T, 7),
         make_indices(T, 7, 2, device=device), {"score_func": "sigmoid"}),
        ("K=64 of E=256", make_logits(33, 256, device=device),
         make_indices(33, 256, 64, device=device, empty=0.1), {"align": 16}),
        ("E=1000", make_logits(21, 1000, device=device),
         make_indices(21, 1000, 8, device=device, empty=0.1),
         {"align": 128, "score_func": "sqrtsoftplus"}),
        ("align=1000", make_logits(17, 7, device=device), make_indices(17, 7, 3, device=device),
         {"align": 1000, "normalize": False}),
    ]
    for name, logits, idx, kw in cases:
        plan = check_gate(logits, idx, backend, **kw)
        check_plan_structure(plan, idx, logits.shape[1], kw.get("align", 1))


# The Triton interpreter evaluates both sides of a tl.where in numpy, so the untaken
# overflowing branch warns; the results are checked below.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dev_backend", backend_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gate_extreme_logits(dev_backend, dtype):
    """Logits far in the tails (softplus underflows, exp overflows without a max shift):
    weights and gradients stay finite and close to the fp64 values."""
    device, backend = dev_backend
    big = 1e4 if dtype != torch.float16 else 6e4
    # the third row: an empty slot beside selected logits far below zero (the softmax over
    # the selection must be shifted by the valid logits' maximum, not by the empty slot)
    logits = torch.tensor([[100.0, -200.0, 30.0, 5.0, -30.0], [big, -big, 0.0, 88.0, 89.0],
                           [-300.0, -310.0, 5.0, 1.0, 0.0]], device=device).to(dtype)
    idx = torch.tensor([[0, 1, 2], [0, 3, 4], [0, 1, -1]], device=device)
    gw = torch.tensor([[1.0, -2.0, 0.5], [0.25, 1.0, -1.0], [1.0, -0.5, 2.0]], device=device)
    for sf in SCORE_FUNCS:
        for norm in (False, True):
            kw = dict(score_func=sf, normalize=norm)
            out_plan = check_gate(logits, idx, backend, **kw)
            assert torch.isfinite(out_plan.weights).all(), (sf, norm)
            out_g = _grad(lambda x: replay_ops.gate(x, idx, backend=backend, **kw).weights,
                          logits, gw)
            ref64 = _grad(lambda x: ref.gate(x, idx, **kw).weights, logits.double(), gw)
            assert torch.isfinite(out_g).all(), (sf, norm, out_g)
            tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
            err = (out_g.double() - ref64).abs().max().item()
            assert err <= tol, (sf, norm, err)


@pytest.mark.parametrize("dev_backend", backend_params())
def test_gate_replay_mask_sync_free_path(dev_backend):
    """validate=False takes the sync-free fallback path; it must give the same plan."""
    device, backend = dev_backend
    T, E, K = (15, 9, 3)
    logits = make_logits(T, E, device=device, seed=15)
    idx = make_indices(T, E, K, device=device, empty=0.2)
    mask = torch.rand(T, generator=torch.Generator().manual_seed(16)) > 0.4
    mask = mask.to(device)
    for sf in SCORE_FUNCS:
        a = replay_ops.gate(logits, idx, replay_mask=mask, score_func=sf, backend=backend)
        b = replay_ops.gate(logits, idx, replay_mask=mask, score_func=sf, validate=False,
                            backend=backend)
        assert_plan_ints_equal(a, b)
        assert torch.equal(a.weights, b.weights)
        none = torch.zeros(T, dtype=torch.bool, device=device)
        c = check_gate(logits, idx, backend, replay_mask=none, score_func=sf, validate=False)
        assert_int_equal(c.expert_indices, ref.select_experts(logits, K, sf), "all-fallback")


@pytest.mark.parametrize(
    "device,backend,dtype",
    case_params([torch.float32, torch.bfloat16], [torch.float32], ids=lambda d: str(d)[6:]),
)
def test_gate_wide_expert_dim(device, backend, dtype):
    """E = 1000 (several E blocks): the softmax denominator and its gradient are reductions
    over E; forward and backward held to the flash-attention rule."""
    T, E, K = (16, 1000, 8)
    logits = make_logits(T, E, dtype=dtype, device=device, seed=17, scale=0.5)
    idx = make_indices(T, E, K, device=device, empty=0.1)
    gw = torch.randn(T, K, generator=torch.Generator().manual_seed(18)).to(device)
    for sf, norm in (("softmax", False), ("softmax", True), ("sigmoid", True)):
        kw = dict(score_func=sf, normalize=norm)
        check_gate(logits, idx, backend, **kw)
        out_g = _grad(lambda x: replay_ops.gate(x, idx, backend=backend, **kw).weights, logits, gw)
        ref_g = _grad(lambda x: ref.gate(x, idx, **kw).weights, logits, gw)
        ref64 = _grad(lambda x: ref.gate(x, idx, **kw).weights, logits.double(), gw)
        assert_fa_close(out_g, ref_g, ref64, f"grad logits ({sf}, normalize={norm})")


@pytest.mark.slow
@pytest.mark.parametrize(
    "device,backend,case",
    case_params([(8200, 8, 8, 16), (5000, 1, 1, 128)], ids=lambda c: "T{}E{}K{}a{}".format(*c)),
)
def test_gate_many_programs(device, backend, case):
    """Enough slots for a Triton grid of more than 64 programs (more than one block of the
    chunk scan), and a single expert with multi-program planning."""
    T, E, K, align = case
    logits = make_logits(T, E, device=device, seed=20)
    idx = make_indices(T, E, K, device=device, seed=21, empty=0.05 if K > 1 else 0.0)
    plan = check_gate(logits, idx, backend, align=align, score_func="sigmoid")
    check_plan_structure(plan, idx, E, align)


# Values outside [0, E) with validate=False: E, E+3, int16's largest, a negative other than
# -1, and an int64 that an int32 narrowing would turn into expert 3.
OUT_OF_RANGE = [("E", torch.int32), ("E+3", torch.int32), (32767, torch.int16), (-5, torch.int32),
                (2**32 + 3, torch.int64)]


@pytest.mark.parametrize(
    "device,backend,case",
    case_params([(37, 7, 3), (1100, 16, 4)], ids=lambda c: "T{}E{}K{}".format(*c)),
)
def test_out_of_range_without_validation_is_an_empty_slot(device, backend, case):
    """validate=False skips the index checks; every backend then treats a value outside
    [0, E) as an empty slot (weight 0, expert_indices -1, row_id_map -1, no row, not
    counted), on the single-program and the multi-program plan paths alike, and tests the
    range on the full-width value."""
    T, E, K = case
    logits = make_logits(T, E, device=device, seed=5)
    for bad, dtype in OUT_OF_RANGE:
        value = {"E": E, "E+3": E + 3}.get(bad, bad)
        idx = make_indices(T, E, K, dtype=torch.int64, seed=6)
        idx[1, 0] = value
        idx[T - 2, K - 1] = value
        idx[T // 2] = value
        cleaned = torch.where((idx >= 0) & (idx < E), idx, -1)
        out = replay_ops.gate(logits, idx.to(dtype).to(device), validate=False, backend=backend,
                              align=4)
        want = ref.gate(logits, cleaned.to(device), align=4)
        assert_plan_ints_equal(out, want)
        assert (out.weights[cleaned.to(device) < 0] == 0).all(), bad
        check_plan_structure(out, cleaned, E, 4)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dev_backend", backend_params())
def test_softmax_of_infinite_logits(dev_backend, normalize):
    """Softmax weights where the max is not finite, every backend against the oracle (NaN
    where it has NaN), gate and gate_dense, forward and backward.

    Over the selection (normalize=True) the weights are torch.softmax's except that a
    selection of -inf logits gets weights 0 and zero gradients (torch.softmax gives NaN); a
    +inf or a NaN makes the row NaN. Over all E (normalize=False) they are torch.softmax's:
    NaN for a row of -inf logits or with a +inf. A -inf among finite logits gets weight 0
    and gradient 0 either way."""
    device, backend = dev_backend
    ninf, inf, nan = float("-inf"), float("inf"), float("nan")
    logits = torch.tensor([[ninf, ninf, 1.0, 2.0],     # the selection all -inf
                           [ninf, ninf, ninf, ninf],   # the whole row -inf
                           [inf, 0.0, 1.0, 2.0],       # one +inf
                           [100.0, inf, 1.0, 2.0],     # +inf, and exp(100) overflows fp32
                           [ninf, 0.0, 1.0, 2.0],      # one -inf among finite ones
                           [ninf, 3.0, ninf, 2.0],     # -inf and an empty slot
                           [0.5, 3.0, -1.0, 2.0],      # finite
                           [nan, 0.0, 1.0, 2.0]],      # a NaN: its row is NaN, not renormalised
                          device=device)
    idx = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1], [0, 1], [0, -1], [3, 1], [0, 1]],
                       device=device)
    g = torch.linspace(-1.5, 2.0, idx.numel(), device=device).view(idx.shape)
    x = logits.clone().requires_grad_(True)
    w = replay_ops.gate(x, idx, normalize=normalize, validate=False, backend=backend).weights
    (gx,) = torch.autograd.grad(w, x, g)
    # the oracle in fp32 as well: exp(100) overflows there, not in fp64
    xr = logits.clone().requires_grad_(True)
    want = ref.gate(xr, idx, normalize=normalize, validate=False).weights
    (gwant,) = torch.autograd.grad(want, xr, g)
    if normalize:  # the case the rule is about
        assert want[0].eq(0).all() and gwant[0].eq(0).all() and want[2:4].isnan().all()
    else:
        assert want[1:4].isnan().all() and want[0].eq(0).all()
    assert want[4, 0] == 0 and gwant[4, 0] == 0
    assert want[7].isnan().all()  # a sum that is NaN stays NaN (not replaced by 1)
    torch.testing.assert_close(w, want, equal_nan=True)
    torch.testing.assert_close(gx, gwant, equal_nan=True)
    xd = logits.clone().requires_grad_(True)
    d = replay_ops.gate_dense(xd, idx, normalize=normalize, validate=False, backend=backend)
    gd = torch.linspace(-1.0, 1.0, d.probs.numel(), device=device).view(d.probs.shape)
    (gxd,) = torch.autograd.grad(d.probs, xd, gd)
    xr = logits.clone().requires_grad_(True)
    dwant = ref.gate_dense(xr, idx, normalize=normalize)
    (gdwant,) = torch.autograd.grad(dwant.probs, xr, gd)
    torch.testing.assert_close(d.probs, dwant.probs, equal_nan=True)
    torch.testing.assert_close(gxd, gdwant, equal_nan=True)
