"""The CUDA kernels' arithmetic, run on the CPU: csrc/tests/device_math_check.cpp is built
with -DRO_EMULATE_DEVICE_MATH, so replay_math.h takes its device branches (the reciprocal
estimates and FMA refinements the GPU runs, with host stand-ins for the intrinsics), and
the gate's forward and backward sequences of the CUDA kernels are evaluated on extreme
logits for every score function and normalize setting, against the fp64 reference.

Before the device division was made safe, sigmoid(x) was NaN below -88.7 in fp32 (and the
NaN spread to the token's weights and gradient with normalize=True), and the fp64 paths
were NaN below -709.8; these cases are here."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from replay_ops import reference as ref
from replay_ops import scores

from _helpers import assert_fa_close

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "csrc" / "tests" / "device_math_check.cpp"

# (dtype, logits [E], indices [K]): below -88 (fp32 exp underflow), below -709 (fp64),
# every selected logit below -50, large positive logits, and mixes with empty slots.
E = 6
ROWS = [
    (torch.float32, [-90.0, -100.0, -150.0, 2.0, 50.0, -60.0], [0, 1, 2]),
    (torch.float32, [-90.0, -100.0, -150.0, 2.0, 50.0, -60.0], [3, 0, 5]),
    (torch.float32, [-55.0, -60.0, -70.0, -80.0, -51.0, -52.0], [4, 5, 0]),
    (torch.float32, [100.0, 88.8, 89.0, -100.0, 0.0, 1.0], [1, 2, -1]),
    (torch.float32, [-200.0, 3.0, -1e4, 7.0, -0.5, 1e4], [0, 2, 5]),
    (torch.float64, [-710.0, -720.0, -800.0, -745.0, 1.0, 2.0], [0, 1, 2]),
    (torch.float64, [-708.0, -709.9, -730.0, 3.0, 0.0, -1.0], [1, 2, 3]),
    (torch.float64, [-1e3, -2e3, 5.0, 800.0, -60.0, -55.0], [0, 1, -1]),
]
GRAD = [1.0, -2.0, 0.5]
SCALE = 2.5


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the device-arithmetic check")
    headers = sorted((ROOT / "csrc" / "include").glob("*.h"))
    key = hashlib.sha256(b"".join(p.read_bytes() for p in [SRC, *headers])).hexdigest()[:16]
    out = ROOT / "build" / "device_math" / f"check-{key}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = tmp_path_factory.mktemp("device_math") / "check"
        # -ffp-contract=off: the CUDA build compiles with --fmad=false (no implicit FMA)
        subprocess.run([cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Wextra",
                        "-Werror", "-DRO_EMULATE_DEVICE_MATH", f"-I{ROOT / 'csrc' / 'include'}",
                        str(SRC), "-o", str(tmp)], check=True, timeout=300)
        shutil.move(tmp, out)
    return out


def _cases():
    return [(sf, norm, r) for sf in scores.NAMES for norm in (False, True) for r in ROWS]


def _run(program, cases):
    lines = []
    for sf, norm, (dtype, x, idx) in cases:
        bits = 64 if dtype == torch.float64 else 32
        fields = [bits, scores.get(sf).id, int(norm), SCALE, E, len(idx), *x, *idx, *GRAD]
        lines.append(" ".join(repr(float(v)) if isinstance(v, float) else str(v)
                              for v in fields))
    out = subprocess.run([str(program)], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, timeout=120, check=True)
    return [[float(v) for v in line.split()] for line in out.stdout.splitlines()]


def _reference(sf, norm, dtype, x, idx):
    """(weights, logits gradient) of the reference in `cdt` (fp64 for the oracle, the
    input dtype for the same-precision reference)."""
    out = {}
    for name, cdt in (("ref64", torch.float64), ("same", dtype)):
        lg = torch.tensor([x], dtype=dtype).to(cdt).requires_grad_(True)
        w = ref.gate(lg, torch.tensor([idx]), score_func=sf, normalize=norm,
                     scaling_factor=SCALE, validate=False).weights
        (w * torch.tensor([GRAD], dtype=cdt)).sum().backward()
        out[name] = (w.detach()[0], lg.grad[0])
    return out


def _results(program, cases):
    """Per case: (the case, its description, the device weights [K] and logits gradient [E]
    in the case's dtype, the references of `_reference`)."""
    results = _run(program, cases)
    assert len(results) == len(cases)
    for case, vals in zip(cases, results):
        sf, norm, (dtype, x, idx) = case
        K = len(idx)
        out_w = torch.tensor(vals[:K], dtype=torch.float64).to(dtype)
        out_g = torch.tensor(vals[K:], dtype=torch.float64).to(dtype)
        yield (case, f"{sf} normalize={norm} {dtype} x={x} idx={idx}", out_w, out_g,
               _reference(sf, norm, dtype, x, idx))


def test_device_arithmetic_on_extreme_logits(program):
    for (sf, norm, (dtype, x, idx)), what, out_w, out_g, r in _results(program, _cases()):
        for name, out, same, r64 in (("weights", out_w, r["same"][0], r["ref64"][0]),
                                     ("grad", out_g, r["same"][1], r["ref64"][1])):
            finite = torch.isfinite(r64)
            assert torch.isfinite(out[finite]).all(), f"{name} not finite: {out} ({what})"
            assert_fa_close(out, same.to(dtype), r64, f"{name} ({what})")


def test_device_division_edge_cases(program):
    """The denominators that broke the old device division: an infinite one (1 + exp(800)
    in sigmoid), and fp64 ones outside the float range (2 * sqrt(softplus(-720)) = 4.9e-157
    in the sqrt-softplus gradient)."""
    cases = [("sigmoid", True, (torch.float32, [-100.0, -95.0, -89.0, -120.0, 0.0, 1.0],
                                [0, 1, 2])),
             ("sqrtsoftplus", True, (torch.float64, [-720.0, -730.0, -700.0, 0.0, 1.0, 2.0],
                                     [0, 1, 2]))]
    for (sf, norm, (dtype, x, idx)), vals in zip(cases, _run(program, cases)):
        assert all(v == v for v in vals), (sf, vals)  # no NaN
        r = _reference(sf, norm, dtype, x, idx)
        got = torch.tensor(vals[:3], dtype=torch.float64).to(dtype)
        assert_fa_close(got, r["same"][0].to(dtype), r["ref64"][0], f"{sf} weights")
        # the weights are not all zero: these rows have routes with non-negligible scores
        assert (got.abs() > 0).any()


def test_sqrtsoftplus_of_a_subnormal_softplus(program):
    """sqrt(softplus(z)) where softplus(z) = exp(z) is subnormal in fp32 (z < -87.3; at
    z = -100 it keeps 5 significant bits) or underflows to 0 (z < -103.3), while the score
    exp(z / 2) is a normal number. The device sequence (ro_exp, ro_log1p, then ro_sqrt's
    reciprocal square-root estimate refined with FMA) must not flush the subnormal: the
    score and its gradient are not 0, and are as close to fp64 as the same-precision
    reference (which goes through the same subnormal). fp64 rows: below -708 exp(z) is
    subnormal in fp64. The Triton kernels compute exp(z / 2) there instead (see
    tests/test_triton_kernels.py::test_sqrtsoftplus_of_a_subnormal_softplus)."""
    rows = [
        (torch.float32, [-88.0, -95.0, -100.0, -60.0, -103.0, 1.0], [0, 1, 2]),
        (torch.float32, [-88.0, -95.0, -100.0, -60.0, -103.0, 1.0], [2, 4, -1]),
        (torch.float32, [-90.5, -96.0, -101.0, -87.0, -5.0, 0.0], [0, 1, 3]),
        (torch.float64, [-710.0, -720.0, -740.0, -700.0, 0.0, 1.0], [0, 1, 2]),
    ]
    cases = [("sqrtsoftplus", norm, r) for norm in (False, True) for r in rows]
    for (sf, norm, (dtype, x, idx)), what, out_w, out_g, r in _results(program, cases):
        valid = torch.tensor(idx) >= 0
        # z < -103.3 (fp32): softplus itself underflows to 0, in the reference too
        live = valid & (r["same"][0].to(dtype) != 0)
        assert (out_w[live] != 0).all(), f"score flushed to 0: {out_w} ({what})"
        sel = torch.tensor([i for i in idx if i >= 0])
        g_live = torch.zeros(E, dtype=torch.bool)
        g_live[sel[r["same"][0].to(dtype)[valid] != 0]] = True
        assert (out_g[g_live] != 0).all(), f"gradient flushed to 0: {out_g} ({what})"
        assert_fa_close(out_w, r["same"][0].to(dtype), r["ref64"][0], f"weights ({what})")
        assert_fa_close(out_g, r["same"][1].to(dtype), r["ref64"][1], f"grad ({what})")


def test_softmax_of_infinite_logits(program):
    """The device sequences on non-finite logits give the oracle's values (NaN where it has
    NaN): over the selection a max of -inf is taken as 0 (an all -inf selection gets
    weights 0 and zero gradients), and a +inf or NaN makes the row NaN; over all E the
    result is torch.softmax's (NaN for a row of -inf or with a +inf); a -inf among finite
    logits gets weight 0 and gradient 0."""
    ninf, inf = float("-inf"), float("inf")
    rows = [
        (torch.float32, [ninf, ninf, 1.0, 2.0, 0.0, 3.0], [0, 1, 2]),
        (torch.float32, [ninf] * 6, [0, 1, 2]),
        (torch.float32, [inf, 0.0, 1.0, 2.0, 0.0, 3.0], [0, 1, 2]),
        (torch.float32, [ninf, 0.0, 1.0, 2.0, 0.0, 3.0], [0, 1, -1]),
        (torch.float64, [ninf, ninf, ninf, 2.0, 0.0, 3.0], [0, 1, 2]),
        (torch.float32, [float("nan"), 0.0, 1.0, 2.0, 0.0, 3.0], [0, 1, 2]),  # a NaN sum
    ]
    cases = [("softmax", norm, r) for norm in (False, True) for r in rows]
    for (sf, norm, (dtype, x, idx)), what, out_w, out_g, r in _results(program, cases):
        torch.testing.assert_close(out_w, r["same"][0].to(dtype), equal_nan=True, msg=what)
        torch.testing.assert_close(out_g, r["same"][1].to(dtype), equal_nan=True, msg=what)
