"""The native backend (replay_ops._C): build and availability, the CPU kernels at shapes
that span many work chunks, thread-count independence, the fallback when the extension is
missing, the CUDA compile check, and (on a GPU machine) the CUDA kernels.

The core parity suite (test_gate.py, test_permute.py, test_unpermute.py, ...) already runs
every case against the reference for each available backend, `native` included; the tests
here add what is specific to the native code."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import replay_ops
from replay_ops import backends as _backend
from replay_ops import reference as ref

from _helpers import (
    SCORE_FUNCS,
    assert_fa_close,
    assert_plan_ints_equal,
    capture_cuda_graph,
    check_plan_structure,
    make_indices,
    make_logits,
    ref_gate64,
    strided_indices,
    with_marks,
)

ROOT = Path(__file__).resolve().parents[1]
NATIVE_SKIPPED = os.environ.get("REPLAY_OPS_NATIVE", "").strip().lower() in ("0", "false", "off", "no")
HAS_CUDA = torch.cuda.is_available()

# Shapes that span several 2048-slot chunks of the CPU gate (T*K > 2048), with odd sizes.
LARGE_GATE = [  # (T, E, K, align)
    (2048, 128, 8, 1),
    (1531, 67, 6, 16),
    (3001, 256, 2, 4),
]
# (T, E, K, H): H=1024 is the speed target; 1000 and 7 are odd sizes.
LARGE_PERMUTE = [(512, 64, 8, 1024), (333, 17, 3, 1000), (129, 8, 2, 7)]


def _native():
    mod = _backend.load("native")
    if mod is None:
        pytest.fail(
            "the native extension did not import: "
            f"{replay_ops.backends()['backends']['native'].get('reason')}"
        )
    return mod


needs_native = pytest.mark.skipif(
    NATIVE_SKIPPED, reason="REPLAY_OPS_NATIVE=0: the native extension was not built"
)


# ------------------------------------------------------------------------ build / status
@needs_native
def test_extension_is_built_and_serves_cpu():
    mod = _native()
    assert mod.NAME == "native"
    assert mod.available("cpu")
    info = replay_ops.backends()
    assert info["active"]["cpu"] == "native", info
    assert info["backends"]["native"]["cpu"] is True
    for op in ("gate_fwd", "gate_bwd", "permute_fwd", "permute_bwd", "unpermute_fwd",
               "unpermute_bwd"):
        assert hasattr(torch.ops.replay_native, op), op


@needs_native
def test_cuda_kernels_flag_matches_the_torch_build():
    from replay_ops import _C

    if torch.version.cuda is None:
        # A CPU torch cannot build the CUDA bindings: the library must say so.
        assert _C.WITH_CUDA == 0
        assert not _native().available("cuda")
    else:
        assert _C.WITH_CUDA in (0, 1)
    assert bool(_native().available("cuda")) == bool(_C.WITH_CUDA and HAS_CUDA)


def test_package_works_without_the_extension(tmp_path):
    """Block `replay_ops._C` in a fresh interpreter: the package still imports, reports the
    reason, serves CPU tensors with the torch backend, and gives the reference's result."""
    code = textwrap.dedent(
        """
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "replay_ops._C":
                    raise ImportError("blocked for the test")
                return None
        sys.meta_path.insert(0, Block())
        import torch, replay_ops
        from replay_ops import reference as ref
        info = replay_ops.backends()
        assert info["active"]["cpu"] == "torch", info
        assert "blocked for the test" in info["backends"]["native"]["reason"], info
        logits = torch.randn(5, 6)
        idx = torch.tensor([[0, 1], [2, -1], [5, 4], [-1, -1], [3, 0]])
        plan = replay_ops.gate(logits, idx)
        want = ref.gate(logits, idx)
        # the torch backend is its own implementation: integers exact, weights to fp32
        torch.testing.assert_close(plan.weights, want.weights, rtol=2e-7, atol=1e-7)
        for a, b in zip(plan[1:6], want[1:6]):
            assert torch.equal(a, b)
        try:
            replay_ops.gate(logits, idx, backend="native")
        except RuntimeError as e:
            assert "native" in str(e) and "blocked for the test" in str(e), e
        else:
            raise AssertionError("backend='native' must fail loudly without the extension")
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


# ------------------------------------------------------------------------- CPU parity
@needs_native
@pytest.mark.parametrize("T,E,K,align", LARGE_GATE, ids=lambda v: str(v))
@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("normalize", [True, False])
def test_native_gate_many_chunks_matches_reference(T, E, K, align, score_func, normalize):
    _native()
    rec, idx = strided_indices(T, E, K, dtype=torch.int16, empty=0.1, seed=T + E)
    logits = make_logits(T, E, torch.float32, seed=E)
    kw = dict(score_func=score_func, normalize=normalize, scaling_factor=1.7, align=align)
    out = replay_ops.gate(logits, idx, backend="native", **kw)
    ref_out = ref.gate(logits, idx, **kw)
    ref64 = ref_gate64(logits, idx, **kw)
    assert_plan_ints_equal(out, ref_out)
    assert_fa_close(out.weights, ref_out.weights, ref64.weights, "weights")


@needs_native
def test_native_plan_structure_at_many_chunks():
    """The plan's invariants, checked from their definition (no reference)."""
    T, E, K, align = 1200, 40, 5, 8
    idx = make_indices(T, E, K, dtype=torch.int64, empty=0.2, seed=3)
    plan = replay_ops.gate(make_logits(T, E), idx, align=align, backend="native")
    check_plan_structure(plan, idx, E, align)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_native_gate_dtypes_large(dtype):
    T, E, K = 2500, 96, 4
    idx = make_indices(T, E, K, empty=0.05, seed=11)
    logits = make_logits(T, E, dtype, seed=12)
    for sf in SCORE_FUNCS:
        kw = dict(score_func=sf, normalize=True, align=2)
        out = replay_ops.gate(logits, idx, backend="native", **kw)
        ref_out = ref.gate(logits, idx, **kw)
        assert_plan_ints_equal(out, ref_out)
        assert_fa_close(out.weights, ref_out.weights, ref_gate64(logits, idx, **kw).weights,
                        f"weights {sf}")


@needs_native
@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("normalize", [True, False])
def test_native_gate_backward_large(score_func, normalize):
    T, E, K = 2100, 64, 6
    idx = make_indices(T, E, K, empty=0.1, seed=5)
    logits = make_logits(T, E, seed=6)
    g = torch.randn(T, K, generator=torch.Generator().manual_seed(7))
    kw = dict(score_func=score_func, normalize=normalize, scaling_factor=2.5)

    def grad_of(fn, x):
        x = x.clone().requires_grad_(True)
        (fn(x, idx, **kw).weights * g.to(x.dtype)).sum().backward()
        return x.grad

    out = grad_of(lambda x, i, **k: replay_ops.gate(x, i, backend="native", **k), logits)
    ref_same = grad_of(ref.gate, logits)
    ref64 = grad_of(ref.gate, logits.double())
    assert_fa_close(out, ref_same, ref64, "grad logits")


@needs_native
@pytest.mark.parametrize("T,E,K,H", LARGE_PERMUTE, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_permute_unpermute_large(T, E, K, H, dtype):
    idx = make_indices(T, E, K, empty=0.1, seed=H)
    plan = replay_ops.gate(make_logits(T, E, dtype), idx, align=4, backend="native")
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = replay_ops.permute(hidden, plan, backend="native")
    assert torch.equal(x, ref.permute(hidden, plan)), "permute must be an exact copy"
    # padding rows at the end of num_rows=max_rows are zero
    xm = replay_ops.permute(hidden, plan, plan.max_rows, backend="native")
    assert torch.equal(xm, ref.permute(hidden, plan, plan.max_rows))
    eo = torch.randn(x.shape[0], H, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = replay_ops.unpermute(eo, plan, backend="native")
    plan64 = plan._replace(weights=plan.weights.double())
    assert_fa_close(y, ref.unpermute(eo, plan), ref.unpermute(eo.double(), plan64), "unpermute")


@needs_native
# The whole chain (gate -> permute -> unpermute -> backward) in fp64, where it checks the
# logic, and in bf16, where the rounding of the stored values dominates. In fp32 the chain's
# error is the sum of per-op errors in different summation orders, so the 2x rule is only
# meaningful per op (the tests above and the core parity suite).
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_native_permute_unpermute_backward_large(dtype):
    T, E, K, H = 300, 16, 4, 264
    idx = make_indices(T, E, K, empty=0.1, seed=9)
    logits = make_logits(T, E, dtype, seed=10)
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    gy = torch.randn(T, H, generator=torch.Generator().manual_seed(4))

    def run(gate, permute, unpermute, cast):
        lg = logits.to(cast).clone().requires_grad_(True)
        hd = hidden.to(cast).clone().requires_grad_(True)
        plan = gate(lg, idx)
        x = permute(hd, plan)
        y = unpermute(x * 1.5, plan)
        (y * gy.to(cast)).sum().backward()
        return y, lg.grad, hd.grad

    nat = run(lambda l, i: replay_ops.gate(l, i, backend="native"),
              lambda h, p: replay_ops.permute(h, p, backend="native"),
              lambda x, p: replay_ops.unpermute(x, p, backend="native"), dtype)
    same = run(ref.gate, ref.permute, ref.unpermute, dtype)
    r64 = run(ref.gate, ref.permute, ref.unpermute, torch.float64)
    for name, o, s, r in zip(("y", "grad logits", "grad hidden"), nat, same, r64):
        assert_fa_close(o, s, r, name)


@needs_native
def test_native_gradcheck_fp64():
    T, E, K, H = 6, 7, 3, 5
    idx = torch.tensor([[0, 3, 6], [1, -1, 2], [-1, -1, -1], [4, 5, 0], [2, 6, -1], [3, 1, 5]])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, dtype=torch.float64, generator=g, requires_grad=True)
    hidden = torch.randn(T, H, dtype=torch.float64, generator=g, requires_grad=True)
    for sf in SCORE_FUNCS:
        for norm in (True, False):
            def f(lg, hd):
                plan = replay_ops.gate(lg, idx, score_func=sf, normalize=norm, align=2,
                                       backend="native")
                x = replay_ops.permute(hd, plan, plan.max_rows, backend="native")
                return replay_ops.unpermute(x.tanh(), plan, backend="native")

            assert torch.autograd.gradcheck(f, (logits, hidden)), (sf, norm)


# ------------------------------------------------------------------- determinism / threads
@needs_native
def test_native_outputs_do_not_depend_on_thread_count():
    T, E, K, H = 3000, 128, 8, 96
    rec, idx = strided_indices(T, E, K, dtype=torch.int32, empty=0.05, seed=21)
    logits = make_logits(T, E, torch.bfloat16, seed=22)
    hidden = torch.randn(T, H).to(torch.bfloat16)
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 1, 2):
            torch.set_num_threads(n)
            plan = replay_ops.gate(logits, idx, align=8, backend="native")
            x = replay_ops.permute(hidden, plan, backend="native")
            y = replay_ops.unpermute(x, plan, backend="native")
            results.append((*plan[:6], x, y))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert a.dtype == b.dtype and torch.equal(a, b)


def _cpu_isas():
    """The x86 vector ISAs of the CPU row kernels that this machine runs."""
    ops = torch.ops.replay_native
    prev = ops.cpu_isa("")
    found = []
    try:
        for isa in ("baseline", "avx2", "avx512"):
            try:
                ops.cpu_isa(isa)
            except ValueError:
                continue
            found.append(isa)
    finally:
        ops.cpu_isa(prev)
    return found


def _bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("E", [1, 7, 16, 37, 128, 200])
def test_native_row_kernels_give_the_same_bits_on_every_cpu_isa(dtype, E):
    """The softmax row kernels (gate with normalize=False, forward and backward) have an
    AVX2 and an AVX-512 copy besides the baseline one; all give the same bits, and the
    baseline matches the reference."""
    _native()
    isas = _cpu_isas()
    assert isas[0] == "baseline"
    if len(isas) < 2:
        pytest.skip(f"this CPU runs only the baseline row kernels ({isas})")
    T, K = 97, min(4, E)
    logits = make_logits(T, E, dtype, seed=31) * 4
    if E >= 16:
        logits[3, ::5] = float("-inf")  # masked experts
        logits[5, :] = -1e4
    idx = make_indices(T, E, K, empty=0.1, seed=32)
    grad_w = torch.randn(T, K, generator=torch.Generator().manual_seed(33)).to(dtype)
    ops = torch.ops.replay_native
    prev = ops.cpu_isa("")
    results = {}
    try:
        for isa in isas:
            ops.cpu_isa(isa)
            x = logits.clone().requires_grad_(True)
            plan = replay_ops.gate(x, idx, normalize=False, backend="native")
            (plan.weights.float() * grad_w.float()).sum().backward()
            results[isa] = (plan.weights.detach(), x.grad)
    finally:
        ops.cpu_isa(prev)
    for isa in isas[1:]:
        for a, b in zip(results["baseline"], results[isa]):
            assert torch.equal(_bits(a), _bits(b)), f"{isa} differs from baseline"
    if E >= 16:  # a masked expert's gradient is exactly 0, as on the other backends
        grad = results["baseline"][1]
        assert (grad[3, ::5] == 0).all(), grad[3, ::5]
    keep = torch.isfinite(logits).all(dim=1)
    x, i = logits[keep], idx[keep]
    assert_fa_close(
        results["baseline"][0][keep],
        ref.gate(x, i, normalize=False).weights,
        ref.gate(x.double(), i, normalize=False).weights,
        "weights",
    )


@needs_native
def test_native_cpu_isa_names_and_errors():
    ops = torch.ops.replay_native
    active = ops.cpu_isa("")
    assert active in _cpu_isas()
    assert replay_ops.backends()["backends"]["native"]["cpu_isa"] == active
    with pytest.raises(ValueError, match=r"isa='sse9' is not a CPU ISA; expected baseline"):
        ops.cpu_isa("sse9")
    assert ops.cpu_isa("") == active


@needs_native
def test_native_cpu_isa_environment_cap():
    code = "import replay_ops; print(replay_ops.backends()['backends']['native']['cpu_isa'])"
    env = dict(os.environ, REPLAY_OPS_CPU_ISA="baseline")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "baseline", out.stderr[-2000:]
    env["REPLAY_OPS_CPU_ISA"] = "avx9"
    code += (
        "\nimport torch\ntry:\n"
        "    replay_ops.gate(torch.randn(3, 4), torch.zeros(3, 1, dtype=torch.long),"
        " normalize=False, backend='native')\n"
        "except ValueError as e:\n    print('raised:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    msg = "REPLAY_OPS_CPU_ISA='avx9' is not a CPU ISA; expected baseline, avx2 or avx512"
    lines = out.stdout.splitlines()
    assert lines[0].startswith("error: ") and msg in lines[0], out.stdout
    assert lines[1].startswith("raised: ") and msg in lines[1], out.stdout


# ------------------------------------------------------------------------ bad input
@needs_native
def test_native_gate_returns_fresh_tensors():
    idx = torch.tensor([[0, 2], [1, -1]], dtype=torch.int32)
    plan = replay_ops.gate(torch.randn(2, 3), idx, backend="native")
    assert plan.expert_indices.data_ptr() != idx.data_ptr()
    plan.expert_indices[0, 0] = 2
    assert idx[0, 0] == 0


# ----------------------------------------------------------------- CUDA compile check
def test_cuda_kernels_compile_without_warnings_or_spills():
    """The standalone check of csrc/cuda/*.cu (nvcc, sm_80 and sm_90a, -Werror, 0 spill
    stores; cached by the sources' hash). `make test` makes the same checks on its CUDA
    wheel builds (.ci/cuda_build_job.sh: warnings and ptxas spills fail the job, sm_80 and
    sm_90) and sets REPLAY_OPS_CUDA_CHECKED_IN_WHEELS, so it does not compile them twice."""
    if os.environ.get("REPLAY_OPS_CUDA_CHECKED_IN_WHEELS") == "1":
        pytest.skip("make test checks the CUDA kernels' compile (warnings, spills) in its "
                    "CUDA wheel jobs (.ci/cuda_build_job.sh); `make check-cuda` runs this")
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None
    )
    if nvcc is None:
        pytest.skip("nvcc not found: the CUDA kernels cannot be compile-checked here")
    out = subprocess.run(
        ["bash", str(ROOT / ".ci" / "check_cuda.sh")], capture_output=True, text=True,
        timeout=900, cwd=ROOT, env={**os.environ, "PY": sys.executable},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "check_cuda: OK" in out.stdout, out.stdout


# -------------------------------------------------------------------------- GPU only
def _native_cuda_ready():
    mod = _backend.load("native")
    return mod is not None and mod.available("cuda")


gpu_native = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device; none is present"),
    pytest.mark.skipif(HAS_CUDA and not _native_cuda_ready(),
                       reason="replay_ops._C was built without the CUDA kernels"),
]

GPU_CASES = [  # (T, E, K, align): single-launch path, then the multi-CTA path
    (1, 8, 1, 1), (37, 9, 3, 4), (1000, 64, 8, 1), (20000, 128, 8, 16), (70001, 256, 2, 128),
]



@with_marks(gpu_native)
@pytest.mark.parametrize("T,E,K,align", GPU_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("normalize", [True, False])
def test_cuda_gate_matches_reference_and_triton(T, E, K, align, dtype, score_func, normalize):
    rec, idx = strided_indices(T, E, K, dtype=torch.int16, empty=0.1, seed=T, device="cuda")
    logits = make_logits(T, E, dtype, seed=E, device="cuda")
    kw = dict(score_func=score_func, normalize=normalize, scaling_factor=2.0, align=align)
    out = replay_ops.gate(logits, idx, backend="native", **kw)
    ref_out = ref.gate(logits, idx, **kw)
    assert_plan_ints_equal(out, ref_out)
    assert_fa_close(out.weights, ref_out.weights, ref_gate64(logits, idx, **kw).weights, "weights")
    if _backend.available("triton", "cuda"):
        tri = replay_ops.gate(logits, idx, backend="triton", **kw)
        assert_plan_ints_equal(out, tri)
        w64 = ref_gate64(logits, idx, **kw).weights
        assert_fa_close(out.weights, tri.weights, w64, "weights vs triton")


class _gate_path:
    """Run the CUDA gate on one launch path (replay_cuda::GatePath) inside the block."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.prev = torch.ops.replay_native.cuda_gate_path(self.name)

    def __exit__(self, *exc):
        torch.ops.replay_native.cuda_gate_path(self.prev)


@with_marks(gpu_native)
@pytest.mark.parametrize(
    "T,E,K,align",
    [(37, 9, 3, 4), (1000, 64, 8, 1), (20000, 128, 8, 16), (70001, 256, 2, 128),
     (131072, 256, 8, 1), (4096, 1024, 8, 1)],
    ids=lambda v: str(v),
)
def test_cuda_gate_launch_paths_give_the_same_bits(T, E, K, align):
    """The single-CTA, cooperative (one launch, grid-wide barriers) and three-launch paths
    of the CUDA gate give the same bits, and the plan of the reference."""
    rec, idx = strided_indices(T, E, K, dtype=torch.int32, empty=0.05, seed=T + 1, device="cuda")
    logits = make_logits(T, E, torch.bfloat16, seed=E + 1, device="cuda")
    paths = ["cooperative", "three_launches"] + (["single_cta"] if T * K <= 8192 else [])
    outs = {}
    for path in paths:
        with _gate_path(path):
            outs[path] = replay_ops.gate(logits, idx, align=align, validate=False,
                                         backend="native")
    # A grid of 3 CTAs makes every CTA stride over many chunks and expert groups (the reuse
    # of its shared-memory counters across iterations).
    paths.append("cooperative, 3 CTAs")
    prev = torch.ops.replay_native.cuda_gate_max_ctas(3)
    try:
        with _gate_path("cooperative"):
            outs[paths[-1]] = replay_ops.gate(logits, idx, align=align, validate=False,
                                              backend="native")
    finally:
        torch.ops.replay_native.cuda_gate_max_ctas(prev)
    assert_plan_ints_equal(outs["cooperative"], ref.gate(logits, idx, align=align))
    for path in paths[1:]:
        for a, b in zip(outs["cooperative"], outs[path]):
            assert torch.equal(a, b), path


def test_cuda_gate_path_names_are_checked():
    if not hasattr(torch.ops.replay_native, "cuda_gate_path"):
        pytest.skip("replay_ops._C was built without the CUDA kernels")
    assert torch.ops.replay_native.cuda_gate_path("") == "auto"
    with pytest.raises(ValueError, match="gate path 'warp' is unknown; expected auto"):
        torch.ops.replay_native.cuda_gate_path("warp")
    assert torch.ops.replay_native.cuda_gate_max_ctas(-1) == 0


@with_marks(gpu_native)
@pytest.mark.parametrize("H", [4096, 7168, 1000, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_permute_unpermute_and_backward(H, dtype):
    T, E, K = 513, 64, 8
    idx = make_indices(T, E, K, empty=0.1, seed=H, device="cuda")
    logits = make_logits(T, E, dtype, device="cuda").requires_grad_(True)
    hidden = torch.randn(T, H, device="cuda", dtype=dtype, requires_grad=True)

    def run(backend, lg, hd):
        plan = replay_ops.gate(lg, idx, align=16, backend=backend)
        x = replay_ops.permute(hd, plan, plan.max_rows, backend=backend)
        y = replay_ops.unpermute(x * 2, plan, backend=backend)
        gl, gh = torch.autograd.grad(y.float().square().sum(), (lg, hd))
        return x, y, gl, gh

    nat = run("native", logits, hidden)
    same = run("torch", logits, hidden)
    r64 = run("torch", logits.double(), hidden.double())
    assert torch.equal(nat[0], same[0])
    for name, o, s, r in zip(("y", "grad logits", "grad hidden"), nat[1:], same[1:], r64[1:]):
        assert_fa_close(o, s, r, name)


@with_marks(gpu_native)
def test_cuda_bitwise_deterministic_100_runs():
    T, E, K, H = 40000, 128, 8, 512
    idx = make_indices(T, E, K, empty=0.02, seed=1, device="cuda")
    logits = make_logits(T, E, torch.bfloat16, device="cuda")
    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    first = None
    for _ in range(100):
        plan = replay_ops.gate(logits, idx, align=16, validate=False, backend="native")
        x = replay_ops.permute(hidden, plan, plan.max_rows, validate=False, backend="native")
        y = replay_ops.unpermute(x, plan, backend="native")
        cur = (*plan[:6], x, y)
        if first is None:
            first = cur
        else:
            for a, b in zip(first, cur):
                assert torch.equal(a, b)


@with_marks(gpu_native)
@pytest.mark.parametrize("path", ["auto", "cooperative", "three_launches"])
def test_cuda_graph_capture_and_replay(path):
    T, E, K, H = 20000, 64, 4, 256
    idx = make_indices(T, E, K, seed=2, device="cuda")
    logits = make_logits(T, E, torch.bfloat16, device="cuda")
    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    max_rows = T * K + E * 15

    def step():
        plan = replay_ops.gate(logits, idx, align=16, validate=False, backend="native")
        x = replay_ops.permute(hidden, plan, max_rows, validate=False, backend="native")
        return plan, replay_ops.unpermute(x, plan, backend="native")

    with _gate_path(path):
        graph, (plan_g, y_g) = capture_cuda_graph(step)
        logits.copy_(make_logits(T, E, torch.bfloat16, seed=9, device="cuda"))
        idx.copy_(make_indices(T, E, K, seed=10, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        plan_e, y_e = step()
    for a, b in zip((*plan_g, y_g), (*plan_e, y_e)):
        assert torch.equal(a, b)


@with_marks(gpu_native)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_cuda_compute_sanitizer(tool):
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("compute-sanitizer not found on PATH")
    code = textwrap.dedent(
        """
        import torch, replay_ops
        cases = [(37, 9, 3, 4, "auto", 0), (3000, 64, 8, 16, "cooperative", 0),
                 (3000, 64, 8, 16, "cooperative", 2), (3000, 64, 8, 16, "three_launches", 0)]
        for T, E, K, align, path, max_ctas in cases:
            torch.ops.replay_native.cuda_gate_path(path)
            torch.ops.replay_native.cuda_gate_max_ctas(max_ctas)
            idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
            idx[T // 2] = -1
            lg = torch.randn(T, E, device="cuda", requires_grad=True)
            hd = torch.randn(T, 264, device="cuda", requires_grad=True)
            plan = replay_ops.gate(lg, idx, align=align, backend="native")
            x = replay_ops.permute(hd, plan, plan.max_rows, backend="native")
            y = replay_ops.unpermute(x, plan, backend="native")
            y.sum().backward()
        torch.cuda.synchronize()
        print("OK")
        """
    )
    # without the caching allocator, an overrun inside a cached block and a read of memory
    # an earlier tensor wrote are visible to the sanitizer
    out = subprocess.run(
        [exe, "--tool", tool, "--error-exitcode", "3", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=1200,
        env=dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1"),
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-4000:] + out.stderr[-4000:]


@needs_native
@pytest.mark.parametrize("align", [2**31, 2**62, 2**63 - 1])
def test_direct_calls_refuse_a_plan_past_int32_even_where_int64_wraps(align):
    """The kernels' own capacity check (direct torch.ops.replay_native calls, past the
    Python checks): T*K + E*(align-1) is compared without forming the product, which for a
    huge align wraps int64 to a small value and let a zero 32-bit align reach the kernels."""
    _native()
    logits, idx = make_logits(3, 4), make_indices(3, 4, 2)
    with pytest.raises(ValueError, match="does not fit its int32"):
        torch.ops.replay_native.gate_fwd(logits, idx, None, None, 0, True, 1.0, align, 0, 0,
                                         False, 0, 0, 0, False)
    with pytest.raises(ValueError, match="does not fit its int32"):
        torch.ops.replay_native.gate_dense_fwd(logits, idx, None, None, None, 0, True, 1.0, 0, 1,
                                               0, False, align, True, 0, False, 0, 0, 0, False)
