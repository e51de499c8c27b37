"""replay_ops.unpermute: weighted combine per token (fp32 accumulation), padding rows
ignored, gradients w.r.t. expert_out and (through the weights) the logits."""
from __future__ import annotations

import pytest
import torch

import replay_ops
from replay_ops import reference as ref

from _helpers import (
    SCORE_FUNCS,
    assert_fa_close,
    backend_params,
    case_params,
    is_interpreted,
    make_indices,
    make_logits,
)

# (T, E, K, H, align)
CASES = [
    (0, 7, 2, 16, 1),
    (1, 1, 1, 1, 1),
    (1, 7, 7, 5, 16),
    (13, 7, 2, 33, 1),
    (29, 64, 3, 1, 128),
    (37, 64, 2, 300, 16),
    (301, 256, 8, 24, 1),
    (6, 5, 2, 0, 1),  # H = 0
]
CASES_INTERP = [(0, 7, 2, 16, 1), (1, 1, 1, 1, 1), (13, 7, 2, 33, 1), (29, 64, 3, 1, 128),
                (37, 64, 2, 300, 16), (6, 5, 2, 0, 1)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _id(c):
    return "T{}E{}K{}H{}a{}".format(*c)


def make_plan(T, E, K, align, device, backend, dtype=torch.float32, seed=0, empty=0.2,
              score_func="softmax", normalize=True, logits=None):
    if logits is None:
        logits = make_logits(T, E, dtype=dtype, device=device, seed=seed)
    idx = make_indices(T, E, K, device=device, seed=seed + 1, empty=empty if K > 1 else 0.0)
    plan = replay_ops.gate(logits, idx, align=align, score_func=score_func, normalize=normalize,
                           backend=backend)
    return plan


def combine_by_loops(expert_out, plan):
    """out[t] = sum_k w[t,k] * expert_out[row_id_map[t,k]] in fp64, element by element."""
    T, K = plan.row_id_map.shape
    x = expert_out.detach().cpu().double()
    w = plan.weights.detach().cpu().double()
    rid = plan.row_id_map.cpu().tolist()
    out = torch.zeros(T, expert_out.shape[1], dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            if rid[t][k] >= 0:
                out[t] += w[t, k] * x[rid[t][k]]
    return out


def _ref_pair(expert_out, plan):
    """(same-precision reference, fp64 reference)."""
    ref_same = ref.unpermute(expert_out, plan)
    plan64 = plan._replace(weights=plan.weights.double())
    return ref_same, ref.unpermute(expert_out.double(), plan64)


@pytest.mark.parametrize("device,backend,case", case_params(CASES, CASES_INTERP, ids=_id))
def test_unpermute_values(device, backend, case):
    T, E, K, H, align = case
    plan = make_plan(T, E, K, align, device, backend)
    R = plan.num_rows()
    expert_out = torch.randn(R, H, device=device)
    out = replay_ops.unpermute(expert_out, plan, backend=backend)
    assert out.shape == (T, H) and out.dtype == expert_out.dtype and out.device == expert_out.device
    ref_same, ref64 = _ref_pair(expert_out, plan)
    assert_fa_close(out, ref_same, ref64)
    # the fp64 reference itself agrees with the element loops
    assert torch.allclose(ref64.cpu(), combine_by_loops(expert_out, plan), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "device,backend,case",
    case_params(
        [(xd, wd) for xd in DTYPES for wd in (torch.float32, xd)],
        [(torch.bfloat16, torch.float32), (torch.float16, torch.float16),
         (torch.float64, torch.float64)],
        ids=lambda c: f"x{str(c[0])[6:]}-w{str(c[1])[6:]}",
    ),
)
def test_unpermute_dtypes(device, backend, case):
    """expert_out dtype x weights dtype (bf16 hidden with an fp32 router is the usual case)."""
    x_dtype, w_dtype = case
    T, E, K, H = (19, 7, 3, 40)
    plan = make_plan(T, E, K, 16, device, backend, dtype=w_dtype, empty=0.2)
    assert plan.weights.dtype == w_dtype
    expert_out = (torch.randn(plan.num_rows(), H, device=device) * 3).to(x_dtype)
    out = replay_ops.unpermute(expert_out, plan, backend=backend)
    assert out.dtype == x_dtype
    ref_same, ref64 = _ref_pair(expert_out, plan)
    assert_fa_close(out, ref_same, ref64)


@pytest.mark.parametrize("dev_backend", backend_params())
def test_unpermute_noncontiguous_expert_out(dev_backend):
    device, backend = dev_backend
    T, E, K, H = (15, 7, 2, 12)
    plan = make_plan(T, E, K, 1, device, backend)
    R = plan.num_rows()
    views = {
        "transposed": torch.randn(H, R, device=device).t(),
        "column-strided": torch.randn(R, 2 * H, device=device)[:, 1::2],
        "broadcast rows (stride 0)": torch.randn(1, H, device=device).expand(R, H),
    }
    for name, x in views.items():
        assert not x.is_contiguous()
        out = replay_ops.unpermute(x, plan, backend=backend)
        ref_same, ref64 = _ref_pair(x, plan)
        assert_fa_close(out, ref_same, ref64, name)


@pytest.mark.parametrize("dev_backend", backend_params())
def test_unpermute_accumulates_in_fp32(dev_backend):
    """bf16 inputs, fp32 accumulation: 1 + 2^-7.68 + 2^-7.68 rounds to 1.0078125 once,
    where a bf16 running sum would round twice and give 1.015625."""
    device, backend = dev_backend
    E, K = 3, 3
    logits = torch.zeros(1, E, dtype=torch.bfloat16, device=device)
    plan = replay_ops.gate(logits, torch.tensor([[0, 1, 2]], device=device),
                           score_func="sigmoid", normalize=False, scaling_factor=2.0,
                           backend=backend)
    assert plan.weights.tolist() == [[1.0, 1.0, 1.0]]  # 2 * sigmoid(0)
    x = torch.tensor([[1.0], [0.0048828125], [0.0048828125]], dtype=torch.bfloat16, device=device)
    out = replay_ops.unpermute(x, plan, backend=backend)
    assert out.item() == 1.0078125


@pytest.mark.parametrize("dev_backend", backend_params())
def test_unpermute_ignores_padding_rows(dev_backend):
    """Padding rows (an expert MLP with a bias makes them nonzero) and rows past
    expert_offsets[E] never reach the output."""
    device, backend = dev_backend
    T, E, K, H = (10, 5, 2, 6)
    plan = make_plan(T, E, K, 8, device, backend, empty=0.2)
    n = plan.max_rows
    x = torch.full((n, H), float("nan"), device=device)
    used = (plan.sorted_slots >= 0).nonzero().flatten()
    x[used] = torch.randn(used.numel(), H, device=device)
    out = replay_ops.unpermute(x, plan, backend=backend)
    assert not out.isnan().any()
    assert torch.allclose(out.cpu().double(), combine_by_loops(x.nan_to_num(), plan), atol=1e-6)


@pytest.mark.parametrize(
    "device,backend,sf", case_params(list(SCORE_FUNCS), ["softmax"], ids=str)
)
def test_permute_unpermute_roundtrip(device, backend, sf):
    """Identity experts: unpermute(permute(x)) = x * sum_k w[t, k]."""
    T, E, K, H = (21, 7, 3, 9)
    plan = make_plan(T, E, K, 16, device, backend, empty=0.2, score_func=sf)
    x = torch.randn(T, H, device=device)
    y = replay_ops.unpermute(replay_ops.permute(x, plan, backend=backend), plan, backend=backend)
    want = x.double() * plan.weights.double().sum(1, keepdim=True)
    assert torch.allclose(y.double(), want, rtol=1e-6, atol=1e-6)
    if sf == "softmax":
        full = (plan.expert_indices >= 0).any(1)
        assert torch.allclose(y[full], x[full], rtol=1e-6, atol=1e-6)
        assert (y[~full] == 0).all()


# ----------------------------------------------------------------------- backward
def _grads(fn, expert_out, logits, grad_out):
    x = expert_out.detach().clone().requires_grad_(True)
    lg = logits.detach().clone().requires_grad_(True)
    fn(x, lg).backward(grad_out)
    return x.grad, lg.grad


@pytest.mark.parametrize(
    "device,backend,case",
    case_params(
        [(sf, n, xd) for sf in SCORE_FUNCS for n in (False, True)
         for xd in (torch.float32, torch.bfloat16)],
        [("softmax", True, torch.float32), ("sigmoid", True, torch.bfloat16),
         ("sqrtsoftplus", False, torch.float32)],
        ids=lambda c: f"{c[0]}-norm{int(c[1])}-{str(c[2])[6:]}",
    ),
)
def test_unpermute_backward_parity(device, backend, case):
    """Gradients of expert_out and of the logits (through plan.weights) vs autograd through
    the reference gate + combine."""
    sf, norm, x_dtype = case
    T, E, K, H, align = (17, 7, 3, 10, 16)
    logits = make_logits(T, E, device=device, seed=21)
    idx = make_indices(T, E, K, device=device, empty=0.25)
    kw = dict(score_func=sf, normalize=norm, scaling_factor=1.5, align=align)
    n = replay_ops.gate(logits, idx, **kw, backend=backend).max_rows
    expert_out = torch.randn(n, H, device=device).to(x_dtype)
    grad_out = torch.randn(T, H, device=device).to(x_dtype)

    def op(x, lg):
        plan = replay_ops.gate(lg, idx, backend=backend, **kw)
        return replay_ops.unpermute(x, plan, backend=backend)

    def reference(x, lg):
        return ref.unpermute(x, ref.gate(lg, idx, **kw))

    out_gx, out_gl = _grads(op, expert_out, logits, grad_out)
    ref_gx, ref_gl = _grads(reference, expert_out, logits, grad_out)
    r64_gx, r64_gl = _grads(reference, expert_out.double(), logits.double(), grad_out.double())
    assert_fa_close(out_gx, ref_gx, r64_gx, "grad expert_out")
    assert_fa_close(out_gl, ref_gl, r64_gl, "grad logits")
    # rows that hold no slot get exactly zero gradient
    pad = replay_ops.gate(logits, idx, **kw, backend=backend).sorted_slots < 0
    assert (out_gx[pad] == 0).all()


@pytest.mark.parametrize(
    "device,backend,case",
    case_params(
        [(sf, n, a) for sf in SCORE_FUNCS for n in (False, True) for a in (1, 4)],
        [(sf, True, 4) for sf in SCORE_FUNCS] + [("softmax", False, 1)],
        ids=lambda c: f"{c[0]}-norm{int(c[1])}-align{c[2]}",
    ),
)
def test_unpermute_gradcheck(device, backend, case):
    """fp64 gradcheck of gate -> unpermute w.r.t. expert_out and the logits."""
    sf, norm, align = case
    T, E, K, H = (4, 5, 2, 3)
    idx = torch.tensor([[0, 3], [-1, 1], [2, 0], [-1, -1]], device=device)
    logits = make_logits(T, E, dtype=torch.float64, device=device, seed=22, scale=1.0)
    n = replay_ops.gate(logits, idx, align=align, backend=backend).max_rows
    x = torch.randn(n, H, dtype=torch.float64, device=device)

    def fn(x, lg):
        plan = replay_ops.gate(lg, idx, score_func=sf, normalize=norm, scaling_factor=0.7,
                               align=align, backend=backend)
        return replay_ops.unpermute(x, plan, backend=backend)

    inputs = (x.requires_grad_(True), logits.requires_grad_(True))
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=is_interpreted(device, backend))


@pytest.mark.parametrize("dev_backend", backend_params())
def test_permute_unpermute_chain_gradcheck(dev_backend):
    """hidden -> permute -> (rows * scale) -> unpermute, gradcheck through hidden and logits."""
    device, backend = dev_backend
    T, E, K, H = (4, 4, 2, 2)
    idx = torch.tensor([[0, 3], [1, -1], [3, 2], [-1, -1]], device=device)
    logits = make_logits(T, E, dtype=torch.float64, device=device, seed=23, scale=1.0)
    h = torch.randn(T, H, dtype=torch.float64, device=device)
    scale = torch.randn(1, H, dtype=torch.float64, device=device)

    def fn(h, lg):
        plan = replay_ops.gate(lg, idx, align=2, backend=backend)
        y = replay_ops.permute(h, plan, plan.max_rows, backend=backend)
        return replay_ops.unpermute(torch.tanh(y * scale), plan, backend=backend)

    assert torch.autograd.gradcheck(
        fn, (h.requires_grad_(True), logits.requires_grad_(True)),
        fast_mode=is_interpreted(device, backend),
    )


@pytest.mark.parametrize("dev_backend", backend_params())
def test_unpermute_backward_rows_past_the_plan(dev_backend):
    """expert_out with more rows than sorted_slots (a static size above max_rows) and H wider
    than one block: the extra rows get exactly zero gradient; the rest match the reference."""
    device, backend = dev_backend
    T, E, K, H = (9, 5, 2, 300)
    plan = make_plan(T, E, K, 4, device, backend, empty=0.2)
    n = plan.max_rows + 3
    g = torch.Generator().manual_seed(24)
    expert_out = torch.randn(n, H, generator=g).to(device)
    grad_out = torch.randn(T, H, generator=g).to(device)
    logits = make_logits(T, E, device=device)

    def op(x, lg):
        return replay_ops.unpermute(x, plan._replace(weights=lg[:, :K] * 1.0), backend=backend)

    def reference(x, lg):
        return ref.unpermute(x, plan._replace(weights=lg[:, :K] * 1.0))

    out_gx, _ = _grads(op, expert_out, logits, grad_out)
    ref_gx, _ = _grads(reference, expert_out, logits, grad_out)
    r64_gx, _ = _grads(reference, expert_out.double(), logits.double(), grad_out.double())
    assert_fa_close(out_gx, ref_gx, r64_gx, "grad expert_out")
    assert (out_gx[plan.max_rows:] == 0).all()
    assert (out_gx[:plan.max_rows][plan.sorted_slots < 0] == 0).all()


@pytest.mark.parametrize("device,backend,H", case_params([300, 4096], [300], ids=lambda h: f"H{h}"))
def test_unpermute_grad_weights_accuracy_wide_hidden(device, backend, H):
    """grad_weights[t, k] = <grad_out[t], expert_out[row]> is a reduction over H (hidden sizes
    are thousands wide). Held to the flash-attention rule against PyTorch's fp32 reduction:
    a plain left-to-right fp32 sum over H loses about sqrt(H) more bits than that."""
    T, E, K = (24, 8, 2)
    logits = make_logits(T, E, device=device, seed=25)
    plan = replay_ops.gate(logits, make_indices(T, E, K, device=device), backend=backend)
    g = torch.Generator().manual_seed(26)
    x = torch.randn(plan.num_rows(), H, generator=g).to(device)
    gy = torch.randn(T, H, generator=g).to(device)
    w = plan.weights.detach()

    def grad_w(fn, x, w, gy):
        w = w.clone().requires_grad_(True)
        fn(x, plan._replace(weights=w)).backward(gy)
        return w.grad

    out_gw = grad_w(lambda x, p: replay_ops.unpermute(x, p, backend=backend), x, w, gy)
    ref_gw = grad_w(ref.unpermute, x, w, gy)
    r64_gw = grad_w(ref.unpermute, x.double(), w.double(), gy.double())
    assert_fa_close(out_gw, ref_gw, r64_gw, "grad weights")


@pytest.mark.parametrize("dev_backend", backend_params())
def test_unpermute_backward_weight_grad_of_empty_slots_is_zero(dev_backend):
    """The weights gradient of an empty slot (row_id_map -1, or a row past expert_out's end)
    is exactly 0: the slot read no row. (Through the gate this never shows, since the gate
    backward ignores empty slots; a caller that differentiates the weights directly sees it.)
    The other slots get <grad_out[t], expert_out[row]>, computed here by a loop."""
    device, backend = dev_backend
    T, E, K, H = 5, 4, 3, 6
    idx = torch.tensor([[0, -1, 2], [1, 3, -1], [-1, -1, -1], [2, 0, 1], [3, -1, 0]],
                       device=device)
    plan = replay_ops.gate(make_logits(T, E, device=device), idx, backend=backend)
    R = plan.num_rows()
    g = torch.Generator().manual_seed(3)
    expert_out = torch.randn(R, H, generator=g, dtype=torch.float64).to(device)
    grad_out = torch.randn(T, H, generator=g, dtype=torch.float64).to(device)
    row_id_map = plan.row_id_map.clone()
    row_id_map[3, 1] = R + 2  # a row past the end of expert_out: an empty slot too
    weights = torch.randn(T, K, generator=g, dtype=torch.float64).to(device)
    _, grad_w = torch.ops.replay.unpermute_backward(grad_out, expert_out, row_id_map,
                                                    plan.sorted_slots, weights, backend)
    for t in range(T):
        for k in range(K):
            r = int(row_id_map[t, k])
            want = float((grad_out[t] * expert_out[r]).sum()) if 0 <= r < R else 0.0
            assert float(grad_w[t, k]) == pytest.approx(want, rel=1e-12, abs=0.0), (t, k, r)
            if not 0 <= r < R:
                assert float(grad_w[t, k]) == 0.0
