"""Same inputs give bitwise-identical outputs and gradients, run after run; a token's
results do not depend on which other tokens share the batch; the ops run under
torch.use_deterministic_algorithms(True)."""
from __future__ import annotations

import pytest
import torch

import replay_ops

from _helpers import case_params, is_interpreted, make_indices, make_logits

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32,
             torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so NaN and -0.0 compare exactly too."""
    t = t.detach().contiguous()
    return t.view(_INT_VIEW[t.dtype]) if t.is_floating_point() else t


def assert_bitwise(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if not torch.equal(bits(a), bits(b)):
        n = int((bits(a) != bits(b)).sum())
        raise AssertionError(f"{what}: {n} elements differ between identical runs")


# (T, E, K, H, align, dtype): heavy contention (few experts, many tokens) is where atomics
# or thread timing would show.
CASES = [
    (257, 4, 2, 24, 16, torch.float32),
    (700, 8, 8, 8, 1, torch.float32),  # more than 4096 slots
    (129, 64, 6, 16, 128, torch.bfloat16),
]
CASES_INTERP = [(257, 4, 2, 24, 16, torch.float32), (520, 8, 8, 8, 1, torch.bfloat16)]


def _run(device, backend, case, score_func):
    T, E, K, H, align, dtype = case
    logits = make_logits(T, E, dtype=dtype, device=device, seed=31).requires_grad_(True)
    idx = make_indices(T, E, K, dtype=torch.int16, device=device, seed=32, empty=0.1)
    g = torch.Generator().manual_seed(34)
    hidden = torch.randn(T, H, generator=g).to(device, dtype).requires_grad_(True)
    w = (torch.randn(H, H, generator=g) / H**0.5).to(device, dtype)
    plan = replay_ops.gate(logits, idx, score_func=score_func, align=align, backend=backend)
    x = replay_ops.permute(hidden, plan, backend=backend)
    y = replay_ops.unpermute(torch.tanh(x @ w), plan, backend=backend)
    gy = torch.randn(T, H, generator=torch.Generator().manual_seed(33)).to(device, dtype)
    y.backward(gy)
    fields = {k: v for k, v in plan._asdict().items() if v is not None}  # no agreement asked
    return dict(fields, permuted=x, out=y, grad_logits=logits.grad,
                grad_hidden=hidden.grad)


def _can_differ(params):
    """Only the backends whose runs could differ: CUDA kernels, and the native CPU kernels
    (several threads). The eager torch backend and the single-threaded Triton interpreter on
    the CPU cannot give two identical calls different bits, so comparing them tests nothing."""
    return [p for p in params if p.values[0] == "cuda" or p.values[1] == "native"]


@pytest.mark.parametrize(
    "device,backend,case",
    _can_differ(case_params(CASES, CASES_INTERP,
                            ids=lambda c: "T{}E{}K{}H{}a{}-{}".format(*c[:5], str(c[5])[6:]))),
)
def test_repeated_runs_are_bitwise_identical(device, backend, case):
    repeats = 1 if is_interpreted(device, backend) else 2
    for sf in ("softmax", "sigmoid"):
        first = _run(device, backend, case, sf)
        for _ in range(repeats):
            again = _run(device, backend, case, sf)
            for name in first:
                assert_bitwise(first[name], again[name], f"{sf}: {name}")


def _batch_invariance_params():
    # The "torch" backend computes sigmoid/softplus with PyTorch's CPU elementwise kernels,
    # which take a vectorised or a scalar path depending on the tensor's size, so the last
    # bit of those scores may depend on the batch size. It is held to batch invariance for
    # softmax only; every kernel backend is held to it for every score function.
    return [p for p in case_params(["softmax", "sigmoid", "sqrtsoftplus"])
            if p.values[1] != "torch" or p.values[2] == "softmax"]


# (E, K, normalize): the reductions over a row are the softmax denominators over E (with
# normalize=False; E a multiple of 16, where a layout-ordered sum would differ between tile
# shapes) and over the K selected slots.
INVARIANCE_SHAPES = [(16, 8, True), (64, 8, False), (128, 8, False), (64, 16, True),
                     (128, 16, False)]


# The (slow) Triton interpreter: the smallest shape with every score function and the
# largest tile (E 128 and K 16, the widest rows of both reductions) with softmax; the
# shapes between them are compiled (make check-triton) and run on the other backends.
INTERPRETED_SHAPES = [INVARIANCE_SHAPES[0], (128, 16, False)]


def _invariance_params():
    """Every shape for every backend and score function, except the Triton interpreter's
    (INTERPRETED_SHAPES: the first shape covers the score functions there)."""
    out = []
    for p in _batch_invariance_params():
        device, backend, sf = p.values
        for shape in INVARIANCE_SHAPES:
            if is_interpreted(device, backend) and (
                    shape not in INTERPRETED_SHAPES
                    or (shape != INVARIANCE_SHAPES[0] and sf != "softmax")):
                continue
            out.append(pytest.param(device, backend, sf, shape, marks=p.marks,
                                    id=f"{p.id}-E{shape[0]}K{shape[1]}norm{int(shape[2])}"))
    return out


@pytest.mark.parametrize("device,backend,score_func,shape", _invariance_params())
def test_token_results_do_not_depend_on_the_batch(device, backend, score_func, shape):
    """Gate weights, the combine and their gradients for a token are the same whether it
    is processed alone, in a small batch or in a large one (batch invariance): the block
    shapes of the kernels change with the batch, the order of every row's sums must not."""
    E, K, normalize = shape
    T, H = 600, 12  # the full batch takes the multi-program plan path
    if is_interpreted(device, backend) and shape != INVARIANCE_SHAPES[0]:
        T = 300  # the interpreter is slow; 300 * K still spans several programs
    logits = make_logits(T, E, device=device, seed=41)
    idx = make_indices(T, E, K, device=device, seed=42, empty=0.1)
    g = torch.Generator().manual_seed(43)
    x_rows = torch.randn(T * K, H, generator=g).to(device)  # one expert output row per slot
    gy = torch.randn(T, H, generator=g).to(device)

    def run(lo, hi):
        lg = logits[lo:hi].detach().clone().requires_grad_(True)
        plan = replay_ops.gate(lg, idx[lo:hi], score_func=score_func, normalize=normalize,
                               backend=backend)
        # expert output of slot s placed at the row the plan assigns to s
        rows = torch.zeros(plan.num_rows(), H, device=device)
        valid = plan.row_id_map >= 0
        flat = torch.arange(lo * K, hi * K, device=device).view(-1, K)
        rows[plan.row_id_map[valid].long()] = x_rows[flat[valid]]
        rows.requires_grad_(True)
        out = replay_ops.unpermute(rows, plan, backend=backend)
        out.backward(gy[lo:hi])
        g_rows = torch.zeros(hi - lo, K, H, device=device)
        g_rows[valid] = rows.grad[plan.row_id_map[valid].long()]
        return plan.weights.detach(), out.detach(), lg.grad, g_rows

    full = run(0, T)
    # the interpreter: the full batch is the multi-program run, the parts single-program
    parts = ((0, 1), (5, 6), (37, 44)) + (() if is_interpreted(device, backend)
                                          else ((T // 2, T),))
    for lo, hi in parts:
        part = run(lo, hi)
        for name, a, b in zip(("weights", "out", "grad logits", "grad rows"), full, part):
            assert_bitwise(a[lo:hi], b, f"{name} of tokens {lo}..{hi} (alone vs in the batch)")


@pytest.mark.parametrize("device,backend,n", case_params([None]))
def test_runs_under_deterministic_algorithms(device, backend, n):
    """No op of the forward and backward raises under torch.use_deterministic_algorithms;
    where two runs could differ, they do not."""
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        r1 = _run(device, backend, (33, 5, 2, 8, 16, torch.float32), "softmax")
        if device == "cuda" or backend == "native":
            r2 = _run(device, backend, (33, 5, 2, 8, 16, torch.float32), "softmax")
            for name in r1:
                assert_bitwise(r1[name], r2[name], name)
    finally:
        torch.use_deterministic_algorithms(prev)


@pytest.mark.parametrize(
    "device,backend,n", [p for p in case_params([None]) if p.values[0] == "cpu"]
)
def test_cpu_results_do_not_depend_on_thread_count(device, backend, n):
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(device, backend, (300, 6, 4, 16, 16, torch.float32), "sigmoid")
        torch.set_num_threads(max(2, prev))
        many = _run(device, backend, (300, 6, 4, 16, 16, torch.float32), "sigmoid")
    finally:
        torch.set_num_threads(prev)
    for name in one:
        assert_bitwise(one[name], many[name], f"{name} (1 thread vs {max(2, prev)})")
