#!/usr/bin/env python3
"""Compile every Triton kernel of replay_ops for sm_80 and sm_90 with no GPU, for the
specialisations the launchers choose, and check the machine code (`make check-triton`).

    python3 tools/triton_compile_check.py              # the check; writes the results
    python3 tools/triton_compile_check.py --list       # the cases, nothing compiled
    python3 tools/triton_compile_check.py --kernels _gate_fwd_kernel --no-write

Where the specialisations come from. Each case calls one public launcher of
`replay_ops.triton_kernels` (gate_fwd, gate_bwd, permute_fwd, permute_bwd, unpermute_fwd,
unpermute_bwd) on meta tensors (no memory, no device), with every `@triton.jit` kernel of
the kernel modules replaced by a recorder. The launcher runs its own config functions
(`gate_config`, `gate_bwd_config`, `row_config`) and its own argument list; the recorder
turns each launch into the signature, constexprs, divisibility attributes and compile
options with Triton's own specialisation code (`create_function_from_signature` and
`JITFunction._pack_args`, what a real launch runs; Triton internals as of 3.9, so a Triton
that changes them breaks the check loudly). Identical specialisations are compiled once.
So the check cannot drift from the launchers: a new block size, a new constexpr or a new
kernel is compiled as soon as a launcher uses it.

Compilation: `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`, Triton's
own LLVM and ptxas (`ptxas -v`, whose report gives the registers, spill stores and stack),
with TRITON_ALWAYS_COMPILE=1 and a fresh cache directory (nothing is reused between runs
or cases), in a pool of --jobs processes without TRITON_INTERPRET.

Sampling. The full cross-product (score function x normalize, logits dtype, index dtype,
block-shape class, memory layout, align, ...) is 12960 cases for the gate forward alone. The
cases are an all-pairs (pairwise) covering array over each op's factors: every pair of
values of any two factors occurs in at least one case, so each index dtype meets each
logits dtype, each score mode meets each block shape, plan path, layout and dtype, and so
on. Each shape class is picked to reach one block regime of the config functions (T=1;
the single-program path; its largest tile; the chunked path with the largest BLOCK_T x
E_BLOCK tile; large K; the largest K the kernels take; E not a power of two; H not a
multiple of 16; H above the block width). Sizes that only change runtime values are not
repeated.

Failures (exit status 1): a compile error, or a compile running longer than
COMPILE_TIMEOUT_S (its process is killed); spill stores above SPILL_BUDGET_BYTES in any
kernel; a launch that leaves the fp-fusion choice to Triton's default; an approximate or
flush-to-zero instruction in a kernel whose math is declared precise (MATH_POLICY); a
32-bit product of a stride argument (int32 overflow, see INT32_RULE); a 64-bit integer
division; a kernel of the modules that no case compiled.

Output: bench/results/triton_compile_sm80_sm90.md and .json (registers, spills, stack,
shared memory, widest global load, per specialisation and per kernel).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "triton_compile_sm80_sm90"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def setup_environment() -> str:
    """Before triton is imported (main() does it; the worker processes inherit it): no
    interpreter (re-executes without TRITON_INTERPRET, which Triton reads when a kernel is
    decorated), every kernel compiled anew into a fresh cache directory, ptxas -v's report
    printed. Returns the cache directory."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if "triton" in sys.modules:
        raise RuntimeError("triton_compile_check: triton was imported before the setup")
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="ro_triton_compile_")
    return os.environ["TRITON_CACHE_DIR"]

ARCHS = (80, 90)
KERNEL_MODULES = ("replay_ops.triton_kernels.gate", "replay_ops.triton_kernels.permute",
                  "replay_ops.triton_kernels.unpermute", "replay_ops.triton_kernels.gate_dense",
                  "replay_ops.triton_kernels.codec")

# Spill stores allowed per kernel, in bytes: 8, two 32-bit values or one pointer. What
# spills below that here is ptxas parking a value that is live across a loop in local
# memory at 96-168 registers, far below the limit of 255 (one store before the loop, one
# load after it or per iteration, from L1); it comes and goes with ptxas versions and
# unrelated code, and costs nothing measurable in these memory-bound kernels. A tile that
# does not fit in registers spills far more: 0.5-23 KB for the gate's 256 x 128 softmax
# tile, 40 B-5.6 KB in the unpermute backward, 36 B in the plan scan (before the caps in
# the config functions). The CUDA kernels' check (.ci/check_cuda.sh) allows 0; nvcc has
# no such parked values there.
SPILL_BUDGET_BYTES = 8
# The gate's forward with the agreement outputs (return_agreement: the model's own top-k
# set of every row, its membership test and the set's log-sum-exp) holds more per row than
# the registers give: up to 92 bytes of spill stores measured under Triton 3.9 (sm_80 and
# sm_90; bf16 up to 28) and 180 under 3.6 (sm_90), fp64 the largest. Its own budget, until
# that kernel's agreement part is split from it.
AGREEMENT_SPILL_BUDGET_BYTES = 192

# Math each kernel's PTX may not contain. Every kernel is declared precise (the NOTE on
# math in triton_kernels/_common.py): no ex2.approx (tl.exp's lowering; the kernels'
# precise_exp uses none), no approximate division, reciprocal, square root or logarithm,
# and no flush-to-zero division or square root (which would turn a subnormal softplus into
# a score of 0). The fma.ftz inside libdevice's logf (tl.log, with Triton's default FTZ
# reflection) is not matched: the gate's log1p takes logs of 1 + u >= 1 only.
APPROX_PATTERNS = {
    "ex2.approx": r"\bex2\.approx\.",
    "sqrt.approx": r"\bsqrt\.approx\.",
    "rsqrt.approx.f32": r"\brsqrt\.approx(?:\.ftz)?\.f32\b",
    "div.full/approx": r"\bdiv\.(?:full|approx)\.",
    "rcp.approx.f32": r"\brcp\.approx(?:\.ftz)?\.f32\b",
    "lg2.approx": r"\blg2\.approx\.",
    "ftz div/sqrt": r"\b(?:div|sqrt)\.rn\.ftz\.",
}
MATH_POLICY = {"precise": set(APPROX_PATTERNS)}  # every kernel is precise

# INT32_RULE: a product of a stride argument must be 64-bit. A column offset h * stride
# overflows int32 for a column-major [T, H] input once H * T >= 2^31, long before the
# tensors stop fitting on a GPU. Checked on the TTIR: every arith.muli whose result is i32
# and one of whose operands derives from an argument named stride_* is reported.
INT32_SOURCES = re.compile(r"^stride_")

# One specialisation may take this long to compile; longer is a failure (a bound against a hang: the slowest
# takes a few seconds, and make test must stay within minutes on a 2-core machine).
COMPILE_TIMEOUT_S = 300

# A 64-bit integer division or remainder is a subroutine call on the GPU; the row mapping
# (slot // K) divided in 64 bits in the gate and permute kernels.
INT64_DIVISION = re.compile(r"\b(?:div|rem)\.[su]64\b")

TYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64",
         "i16": "int16", "i32": "int32", "i64": "int64"}  # torch dtype names


# ------------------------------------------------------------------------------ sampling
def all_pairs(factors: dict[str, list]) -> list[dict]:
    """A deterministic greedy all-pairs covering array: rows (dicts factor -> value) such
    that every pair of values of two different factors occurs in some row. It starts from
    the full product of the two largest factors and fills the other factors, one at a
    time, with the value that covers the most pairs not yet covered (ties: the value used
    least so far, then the first)."""
    names = sorted(factors, key=lambda n: -len(factors[n]))
    vals = {n: list(range(len(factors[n]))) for n in names}
    todo = {((a, i), (b, j)) for a, b in itertools.combinations(names, 2)
            for i in vals[a] for j in vals[b]}
    used = {n: [0] * len(factors[n]) for n in names}

    def key(p, q):
        return (p, q) if names.index(p[0]) < names.index(q[0]) else (q, p)

    def fill(row):
        for n in names:
            if n in row:
                continue
            best = max(vals[n], key=lambda v: (
                sum(key((m, row[m]), (n, v)) in todo for m in row), -used[n][v], -v))
            row[n] = best
        for a, b in itertools.combinations(names, 2):
            todo.discard(key((a, row[a]), (b, row[b])))
        for n in names:
            used[n][row[n]] += 1
        return row

    rows = []
    if len(names) >= 2:
        for i in vals[names[0]]:
            for j in vals[names[1]]:
                rows.append(fill({names[0]: i, names[1]: j}))
    else:
        rows = [fill({names[0]: i}) for i in vals[names[0]]]
    while todo:
        (a, i), (b, j) = min(todo)
        rows.append(fill({a: i, b: j}))
    return [{n: factors[n][r[n]] for n in factors} for r in rows]


SCORE_MODES = [("softmax", False), ("softmax", True), ("sigmoid", False), ("sigmoid", True),
               ("sqrtsoftplus", False), ("sqrtsoftplus", True)]
# (T, E, K): each reaches one block regime of gate_config / gate_bwd_config.
GATE_SHAPES = [
    (1, 8, 1),          # T=1, K=1 (a constexpr 1), smallest tile
    (512, 64, 8),       # single program, BLOCK_T 128 x E_BLOCK 64
    (4096, 128, 1),     # single program, its largest tile: BLOCK_T 256 x E_BLOCK 128
    (19, 1000, 200),    # single program, E and K not powers of two, E_HIST 1024
    (16384, 128, 8),    # chunked (3 launches), BLOCK_T 128 x E_BLOCK 128
    (8192, 128, 1),     # chunked, the largest tile: BLOCK_T 256 x E_BLOCK 128
    (5000, 48, 2),      # chunked, odd T, E not a power of two
    (512, 256, 64),     # chunked, large K (BLOCK_T 16)
    (8192, 384, 6),     # chunked, E_HIST 512 and E_BLOCK 128 over 3 blocks
    (5, 1024, 1024),    # chunked, K = 1024: the largest K of the Triton gate
]
GATE_BWD_SHAPES = [(1, 8, 1), (512, 64, 8), (4096, 256, 8), (8192, 128, 1), (512, 256, 64),
                   (19, 1000, 200), (5, 1024, 1024)]
LOGITS_DTYPES = ["fp32", "fp16", "bf16", "fp64"]
INDEX_DTYPES = ["i64", "i32", "i16"]
# contiguous; column-major ([E, T] transposed: stride 1 along T, a large column stride);
# rows sliced from a wider tensor (a row stride >= 2^31: the stride argument is i64).
LAYOUTS = ["contiguous", "column-major", "wide-rows"]
ROW_H = [1, 7, 100, 256, 4096]  # H=1 is a constexpr 1; 7 and 100 are not multiples of 16
# The dense gate (gate_dense.py): its row-pass and plan regimes, its padding modes and inputs.
DENSE_SHAPES = [(1, 8, 1), (512, 64, 8), (16384, 128, 8), (5000, 48, 2), (512, 256, 64),
                (19, 1000, 200)]
DENSE_PADDING = ["empty", "spread", "fallback"]
# the flagged rows (replay mask False, or padding="select") and the selection rule:
# top-k of the scores; with an expert bias and group-limited top-k (DeepSeek-V3); of the
# logits with Megatron's rounding of the scores
SELECT_RULES = ["mask", "pad", "mask+bias+groups", "pad+logits+round"]
ROW_DTYPES = ["fp32", "fp16", "bf16", "fp64"]


def op_factors() -> dict[str, dict[str, list]]:
    """{launcher: {factor: values}}: what the cases of each launcher vary."""
    out = {
        "gate_fwd": {"mode": SCORE_MODES, "shape": GATE_SHAPES, "logits": LOGITS_DTYPES,
                     "index": INDEX_DTYPES, "layout": LAYOUTS, "align": [1, 16, 128],
                     "indices": ["contiguous", "strided"]},
        "gate_bwd": {"mode": SCORE_MODES, "shape": GATE_BWD_SHAPES, "logits": LOGITS_DTYPES,
                     "index": INDEX_DTYPES, "layout": LAYOUTS[:2]},
    }
    # the model's own selection of flagged rows, agreement and the set log-prob (forward)
    # and its gradient (backward): each selection rule, with both agreement settings
    out["gate_select_fwd"] = {"mode": SCORE_MODES, "select": SELECT_RULES,
                              "logits": ["fp32", "bf16", "fp64"], "agreement": [True, False],
                              "shape": [(512, 64, 8), (8192, 256, 8)]}
    out["gate_select_bwd"] = {"mode": SCORE_MODES, "logits": ["fp32", "bf16", "fp64"],
                              "shape": [(512, 64, 8), (8192, 256, 8)]}
    # fp32 weights from half / bf16 logits (weights_dtype): the weights' store differs
    out["gate_fwd_weights32"] = {"mode": SCORE_MODES, "logits": ["fp16", "bf16"],
                                 "shape": [(512, 64, 8), (8192, 256, 8)]}
    out["gate_dense_fwd"] = {"mode": SCORE_MODES, "shape": DENSE_SHAPES, "logits": LOGITS_DTYPES,
                             "index": INDEX_DTYPES, "padding": DENSE_PADDING,
                             "mask": [False, True], "plan": [True, False],
                             "guard": [True, False]}
    out["gate_dense_bwd"] = {"mode": SCORE_MODES, "shape": DENSE_SHAPES, "logits": LOGITS_DTYPES,
                             "grad": ["contiguous", "expanded"]}
    for op in ("permute_probs_fwd", "permute_probs_bwd"):
        out[op] = {"dtype": ROW_DTYPES, "K": [1, 2, 8, 64], "T": [1, 999, 4096]}
    for op in ("permute_fwd", "permute_bwd", "unpermute_fwd", "unpermute_bwd"):
        f = {"dtype": ROW_DTYPES, "H": ROW_H, "K": [1, 2, 8], "T": [1, 999, 4096]}
        if op != "permute_bwd":  # permute_bwd's grad_out is contiguous (ops.py)
            f["layout"] = LAYOUTS
        if op.startswith("unpermute"):
            f["weights"] = ["same", "fp32"]
        out[op] = f
    # the routing codec's row transform (codec.py): K from 1 to the Lehmer limit, the
    # narrow id types, both orders, both order codes (inverse: format 2's)
    out["codec_sort"] = {"K": [1, 2, 8, 13, 20], "E": [128, 300, 40000],
                         "order": ["set", "keep"], "routing": ["int16", "int64", "strided"],
                         "inverse": [False, True]}
    out["codec_unsort"] = {"K": [1, 2, 8, 13, 20], "E": [128, 300, 40000],
                           "order": ["set", "keep"], "out": ["int16", "int32"],
                           "inverse": [False, True]}
    return out


def cases() -> list[dict]:
    return [dict(op=op, **c) for op, f in op_factors().items() for c in all_pairs(f)]


def label(case: dict) -> str:
    parts = [case["op"]]
    for k, v in case.items():
        if k == "op":
            continue
        if k == "mode":
            v = f"{v[0]}{'+norm' if v[1] else ''}"
        elif k == "shape":
            v = "T=%d E=%d K=%d" % v
            parts.append(v)
            continue
        parts.append(f"{k}={v}")
    return " ".join(parts)


# ------------------------------------------------------------------------------ launches
def _hidden(shape, dtype, layout):
    import torch

    rows, cols = shape
    dt = getattr(torch, TYPES[dtype])
    if layout == "column-major":
        return torch.empty(cols, rows, dtype=dt, device="meta").t()
    if layout == "wide-rows":
        return torch.empty(rows, 2**31 + 64, dtype=dt, device="meta")[:, :cols]
    return torch.empty(rows, cols, dtype=dt, device="meta")


def run_launcher(case: dict) -> None:
    """Call the case's launcher on meta tensors (the kernels are recorders by then)."""
    import torch

    from replay_ops.plan import plan_capacity
    from replay_ops.triton_kernels import gate, gate_dense, permute, unpermute

    i32 = dict(dtype=torch.int32, device="meta")
    op = case["op"]
    if op in ("codec_sort", "codec_unsort"):
        from replay_ops.triton_kernels import codec

        N, K, E = 4096, case["K"], case["E"]
        if op == "codec_sort":
            if case["routing"] == "strided":  # one token's layer of a [T, L, K] recording
                r = torch.empty(N, 3, K, dtype=torch.int32, device="meta")[:, 1, :]
            else:
                r = torch.empty(N, K, dtype=getattr(torch, case["routing"]), device="meta")
            codec.sort_rows(r, E, case["order"], inverse=case["inverse"])
        else:
            srt = torch.empty(N, K, dtype=torch.uint8 if E <= 255 else torch.int16
                              if E <= 32767 else torch.int32, device="meta")
            code = (torch.empty(N, K, dtype=torch.uint8, device="meta")
                    if case["order"] == "keep" and K > 1 else None)
            codec.unsort_rows(srt, code, E, torch.empty(N, 2, K, dtype=getattr(
                torch, case["out"]), device="meta")[:, 0, :], inverse=case["inverse"])
        return
    if op in ("gate_dense_fwd", "gate_dense_bwd"):
        T, E, K = case["shape"]
        sf, norm = case["mode"]
        logits = _hidden((T, E), case["logits"], "contiguous")
        if op == "gate_dense_fwd":
            idx = torch.empty(T, K, dtype=getattr(torch, TYPES[case["index"]]), device="meta")
            mask = torch.empty(T, dtype=torch.bool, device="meta") if case["mask"] else None
            fb = torch.empty(T, K, dtype=torch.int64, device="meta") \
                if case["padding"] == "fallback" or case["mask"] else None
            gate_dense.gate_dense_fwd(logits, idx, mask, fb, sf, norm, 1.0, case["padding"],
                                      2 if E % 2 == 0 else 1, 3, case["guard"], 1, case["plan"])
        else:
            g = logits if case["grad"] == "contiguous" else \
                torch.empty(1, 1, dtype=logits.dtype, device="meta").expand(T, E)
            gate_dense.gate_dense_bwd(g, logits, torch.empty(T, K, **i32), sf, norm, 1.0)
        return
    if op in ("permute_probs_fwd", "permute_probs_bwd"):
        T, K, E = case["T"], case["K"], 64
        dt = getattr(torch, TYPES[case["dtype"]])
        idx = torch.empty(T, K, **i32)
        if op == "permute_probs_fwd":
            gate_dense.permute_probs_fwd(torch.empty(T, E, dtype=dt, device="meta"),
                                         torch.empty(plan_capacity(T, K, E, 1), **i32), idx,
                                         T * K)
        else:
            gate_dense.permute_probs_bwd(torch.empty(T * K, dtype=dt, device="meta"),
                                         torch.empty(T, K, **i32), idx, E)
        return
    if op == "gate_fwd_weights32":
        T, E, K = case["shape"]
        sf, norm = case["mode"]
        gate.gate_fwd(_hidden((T, E), case["logits"], "contiguous"),
                      torch.empty(T, K, **i32), sf, norm, 1.0, 1,
                      weights_dtype=torch.float32)
        return
    if op in ("gate_select_fwd", "gate_select_bwd"):
        from replay_ops import Selection

        T, E, K = case["shape"]
        sf, norm = case["mode"]
        logits = _hidden((T, E), case["logits"], "contiguous")
        idx = torch.empty(T, K, **i32)
        if op == "gate_select_bwd":
            gw = torch.empty(T, K, dtype=logits.dtype, device="meta")
            gate.gate_bwd(gw, logits, idx, sf, norm, 1.0,
                          torch.empty(T, dtype=torch.float32, device="meta"))
            return
        rule = case["select"]
        sel = Selection(
            source="logits" if "logits" in rule else "scores", round_scores="round" in rule,
            expert_bias=torch.empty(E, dtype=torch.float32, device="meta")
            if "bias" in rule else None,
            num_groups=8 if "groups" in rule else 0, group_topk=4 if "groups" in rule else 0)
        mask = torch.empty(T, dtype=torch.bool, device="meta") if "mask" in rule else None
        gate.gate_fwd(logits, idx, sf, norm, 1.0, 1, replay_mask=mask,
                      pad_select="pad" in rule, selection=sel,
                      return_agreement=case["agreement"])
        return
    if op in ("gate_fwd", "gate_bwd"):
        T, E, K = case["shape"]
        sf, norm = case["mode"]
        logits = _hidden((T, E), case["logits"], case["layout"])
        if case.get("indices") == "strided":  # one layer of a [T, L, K] recording
            idx = torch.empty(T, 3, K, dtype=getattr(torch, TYPES[case["index"]]),
                              device="meta")[:, 1, :]
        else:
            idx = torch.empty(T, K, dtype=getattr(torch, TYPES[case["index"]]), device="meta")
        if op == "gate_fwd":
            gate.gate_fwd(logits, idx, sf, norm, 1.0, case["align"])
        else:
            gw = torch.empty(T, K, dtype=logits.dtype, device="meta")
            gate.gate_bwd(gw, logits, idx, sf, norm, 1.0)
        return
    T, H, K = case["T"], case["H"], case["K"]
    R = T * K
    rmap = torch.empty(T, K, **i32)
    slots = torch.empty(plan_capacity(T, K, 8, 1), **i32)
    wdt = case["dtype"] if case.get("weights", "same") == "same" else case["weights"]
    w = torch.empty(T, K, dtype=getattr(torch, TYPES[wdt]), device="meta")
    layout = case.get("layout", "contiguous")
    if op == "permute_fwd":
        permute.permute_fwd(_hidden((T, H), case["dtype"], layout), slots, rmap, R)
    elif op == "permute_bwd":
        permute.permute_bwd(_hidden((R, H), case["dtype"], "contiguous"), rmap)
    elif op == "unpermute_fwd":
        unpermute.unpermute_fwd(_hidden((R, H), case["dtype"], layout), rmap, w)
    elif op == "unpermute_bwd":
        g = _hidden((T, H), case["dtype"], "contiguous")
        unpermute.unpermute_bwd(g, _hidden((R, H), case["dtype"], layout), rmap, slots, w)
    else:
        raise ValueError(op)


def kernel_objects() -> dict:
    """{kernel name: (module, attribute, JITFunction)} of every kernel in the modules."""
    import importlib

    from triton.runtime.jit import JITFunction

    found = {}
    for modname in KERNEL_MODULES:
        mod = importlib.import_module(modname)
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and name.endswith("_kernel") \
                    and obj.__module__ == modname:
                found[name] = (mod, name, obj)
    return found


class _Recorder:
    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.fn, args, kwargs))
        return launch


def specialise(fn, args, kwargs, arch: int) -> dict:
    """What a launch of JITFunction `fn` with these arguments compiles, on `arch`: Triton's
    own binder and argument packing, as in JITFunction.run."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs)
    explicit = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    for opt in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, opt):
            kwargs[opt] = getattr(knobs.compilation, opt)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    return {"signature": signature, "constexprs": constexprs, "attrs": attrs,
            "options": options.__dict__, "launch_options": explicit}


def collect(case_list: list[dict], archs) -> tuple[list[dict], dict]:
    """Unique (kernel, arch, specialisation) jobs of all cases; {kernel: module name}."""
    kernels = kernel_objects()
    log: list = []
    saved = [(mod, attr, fn) for mod, attr, fn in kernels.values()]
    for mod, attr, fn in saved:
        setattr(mod, attr, _Recorder(fn, log))
    jobs: dict[str, dict] = {}
    try:
        for case in case_list:
            del log[:]
            run_launcher(case)
            for fn, args, kwargs in log:
                for arch in archs:
                    sp = specialise(fn, args, kwargs, arch)
                    key = repr((fn.__name__, arch, sorted(sp["signature"].items()),
                                sorted(sp["constexprs"].items(), key=repr),
                                sorted(sp["attrs"].items(), key=repr),
                                sorted(sp["launch_options"].items())))
                    if key in jobs:
                        jobs[key]["cases"].append(label(case))
                        continue
                    jobs[key] = dict(kernel=fn.__name__, module=fn.__module__, arch=arch,
                                     cases=[label(case)], **sp)
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)
    return list(jobs.values()), {k: v[2].__module__ for k, v in kernels.items()}


# ------------------------------------------------------------------------------- compile
_PTXAS = {
    "regs": re.compile(r"Used (\d+) registers"),
    "spills": re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads"),
}


def int32_stride_products(ttir: str) -> list[str]:
    """The i32 arith.muli of the TTIR with an operand derived from a stride_* argument
    (see INT32_RULE), as their source lines. A forward pass over the SSA definitions in
    program order; MLIR reuses value names in nested regions, so each definition sets its
    name's state anew. Comparisons and loads end a chain (a flag, or data)."""
    m = re.search(r"tt\.func public @\w+\((.*?)\) attributes", ttir, re.S)
    tainted = set()
    if m:
        for name, ty in re.findall(r"%(\w+): (i32|i64)", m.group(1)):
            if INT32_SOURCES.search(name) and ty == "i32":
                tainted.add(name)

    def mark(name, on):
        (tainted.add if on else tainted.discard)(name)

    bad = []
    for line in ttir.splitlines():
        body = line.split(" loc(")[0].strip()
        if body.startswith("^bb"):  # block arguments of a reduce/scan body
            for name in re.findall(r"%([\w.]+):", body):
                mark(name, False)
            continue
        d = re.match(r"%([\w.]+)(?::\d+)? = ([\w.\"]+)(.*)", body)
        if not d:
            continue
        name, op, rest = d.groups()
        op = op.strip('"')
        if op == "scf.for":
            f = re.match(r"\s*%([\w.]+) = %([\w.]+) to %([\w.]+) step %([\w.]+)", rest)
            if f:
                mark(f.group(1), bool({f.group(2), f.group(3), f.group(4)} & tainted))
            inits = re.findall(r"%([\w.]+) = %([\w.]+)", rest.split("iter_args", 1)[-1]) \
                if "iter_args" in rest else []
            for a, b in inits:
                mark(a, b in tainted)
            mark(name, any(b in tainted for _, b in inits))
            continue
        operands = set(re.findall(r"%([\w.]+)", rest))
        if op.startswith("arith.cmp") or op == "tt.load":
            mark(name, False)  # a flag or loaded data, not an index computed from a stride
            continue
        on = bool(operands & tainted)
        mark(name, on)
        if on and op == "arith.muli" and re.search(r":\s*(?:tensor<[\dx]*xi32>|i32)$", rest):
            bad.append(body)
    return bad


def widest_global_load(ptx: str) -> int:
    """Bits of the widest ld.global of the PTX (0 when none)."""
    best = 0
    for vec, bits in re.findall(r"ld\.global(?:\.[a-z0-9_:]+)*?(?:\.v(\d))?\.[bsuf](\d+)\b",
                                ptx):
        best = max(best, int(vec or 1) * int(bits))
    return best


def compile_job(job: dict) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(job["module"]), job["kernel"])
    row = {k: job[k] for k in ("kernel", "arch", "cases")}
    row["constexprs"] = {fn.arg_names[p[0]]: _show(v) for p, v in job["constexprs"].items()}
    row["signature"] = {k: v for k, v in job["signature"].items() if v != "constexpr"}
    row["launch_options"] = job["launch_options"]
    t0 = time.perf_counter()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            ck = triton.compile(ASTSource(fn, job["signature"], job["constexprs"], job["attrs"]),
                                target=GPUTarget("cuda", job["arch"], 32),
                                options=job["options"])
    except Exception as e:  # a compile error is a result, reported with its message
        row.update(status="error", error=f"{type(e).__name__}: {e}"[:4000],
                   compile_s=round(time.perf_counter() - t0, 2))
        return row
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    text = log.getvalue()
    regs = _PTXAS["regs"].search(text)
    sp = _PTXAS["spills"].search(text)
    if regs is None or sp is None:
        row.update(status="error", error="no ptxas -v report in the compile log:\n" + text[-2000:])
        return row
    ptx, ttir = ck.asm["ptx"], ck.asm["ttir"]
    row.update(status="ok", registers=int(regs.group(1)), stack=int(sp.group(1)),
               spill_stores=int(sp.group(2)), spill_loads=int(sp.group(3)),
               shared=int(ck.metadata.shared), num_warps=int(ck.metadata.num_warps),
               ld_global_bits=widest_global_load(ptx),
               approx=sorted(k for k, p in APPROX_PATTERNS.items() if re.search(p, ptx)),
               int32_stride_products=int32_stride_products(ttir),
               int64_divisions=len(re.findall(INT64_DIVISION, ptx)))
    return row


def _worker(conn) -> None:
    """Compile the jobs sent on `conn` until None arrives."""
    while True:
        job = conn.recv()
        if job is None:
            return
        conn.send(compile_job(job))


def compile_all(jobs: list[dict], nproc: int, timeout: int, t0: float) -> list[dict]:
    """compile_job over `jobs` in `nproc` worker processes. A compile still running after
    `timeout` seconds (in LLVM or ptxas, where no Python exception can stop it) is a
    result with an error: its worker is killed and replaced."""
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    todo = list(enumerate(jobs))
    rows: list = [None] * len(jobs)
    workers = {}  # connection -> (process, job index, start time)

    def start():
        a, b = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(b,), daemon=True)
        p.start()
        b.close()
        return a, p

    idle = [start() for _ in range(max(1, min(nproc, len(jobs))))]
    done = 0
    while done < len(jobs):
        while idle and todo:
            conn, proc = idle.pop()
            i, job = todo.pop(0)
            conn.send(job)
            workers[conn] = (proc, i, time.perf_counter())
        ready = wait(list(workers), timeout=5)
        for conn in ready:
            proc, i, _ = workers.pop(conn)
            try:
                rows[i] = conn.recv()
            except (EOFError, OSError):  # the worker died (out of memory, a compiler crash)
                rows[i] = _failed(jobs[i], f"the compiling process died (exit code "
                                           f"{proc.exitcode})")
                proc.join()
                conn, proc = start()
            idle.append((conn, proc))
            done += 1
            if done % 50 == 0:
                print(f"  {done}/{len(jobs)} compiled ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
        now = time.perf_counter()
        for conn, (proc, i, began) in list(workers.items()):
            if now - began > timeout:
                proc.kill()
                proc.join()
                del workers[conn]
                rows[i] = _failed(jobs[i], f"CompileTimeout: still compiling after "
                                           f"{timeout} s")
                idle.append(start())
                done += 1
    for conn, proc in idle:
        conn.send(None)
        proc.join(timeout=10)
    return rows


def _failed(job: dict, error: str) -> dict:
    return dict(kernel=job["kernel"], arch=job["arch"], cases=job["cases"],
                constexprs={}, signature={}, launch_options=job["launch_options"],
                status="error", error=error, compile_s=None)


def _show(v):
    return v if isinstance(v, (int, float, bool, str)) or v is None else str(v)


def problems(row: dict, budget: int) -> list[str]:
    if row["status"] != "ok":
        return [f"does not compile: {row['error'].splitlines()[0] if row['error'] else ''}"]
    out = []
    if any("agreement=True" in c for c in row.get("cases", ())):
        budget = max(budget, AGREEMENT_SPILL_BUDGET_BYTES)
    if row["spill_stores"] > budget:
        out.append(f"{row['spill_stores']} bytes of spill stores (budget {budget})")
    if "enable_fp_fusion" not in row["launch_options"]:
        out.append("the launch leaves enable_fp_fusion to Triton's default")
    bad = sorted(set(row["approx"]) & MATH_POLICY["precise"])
    if bad:
        out.append(f"approximate math in a precise kernel: {', '.join(bad)}")
    if row["int32_stride_products"]:
        out.append(f"32-bit stride products: {row['int32_stride_products'][:3]}")
    if row.get("int64_divisions"):
        out.append(f"{row['int64_divisions']} 64-bit integer divisions (a subroutine call on "
                   "the GPU; the plan's slots and rows are below 2^31: divide in 32 bits)")
    return out


# -------------------------------------------------------------------------------- report
def versions() -> dict:
    import torch
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    info = {"triton": triton.__version__, "torch": torch.__version__}
    for arch in ARCHS:
        try:
            out = subprocess.run([get_ptxas(arch).path, "--version"], capture_output=True,
                                 text=True, check=True).stdout.strip().splitlines()[-1]
        except Exception as e:  # reported, not fatal: the compile itself will fail
            out = f"unavailable: {e}"
        info[f"ptxas sm_{arch}"] = out
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                                     capture_output=True, text=True).stdout.strip()
    except OSError:
        info["git"] = "unknown"
    return info


def write_report(rows: list[dict], n_cases: int, wall: float, args, failures: list[str],
                 out: Path) -> None:
    info = versions()
    slim = [dict(r, cases=r["cases"][:3], n_cases=len(r["cases"]),
                 signature=" ".join(f"{k}:{v}" for k, v in r["signature"].items()))
            for r in rows]
    data = {"command": " ".join(["python3", "tools/triton_compile_check.py", *sys.argv[1:]]),
            "versions": info, "archs": list(args.archs), "spill_budget_bytes": args.budget,
            "cases": n_cases, "compiles": len(rows), "wall_s": round(wall, 1),
            "jobs": args.jobs, "failures": failures, "rows": slim}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".json.tmp")
    head = json.dumps({k: v for k, v in data.items() if k != "rows"}, indent=1)[:-2]
    tmp.write_text(head + ',\n "rows": [\n'
                   + ",\n".join(json.dumps(r, separators=(",", ":")) for r in slim)
                   + "\n ]\n}\n")
    tmp.replace(out.with_name(out.name + ".json"))

    L = ["# Triton kernels compiled for sm_80 and sm_90 (no GPU)", "",
         f"Command: `{data['command']}` (also `make check-triton`, part of `make test`)", "",
         "Versions: " + "; ".join(f"{k} {v}" for k, v in info.items()), "",
         f"{n_cases} launcher cases (all-pairs over each op's factors, see the tool's "
         f"docstring) gave {len(rows) // max(len(args.archs), 1)} distinct specialisations; "
         f"{len(rows)} compiles over sm_{' and sm_'.join(map(str, args.archs))} in "
         f"{wall:.0f} s with {args.jobs} processes. Spill budget: {args.budget} bytes "
         "of spill stores per kernel. Registers are per thread (4 warps), shared memory "
         "per program, `ld bits` the widest global load.", ""]
    L += ["## Sampling", "",
          "| launcher | factors (values) | full product | all-pairs cases |", "|---|---|---|---|"]
    for op, f in op_factors().items():
        full = 1
        for v in f.values():
            full *= len(v)
        L.append(f"| {op} | " + ", ".join(f"{k} ({len(v)})" for k, v in f.items())
                 + f" | {full} | {len(all_pairs(f))} |")
    L += ["", "## Result", ""]
    L += ([f"- FAIL: {f}" for f in failures] or ["- pass: every specialisation compiles, "
          f"none spills above {args.budget} bytes, every launch sets enable_fp_fusion, "
          "no approximate or flush-to-zero instruction, no 32-bit stride product, no 64-bit "
          "integer division"])
    L += ["", "## Per kernel", "",
          "| kernel | arch | compiles | registers (max) | spill stores (max) | stack (max) | "
          "shared bytes (max) | ld bits (min..max) | compile s (max) | "
          "worst case (spills, registers) |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    by = {}
    for r in rows:
        by.setdefault((r["kernel"], r["arch"]), []).append(r)
    for (k, arch), rs in sorted(by.items()):
        ok = [r for r in rs if r["status"] == "ok"]
        if not ok:
            L.append(f"| {k} | sm_{arch} | {len(rs)} | error | | | | | | |")
            continue
        worst = max(ok, key=lambda r: (r["spill_stores"], r["registers"]))
        L.append(f"| {k} | sm_{arch} | {len(rs)} | {max(r['registers'] for r in ok)} | "
                 f"{max(r['spill_stores'] for r in ok)} | {max(r['stack'] for r in ok)} | "
                 f"{max(r['shared'] for r in ok)} | "
                 f"{min(r['ld_global_bits'] for r in ok)}..{max(r['ld_global_bits'] for r in ok)}"
                 f" | {max(r['compile_s'] for r in ok)} | {worst['cases'][0]} |")
    L += ["", "## Every specialisation", "",
          "| kernel | arch | constexprs | registers | spill stores | stack | shared | ld bits "
          "| cases (first of n) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["kernel"], r["arch"], -r.get("registers", 999))):
        ce = " ".join(f"{k}={v}" for k, v in r["constexprs"].items())
        if r["status"] != "ok":
            L.append(f"| {r['kernel']} | sm_{r['arch']} | {ce} | error | | | | | "
                     f"{r['cases'][0]} (of {len(r['cases'])}) |")
            continue
        L.append(f"| {r['kernel']} | sm_{r['arch']} | {ce} | {r['registers']} | "
                 f"{r['spill_stores']} | {r['stack']} | {r['shared']} | {r['ld_global_bits']} | "
                 f"{r['cases'][0]} (of {len(r['cases'])}) |")
    tmp = out.with_name(out.name + ".md.tmp")
    tmp.write_text("\n".join(L) + "\n")
    tmp.replace(out.with_name(out.name + ".md"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", type=lambda s: tuple(int(a) for a in s.split(",")),
                    default=ARCHS, help="compute capabilities, default 80,90")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--budget", type=int, default=SPILL_BUDGET_BYTES,
                    help="spill-store bytes allowed per kernel (default %(default)s)")
    ap.add_argument("--timeout", type=int, default=COMPILE_TIMEOUT_S,
                    help="seconds one compile may take (default %(default)s)")
    ap.add_argument("--kernels", default="", help="comma-separated kernel names only")
    ap.add_argument("--ops", default="", help="comma-separated launcher names only")
    ap.add_argument("--match", default="", help="only the cases whose label contains this")
    ap.add_argument("--every", type=int, default=1, metavar="N",
                    help="a sample: every Nth case of each launcher (each kernel must still "
                         "be compiled by one)")
    ap.add_argument("--offset", type=int, default=0, metavar="I",
                    help="with --every N: the cases whose index in their launcher is I mod N "
                         "(N runs with offsets 0..N-1 compile each case once)")
    ap.add_argument("--list", action="store_true", help="print the cases and jobs, compile nothing")
    ap.add_argument("--no-write", action="store_true", help="do not write bench/results")
    ap.add_argument("--out", type=Path, default=OUT, help="results path without suffix (.json and .md are appended: a name may hold dots)")
    args = ap.parse_args(argv)

    cache_dir = setup_environment()
    try:
        return run(args)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def run(args) -> int:
    t0 = time.perf_counter()
    case_list = cases()
    if args.ops:
        case_list = [c for c in case_list if c["op"] in args.ops.split(",")]
    if args.match:
        case_list = [c for c in case_list if args.match in label(c)]
    if args.every > 1:  # a sample: every Nth case of each launcher (still every kernel)
        count: dict = {}
        kept = []
        for c in case_list:
            count[c["op"]] = count.get(c["op"], -1) + 1
            if count[c["op"]] % args.every == args.offset % args.every:
                kept.append(c)
        case_list = kept
    jobs, all_kernels = collect(case_list, args.archs)
    if args.kernels:
        jobs = [j for j in jobs if j["kernel"] in args.kernels.split(",")]
    if args.list:
        for c in case_list:
            print(label(c))
        for j in jobs:
            print(j["kernel"], j["arch"], {k: _show(v) for k, v in j["constexprs"].items()})
        print(f"{len(case_list)} cases, {len(jobs)} compiles")
        return 0
    # the heaviest first, so the pool does not end on one long compile
    jobs.sort(key=lambda j: (j["kernel"] not in ("_gate_fwd_kernel", "_gate_bwd_kernel"),))
    print(f"triton_compile_check: {len(case_list)} cases -> {len(jobs)} compiles over "
          f"sm_{', sm_'.join(map(str, args.archs))}, {args.jobs} processes", flush=True)
    rows = compile_all(jobs, args.jobs, args.timeout, t0)
    wall = time.perf_counter() - t0
    failures = []
    for r in rows:
        for p in problems(r, args.budget):
            failures.append(f"{r['kernel']} sm_{r['arch']} [{r['cases'][0]}]: {p}")
    if not args.kernels and not args.ops and not args.match:
        seen = {r["kernel"] for r in rows}
        failures += [f"{k} ({m}): no case compiles it" for k, m in sorted(all_kernels.items())
                     if k not in seen]
    if not args.no_write:
        write_report(rows, len(case_list), wall, args, failures, args.out)
    ok = [r for r in rows if r["status"] == "ok"]
    worst = max(ok, key=lambda r: (r["spill_stores"], r["registers"]), default=None)
    print(f"triton_compile_check: {len(rows)} compiles in {wall:.0f} s; "
          + (f"worst: {worst['kernel']} sm_{worst['arch']} {worst['registers']} registers, "
             f"{worst['spill_stores']} bytes spill stores [{worst['cases'][0]}]" if worst else ""))
    for f in failures[:40]:
        print("  FAIL", f)
    if len(failures) > 40:
        print(f"  ... and {len(failures) - 40} more (see {args.out}.md)")
    print("triton_compile_check: " + ("FAILED" if failures else "OK"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
