"""The compile check of the Triton kernels (tools/triton_compile_check.py, `make
check-triton`, part of `make test`): its sampling, its rules, and one real compile of the
sqrt-softplus gate kernels for sm_90 with Triton's ptxas (no GPU needed). The full check
compiles every specialisation for sm_80 and sm_90 in `make check-triton`; these tests keep
the tool itself honest and fast.

The tool runs in a subprocess: the compile must not run under TRITON_INTERPRET, which this
test session sets (tests/conftest.py)."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "triton_compile_check.py"

import triton_compile_check as tcc  # tools/ (pytest pythonpath); imports no triton

pytest.importorskip("triton")


def _run(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_all_pairs_covers_every_pair_of_values():
    factors = {"a": list(range(6)), "b": list("xyzuvwpq"), "c": [0, 1, 2], "d": [True, False],
               "e": ["s", "t", "u", "v"]}
    rows = tcc.all_pairs(factors)
    for f, g in itertools.combinations(factors, 2):
        seen = {(r[f], r[g]) for r in rows}
        assert seen == set(itertools.product(factors[f], factors[g])), (f, g)
    assert len(rows) < 0.1 * 6 * 8 * 3 * 2 * 4  # far fewer than the full product
    assert rows == tcc.all_pairs(factors)  # deterministic


def test_cases_reach_every_launcher_and_regime():
    cs = tcc.cases()
    assert {c["op"] for c in cs} == {"gate_fwd", "gate_bwd", "permute_fwd", "permute_bwd",
                                     "unpermute_fwd", "unpermute_bwd", "gate_dense_fwd",
                                     "gate_dense_bwd", "permute_probs_fwd", "permute_probs_bwd",
                                     "codec_sort", "codec_unsort", "gate_select_fwd",
                                     "gate_select_bwd", "gate_fwd_weights32"}
    codec = [c for c in cs if c["op"].startswith("codec")]
    assert {(c["op"], c["order"], c["K"]) for c in codec} == set(
        itertools.product(["codec_sort", "codec_unsort"], ["set", "keep"], [1, 2, 8, 13, 20]))
    # both order codes (format 1's and format 2's inverse) with keep rows
    assert {(c["op"], c["inverse"]) for c in codec if c["order"] == "keep"} == set(
        itertools.product(["codec_sort", "codec_unsort"], [False, True]))
    gate = [c for c in cs if c["op"] == "gate_fwd"]
    assert {(c["logits"], c["index"]) for c in gate} == set(
        itertools.product(tcc.LOGITS_DTYPES, tcc.INDEX_DTYPES))
    assert {(c["mode"], c["shape"]) for c in gate} == set(
        itertools.product(tcc.SCORE_MODES, tcc.GATE_SHAPES))
    from replay_ops.triton_kernels import gate as G

    paths = {G.gate_config(T, K, E, c["align"]).single for c in gate
             for T, E, K in [c["shape"]]}
    assert paths == {True, False}  # both plan paths
    assert max(c["shape"][2] for c in gate) == G.MAX_TOPK


def test_every_kernel_has_a_launch_and_every_launch_sets_fp_fusion():
    out = _run("--list", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    kernels = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("_")}
    assert kernels == {"_gate_fwd_kernel", "_plan_scan_kernel", "_plan_scatter_kernel",
                       "_gate_bwd_kernel", "_permute_fwd_kernel", "_gather_sum_kernel",
                       "_unpermute_bwd_dx_kernel", "_unpermute_bwd_dw_kernel",
                       "_gate_dense_fwd_kernel", "_gate_dense_bwd_kernel",
                       "_permute_probs_fwd_kernel", "_permute_probs_bwd_kernel",
                       "_codec_sort_kernel", "_codec_unsort_kernel"}


def test_rules_flag_what_they_should():
    ok = dict(status="ok", spill_stores=0, launch_options={"enable_fp_fusion": False},
              approx=[], int32_stride_products=[])
    assert tcc.problems(ok, 8) == []
    assert "spill" in tcc.problems(dict(ok, spill_stores=12), 8)[0]
    # the agreement forward has its own budget; no other specialisation shares it
    agree = dict(ok, spill_stores=92, cases=["gate_select_fwd select=mask agreement=True"])
    assert tcc.problems(agree, 8) == []
    assert "spill" in tcc.problems(dict(agree, cases=["gate_select_fwd agreement=False"]), 8)[0]
    big = tcc.AGREEMENT_SPILL_BUDGET_BYTES + 4
    assert "spill" in tcc.problems(dict(agree, spill_stores=big), 8)[0]
    assert "enable_fp_fusion" in tcc.problems(dict(ok, launch_options={}), 8)[0]
    assert "approximate" in tcc.problems(dict(ok, approx=["sqrt.approx"]), 8)[0]
    assert "does not compile" in tcc.problems(dict(status="error", error="boom"), 8)[0]
    assert "64-bit integer division" in tcc.problems(dict(ok, int64_divisions=1), 8)[0]
    assert tcc.INT64_DIVISION.search("div.s64 %rd3, %rd1, %rd2;")
    assert not tcc.INT64_DIVISION.search("div.s32 %r3, %r1, %r2;")
    ptx = "sqrt.approx.ftz.f32 %f1, %f2;\n div.full.f32 %f3, %f4, %f5;\n ex2.approx.f32 %f6, %f7;"
    import re

    found = {k for k, p in tcc.APPROX_PATTERNS.items() if re.search(p, ptx)}
    assert found == {"sqrt.approx", "div.full/approx", "ex2.approx"}
    assert not any(re.search(p, "sqrt.rn.f32 %f1, %f2;\n div.rn.f32 %f3, %f4, %f5;")
                   for p in tcc.APPROX_PATTERNS.values())


def test_int32_rule_finds_a_32_bit_stride_product():
    """The TTIR of the permute kernel before its column offsets were made 64-bit."""
    ttir = """
  tt.func public @k(%X_ptr: !tt.ptr<f16>, %H: i32, %stride_xh: i32) attributes {} {
    scf.for %h0 = %c0_i32 to %H step %c256_i32  : i32 {
      %h = tt.make_range {end = 256 : i32, start = 0 : i32} : tensor<256xi32> loc(#loc52)
      %h_25 = arith.addi %h_24, %h : tensor<256xi32> loc(#loc53)
      %v_37 = tt.expand_dims %h_25 {axis = 0 : i32} : tensor<256xi32> -> tensor<1x256xi32>
      %v_38 = tt.splat %stride_xh : i32 -> tensor<1x256xi32> loc(#loc59)
      %v_39 = arith.muli %v_37, %v_38 : tensor<1x256xi32> loc(#loc59)
      %w_1 = arith.extsi %stride_xh : i32 to i64 loc(#loc59)
      %w_2 = arith.muli %w_0, %w_1 : i64 loc(#loc59)
      %x = tt.load %p, %m : tensor<1x256x!tt.ptr<i32>> loc(#loc60)
      %y = arith.muli %x, %x : tensor<1x256xi32> loc(#loc61)
    }
"""
    bad = tcc.int32_stride_products(ttir)
    assert bad == ["%v_39 = arith.muli %v_37, %v_38 : tensor<1x256xi32>"]


def test_sqrtsoftplus_gate_kernels_compile_precise_for_sm90():
    """One real compile each of the sqrt-softplus gate forward and backward for sm_90: no
    ex2.approx, sqrt.approx, div.full or flush-to-zero square root (a subnormal softplus
    must reach the square root unflushed), fusion off, no spill above the budget."""
    out = _run("--match", "mode=sqrtsoftplus T=4096", "--archs", "90", "--no-write")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "triton_compile_check: OK" in out.stdout
    assert "_gate" in out.stdout
