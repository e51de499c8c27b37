"""GPU tests of the gate at its edges, on the native CUDA kernels and the Triton kernels (CUDA
only: they skip without a GPU, saying why):

* `validate=False` with indices outside [0, E) (E, E+3, int16 32767, -5, int64 2**32+3, ...):
  empty slots on every gate launch path of both backends;
* the mixed chain of tools/gpu_workloads.py (bf16, strided int16 indices, misaligned views),
  the same cases that tests/test_gpu_sanitizer.py runs under compute-sanitizer;
* extreme logits (below -88, below -709 in fp64, every selected logit below -50, large
  positive ones) for every score function and normalize setting, forward and backward,
  against the fp64 reference, finite wherever the reference is;
* the size limits of the native kernels: E=1024 on the single-CTA path, E=1025 handed to the
  next backend, K=32 and K=33 in the backward.

Integers are compared exactly, floats with the flash-attention rule (`assert_fa_close`)."""
from __future__ import annotations


import pytest
import torch

import replay_ops
from replay_ops import reference as ref

from _helpers import (
    SCORE_FUNCS,
    assert_fa_close,
    assert_plan_ints_equal,
    gen,
    make_indices,
    make_logits,
    ref_gate64,
    with_marks,
)

import gpu_workloads as W  # tools/ (pyproject's pytest pythonpath)

TIME_LIMIT_S = 300


def on_cuda(*backends):
    """Marks of a test that needs a CUDA device and the given backends there."""
    reasons = [r for r in (W.cuda_reason(b) for b in backends or (None,)) if r]
    return [pytest.mark.gpu, pytest.mark.skipif(bool(reasons), reason="; ".join(reasons))]



def backend_params(*backends):
    return [pytest.param(b, id=f"cuda-{b}", marks=on_cuda(b)) for b in backends]


@pytest.fixture(autouse=True)
def _bounded(request):
    with W.time_limit(TIME_LIMIT_S, request.node.nodeid):
        yield


def next_backend_after_native() -> str:
    return "torch" if W.cuda_reason("triton") else "triton"


def grad_of(gate_fn, logits, idx, grad_w, **kw):
    return W.grad_of_gate(gate_fn, logits, idx, grad_w, **kw)


def assert_finite_where_reference_is(out, ref64, what):
    bad = ~torch.isfinite(out.detach().double().cpu()) & torch.isfinite(ref64.detach().cpu())
    if bad.any():
        i = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: not finite where the fp64 reference is, at {i}")


# --------------------------------------------------------------- indices outside [0, E)
@pytest.mark.parametrize(
    "backend,path,T,E,K",
    [pytest.param(*c, id=f"cuda-{c[0]}-{c[1]}-T{c[2]}", marks=on_cuda(c[0]))
     for c in W.garbage_cases()],
)
@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32, torch.int64],
                         ids=["int16", "int32", "int64"])
def test_gpu_validate_false_garbage_indices_are_empty_slots(backend, path, T, E, K, index_dtype):
    W.check_case_path(backend, path, T, E, K)
    assert W.check_garbage_case(backend, W.native_path(backend, path), T, E, K, index_dtype) > 0


# ------------------------------------------------------------------------ mixed chain
@pytest.mark.parametrize(
    "backend,path,T,dtype",
    [pytest.param(*c, id=f"cuda-{c[0]}-{c[1]}-T{c[2]}-{str(c[3])[6:]}", marks=on_cuda(c[0]))
     for c in W.mix_cases()],
)
def test_gpu_strided_int16_and_misaligned_views(backend, path, T, dtype):
    W.check_case_path(backend, path, T, 64, 8, align=16)
    assert W.check_mix_case(backend, W.native_path(backend, path), T, dtype) > 0


# ---------------------------------------------------------------------- extreme logits
# The K=4 selected logits of one row (fp64 values, cast to the dtype of the test).
EXTREME_SELECTED = [
    [-50.5, -55.0, -60.0, -70.0],  # every selected logit below -50
    [-88.5, -90.0, -95.0, -103.9],  # fp32: e^-x overflows, sigmoid is subnormal
    [-104.0, -120.0, -300.0, -1000.0],  # fp32: sigmoid and softplus are 0
    [-709.5, -710.0, -745.5, -800.0],  # fp64: e^-x overflows
    [-600.0, -650.0, -700.0, -709.0],
    [30.0, -100.0, -200.0, -1000.0],  # one slot dominates
    [89.0, 100.0, 200.0, 1000.0],  # large positive
    [1.0e4, 3.0e4, -3.0e4, 0.5],
]


def extreme_case(E: int = 64, K: int = 4):
    """(logits fp64 [R, E], indices int32 [R, K]) on the CPU: one row per entry of
    EXTREME_SELECTED on a random background, then rows whose whole logits are extreme, a row
    with -inf at unselected experts, rows with one valid slot, an empty row and a plain row."""
    g = gen(11)
    rows, idxs = [], []

    def add(sel, background=None, n_valid=K):
        x = (torch.randn(E, generator=g, dtype=torch.float64) * 2 if background is None
             else background.clone())
        ids = torch.randperm(E, generator=g)[:K]
        x[ids[:len(sel)]] = torch.tensor(sel, dtype=torch.float64)
        ids = ids.clone()
        ids[n_valid:] = -1
        rows.append(x)
        idxs.append(ids)

    for sel in EXTREME_SELECTED:
        add(sel)
    add([-1000.0] * K, torch.full((E,), -1000.0, dtype=torch.float64))  # the whole row
    add([0.1, -0.3, 1.2, 2.0], torch.full((E,), -1.0e4, dtype=torch.float64))
    masked = torch.randn(E, generator=g, dtype=torch.float64)
    masked[::8] = float("-inf")
    x = masked.clone()
    ids = torch.tensor([i for i in range(E) if i % 8][:K])
    x[ids] = torch.tensor([-95.0, -96.0, 3.0, 5.0][:K], dtype=torch.float64)
    rows.append(x)
    idxs.append(ids)
    add([-800.0], n_valid=1)  # one valid slot (no normalisation)
    add([1000.0], n_valid=1)
    add([], n_valid=0)  # an empty row
    add([])  # a plain row
    return torch.stack(rows), torch.stack(idxs).to(torch.int32)


def test_extreme_case_holds_what_it_claims():
    """CPU check of the input builder (not a GPU test): the extreme rows are there."""
    logits, idx = extreme_case()
    valid = idx >= 0
    sel = logits.gather(1, idx.clamp_min(0).long())
    assert (sel[0][valid[0]] < -50).all()
    assert (sel[valid] < -709).any() and (sel[valid] > 700).any() and (sel[valid] < -88).any()
    assert torch.isinf(logits).any() and not torch.isinf(sel[valid]).any()
    assert (~valid).all(dim=1).any() and (valid.sum(dim=1) == 1).any()


@pytest.mark.parametrize("backend", backend_params("native", "triton"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
def test_gpu_extreme_logits_match_the_fp64_reference(backend, dtype, score_func, normalize):
    logits_c, idx_c = extreme_case()
    R, K = idx_c.shape
    # R rows: the single-CTA / single-program path; R*160 rows (T*K > 8192): the multi-CTA /
    # chunked paths.
    for reps in (1, 160):
        logits = logits_c.repeat(reps, 1).to(dtype).to("cuda")
        idx = idx_c.repeat(reps, 1).to("cuda")
        grad_w = torch.randn(R * reps, K, generator=gen(reps)).to("cuda")
        kw = dict(score_func=score_func, normalize=normalize, scaling_factor=2.5)
        what = f"{backend} {dtype} {score_func} normalize={normalize} T={R * reps}"
        out = replay_ops.gate(logits, idx, align=4, backend=backend, **kw)
        ref_same = ref.gate(logits, idx, align=4, **kw)
        ref64 = ref_gate64(logits, idx, align=4, **kw)
        assert_plan_ints_equal(out, ref_same)
        assert_fa_close(out.weights, ref_same.weights, ref64.weights, f"{what}: weights")
        assert_finite_where_reference_is(out.weights, ref64.weights, f"{what}: weights")
        grad = grad_of(lambda x, i, **k: replay_ops.gate(x, i, backend=backend, **k),
                       logits, idx, grad_w, **kw)
        ref_grad = grad_of(ref.gate, logits, idx, grad_w, **kw)
        ref_grad64 = grad_of(ref.gate, logits.double(), idx, grad_w, **kw)
        assert_fa_close(grad, ref_grad, ref_grad64, f"{what}: grad logits")
        assert_finite_where_reference_is(grad, ref_grad64, f"{what}: grad logits")


# ------------------------------------------------------------------- native size limits
@with_marks(on_cuda("native"))
@pytest.mark.parametrize("T,K", [(1024, 8), (2047, 4)], ids=["TK8192", "TK8188"])
def test_gpu_native_e1024_on_the_single_cta_path(T, K):
    """E=1024 (kMaxExperts) with T*K at the single-CTA limit: the single-CTA, cooperative
    and three-launch paths give the same bits, and the reference's plan; the backward runs
    natively too."""
    E = 1024
    assert T * K <= W.NATIVE_SINGLE_CTA_MAX_SLOTS
    for op in ("gate_fwd", "gate_bwd"):
        call = replay_ops.backends(op=op, device="cuda", shape=(T, E, K))["call"]
        assert call["runs"] == "native", call
    idx = make_indices(T, E, K, dtype=torch.int32, empty=0.05, seed=3, device="cuda")
    logits = make_logits(T, E, torch.bfloat16, seed=4, device="cuda")
    grad_w = torch.randn(T, K, generator=gen(5)).to("cuda")
    for sf, normalize in (("softmax", False), ("softmax", True), ("sigmoid", True)):
        kw = dict(score_func=sf, normalize=normalize, align=8)
        outs = {}
        for path in W.NATIVE_PATHS:
            with W.gate_path(path):
                outs[path] = replay_ops.gate(logits, idx, validate=False, backend="native", **kw)
        ref_same = ref.gate(logits, idx, **kw)
        assert_plan_ints_equal(outs["single_cta"], ref_same)
        assert_fa_close(outs["single_cta"].weights, ref_same.weights,
                        ref_gate64(logits, idx, **kw).weights, f"E=1024 {sf} weights")
        for path in W.NATIVE_PATHS[1:]:
            for name, a, b in zip(ref_same._fields, outs["single_cta"], outs[path]):
                assert a is b is None or torch.equal(a, b), f"{path} differs from single_cta in {name}"
        kw.pop("align")
        with W.gate_path("single_cta"):
            grad = grad_of(lambda x, i, **k: replay_ops.gate(x, i, backend="native", **k),
                           logits, idx, grad_w, **kw)
        assert_fa_close(grad, grad_of(ref.gate, logits, idx, grad_w, **kw),
                        grad_of(ref.gate, logits.double(), idx, grad_w, **kw),
                        f"E=1024 {sf} grad logits")


@with_marks(on_cuda("native"))
def test_gpu_native_single_cta_path_refuses_more_slots():
    T, E, K = 1025, 16, 8  # T*K = 8200
    idx = make_indices(T, E, K, device="cuda")
    with W.gate_path("single_cta"):
        with pytest.raises(ValueError, match=r"gate path 'single_cta' takes T\*K <= 8192"):
            replay_ops.gate(torch.randn(T, E, device="cuda"), idx, backend="native")


@with_marks(on_cuda("native"))
@pytest.mark.parametrize("T", [200, 3000], ids=["single", "chunked"])
def test_gpu_e1025_is_handed_from_native_to_the_next_backend(T):
    """E=1025 is past the native kernels' limit: the registry names the next backend
    (Triton, else torch) for the forward and the backward, with or without
    backend='native', and that backend's results match the reference."""
    E, K = 1025, 8
    nxt = next_backend_after_native()
    for requested in (None, "native"):
        for op in ("gate_fwd", "gate_bwd"):
            call = replay_ops.backends(op=op, device="cuda", shape=(T, E, K),
                                       requested=requested)["call"]
            assert call["runs"] == nxt, call
            assert "kMaxExperts" in call["passed_over"]["native"], call
    idx = make_indices(T, E, K, dtype=torch.int16, empty=0.05, seed=T, device="cuda")
    logits = make_logits(T, E, torch.float32, seed=T + 1, device="cuda")
    grad_w = torch.randn(T, K, generator=gen(6)).to("cuda")
    for sf, normalize in (("softmax", False), ("sqrtsoftplus", True)):
        kw = dict(score_func=sf, normalize=normalize, align=16)
        direct = replay_ops.gate(logits, idx, backend=nxt, **kw)
        ref_same = ref.gate(logits, idx, **kw)
        assert_plan_ints_equal(direct, ref_same)
        assert_fa_close(direct.weights, ref_same.weights, ref_gate64(logits, idx, **kw).weights,
                        f"E=1025 {sf} weights")
        for requested in (None, "native"):
            out = replay_ops.gate(logits, idx, backend=requested, **kw)
            for name, a, b in zip(ref_same._fields, direct, out):
                assert a is b is None or torch.equal(a, b), f"backend={requested!r} E=1025: {name}"
        kw.pop("align")
        grad = grad_of(lambda x, i, **k: replay_ops.gate(x, i, backend="native", **k),
                       logits, idx, grad_w, **kw)
        assert_fa_close(grad, grad_of(ref.gate, logits, idx, grad_w, **kw),
                        grad_of(ref.gate, logits.double(), idx, grad_w, **kw),
                        f"E=1025 {sf} grad logits")


@with_marks(on_cuda("native"))
@pytest.mark.parametrize("K", [32, 33])
def test_gpu_native_backward_top_k_limit(K):
    """K=32 (kMaxTopK, one lane per slot) runs the native backward; K=33 runs the native
    forward and hands the backward to the next backend. Both match the reference."""
    T, E = 300, 64
    bwd = "native" if K <= 32 else next_backend_after_native()
    assert replay_ops.backends(op="gate_fwd", device="cuda", shape=(T, E, K))["call"]["runs"] \
        == "native"
    call = replay_ops.backends(op="gate_bwd", device="cuda", shape=(T, E, K))["call"]
    assert call["runs"] == bwd, call
    if bwd != "native":
        assert "kMaxTopK" in call["passed_over"]["native"], call
    idx = make_indices(T, E, K, dtype=torch.int32, empty=0.1, seed=K, device="cuda")
    logits = make_logits(T, E, torch.float32, seed=K + 1, device="cuda")
    grad_w = torch.randn(T, K, generator=gen(K + 2)).to("cuda")
    for sf in SCORE_FUNCS:
        for normalize in (True, False):
            kw = dict(score_func=sf, normalize=normalize, scaling_factor=1.25)
            out = replay_ops.gate(logits, idx, backend="native", **kw)
            ref_same = ref.gate(logits, idx, **kw)
            assert_plan_ints_equal(out, ref_same)
            assert_fa_close(out.weights, ref_same.weights, ref_gate64(logits, idx, **kw).weights,
                            f"K={K} {sf} normalize={normalize} weights")
            grad = grad_of(lambda x, i, **k: replay_ops.gate(x, i, backend="native", **k),
                           logits, idx, grad_w, **kw)
            assert_fa_close(grad, grad_of(ref.gate, logits, idx, grad_w, **kw),
                            grad_of(ref.gate, logits.double(), idx, grad_w, **kw),
                            f"K={K} {sf} normalize={normalize} grad logits")
