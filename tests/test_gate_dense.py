"""replay_ops.gate_dense (Megatron-Core's dense probs and routing map written by the gate
kernel, with per-row flags, the padding modes, the underflow guard and the plan) and
permute with probs: parity with the reference on every backend, exact integer outputs,
gradients, determinism, registration, and the error messages."""
from __future__ import annotations

import pytest
import torch

import replay_ops
from replay_ops import reference as ref
from replay_ops.options import DENSE_FIELDS, GateOptions, Selection
from replay_ops.plan import (
    ROW_EMPTY_SLOT,
    ROW_MASKED,
    ROW_OUT_OF_RANGE,
    ROW_REPEAT,
    describe_row_flags,
)

from _helpers import (
    SCORE_FUNCS,
    assert_fa_close,
    assert_int_equal,
    backend_params,
    case_params,
    check_plan_structure,
    is_interpreted,
    make_indices,
    make_logits,
    strided_indices,
)

BACKENDS = backend_params()

# (T, E, K): zero-sized, T=1, K=E, odd sizes, more than one program of the plan kernels.
SHAPES = [(0, 7, 2), (1, 1, 1), (1, 7, 7), (13, 64, 1), (37, 64, 2), (5, 256, 2),
          (301, 256, 8), (300, 7, 2), (1031, 64, 8)]
SHAPES_INTERP = [(0, 7, 2), (1, 1, 1), (7, 7, 7), (37, 64, 2), (5, 256, 2), (300, 7, 2),
                 (1031, 64, 8)]
MODES = [(sf, norm) for sf in SCORE_FUNCS for norm in (False, True)]


def _shape_id(s):
    return "T{}E{}K{}".format(*s)


def messy_indices(T, E, K, *, device="cpu", seed=1, dtype=torch.int64):
    """Real routes, with rows that need filling: a -1 row, a -1 slot, a repeated expert,
    an id outside [-1, E), and zero-filled rows (all expert 0)."""
    idx = make_indices(T, E, K, dtype=torch.int64, seed=seed)
    if T >= 6 and K >= 2:
        idx[0] = -1
        idx[1, 1] = -1
        idx[2, 1] = idx[2, 0]
        idx[3, 0] = E + 2
        idx[4, K - 1] = -7
        idx[5] = 0
    return idx.to(dtype).to(device)


def masked_rows(T, device, seed=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(T, generator=g) > 0.3).to(device)


def check_dense(logits, idx, backend, *, validate=False, **kw):
    """Run gate_dense and compare every output with the reference: probs by the FA rule,
    routing map, flags, indices and plan exactly."""
    out = replay_ops.gate_dense(logits, idx, backend=backend, validate=validate, **kw)
    want = ref.gate_dense(logits, idx, **kw)
    kw64 = dict(kw)
    want64 = ref.gate_dense(logits.detach().double(), idx, **kw64)
    assert isinstance(out, replay_ops.DenseRouting)
    assert_fa_close(out.probs, want.probs, want64.probs, "probs")
    assert_int_equal(out.routing_map, want.routing_map, "routing_map")
    assert_int_equal(out.row_flags, want.row_flags, "row_flags")
    assert_int_equal(out.expert_indices, want.expert_indices, "expert_indices")
    for f in ("tokens_per_expert", "expert_offsets", "row_id_map", "sorted_slots"):
        assert_int_equal(getattr(out.plan, f), getattr(want.plan, f), f)
    assert out.plan.weights is None
    for t in out[:4]:
        assert t.device == logits.device
    return out


# ------------------------------------------------------------------- forward parity
@pytest.mark.parametrize("device,backend,shape", case_params(SHAPES, SHAPES_INTERP,
                                                             ids=_shape_id))
def test_dense_parity_shapes(device, backend, shape):
    T, E, K = shape
    logits = make_logits(T, E, device=device)
    idx = messy_indices(T, E, K, device=device)
    out = check_dense(logits, idx, backend, padding="spread")
    used = out.expert_indices
    check_plan_structure(out.plan._replace(weights=torch.empty(T, K)), used, E, 1)
    # every row routes K distinct experts (spread fills the padding rows)
    assert int(out.routing_map.sum()) == T * K
    assert (out.routing_map.sum(dim=1) == K).all()


@pytest.mark.parametrize("device,backend,mode", case_params(
    [(sf, n, p) for sf, n in MODES for p in ("empty", "spread", "fallback")],
    [(sf, n, p) for sf, n in MODES for p in ("empty", "spread") if (sf == "softmax") == n]
    + [("sigmoid", True, "fallback")],
    ids=lambda m: f"{m[0]}-norm{int(m[1])}-{m[2]}"))
def test_dense_parity_modes_and_padding(device, backend, mode):
    sf, norm, padding = mode
    T, E, K = 40, 32, 4
    logits = make_logits(T, E, device=device, seed=3)
    idx = messy_indices(T, E, K, device=device)
    fb = make_indices(T, E, K, device=device, seed=9)
    for mask in (None, masked_rows(T, device)):
        check_dense(logits, idx, backend, score_func=sf, normalize=norm, scaling_factor=2.5,
                    padding=padding, fallback=fb, replay_mask=mask, ep_size=4,
                    spread_offset=12, align=4)


@pytest.mark.parametrize("device,backend,dtype", case_params(
    [torch.float32, torch.bfloat16, torch.float16, torch.float64],
    [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:]))
def test_dense_dtypes_and_index_dtypes(device, backend, dtype):
    T, E, K = 33, 64, 6
    logits = make_logits(T, E, dtype=dtype, device=device)
    for itype in (torch.int16, torch.int32, torch.int64):
        idx = messy_indices(T, E, K, device=device, dtype=itype)
        out = check_dense(logits, idx, backend, padding="spread", score_func="sigmoid")
        assert out.probs.dtype == dtype
    # a strided [T, L, K] recording column
    _, view = strided_indices(T, E, K, dtype=torch.int16, device=device, empty=0.2)
    check_dense(logits, view, backend, padding="empty")


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_row_flags_bits(dev_backend):
    device, backend = dev_backend
    E = 8
    idx = torch.tensor([[0, 1, 2], [-1, 1, 2], [3, 3, 4], [9, 1, 2], [-1, 5, 5], [-3, 8, 0],
                        [7, 6, 5], [0, 0, 0]], device=device)
    mask = torch.tensor([True] * 6 + [False, True], device=device)
    out = replay_ops.gate_dense(make_logits(8, E, device=device), idx, replay_mask=mask,
                                validate=False, backend=backend)
    want = [0, ROW_EMPTY_SLOT, ROW_REPEAT, ROW_OUT_OF_RANGE, ROW_EMPTY_SLOT | ROW_REPEAT,
            ROW_OUT_OF_RANGE, ROW_MASKED, ROW_REPEAT]
    assert out.row_flags.dtype == torch.uint8
    assert out.row_flags.cpu().tolist() == want
    assert describe_row_flags(5) == "a -1 slot, a repeated expert"
    # padding="empty": a repeated expert's weights add up; a masked row routes nothing
    assert out.routing_map[2].sum() == 2 and out.routing_map[6].sum() == 0
    assert out.expert_indices[3].tolist() == [-1, 1, 2]


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_row_flags_repeats_apart_and_ids_at_the_range_ends(dev_backend):
    """A repeated expert is flagged wherever its slots sit in the row (not only in adjacent
    slots), and ids just outside [-1, E) (E itself, -2) are out of range. Flags derived by
    hand from the definitions; with padding="spread" every flagged row routes K distinct
    experts."""
    device, backend = dev_backend
    E = 8
    idx = torch.tensor([[3, 4, 3], [5, -1, 5], [2, 1, 6], [0, 8, 2], [-2, 1, 2],
                        [7, 0, 1]], device=device)
    want = [ROW_REPEAT, ROW_EMPTY_SLOT | ROW_REPEAT, 0, ROW_OUT_OF_RANGE, ROW_OUT_OF_RANGE, 0]
    logits = make_logits(len(want), E, device=device)
    for padding in ("empty", "spread"):
        out = replay_ops.gate_dense(logits, idx, padding=padding, validate=False,
                                    backend=backend)
        assert out.row_flags.cpu().tolist() == want, padding
        if padding == "spread":
            assert (out.routing_map.sum(dim=1) == 3).all()
        else:  # a repeated expert's weights add up; out-of-range ids route nothing
            assert out.routing_map.sum(dim=1).cpu().tolist() == [2, 1, 3, 2, 2, 3]
        check_dense(logits, idx, backend, padding=padding)


def test_spread_rows_are_distinct_and_balanced():
    """Every spread row has K distinct experts on distinct EP ranks; a run of padding rows
    covers the experts evenly; periodic padding rows (one per packed sequence) do not pile
    onto the same experts."""
    E, K, ep = 128, 8, 8
    local = E // ep
    rows = [[ref.spread_expert(t, k, K, E, ep, 0) for k in range(K)] for t in range(256)]
    for r in rows:
        assert len(set(r)) == K
        assert len({e // local for e in r}) == K  # K <= ep: one slot per rank
    counts = torch.bincount(torch.tensor(rows).flatten(), minlength=E)
    assert counts.max() - counts.min() == 0  # 256 rows * 8 = 16 full cycles of 128 experts
    # one padding row every 1024 tokens (t*K is a multiple of E at every one of them)
    periodic = [ref.spread_expert(t, 0, K, E, ep, 0) for t in range(1023, 1024 * 64, 1024)]
    assert len(set(periodic)) > 32, periodic
    # the torch backend computes the same formula for every row at once
    from replay_ops.backends.torch import spread_rows

    got = spread_rows(300, 40, 3, 4, 17, "cpu")
    want = [[ref.spread_expert(t, k, 3, 40, 4, 17) for k in range(3)] for t in range(300)]
    assert got.tolist() == want


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_underflow_guard(dev_backend):
    """A routed probability that rounds to 0 becomes the dtype's smallest normal value; its
    gradient is the unguarded one (here 0 in fp16, exactly as without the guard)."""
    device, backend = dev_backend
    E = 8
    logits = torch.zeros(4, E, dtype=torch.float16, device=device)
    logits[:, 7] = -30.0
    idx = torch.tensor([[0, 7]] * 4, device=device)
    g0 = None  # the gradient without the guard (the first pass)
    for guard in (False, True):
        lg = logits.clone().requires_grad_(True)
        out = replay_ops.gate_dense(lg, idx, normalize=False, underflow_guard=guard,
                                    validate=False, backend=backend)
        want = torch.finfo(torch.float16).tiny if guard else 0.0
        assert (out.probs[:, 7] == want).all()
        assert out.routing_map[:, 7].all()
        out.probs.sum().backward()
        if guard:
            assert torch.equal(lg.grad, g0)
        g0 = lg.grad.clone()


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_without_plan(dev_backend):
    device, backend = dev_backend
    T, E, K = 21, 16, 3
    logits = make_logits(T, E, device=device)
    idx = messy_indices(T, E, K, device=device)
    a = replay_ops.gate_dense(logits, idx, padding="spread", with_plan=False, validate=False,
                              backend=backend)
    b = replay_ops.gate_dense(logits, idx, padding="spread", validate=False, backend=backend)
    assert a.plan is None
    for x, y in zip(a[:4], b[:4]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("with_plan", [True, False])
@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_zero_tokens(dev_backend, with_plan):
    """T = 0 (an empty micro-batch on a rank): empty outputs, the plan of no slots (its
    align padding included), and an empty gradient from a [0, E] gradient that is not an
    expanded scalar (a [0, E] tensor has no data to point at)."""
    device, backend = dev_backend
    E, K, align = 8, 2, 4
    logits = torch.zeros(0, E, device=device, requires_grad=True)
    idx = torch.zeros(0, K, dtype=torch.int64, device=device)
    out = replay_ops.gate_dense(logits, idx, padding="spread", align=align, with_plan=with_plan,
                                backend=backend)
    want = ref.gate_dense(logits.detach(), idx, padding="spread", align=align)
    assert out.probs.shape == (0, E) and out.routing_map.shape == (0, E)
    assert out.row_flags.shape == (0,) and out.expert_indices.shape == (0, K)
    if with_plan:
        for name in ("tokens_per_expert", "expert_offsets", "sorted_slots"):
            assert_int_equal(getattr(out.plan, name), getattr(want.plan, name), name)
    else:
        assert out.plan is None
    (grad,) = torch.autograd.grad(out.probs, logits, torch.zeros(0, E, device=device))
    assert grad.shape == (0, E)


# ------------------------------------------------------------------------ gradients
@pytest.mark.parametrize("device,backend,mode", case_params(
    MODES, [("softmax", False), ("sigmoid", True), ("sqrtsoftplus", False)],
    ids=lambda m: f"{m[0]}-norm{int(m[1])}"))
def test_dense_backward_parity(device, backend, mode):
    sf, norm = mode
    T, E, K = 37, 16, 4
    for dtype in (torch.float32, torch.bfloat16):
        logits0 = make_logits(T, E, dtype=dtype, device=device, seed=5)
        idx = messy_indices(T, E, K, device=device)
        g = torch.randn(T, E, generator=torch.Generator().manual_seed(6)).to(dtype).to(device)
        kw = dict(score_func=sf, normalize=norm, scaling_factor=1.5, padding="empty")
        outs = []
        for fn in (lambda x: replay_ops.gate_dense(x, idx, backend=backend, validate=False,
                                                   **kw).probs,
                   lambda x: ref.gate_dense(x, idx, **kw).probs,
                   lambda x: ref.gate_dense(x.double(), idx, **kw).probs):
            lg = logits0.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(fn(lg), lg, g.to(fn(lg).dtype))
            outs.append(grad)
        assert_fa_close(outs[0], outs[1], outs[2], f"grad logits {dtype}")
        # a transposed (non-contiguous) and an expanded gradient are read in place
        lg = logits0.clone().requires_grad_(True)
        p = replay_ops.gate_dense(lg, idx, backend=backend, validate=False, **kw).probs
        (gt,) = torch.autograd.grad(p, lg, g.t().contiguous().t(), retain_graph=True)
        assert torch.equal(gt, outs[0])
        (ge,) = torch.autograd.grad(p.sum(), lg)
        lg2 = logits0.clone().requires_grad_(True)
        p2 = replay_ops.gate_dense(lg2, idx, backend=backend, validate=False, **kw).probs
        (ge2,) = torch.autograd.grad(p2, lg2, torch.ones_like(p2))
        assert torch.equal(ge, ge2)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_dense_gradcheck(dev_backend):
    device, backend = dev_backend
    T, E, K = (4, 5, 2) if is_interpreted(device, backend) else (6, 7, 3)
    idx = messy_indices(T, E, K, device=device) if T >= 6 else make_indices(T, E, K,
                                                                            device=device)
    modes = MODES if not is_interpreted(device, backend) else [("softmax", False),
                                                               ("sigmoid", True)]
    for sf, norm in modes:
        lg = make_logits(T, E, dtype=torch.float64, device=device).requires_grad_(True)
        torch.autograd.gradcheck(
            lambda x: replay_ops.gate_dense(x, idx, score_func=sf, normalize=norm,
                                            scaling_factor=1.5, padding="spread",
                                            validate=False, backend=backend).probs, (lg,))


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_dense_bitwise_deterministic(dev_backend):
    device, backend = dev_backend
    T, E, K = (300, 64, 4) if not is_interpreted(device, backend) else (40, 16, 4)
    logits = make_logits(T, E, dtype=torch.bfloat16, device=device).requires_grad_(True)
    idx = messy_indices(T, E, K, device=device)
    runs = []
    for _ in range(2):
        out = replay_ops.gate_dense(logits, idx, padding="spread", align=8, validate=False,
                                    backend=backend)
        (g,) = torch.autograd.grad(out.probs, logits, torch.ones_like(out.probs))
        runs.append((*out[:4], *out.plan[1:6], g))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_integer_outputs_get_no_zero_gradients():
    """The integer outputs of the gates get no materialised zero gradient in backward."""
    from launch_counter import LaunchCounter  # bench/ (pytest pythonpath)

    lg = make_logits(12, 8).requires_grad_(True)
    idx = make_indices(12, 8, 2)
    for fn in (lambda: replay_ops.gate(lg, idx, validate=False).weights,
               lambda: replay_ops.gate_dense(lg, idx, validate=False, backend="native").probs):
        out = fn()
        go = torch.ones_like(out)
        with LaunchCounter() as c:
            torch.autograd.grad(out, lg, go)
        assert c.launches == 1, c.summary()  # the gate backward kernel alone


# ------------------------------------------------------------------ validate, errors
@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_validate_errors_and_one_host_read(dev_backend):
    from _helpers import HostSyncCounter

    device, backend = dev_backend
    T, E, K = 10, 8, 2
    logits = make_logits(T, E, device=device)
    idx = make_indices(T, E, K, device=device)
    idx[4] = -1
    with HostSyncCounter() as c:
        replay_ops.gate_dense(logits, idx, backend=backend)
    assert c.count == 1, c.events
    with HostSyncCounter() as c:
        replay_ops.gate_dense(logits, idx, validate=False, backend=backend)
    assert c.count == 0, c.events
    bad = idx.clone()
    bad[3, 1] = E
    with pytest.raises(ValueError, match=r"expert_indices\[3, 1\] = 8 is out of range"):
        replay_ops.gate_dense(logits, bad, padding="spread", backend=backend)
    rep = idx.clone()
    rep[6] = torch.tensor([2, 2])
    with pytest.raises(ValueError, match=r"row 6 repeats expert 2"):
        replay_ops.gate_dense(logits, rep, backend=backend)
    replay_ops.gate_dense(logits, rep, padding="spread", backend=backend)  # filled, no error


def test_bad_options():
    logits, idx = make_logits(4, 8), make_indices(4, 8, 2)
    with pytest.raises(ValueError, match="unknown padding='zero'"):
        replay_ops.gate_dense(logits, idx, padding="zero")
    with pytest.raises(ValueError, match="ep_size=3 must be a positive integer dividing"):
        replay_ops.gate_dense(logits, idx, padding="spread", ep_size=3)
    with pytest.raises(ValueError, match="padding='fallback' needs the fallback"):
        replay_ops.gate_dense(logits, idx, padding="fallback")
    with pytest.raises(ValueError, match="fallback must be an int16/int32/int64 tensor"):
        replay_ops.gate_dense(logits, idx, fallback=idx[:, :1])
    with pytest.raises(ValueError, match="spread_offset must be an integer >= 0"):
        replay_ops.gate_dense(logits, idx, spread_offset=-1)


# ------------------------------------------------------------- permute with probs
@pytest.mark.parametrize("device,backend,shape", case_params(
    [(0, 7, 2), (1, 4, 1), (37, 16, 3), (301, 64, 8)], [(0, 7, 2), (37, 16, 3)],
    ids=_shape_id))
def test_permute_probs_parity_and_gradient(device, backend, shape):
    T, E, K = shape
    H = 5
    logits = make_logits(T, E, device=device)
    idx = messy_indices(T, E, K, device=device)
    dense = replay_ops.gate_dense(logits, idx, padding="empty", align=4, validate=False,
                                  backend=backend)
    plan = dense.plan
    probs0 = dense.probs.detach()
    hidden0 = torch.randn(T, H, device=device)
    for n in (plan.num_rows(), plan.max_rows + 2):
        probs = probs0.clone().requires_grad_(True)
        hidden = hidden0.clone().requires_grad_(True)
        x, px = replay_ops.permute(hidden, plan, n, probs=probs, backend=backend)
        assert torch.equal(x, ref.permute(hidden0, plan._replace(weights=None), n))
        assert torch.equal(px, ref.permute_probs(probs0, plan, n))
        gx = torch.randn(n, H, device=device)
        gp = torch.randn(n, device=device)
        dh, dp = torch.autograd.grad((x, px), (hidden, probs), (gx, gp))
        probs_r = probs0.clone().requires_grad_(True)
        (dp_ref,) = torch.autograd.grad(ref.permute_probs(probs_r, plan, n), probs_r, gp)
        assert torch.equal(dp, dp_ref)
        (dh_only,) = torch.autograd.grad(
            replay_ops.permute(hidden, plan, n, backend=backend), hidden, gx)
        assert torch.equal(dh, dh_only)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_permute_probs_gradcheck_and_opcheck(dev_backend):
    device, backend = dev_backend
    T, E, K = 6, 5, 2
    idx = messy_indices(T, E, K, device=device)
    dense = replay_ops.gate_dense(make_logits(T, E, device=device), idx, align=2,
                                  validate=False, backend=backend)
    plan = dense.plan
    hidden = torch.randn(T, 3, dtype=torch.float64, device=device, requires_grad=True)
    probs = dense.probs.detach().double().requires_grad_(True)
    torch.autograd.gradcheck(
        lambda h, p: replay_ops.permute(h, plan, plan.max_rows, probs=p, backend=backend),
        (hidden, probs))
    torch.library.opcheck(torch.ops.replay.permute_probs.default,
                          (hidden, probs, plan.sorted_slots, plan.row_id_map,
                           plan.expert_indices, plan.max_rows, backend))
    torch.library.opcheck(torch.ops.replay.permute_probs_backward.default,
                          (torch.randn(plan.max_rows, dtype=torch.float64, device=device),
                           plan.row_id_map, plan.expert_indices, E, backend))
    with pytest.raises(ValueError, match=r"probs must be a float \[T, E\] tensor with T=6"):
        replay_ops.permute(hidden, plan, plan.max_rows, probs=probs[:3], backend=backend)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_opcheck_gate_dense(dev_backend):
    device, backend = dev_backend
    T, E, K = 7, 6, 3
    logits = make_logits(T, E, device=device).requires_grad_(True)
    idx = messy_indices(T, E, K, device=device, dtype=torch.int16)
    mask = masked_rows(T, device)
    fb = make_indices(T, E, K, device=device, seed=4)
    variants = [(None, None, "spread", True), (mask, fb, "fallback", True),
                (mask, None, "empty", False)]
    if is_interpreted(device, backend):
        variants = variants[:1]
    for m, f, padding, with_plan in variants:
        opts = GateOptions(score_func="softmax", normalize=True, scaling_factor=1.5,
                           padding=padding, ep_size=2, spread_offset=3, underflow_guard=True,
                           align=4, with_plan=with_plan)
        torch.library.opcheck(torch.ops.replay.gate_dense.default,
                              (logits, idx, m, f, *opts.flat(DENSE_FIELDS), False, backend))
    # the model's own selection of the padding rows (bias, groups), the agreement outputs
    sel = Selection(expert_bias=torch.linspace(-0.2, 0.2, E, device=device), num_groups=3,
                    group_topk=2)
    opts = GateOptions(score_func="sigmoid", padding="select", selection=sel,
                       return_agreement=True)
    torch.library.opcheck(torch.ops.replay.gate_dense.default,
                          (logits, idx, mask, None, *opts.flat(DENSE_FIELDS), False, backend))
    for glp in (None, torch.randn(T, device=device)):
        torch.library.opcheck(torch.ops.replay.gate_dense_backward.default,
                              (torch.randn(T, E, device=device), logits.detach(),
                               make_indices(T, E, K, device=device), "sigmoid", True, 2.0, glp,
                               backend))


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_compile_fullgraph_dense_step(dev_backend):
    """gate_dense -> permute(probs) -> expert -> unpermute(weights=None), compiled in one
    graph (static rows, validate=False), forward and backward equal to eager."""
    device, backend = dev_backend
    torch._dynamo.reset()
    T, E, K, H = 11, 8, 2, 6

    def step(logits, idx, hidden):
        d = replay_ops.gate_dense(logits, idx, padding="spread", underflow_guard=True,
                                  validate=False, backend=backend)
        x, p = replay_ops.permute(hidden, d.plan, T * K, probs=d.probs, validate=False,
                                  backend=backend)
        y = torch.tanh(x) * p[:, None]
        return replay_ops.unpermute(y, d.plan, validate=False, backend=backend), d.routing_map

    idx = messy_indices(T, E, K, device=device)
    logits0 = make_logits(T, E, device=device)
    hidden0 = torch.randn(T, H, device=device)
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")
    res = []
    for fn in (step, compiled):
        lg = logits0.clone().requires_grad_(True)
        h = hidden0.clone().requires_grad_(True)
        out, rmap = fn(lg, idx, h)
        out.backward(torch.ones_like(out))
        res.append((out.detach(), rmap, lg.grad, h.grad))
    for a, b in zip(*res):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


# -------------------------------------------------------------- unpermute unweighted
@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_unpermute_without_weights(dev_backend):
    """weights=None is the plain sum; its backward runs no weight-gradient kernel and
    equals the weighted one with unit weights."""
    device, backend = dev_backend
    T, E, K, H = 13, 8, 3, 4
    plan = replay_ops.gate(make_logits(T, E, device=device),
                           make_indices(T, E, K, device=device, empty=0.2), align=4,
                           backend=backend)
    x0 = torch.randn(plan.max_rows, H, device=device)
    ones = plan._replace(weights=torch.ones_like(plan.weights))
    outs = []
    for p in (plan._replace(weights=None), ones):
        x = x0.clone().requires_grad_(True)
        y = replay_ops.unpermute(x, p, backend=backend)
        (gx,) = torch.autograd.grad(y, x, torch.arange(T * H, dtype=y.dtype,
                                                        device=device).view(T, H))
        outs.append((y, gx))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    torch.library.opcheck(torch.ops.replay.unpermute.default,
                          (x0.clone().requires_grad_(True), plan.row_id_map, plan.sorted_slots,
                           None, backend))


# ------------------------------------------------------------------ Triton specifics
def _triton_dense():
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    pytest.importorskip("triton")
    from replay_ops.triton_kernels import gate_dense as D

    return D


def test_triton_dense_config_and_launches(monkeypatch):
    """Block sizes are pinned; one launch for a small call or without the plan, three (the
    dense rows with chunk ranks, gate.py's scan and scatter) for a chunked plan."""
    D = _triton_dense()
    cfg = D.gate_dense_config(4096, 8, 128, 1)
    assert not cfg.plan.single and cfg.plan == D.gate_config(4096, 8, 128, 1)
    assert cfg.ROW_BLOCK == min(cfg.plan.BLOCK_T, D.SLOT_TILE_ELEMS // 8)
    assert D.gate_dense_config(10, 2, 8, 1).plan.single
    big = D.gate_dense_config(1000, 512, 256, 1)
    assert big.ROW_BLOCK == min(big.plan.BLOCK_T, D.SLOT_TILE_ELEMS // 256)
    log = []
    from replay_ops.triton_kernels import gate as G

    for mod, name in ((D, "_gate_dense_fwd_kernel"), (G, "_plan_scan_kernel"),
                      (G, "_plan_scatter_kernel")):
        fn = getattr(mod, name)

        class Counting:
            def __init__(self, fn, name):
                self.fn, self.name = fn, name

            def __getitem__(self, grid):
                log.append(self.name)
                return self.fn[grid]

        monkeypatch.setattr(mod, name, Counting(fn, name))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    T, E, K = 700, 16, 8
    logits = make_logits(T, E, device=dev)
    idx = messy_indices(T, E, K, device=dev)
    for with_plan, want in ((False, 1), (True, 3)):
        log.clear()
        a = replay_ops.gate_dense(logits, idx, padding="spread", with_plan=with_plan,
                                  validate=False, backend="triton")
        assert len(log) == want, log
        b = replay_ops.gate_dense(logits, idx, padding="spread", with_plan=with_plan,
                                  validate=False, backend="torch")
        torch.testing.assert_close(a.probs, b.probs, rtol=1e-6, atol=1e-7)
        for x, y in zip(a[1:4], b[1:4]):
            assert torch.equal(x, y)
    log.clear()
    replay_ops.gate_dense(logits[:9], idx[:9], validate=False, backend="triton")
    assert log == ["_gate_dense_fwd_kernel"]
