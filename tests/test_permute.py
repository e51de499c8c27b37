"""replay_ops.permute: values (a pure copy, so exact), static num_rows, padding, gradients."""
from __future__ import annotations

import pytest
import torch

import replay_ops
from replay_ops import reference as ref

from _helpers import (
    assert_fa_close,
    backend_params,
    case_params,
    is_interpreted,
    make_indices,
    make_logits,
)

# (T, E, K, H, align): zero tokens, T=1, odd sizes, H=1, H above one 256-wide block, padding.
CASES = [
    (0, 7, 2, 16, 1),
    (0, 7, 2, 16, 16),
    (1, 1, 1, 1, 1),
    (1, 7, 7, 5, 1),
    (13, 7, 2, 33, 1),
    (13, 7, 2, 33, 16),
    (29, 64, 3, 1, 128),
    (37, 64, 2, 300, 1),
    (301, 256, 8, 24, 1),
    (6, 5, 2, 0, 16),  # H = 0
]
CASES_INTERP = [
    (0, 7, 2, 16, 16),
    (1, 1, 1, 1, 1),
    (13, 7, 2, 33, 16),
    (29, 64, 3, 1, 128),
    (37, 64, 2, 300, 1),
    (6, 5, 2, 0, 16),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _id(c):
    return "T{}E{}K{}H{}a{}".format(*c)


def make_plan(T, E, K, align, device, backend, seed=0, empty=0.2):
    logits = make_logits(T, E, device=device, seed=seed)
    idx = make_indices(T, E, K, device=device, seed=seed + 1, empty=empty if K > 1 else 0.0)
    return replay_ops.gate(logits, idx, align=align, backend=backend)


def expected_rows(hidden, plan, num_rows):
    """Row r = hidden[sorted_slots[r] // K]; zero for padding and past the end (loops)."""
    K = plan.top_k
    ss = plan.sorted_slots.cpu().tolist()
    out = torch.zeros(num_rows, hidden.shape[1], dtype=hidden.dtype)
    h = hidden.cpu()
    for r in range(min(num_rows, len(ss))):
        if ss[r] >= 0:
            out[r] = h[ss[r] // K]
    return out


@pytest.mark.parametrize("device,backend,case", case_params(CASES, CASES_INTERP, ids=_id))
def test_permute_values(device, backend, case):
    T, E, K, H, align = case
    plan = make_plan(T, E, K, align, device, backend)
    hidden = torch.randn(T, H, device=device)
    out = replay_ops.permute(hidden, plan, backend=backend)
    R = plan.num_rows()
    assert out.shape == (R, H) and out.dtype == hidden.dtype and out.device == hidden.device
    # a copy: bit-exact against the loops and against the reference
    assert torch.equal(out.cpu(), expected_rows(hidden, plan, R))
    assert torch.equal(out, ref.permute(hidden, plan))


@pytest.mark.parametrize(
    "device,backend,dtype",
    case_params(DTYPES, [torch.bfloat16, torch.float64], ids=lambda d: str(d)[6:]),
)
def test_permute_dtypes_and_views(device, backend, dtype):
    T, E, K, H = (17, 7, 3, 40)
    plan = make_plan(T, E, K, 16, device, backend)
    base = torch.randn(H, 2 * T, device=device).to(dtype)
    views = {
        "contiguous": base[:, :T].t().contiguous(),
        "transposed": base[:, :T].t(),  # stride (1, 2T)
        "column-strided": torch.randn(T, 2 * H, device=device).to(dtype)[:, ::2],
        "broadcast rows (stride 0)": torch.randn(1, H, device=device).to(dtype).expand(T, H),
    }
    for name, hidden in views.items():
        out = replay_ops.permute(hidden, plan, backend=backend)
        assert out.dtype == dtype
        assert torch.equal(out.cpu(), expected_rows(hidden, plan, plan.num_rows())), name


@pytest.mark.parametrize("dev_backend", backend_params())
def test_permute_static_num_rows(dev_backend):
    device, backend = dev_backend
    T, E, K, H = (11, 7, 2, 8)
    plan = make_plan(T, E, K, 16, device, backend)
    hidden = torch.randn(T, H, device=device)
    used = plan.num_rows()
    assert used < plan.max_rows
    for n in (used, plan.max_rows, plan.max_rows + 5):
        out = replay_ops.permute(hidden, plan, n, backend=backend)
        assert out.shape == (n, H)
        assert torch.equal(out.cpu(), expected_rows(hidden, plan, n)), n
        assert (out[used:] == 0).all()


@pytest.mark.parametrize("dev_backend", backend_params())
def test_permute_ignores_tokens_without_slots(dev_backend):
    """Tokens whose slots are all empty are never read (NaN there must not leak)."""
    device, backend = dev_backend
    T, E, K, H = (5, 4, 2, 3)
    idx = torch.tensor([[0, 1], [-1, -1], [3, -1], [-1, -1], [2, 0]], device=device)
    plan = replay_ops.gate(make_logits(T, E, device=device), idx, align=4, backend=backend)
    hidden = torch.randn(T, H, device=device)
    hidden[[1, 3]] = float("nan")
    out = replay_ops.permute(hidden, plan, plan.max_rows, backend=backend)
    assert not out.isnan().any()
    assert torch.equal(out.cpu(), expected_rows(hidden, plan, plan.max_rows))


# ----------------------------------------------------------------------- backward
def _permute_grad(fn, hidden, grad_out):
    h = hidden.detach().clone().requires_grad_(True)
    fn(h).backward(grad_out)
    return h.grad


@pytest.mark.parametrize(
    "device,backend,dtype",
    case_params([torch.float32, torch.bfloat16, torch.float16], [torch.float32, torch.bfloat16],
                ids=lambda d: str(d)[6:]),
)
def test_permute_backward_parity(device, backend, dtype):
    """grad_hidden[t] = sum_k grad_out[row_id_map[t, k]], vs autograd through the reference."""
    T, E, K, H = (23, 7, 4, 20)
    plan = make_plan(T, E, K, 16, device, backend, empty=0.3)
    hidden = torch.randn(T, H, device=device).to(dtype)
    n = plan.max_rows
    grad_out = torch.randn(n, H, device=device).to(dtype)
    out_g = _permute_grad(lambda h: replay_ops.permute(h, plan, n, backend=backend), hidden,
                          grad_out)
    ref_g = _permute_grad(lambda h: ref.permute(h, plan, n), hidden, grad_out)
    ref64 = _permute_grad(lambda h: ref.permute(h, plan, n), hidden.double(), grad_out.double())
    assert_fa_close(out_g, ref_g, ref64, "grad hidden")


@pytest.mark.parametrize("dev_backend", backend_params())
def test_permute_backward_ignores_padding_rows(dev_backend):
    """Gradient arriving at padding rows and rows past expert_offsets[E] is dropped."""
    device, backend = dev_backend
    T, E, K, H = (9, 5, 2, 4)
    plan = make_plan(T, E, K, 8, device, backend, empty=0.2)
    n = plan.max_rows
    grad_out = torch.full((n, H), float("nan"), device=device)
    ss = plan.sorted_slots
    used_rows = (ss >= 0).nonzero().flatten()
    grad_out[used_rows] = torch.randn(used_rows.numel(), H, device=device)
    h = torch.randn(T, H, device=device, requires_grad=True)
    replay_ops.permute(h, plan, n, backend=backend).backward(grad_out)
    want = torch.zeros(T, H, dtype=torch.float64)
    rid = plan.row_id_map.cpu()
    for t in range(T):
        for k in range(K):
            if rid[t, k] >= 0:
                want[t] += grad_out[rid[t, k]].cpu().double()
    assert not h.grad.isnan().any()
    assert torch.allclose(h.grad.cpu().double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "device,backend,case",
    case_params([(1, None), (16, None), (16, "max")], ids=lambda c: f"align{c[0]}-{c[1]}"),
)
def test_permute_gradcheck(device, backend, case):
    align, rows = case
    T, E, K, H = (5, 4, 2, 3)
    idx = torch.tensor([[0, 3], [-1, 1], [2, 0], [-1, -1], [1, 3]], device=device)
    plan = replay_ops.gate(make_logits(T, E, device=device), idx, align=align, backend=backend)
    n = plan.max_rows if rows == "max" else None
    hidden = torch.randn(T, H, dtype=torch.float64, device=device, requires_grad=True)
    fn = lambda h: replay_ops.permute(h, plan, n, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden,), fast_mode=is_interpreted(device, backend))


@pytest.mark.parametrize("dev_backend", backend_params())
def test_permute_backward_accumulates_in_fp32(dev_backend):
    """A token's K row gradients are summed in fp32 and rounded once: 1 + 2 * 0.0048828125
    gives bf16 1.0078125 (a bf16 running sum would round twice, to 1.015625)."""
    device, backend = dev_backend
    idx = torch.tensor([[0, 1, 2]], device=device)
    plan = replay_ops.gate(torch.zeros(1, 3, device=device), idx, backend=backend)
    assert plan.row_id_map.tolist() == [[0, 1, 2]]
    h = torch.zeros(1, 1, dtype=torch.bfloat16, device=device, requires_grad=True)
    g = torch.tensor([[1.0], [0.0048828125], [0.0048828125]], dtype=torch.bfloat16, device=device)
    replay_ops.permute(h, plan, backend=backend).backward(g)
    assert h.grad.item() == 1.0078125
