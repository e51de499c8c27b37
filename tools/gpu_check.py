#!/usr/bin/env python3
"""Check a GPU machine in one command. Nothing is downloaded. `make gpu-check` runs
tools/gpu_run.sh, which calls this script with the 8-minute plan (--out DIR, sm_90, the
sanitizer subset, one run per benchmark):

    tools/gpu_run.sh                               # the GPU run, 8 minutes at most
    tools/gpu_run.sh --dry-run                     # any machine: commands, build rehearsed
    python tools/gpu_check.py --steps test         # some steps (results add up)
    python tools/gpu_check.py --skip-gpu           # a machine without CUDA: facts and commands

Steps, in order, each under its own time limit (and all of them under --budget, 455 s):

  build      (150 s) the CUDA extension, offline:
             REPLAY_OPS_CUDA=1 TORCH_CUDA_ARCH_LIST=<--arch, else the capability of GPU 0>
             MAX_JOBS=<cpus> python -m pip install --no-build-isolation --no-deps --no-index -v -e .
             then a native gate call on the GPU (the kernel image loads and runs)
  test       (150 s) make test-gpu GPU_PYTEST_ARGS="-k 'not sanitizer' ..."  (every gpu-marked
             test, without the compute-sanitizer runs; -n: pytest-xdist workers sharing the
             GPU, where pytest-xdist is installed and --workers > 0). The plugin
             tools/gpu_pytest_plugin.py orders the tests (tools/gpu_test_plan.py: the
             registry guards first, one case per test, backend and dtype, then the rest,
             slowest last) and writes a per-test log as they run: the counts come from it,
             also when the step is stopped at its limit. The step fails when a registry
             guard does not pass or when a backend the registry names for CUDA runs no CUDA
             case; tests that need two GPUs are reported as not runnable here
  sanitizer  (45 s) make test-gpu GPU_PYTEST_ARGS="-k <--sanitizer-select> ..."  (default
             every compute-sanitizer run: memcheck, racecheck, initcheck and synccheck of
             tests/test_gpu_sanitizer.py and tests/test_native.py; tools/gpu_run.sh: a subset)
  bench      (40 s) python bench/bench_all.py --device cuda --out <device>_bench  (the speed
             target shapes with their baselines, bench/bench_cases.py first; --bench-args adds
             arguments, e.g. "--runs 1")
  hf         (20 s) python bench/bench_hf.py --device cuda --out <device>_hf  (a transformers
             MoE model, R3 against its grouped GEMM; --hf-args)
  megatron   (20 s) python bench/bench_megatron.py --device cuda --out <device>_megatron
             (Megatron-Core's router and permutation against the replay router and the plan
             dispatcher's calls, in the same run: launches, syncs, bytes and GPU times, with
             the fast path's targets; needs megatron-core, a --no-deps wheel is enough;
             --megatron-args)

With --out DIR: DIR/summary.md, DIR/summary.json and DIR/logs/<step>.log (8 files at most),
the rest in build/gpu_run_work/. Without it:
Output: bench/results/<device>.md, one summary (device, driver, torch / Triton / CUDA
versions, git SHA, pass or fail and duration of each step, the benchmark table, the last
lines of each failing step), and the logs in bench/results/gpu_check_logs/ (each capped at
256 KiB). The summary is rewritten after every step. A step that cannot run (no GPU, no nvcc,
no compute-sanitizer, a missing Python package) says why in the summary. Steps run one
invocation at a time keep the results of the steps run earlier for the same device and git
commit (`--fresh` drops them), so `--steps build`, then `--steps test`, and so on, add up to
one summary.

Exit status: 0 when every selected step passed; 1 when a step failed or ran past its limit
(after the summary is written); 2 when none failed but a step could not run.

What the GPU machine needs: a CUDA build of torch (2.11 or newer) and the CUDA toolkit that
matches it (nvcc, compute-sanitizer), make, a C++ compiler, Python packages setuptools, pip,
pytest, numpy, triton and safetensors (the test modules import it); transformers is optional
(the Hugging Face tests skip without it), ninja makes the build parallel. megatron-core
(`pip install --no-deps`; the version in the Makefile's MCORE_PIN) is needed by the
megatron step. omegaconf and pyyaml are used only by CPU tests. The check lists what is
missing; `make gpu-wheels` downloads the wheels a GPU machine without network lacks.

A machine with no network gets a missing package as a wheel, built or downloaded elsewhere
for its Python version and platform, for example on a machine with network:

    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 -d wheels NAME==VERSION

(`--no-deps` fetches none of the package's own requirements: name each missing one too), then
on the GPU machine `python tools/gpu_check.py --wheels wheels`: the wheels are installed with
`pip install --no-index --no-deps --target build/gpu_check_site` (only those whose
distribution the machine lacks) and that folder is put on PYTHONPATH, its bin/ on PATH, for
every step.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_test_plan as test_plan  # noqa: E402  (tools/; no pytest needed)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LOG_DIR = "gpu_check_logs"
STEPS = ("build", "test", "sanitizer", "bench", "hf", "megatron")
# tools/gpu_run.sh runs the whole check within 8 minutes of wall time (WALL_S): `timeout`
# stops it 5 s before, and this script's budget (BUDGET_S, counted from its start) is 25 s
# under the wall: 10 s for ending a step at its limit (TERM, then KILL) and 15 s for the
# summary and the shell. The step limits add up to the budget less OVERHEAD_S, the machine
# facts, the wheels and the probe of the backends after the build.
LIMITS_S = {"build": 150, "test": 150, "sanitizer": 45, "bench": 40, "hf": 20,
            "megatron": 20}
WALL_S = 480
BUDGET_S = WALL_S - 25
OVERHEAD_S = 30
MIN_STEP_S = 20  # a step with less time left than this is not started
# The sanitizer step's default selection (pytest -k): every compute-sanitizer run.
# tools/gpu_run.sh picks a small subset (SANITIZER_SUBSET).
SANITIZER_ALL = "sanitizer"
SANITIZER_SUBSET = ("test_cuda_compute_sanitizer or "
                    "(test_gpu_sanitizer_mixed_chain and memcheck) or "
                    "(test_gpu_sanitizer_selection_of_flagged_rows and memcheck)")
PROBE_TIMEOUT_S = 180
LOG_HEAD, LOG_TAIL = 64 * 1024, 192 * 1024  # bytes of a log that are kept
TAIL_LINES = 40
DEFAULT_ARCH = "9.0"  # H100 / H200, when no device tells its own
WHEEL_SITE = ROOT / "build" / "gpu_check_site"

# (import name, distribution, what needs it)
PACKAGES = (
    ("setuptools", "setuptools", "build"),
    ("pip", "pip", "build"),
    ("ninja", "ninja", "build: parallel compiles (without it the build is serial)"),
    ("pytest", "pytest", "test, sanitizer"),
    ("xdist", "pytest-xdist", "test, sanitizer: parallel pytest workers (serial without it)"),
    ("numpy", "numpy", "test, sanitizer, bench: replay_ops' Triton launchers import it"),
    ("triton", "triton", "test, sanitizer, bench: the Triton backend"),
    ("safetensors", "safetensors", "test: tests/test_replay_files.py imports it"),
    ("hypothesis", "hypothesis", "test: property tests (their modules import it)"),
    ("zstandard", "zstandard", "test: the routing codec (router replay files)"),
    ("transformers", "transformers", "test: the Hugging Face tests (they skip without it); "
                                     "hf: bench/bench_hf.py"),
    ("yaml", "pyyaml", "CPU tests only (router replay config)"),
    ("omegaconf", "omegaconf", "CPU tests only (router replay config)"),
    ("megatron.core", "megatron-core", "megatron: bench/bench_megatron.py; the CPU tests"),
)
REQUIRED = {
    "build": ("setuptools", "pip"),
    "test": ("pytest", "numpy"),
    "sanitizer": ("pytest", "numpy"),
    "bench": ("numpy",),
    "hf": ("numpy", "transformers"),
    "megatron": ("numpy", "megatron-core"),
}

FACTS_PROBE = r"""
import importlib.metadata as md, importlib.util, json, platform, sys
facts = {"python": platform.python_version(), "executable": sys.executable, "packages": {}}
for mod, dist in json.loads(sys.argv[1]):
    try:
        found = importlib.util.find_spec(mod) is not None
    except Exception:
        found = False
    version = None
    if found:
        try:
            version = md.version(dist)
        except Exception:
            version = "installed"
    facts["packages"][dist] = version
try:
    import torch
    facts["torch"] = torch.__version__
    facts["torch_cuda"] = torch.version.cuda
    facts["cuda_available"] = torch.cuda.is_available()
    if facts["cuda_available"]:
        facts["devices"] = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            facts["devices"].append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                                     "memory_gib": round(p.total_memory / 2**30, 1),
                                     "sms": p.multi_processor_count})
except Exception as e:
    facts["torch_error"] = f"{type(e).__name__}: {e}"
print("FACTS " + json.dumps(facts))
"""

BACKENDS_PROBE = r"""
import json
import replay_ops
from replay_ops import backends as rb
info = replay_ops.backends()
info["cuda_order"] = list(rb.AUTO_ORDER["cuda"])
try:
    from replay_ops import _C
    info["with_cuda_kernels"] = bool(_C.WITH_CUDA)
except Exception as e:
    info["with_cuda_kernels"] = f"{type(e).__name__}: {e}"
print("BACKENDS " + json.dumps(info, default=str))
"""


def verify_build() -> int:
    """After the build (`--verify-build`, run by the build step): the extension has its CUDA
    kernels, and one native gate call runs on the GPU and gives the softmax over the selected
    logits (a missing kernel image for this device shows here, not amid the tests)."""
    import torch

    import replay_ops
    from replay_ops import _C

    where = Path(replay_ops.__file__).resolve().parent
    print(f"replay_ops from {where}, library {Path(_C.__file__).name}")
    expect = os.environ.get("GPU_CHECK_EXPECT_PACKAGE")  # --dry-run: the copy's, or the tree's
    if expect and where != Path(expect).resolve():
        print(f"expected replay_ops from {expect}, not {where}")
        return 1
    if torch.version.cuda is None:  # the rehearsal of --dry-run on a CPU torch
        print(f"torch {torch.__version__} is a CPU build: CPU kernels only "
              f"(replay_ops._C.WITH_CUDA = {bool(_C.WITH_CUDA)})")
        device = "cpu"
    elif not _C.WITH_CUDA:
        print("replay_ops._C was built without the CUDA kernels")
        return 1
    else:
        print(f"replay_ops._C: CUDA kernels compiled in (E <= {_C.MAX_EXPERTS}, "
              f"K <= {_C.MAX_TOPK})")
        device = "cuda" if torch.cuda.is_available() else None
    if device is not None:
        where = torch.cuda.get_device_name(0) if device == "cuda" else "the CPU"
        logits = torch.randn(6, 8, device=device)
        idx = torch.tensor([[0, 3], [1, -1], [7, 2], [-1, -1], [4, 5], [6, 0]], device=device)
        got = replay_ops.gate(logits, idx, backend="native").weights
        sel = logits.gather(1, idx.clamp_min(0)).masked_fill(idx < 0, float("-inf"))
        want = torch.softmax(sel, dim=1).nan_to_num(0.0)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            print(f"native gate on {where}: {got} != {want}")
            return 1
        print(f"native gate ran on {where}")
    print(f"backends: {replay_ops.backends()['active']}")
    return 0


# ----------------------------------------------------------------------------- facts
def _run_quiet(argv, timeout=30, env=None) -> tuple[int | None, str]:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                             env=env)
        return out.returncode, (out.stdout + out.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{type(e).__name__}: {e}"


def find_tool(name: str) -> str | None:
    """`name` on PATH, else in $CUDA_HOME or /usr/local/cuda (bin/, or name/name)."""
    exe = shutil.which(name)
    if exe:
        return exe
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if not home:
            continue
        for cand in (Path(home) / "bin" / name, Path(home) / name / name):
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return None


def _last_line_with(text: str, word: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if word in ln]
    return lines[-1] if lines else text.strip().splitlines()[-1] if text.strip() else ""


def _paths(*parts) -> str:
    return os.pathsep.join(p for p in parts if p)


def step_env(extra: dict | None = None, pythonpath: str | None = None) -> dict:
    """This environment with `extra`; a PYTHONPATH in `extra` goes before the one here."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)  # the GPU steps run compiled Triton kernels
    extra = dict(extra or {})
    env["PYTHONPATH"] = _paths(extra.pop("PYTHONPATH", None), pythonpath, env.get("PYTHONPATH"))
    if not env["PYTHONPATH"]:
        del env["PYTHONPATH"]
    env.update(extra)
    return env


def probe_python(py: str, code: str, tag: str, args=(), pythonpath=None) -> dict:
    rc, out = _run_quiet([py, "-c", code, *args], timeout=PROBE_TIMEOUT_S,
                         env=step_env(pythonpath=pythonpath))
    for line in out.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    return {"error": f"exit code {rc}: {out[-1500:]}"}


def collect_facts(py: str, pythonpath: str | None = None) -> dict:
    facts = probe_python(py, FACTS_PROBE, "FACTS",
                         [json.dumps([[m, d] for m, d, _ in PACKAGES])], pythonpath)
    if "error" in facts:
        facts = {"probe_error": facts["error"], "packages": {}}
    rc, out = _run_quiet(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"])
    facts["nvidia_smi"] = out.splitlines()[0] if rc == 0 and out else None
    facts["driver"] = facts["nvidia_smi"].split(",")[1].strip() if facts["nvidia_smi"] else None
    nvcc = find_tool("nvcc")
    facts["nvcc"] = nvcc
    facts["nvcc_version"] = _last_line_with(_run_quiet([nvcc, "--version"])[1], "release") \
        if nvcc else None
    san = find_tool("compute-sanitizer")
    facts["compute_sanitizer"] = san
    facts["compute_sanitizer_version"] = _last_line_with(
        _run_quiet([san, "--version"])[1], "ersion") if san else None
    facts["make"] = shutil.which("make")
    facts["cpus"] = os.cpu_count()
    rc, sha = _run_quiet(["git", "rev-parse", "HEAD"])
    facts["git_sha"] = sha if rc == 0 else "unknown (not a git checkout)"
    rc, dirty = _run_quiet(["git", "status", "--porcelain", "--untracked-files=no"])
    facts["git_dirty"] = bool(dirty) if rc == 0 else None
    return facts


def device_slug(facts: dict) -> str:
    devs = facts.get("devices") or []
    name = devs[0]["name"] if devs else "no-cuda-device"
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def cuda_arch(facts: dict, override: str | None) -> tuple[str, str]:
    """(TORCH_CUDA_ARCH_LIST for the build, where it came from)."""
    if override:
        return override, "--arch"
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"], "$TORCH_CUDA_ARCH_LIST"
    devs = facts.get("devices") or []
    if devs:
        return devs[0]["capability"], "the capability of GPU 0"
    return DEFAULT_ARCH, "the default: no GPU to ask"


# ----------------------------------------------------------------------------- steps
@dataclasses.dataclass
class Step:
    name: str
    title: str
    commands: list  # [(argv, env overrides)]
    limit_s: int
    skip: str | None = None  # why the step does not run
    requested: bool = False  # skipped on request, not for a missing need
    notes: list = dataclasses.field(default_factory=list)
    junit: Path | None = None  # pytest's report, parsed for the counts
    progress: Path | None = None  # the per-test log (tools/gpu_pytest_plugin.py), preferred
    coverage: tuple | None = None  # backends that must each run CUDA cases (the test step)
    bench_stem: str | None = None


@dataclasses.dataclass
class Result:
    name: str
    title: str
    status: str  # pass, fail, timeout, skipped, cannot run
    seconds: float = 0.0
    limit_s: int = 0
    commands: list = dataclasses.field(default_factory=list)  # as shell lines
    detail: str = ""
    notes: list = dataclasses.field(default_factory=list)
    tail: list = dataclasses.field(default_factory=list)
    log: str | None = None
    failed_tests: list = dataclasses.field(default_factory=list)
    counts: dict = dataclasses.field(default_factory=dict)  # the per-test log's counts
    tests: dict = dataclasses.field(default_factory=dict)  # nodeid: [outcome, seconds]
    when: str = ""
    earlier: bool = False  # taken from an earlier invocation


def _quote(a) -> str:
    a = str(a)
    if a and not re.search(r"[^\w@%+=:,./-]", a):
        return a
    if not re.search(r'["$`\\]', a):
        return f'"{a}"'
    return shlex.quote(a)


def shell_line(argv: list, env: dict | None = None) -> str:
    """The command as one shell line (environment assignments first)."""
    pre = " ".join(f"{k}={_quote(v)}" for k, v in (env or {}).items())
    return (pre + " " if pre else "") + " ".join(_quote(a) for a in argv)


def build_commands(py: str, arch: str, jobs: int) -> list:
    """The build step: an offline editable install that must compile the CUDA kernels, then
    a check that they load and run. PIP_BREAK_SYSTEM_PACKAGES: a system Python marked
    externally managed (PEP 668) takes the editable install too (nothing is downloaded)."""
    env = {"REPLAY_OPS_CUDA": "1", "TORCH_CUDA_ARCH_LIST": arch, "MAX_JOBS": str(jobs),
           "PIP_BREAK_SYSTEM_PACKAGES": "1"}
    install = [py, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
               "-v", "-e", "."]
    return [(install, env), ([py, "tools/gpu_check.py", "--verify-build"], {})]


PLUGIN = "gpu_pytest_plugin"  # tools/gpu_pytest_plugin.py, loaded with -p (tools/ on PYTHONPATH)


def pytest_commands(py: str, keyword: str, junit: Path, use_make: bool, workers: int = 0,
                    log: Path | None = None, order: bool = False, include=(),
                    durations: Path | None = None, skip_passed: Path | None = None,
                    more=()) -> list:
    """`make test-gpu` with extra pytest arguments (or the same pytest call without make);
    `workers` > 0: that many pytest-xdist workers, which share the GPU. With `log`, the
    plugin writes the per-test log as the tests run; `order`: the plan's order (guards, a
    first pass, the rest; slowest last); `include`: test functions run although they have
    no gpu mark (the registry guard); `durations` / `skip_passed`: an earlier run's log or
    summary.json, to order by its durations / to leave out what passed there."""
    extra = ["-k", keyword, f"--junitxml={junit}", "--continue-on-collection-errors"]
    env = {}
    if log is not None:
        extra += ["-p", PLUGIN, f"--gpu-log={log}"]
        extra += ["--gpu-order"] if order else []
        extra += [f"--gpu-include={name}" for name in include]
        extra += [f"--gpu-durations={durations}"] if durations else []
        extra += [f"--gpu-skip-passed={skip_passed}"] if skip_passed else []
        env["PYTHONPATH"] = str(ROOT / "tools")
    if workers > 0:
        extra += ["-n", str(workers)]
    extra += list(more)
    if use_make:
        return [(["make", "test-gpu", f"PY={shlex.quote(py)}",
                  f"GPU_PYTEST_ARGS={shlex.join(extra)}"], env)]
    return [([py, "-m", "pytest", "-q", "-m", "gpu", *extra, "tests"], env)]


def select_steps(steps: list[Step], args) -> list[Step]:
    """Mark the steps that were not asked for (--steps, --skip-gpu): skipped on request."""
    for s in steps:
        if s.name not in args.steps:
            s.skip, s.requested = "not selected (--steps)", True
        elif args.skip_gpu:
            s.skip, s.requested = "skipped (--skip-gpu)", True
    return steps


def missing(facts: dict, step: str) -> list[str]:
    pk = facts.get("packages") or {}
    return [d for d in REQUIRED[step] if not pk.get(d)]


def default_workers(facts: dict) -> int:
    """pytest-xdist workers of the test step: every core but four (the Triton compiles of
    a cold cache are what they share), 12 at most."""
    return max(1, min(12, int(facts.get("cpus") or 8) - 4))


def plan_steps(args, facts: dict, logs: Path, slug: str) -> list[Step]:
    py = args.python
    arch, arch_from = cuda_arch(facts, args.arch)
    jobs = int(os.environ.get("MAX_JOBS") or facts.get("cpus") or 4)
    use_make = bool(facts.get("make"))
    limits = dict(LIMITS_S, **args.limit)
    xdist = bool((facts.get("packages") or {}).get("pytest-xdist"))
    n = args.workers if args.workers is not None else default_workers(facts)
    # a dry run shows the GPU machine's plan: its image has pytest-xdist
    use_xdist = xdist or args.dry_run
    workers = {"test": n if use_xdist else 0, "sanitizer": min(n, 3) if use_xdist else 0}
    progress = {k: logs / f"{slug}.{k}.progress.jsonl" for k in ("test", "sanitizer")}
    # this machine's last run: the test step moves its log aside before it starts
    last = progress["test"].with_suffix(".prev.jsonl")
    had_last = progress["test"].exists() or last.exists()
    durations = args.test_durations
    if durations is None and had_last:
        durations = last
    resume = last if str(args.resume) == "last" else args.resume
    steps = [
        Step("build", "build the CUDA extension", build_commands(py, arch, jobs), limits["build"],
             notes=[f"TORCH_CUDA_ARCH_LIST={arch} ({arch_from})"]),
        Step("test", "make test-gpu (without the sanitizer runs), the registry guards first",
             pytest_commands(py, "not sanitizer", logs / f"{slug}.test.junit.xml", use_make,
                             workers["test"], log=progress["test"], order=True,
                             include=test_plan.GUARD_TESTS, durations=durations,
                             skip_passed=resume),
             limits["test"], junit=logs / f"{slug}.test.junit.xml", progress=progress["test"],
             coverage=test_plan.DEFAULT_CUDA_BACKENDS,
             notes=["order: the registry guards, one case per test, backend and dtype, then "
                    "the rest, slowest last" + (f" (durations of {durations})" if durations
                                                else "")]
             + ([f"the tests that passed in {resume} are not run again"
                 + ("" if had_last or resume != last else " (no earlier run on this machine)")]
                if resume else [])),
        Step("sanitizer", "compute-sanitizer" + (
                 " memcheck, racecheck, initcheck, synccheck"
                 if args.sanitizer_select == SANITIZER_ALL
                 else f" runs selected by -k {shlex.quote(args.sanitizer_select)}"),
             [(argv, dict(env, REPLAY_OPS_SANITIZER_TIMEOUT_S=str(limits["sanitizer"])))
              for argv, env in pytest_commands(
                  py, args.sanitizer_select, logs / f"{slug}.sanitizer.junit.xml", use_make,
                  workers["sanitizer"], log=progress["sanitizer"])],
             limits["sanitizer"], junit=logs / f"{slug}.sanitizer.junit.xml",
             progress=progress["sanitizer"]),
        Step("bench", "bench/bench_all.py at the speed-target shapes",
             [([py, "bench/bench_all.py", "--device", "cuda", "--out", f"{slug}_bench",
                *shlex.split(args.bench_args)], {})],
             limits["bench"], bench_stem=f"{slug}_bench"),
        Step("hf", "bench/bench_hf.py: a transformers MoE model, replayed against its "
                   "grouped GEMM",
             [([py, "bench/bench_hf.py", "--device", "cuda", "--out", f"{slug}_hf",
                *shlex.split(args.hf_args)], {})],
             limits["hf"], bench_stem=f"{slug}_hf"),
        Step("megatron", "bench/bench_megatron.py: Megatron-Core against the replay router",
             [([py, "bench/bench_megatron.py", "--device", "cuda", "--out",
                f"{slug}_megatron", *shlex.split(args.megatron_args)], {})],
             limits["megatron"], bench_stem=f"{slug}_megatron"),
    ]
    for s in steps[1:3]:
        if not use_make:
            s.notes.append("make not found: pytest is called directly with the same arguments")
        if workers[s.name]:
            s.notes.append(f"{workers[s.name]} pytest-xdist workers" + (
                "" if xdist else " (not installed here; the GPU machine's image has it, and "
                "without it the step runs in one process)"))
    pk = facts.get("packages") or {}
    gone = [f"{d} ({why})" for _, d, why in PACKAGES if not pk.get(d)]
    for s in steps:
        if facts.get("probe_error") or facts.get("torch_error"):
            s.skip = ("python with torch does not start: "
                      f"{facts.get('probe_error') or facts.get('torch_error')}")
            continue
        need = missing(facts, s.name)
        if need:
            s.skip = (f"missing Python packages: {', '.join(need)} (bring them as wheels: "
                      "tools/gpu_check.py --help)")
            continue
        if s.name == "build":
            if not facts.get("torch_cuda"):
                s.skip = f"the installed torch {facts.get('torch')} is not a CUDA build"
            elif not facts.get("nvcc"):
                s.skip = "nvcc not found (PATH, $CUDA_HOME or /usr/local/cuda)"
            continue
        if not facts.get("cuda_available"):
            s.skip = "no CUDA device: torch.cuda.is_available() is False"
            continue
        if s.name == "sanitizer":
            san = facts.get("compute_sanitizer")
            if not san:
                s.skip = "compute-sanitizer not found (PATH, $CUDA_HOME or /usr/local/cuda)"
                continue
            if shutil.which("compute-sanitizer") is None:  # found outside PATH: add its folder
                s.commands = [(argv, dict(env, PATH=os.pathsep.join(
                    [str(Path(san).parent), os.environ.get("PATH", "")])))
                    for argv, env in s.commands]
        if s.name in ("test", "sanitizer") and gone:
            s.notes.append("not installed here: " + "; ".join(gone))
    return steps


# ---------------------------------------------------------------------------- running
def run_command(argv, env, timeout: float, log, echo: bool,
                cwd: Path = ROOT) -> tuple[int | None, bool]:
    """Run one command in its own process group, its output into `log` (and the console);
    (exit code, timed out). On timeout the whole group is ended: TERM, then KILL."""
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        log.write(f"cannot start {argv[0]}: {e}\n".encode())
        return 127, False

    def pump():
        for line in iter(proc.stdout.readline, b""):
            log.write(line)
            if echo:
                sys.stdout.buffer.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        rc = proc.poll()
    reader.join(timeout=15)
    return rc, timed_out


def cap_log(path: Path) -> None:
    """Keep the first LOG_HEAD and the last LOG_TAIL bytes of a long log."""
    size = path.stat().st_size
    if size <= LOG_HEAD + LOG_TAIL:
        return
    with open(path, "rb") as f:
        head = f.read(LOG_HEAD)
        f.seek(size - LOG_TAIL)
        tail = f.read()
    cut = f"\n[... {size - LOG_HEAD - LOG_TAIL} bytes left out ...]\n".encode()
    path.write_bytes(head + cut + tail)


def tail_lines(path: Path, n: int = TAIL_LINES) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return lines[-n:]


def parse_junit(path: Path) -> dict | None:
    """Counts and failed test ids from pytest's JUnit XML report (None without one)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    c = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    for s in suites:
        for k in c:
            c[k] += int(s.get(k, 0) or 0)
        for case in s.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                cls = case.get("classname") or ""
                failed.append(f"{cls}::{case.get('name')}" if cls else case.get("name"))
    c["passed"] = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
    c["failed_tests"] = failed
    return c


def run_step(step: Step, logs: Path, slug: str, time_left: float, echo: bool = True,
             cwd: Path = ROOT) -> Result:
    """Run a step's commands in order under its limit (and the time left); `slug` names its
    log, `<slug>.<step>.log` (`<step>.log` when empty)."""
    n_cmds = len(step.commands)
    res = Result(step.name, step.title, "skipped", limit_s=step.limit_s,
                 commands=[shell_line(a, e) for a, e in step.commands], notes=list(step.notes),
                 when=_now())
    if step.skip:
        res.status = "skipped" if step.requested else "cannot run"
        res.detail = step.skip
        return res
    if time_left < MIN_STEP_S:
        res.status, res.detail = "cannot run", f"no time left in the budget ({int(time_left)} s)"
        return res
    limit = min(step.limit_s, time_left)
    res.limit_s = int(limit)
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / (f"{slug}.{step.name}.log" if slug else f"{step.name}.log")
    if step.junit is not None and step.junit.exists():
        step.junit.unlink()
    if step.progress is not None and step.progress.exists():  # the last run's, kept for
        step.progress.replace(step.progress.with_suffix(".prev.jsonl"))  # its durations
    t0 = time.monotonic()
    status = "pass"
    with open(log_path, "wb") as log:
        for i, (argv, extra) in enumerate(step.commands):
            left = limit - (time.monotonic() - t0)
            log.write(f"$ {shell_line(argv, extra)}\n".encode())
            log.flush()
            if echo:
                print(f"[gpu-check {step.name}] $ {shell_line(argv, extra)}", flush=True)
            rc, timed_out = run_command(argv, step_env(extra), left, log, echo, cwd)
            if timed_out:
                status = "timeout"
                log.write(f"\n[gpu-check: stopped after the step's limit of {int(limit)} s]\n"
                          .encode())
                break
            if rc != 0:
                status = "fail"
                log.write(f"\n[gpu-check: exit code {rc}]\n".encode())
                res.detail = f"exit code {rc}" + (f" (command {i + 1} of {n_cmds})"
                                                  if n_cmds > 1 else "")
                break
    res.seconds = round(time.monotonic() - t0, 1)
    res.status = status
    if status == "timeout":
        res.detail = f"ran past its limit of {int(limit)} s"
    cap_log(log_path)
    res.log = str(log_path)
    log = test_plan.read_log(step.progress) if step.progress is not None else None
    if log is not None:  # the per-test log: counts even when the step was stopped
        summ = test_plan.summarize(log, step.coverage or (),
                                   test_plan.GUARD_TESTS if step.coverage else ())
        line, problems = test_plan.describe(summ)
        res.detail = line + (f"; {res.detail}" if res.detail else "")
        res.failed_tests = summ["failed_tests"][:60]
        res.tests = summ.pop("tests")
        res.counts = summ
        if problems and status == "pass":
            res.status = status = "fail"
        res.notes += problems
        if summ["two_gpu"]:
            res.notes.append("not runnable here (needs 2 GPUs): " + ", ".join(summ["two_gpu"]))
        if summ["running"]:
            res.notes.append("running when the step was stopped: " + ", ".join(
                summ["running"][:20]))
        if summ["collection_skips"]:
            res.notes.append("modules skipped at collection (their gpu tests, if any, did not "
                             "run): "
                             + "; ".join(f"{n} ({(why or '').strip()[:120]})" for n, why in
                                         list(summ["collection_skips"].items())[:10]))
        if summ["collected"] and summ["collected"] == summ["skipped"] + len(summ["two_gpu"]):
            res.notes.append("every selected test was skipped")
        if step.junit is not None and step.junit.exists():
            step.junit.unlink()
    elif step.junit is not None:
        counts = parse_junit(step.junit)
        if counts is not None:
            res.detail = (f"{counts['passed']} passed, {counts['failures']} failed, "
                          f"{counts['errors']} errors, {counts['skipped']} skipped"
                          + (f"; {res.detail}" if res.detail else ""))
            res.failed_tests = counts["failed_tests"][:60]
            if counts["tests"] == counts["skipped"] and status == "pass":
                res.notes.append("every selected test was skipped")
            step.junit.unlink()  # the counts and names are in the summary; the log keeps the rest
    if step.coverage and log is None and status == "pass":
        res.status = status = "fail"
        res.notes.append(f"no per-test log ({step.progress}): the CUDA cases of each backend "
                         "could not be counted")
    if status != "pass":
        res.tail = tail_lines(log_path)
    return res


# ---------------------------------------------------------------------------- summary
def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_bench(results_dir: Path, stem: str) -> dict | None:
    try:
        return json.loads((results_dir / f"{stem}.json").read_text())
    except (OSError, ValueError):
        return None


BENCH_COLS = ("op", "mode", "provider", "T", "E", "K", "H", "dtype", "ms_median", "ms_p20",
              "ms_p80", "speedup_vs_torch", "gbps", "frac_of_copy_bw", "flagged",
              "speedup_vs_softmax_topk", "baseline")


MEGATRON_COLS = ("op", "mode", "provider", "T", "E", "dtype", "launches", "syncs", "bytes",
                 "ms_median", "ms_p20", "ms_p80", "speedup_vs_megatron")
TARGET_COLS = ("case", "target", "value", "bound", "met", "blocking")
HF_COLS = ("case", "dtype", "provider", "launches", "syncs", "ms_median", "ms_p20", "ms_p80",
           "time_vs_unpatched_grouped_mm", "launches_vs_unpatched_grouped_mm")
BENCH_TITLES = {"bench": ("Benchmark", BENCH_COLS),
                "hf": ("Hugging Face benchmark (grouped GEMM)", HF_COLS),
                "megatron": ("Megatron-Core benchmark", MEGATRON_COLS)}


def bench_markdown(doc: dict, cols=None) -> list[str]:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    out = []
    cols = tuple(cols or BENCH_COLS)
    bw = doc.get("copy_bandwidth") or {}
    if bw.get("gbps"):
        out += [f"Copy bandwidth measured in the same run: {bw['gbps']:.1f} GB/s "
                f"(read + write, {int(bw.get('bytes', 0)) >> 20} MiB buffer).", ""]
    if doc.get("summary"):
        out += [f"- {s}" for s in doc["summary"]] + [""]
    targets = doc.get("targets") or []
    if targets:
        met = sum(bool(t.get("met")) for t in targets)
        out += [f"Targets: {met} of {len(targets)} met.", "",
                "| " + " | ".join(TARGET_COLS) + " |", "|" + "---|" * len(TARGET_COLS)]
        out += ["| " + " | ".join(_md_escape(fmt(t.get(c))) for c in TARGET_COLS) + " |"
                for t in targets] + [""]
    rows = doc.get("rows") or []
    if rows:
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---|" * len(cols))
        out += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return out


def _md_escape(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def render_summary(facts: dict, results: list[Result], meta: dict,
                   benches: dict | None = None) -> str:
    """The summary; `benches` maps a benchmark step's name to its results (JSON)."""
    devs = facts.get("devices") or []
    name = devs[0]["name"] if devs else "no CUDA device"
    overall = overall_status(results)
    lines = [f"# GPU check: {name}", "",
             f"Command: `{meta['command']}`, started {meta['started']}, written {_now()}.", "",
             f"Overall: **{overall}**.", ""]
    dev_txt = "; ".join(f"GPU {i}: {d['name']} (compute capability {d['capability']}, "
                        f"{d['memory_gib']} GiB, {d['sms']} SMs)" for i, d in enumerate(devs))
    pk = facts.get("packages") or {}
    gone = [d for _, d, _ in PACKAGES if not pk.get(d)]
    rows = [
        ("device", dev_txt or "none visible to torch"),
        ("nvidia-smi", facts.get("nvidia_smi") or "not available"),
        ("driver", facts.get("driver") or "unknown"),
        ("torch", f"{facts.get('torch', 'not importable')} (CUDA {facts.get('torch_cuda')})"),
        ("triton", pk.get("triton") or "not installed"),
        ("nvcc", facts.get("nvcc_version") or "not found"),
        ("compute-sanitizer", facts.get("compute_sanitizer_version") or "not found"),
        ("python", f"{facts.get('python', '?')} ({facts.get('executable', '?')})"),
        ("git", f"{facts.get('git_sha')}" + (" with uncommitted changes" if facts.get("git_dirty")
                                              else "")),
        ("CPUs", str(facts.get("cpus"))),
        ("packages not installed", ", ".join(gone) or "none"),
    ]
    if facts.get("wheels"):
        rows.append(("wheels installed for this run", facts["wheels"]))
    if facts.get("backends"):
        b = facts["backends"]
        rows.append(("replay_ops backends (after the build)",
                     f"active {b.get('active')}; CUDA kernels compiled in: "
                     f"{b.get('with_cuda_kernels')}; not usable: {b.get('why')}"))
    if facts.get("probe_error"):
        rows.append(("python probe", facts["probe_error"]))
    lines += ["## Machine", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {_md_escape(v)} |" for k, v in rows] + [""]
    lines += ["## Steps", "", "| step | result | time | limit | details |", "|---|---|---|---|---|"]
    for r in results:
        status = r.status.upper() if r.status in ("pass", "fail", "timeout") else r.status
        when = f" (from an earlier run, {r.when})" if r.earlier else ""
        detail = "; ".join(x for x in [r.detail, *r.notes] if x)
        lines.append(f"| {r.name} | {status}{when} | {r.seconds:.0f} s | {r.limit_s} s | "
                     f"{_md_escape(detail)} |")
    lines += ["", "Commands (run from the repository root):", ""]
    for r in results:
        for c in r.commands:
            c = c.replace("\n", " ")
            c = c if len(c) < 400 else c[:400] + " ..."
            lines.append(f"- {r.name}: `{c}`")
    lines.append("")
    for name, (title, cols) in BENCH_TITLES.items():
        doc = (benches or {}).get(name)
        lines += [f"## {title}", ""]
        if doc:
            lines += bench_markdown(doc, cols) + [""]
        else:
            lines += [f"No result of the {name} step from this run.", ""]
    bad = [r for r in results if r.status in ("fail", "timeout")]
    if bad:
        lines += ["## Failing steps", ""]
        for r in bad:
            lines += [f"### {r.name}: {r.status}", ""]
            if r.failed_tests:
                lines += ["Failed tests:", ""] + [f"- `{t}`" for t in r.failed_tests] + [""]
            where = f"{meta.get('log_dir', LOG_DIR)}/{Path(r.log).name}" if r.log else "no log"
            lines += [f"Last lines of the log ({where}):", "", "```"] + r.tail + ["```", ""]
    logs = [r.log for r in results if r.log]
    if logs:
        lines += ["## Logs", ""] + [f"- {meta.get('log_dir', LOG_DIR)}/{Path(p).name}"
                                    for p in logs] + [""]
    return "\n".join(lines)


def overall_status(results: list[Result]) -> str:
    if any(r.status in ("fail", "timeout") for r in results):
        return "FAIL"
    if any(r.status == "cannot run" for r in results):
        return "INCOMPLETE (a step could not run)"
    if all(r.status == "pass" for r in results):
        return "PASS"
    if all(r.status == "skipped" for r in results):
        return "NOT RUN (no step was run)"
    return "PASS (some steps not run)"


def exit_code(results: list[Result]) -> int:
    now = [r for r in results if not r.earlier]
    if any(r.status in ("fail", "timeout") for r in now):
        return 1
    if any(r.status == "cannot run" for r in now):
        return 2
    return 0


# ------------------------------------------------------------------------------ state
def load_state(path: Path, facts: dict, fresh: bool) -> dict:
    """Results of earlier invocations for the same device and git commit."""
    if fresh:
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if state.get("git_sha") != facts.get("git_sha") or state.get("device") != \
            (facts.get("devices") or [{}])[0].get("name"):
        return {}
    return state.get("steps", {})


def save_state(path: Path, facts: dict, results: list[Result], meta: dict) -> None:
    state = {"git_sha": facts.get("git_sha"),
             "device": (facts.get("devices") or [{}])[0].get("name"),
             "started": meta["started"],
             "steps": {r.name: dataclasses.asdict(r) for r in results
                       if r.status not in ("skipped",)}}
    write_text_atomic(path, json.dumps(state, indent=1) + "\n")


# ------------------------------------------------------------------------------- main
INSTALLED_PROBE = r"""
import importlib.metadata as md, json, sys
have = {}
for name in json.loads(sys.argv[1]):
    try:
        have[name] = md.version(name)
    except md.PackageNotFoundError:
        have[name] = None
print("INSTALLED " + json.dumps(have))
"""


def wheel_dist(path: str) -> str:
    """The distribution a wheel file holds (its name's first field, normalised)."""
    return re.sub(r"[-_.]+", "-", Path(path).name.split("-")[0]).lower()


def install_wheels(py: str, wheels: Path, log_dir: Path,
                   site: Path = WHEEL_SITE) -> tuple[str | None, str]:
    """The wheels of `wheels` whose distribution `py` does not have yet (the machine's own
    packages are used where present), installed offline with pip install --no-index
    --no-deps --target `site`; the steps get `site` on PYTHONPATH and site/bin on PATH."""
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    if not files:
        return None, f"no .whl file in {wheels}"
    have = probe_python(py, INSTALLED_PROBE, "INSTALLED",
                        [json.dumps(sorted({wheel_dist(f) for f in files}))])
    present = [f for f in files if have.get(wheel_dist(f))]
    todo = [f for f in files if f not in present]
    kept = "; already installed, not replaced: " + ", ".join(
        f"{wheel_dist(f)} {have[wheel_dist(f)]}" for f in present) if present else ""
    if not todo:
        return None, "none needed" + kept
    site.mkdir(parents=True, exist_ok=True)
    rc, out = _run_quiet([py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                          "--upgrade", "--target", str(site), *todo], timeout=120)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "wheels.log").write_text(out[-20000:] + "\n")
    if rc != 0:
        return None, f"pip install of {len(todo)} wheels failed (exit code {rc}): {out[-300:]}"
    return str(site), ", ".join(Path(f).name for f in todo) + kept


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Check a GPU machine: build, make test-gpu, compute-sanitizer, benchmarks.",
        epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS),
                    help="the steps to run (default: all, in order)")
    ap.add_argument("--skip-gpu", action="store_true",
                    help="run no step; collect the machine facts, assemble each step's command "
                         "and write the summary (machines without CUDA)")
    ap.add_argument("--budget", type=int, default=BUDGET_S,
                    help=f"seconds for all the steps together (default {BUDGET_S})")
    ap.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS",
                    help="another time limit for one step, e.g. --limit test=600")
    ap.add_argument("--arch", default=None,
                    help="TORCH_CUDA_ARCH_LIST of the build (default: $TORCH_CUDA_ARCH_LIST, "
                         f"else the capability of GPU 0, else {DEFAULT_ARCH})")
    ap.add_argument("--results-dir", type=Path, default=RESULTS,
                    help="where the summary and the logs go (default bench/results)")
    ap.add_argument("--name", default=None, help="file name of the summary, without .md "
                                                 "(default: the device name)")
    ap.add_argument("--python", default=sys.executable,
                    help="the Python with torch that runs every step (default: this one)")
    ap.add_argument("--wheels", type=Path, default=None,
                    help="a folder of .whl files to install offline for the steps")
    ap.add_argument("--workers", type=int, default=None,
                    help="pytest-xdist workers of the test step (the sanitizer step uses at "
                         "most 3), where pytest-xdist is installed; 0: one process (default: "
                         "every core but four, 12 at most)")
    ap.add_argument("--test-durations", type=Path, default=None, metavar="FILE",
                    help="order the test step by the durations of an earlier run (its "
                         "summary.json or per-test log; default: the last run's log here)")
    ap.add_argument("--resume", type=Path, default=None, metavar="FILE",
                    help="leave out of the test step the tests that passed in an earlier "
                         "run (its summary.json or per-test log; 'last': the last run on "
                         "this machine); the registry guards run")
    ap.add_argument("--bench-args", default="",
                    help='more arguments for bench/bench_all.py, e.g. "--runs 2"')
    ap.add_argument("--hf-args", default="", help="more arguments for bench/bench_hf.py")
    ap.add_argument("--megatron-args", default="",
                    help="more arguments for bench/bench_megatron.py")
    ap.add_argument("--sanitizer-select", default=SANITIZER_ALL, metavar="EXPR",
                    help="pytest -k expression of the sanitizer step (default: every "
                         f"compute-sanitizer run; tools/gpu_run.sh: {SANITIZER_SUBSET!r})")
    ap.add_argument("--out", type=Path, default=None, metavar="DIR",
                    help="write 8 files at most, 2 folders deep: DIR/summary.md, "
                         "DIR/summary.json and DIR/logs/<step>.log; the reports, the "
                         "benchmarks' own files and the state go to build/gpu_run_work/")
    ap.add_argument("--dry-run", action="store_true",
                    help="run no GPU step: print every step's command, and rehearse the "
                         "build step's command with this Python's torch in a copy of the "
                         "tree (a CPU torch builds the CPU kernels only)")
    ap.add_argument("--rehearse-build", choices=("full", "resolve"), default="full",
                    help="--dry-run: 'full' runs the build step's commands in the copy (a "
                         "build whose inputs are those of the last passing rehearsal is "
                         "reused: same sources by content hash, torch, Python and "
                         "environment); 'resolve' only resolves the install offline (pip "
                         "--dry-run, nothing compiled) and checks the tree's own library")
    ap.add_argument("--git-sha", default=None,
                    help="the commit to record where the tree is not a git checkout (a copy)")
    ap.add_argument("--fresh", action="store_true",
                    help="drop the results of earlier invocations for this device and commit")
    ap.add_argument("--quiet", action="store_true", help="do not echo the steps' output")
    ap.add_argument("--verify-build", action="store_true",
                    help="only check the built extension (the build step's second command)")
    args = ap.parse_args(argv)
    limits = {}
    for item in args.limit:
        step, _, sec = item.partition("=")
        if step not in STEPS or not sec.isdigit():
            ap.error(f"--limit {item!r}: expected STEP=SECONDS with STEP in {', '.join(STEPS)}")
        limits[step] = int(sec)
    args.limit = limits
    return args


WORK = ROOT / "build" / "gpu_run_work"  # --out: what does not go under DIR
DRY = ROOT / "build" / "gpu_run_dry"  # --dry-run: the tree's copy and the build's venv
REHEARSAL_LIMIT_S = 1200  # the dry run's build, on a small CPU machine
WHEEL_TAG_OK = re.compile(r"-(py3|py2\.py3|cp312)-(none|cp312|abi3)-(any|manylinux[\w.]*x86_64)"
                          r"\.whl$")


def copy_tree(dst: Path) -> int:
    """The files git would send (tracked, and untracked ones not ignored) into `dst`, the
    build/ folder left out; the number of files."""
    rc, out = _run_quiet(["git", "ls-files", "-co", "--exclude-standard", "-z"])
    if rc != 0:
        raise RuntimeError(f"git ls-files failed: {out[-300:]}")
    shutil.rmtree(dst, ignore_errors=True)
    n = 0
    for rel in out.split("\0"):
        if not rel or rel.startswith("build/") or not (ROOT / rel).is_file():
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dst / rel)
        n += 1
    return n


BUILD_INPUTS = ("setup.py", "pyproject.toml", "CMakeLists.txt", "csrc")
BUILD_ENV = ("REPLAY_OPS_CUDA", "REPLAY_OPS_NATIVE", "REPLAY_OPS_DEBUG", "TORCH_CUDA_ARCH_LIST",
             "CUDA_HOME", "CUDA_PATH", "CC", "CXX", "CFLAGS", "CXXFLAGS", "LDFLAGS")


def build_inputs_hash(src: Path, facts: dict, env: dict) -> str:
    """sha256 of what the build step's output depends on: the build files and csrc/ of the
    copy (names and contents), torch, Python and the build's environment."""
    import hashlib

    h = hashlib.sha256()
    files = []
    for name in BUILD_INPUTS:
        p = src / name
        files += sorted(p.rglob("*")) if p.is_dir() else [p]
    for f in files:
        if f.is_file():
            h.update(f.relative_to(src).as_posix().encode() + b"\0")
            h.update(hashlib.sha256(f.read_bytes()).digest())
    where = {k: os.environ.get(k) for k in BUILD_ENV}
    where.update({k: v for k, v in env.items() if k in BUILD_ENV})
    h.update(json.dumps([facts.get("torch"), facts.get("torch_cuda"), facts.get("python"),
                         facts.get("nvcc_version"), where], sort_keys=True).encode())
    return h.hexdigest()


def _rehearsal_commands(args, facts: dict, step: Step, vpy: Path) -> tuple[list, bool]:
    cuda_ok = bool(facts.get("torch_cuda")) and bool(facts.get("nvcc"))
    commands = []
    for argv, env in step.commands:
        argv = [str(vpy) if a == args.python else a for a in argv]
        env = dict(env)
        if not cuda_ok and env.get("REPLAY_OPS_CUDA") == "1":
            env["REPLAY_OPS_CUDA"] = "0"
        commands.append((argv, env))
    return commands, cuda_ok


def rehearse_build(args, facts: dict, step: Step, logs: Path) -> Result:
    """--dry-run: the build step's own commands, run with this machine's torch in a copy of
    the tree and a venv that sees this Python's packages (the editable install goes there,
    not into this environment). REPLAY_OPS_CUDA=1 stays where torch is a CUDA build and
    nvcc is found; with a CPU torch it becomes 0 (the CPU kernels only).

    --rehearse-build full: the install compiles the library, unless the last passing
    rehearsal built it from the same inputs (build_inputs_hash): then its library is put
    back into the copy and only the check runs. --rehearse-build resolve: pip resolves the
    install offline (`pip install --dry-run`: the metadata is prepared, nothing compiled)
    in the copy, and the check runs on the tree's own library (the one `make install`
    built): the compile itself is what `make install` (the same editable install) and the
    CUDA build jobs of `make test` (REPLAY_OPS_CUDA=1, sm_90, torch 2.11) do."""
    src, venv = DRY / "src", DRY / "venv"
    vpy = venv / "bin" / "python"
    stamp, kept = DRY / "rehearsal.json", DRY / "kept"
    n = copy_tree(src)
    notes = [f"rehearsal in a copy of the tree ({n} files, {src.relative_to(ROOT)}) with "
             f"torch {facts.get('torch')}"]
    if not vpy.exists():
        stamp.unlink(missing_ok=True)  # a kept library needs the venv's editable install
        rc, out = _run_quiet([args.python, "-m", "venv", "--system-site-packages",
                              "--without-pip", str(venv)], timeout=120)
        if rc != 0:
            return Result(step.name, step.title, "fail", detail=f"venv: {out[-300:]}",
                          notes=notes)
    commands, cuda_ok = _rehearsal_commands(args, facts, step, vpy)
    # the check must load the copy's library (or, with resolve, the tree's own)
    expect = str((ROOT if args.rehearse_build == "resolve" else src) / "replay_ops")
    commands = commands[:1] + [(argv, dict(env, GPU_CHECK_EXPECT_PACKAGE=expect))
                               for argv, env in commands[1:]]
    if not cuda_ok:
        notes.append("REPLAY_OPS_CUDA=1 -> 0: this torch is not a CUDA build or nvcc is "
                     "missing (the GPU machine builds the CUDA kernels)")
    (install, install_env), verify = commands[0], commands[1:]
    digest = build_inputs_hash(src, facts, install_env)
    if args.rehearse_build == "resolve":
        commands = [(install[:4] + ["--dry-run"] + install[4:], install_env)]
        commands += [([args.python if a == str(vpy) else a for a in argv], env)
                     for argv, env in verify]
        notes.append("build resolved offline only (pip install --dry-run, nothing compiled); "
                     "the check runs on the library this Python imports (the tree's own, "
                     "from `make install`)")
    else:
        try:
            last = json.loads(stamp.read_text())
        except (OSError, ValueError):
            last = {}
        saved = [kept / Path(f).name for f in last.get("files", [])]
        if last.get("hash") == digest and saved and all(f.exists() for f in saved):
            for rel in last["files"]:
                shutil.copy2(kept / Path(rel).name, src / rel)
            commands = verify
            notes.append(f"the library of the last passing rehearsal is reused (same build "
                         f"inputs, sha256 {digest[:12]}); --rehearse-build full rebuilds "
                         f"after `rm -r {stamp.relative_to(ROOT)}`")
        else:
            stamp.unlink(missing_ok=True)
    notes.append(f"limit {REHEARSAL_LIMIT_S} s here (a CPU machine; {step.limit_s} s on the "
                 "GPU machine)")
    rehearsal = dataclasses.replace(step, commands=commands, skip=None,
                                    limit_s=REHEARSAL_LIMIT_S)
    res = run_step(rehearsal, logs, "", REHEARSAL_LIMIT_S, echo=not args.quiet, cwd=src)
    res.notes = notes + res.notes
    res.detail = ("rehearsal passed" if res.status == "pass" else "rehearsal: " + res.detail)
    if res.status == "pass" and args.rehearse_build == "full" and commands is not verify:
        libs = sorted(str(p.relative_to(src)) for p in (src / "replay_ops").glob("_C*.so"))
        files = libs + (["replay_ops/_build_info.py"]
                        if (src / "replay_ops" / "_build_info.py").exists() else [])
        if libs:
            shutil.rmtree(kept, ignore_errors=True)
            kept.mkdir(parents=True)
            for rel in files:
                shutil.copy2(src / rel, kept / Path(rel).name)
            write_text_atomic(stamp, json.dumps({"hash": digest, "files": files}) + "\n")
    return res


def rehearse_collection(args, step: Step, logs: Path) -> tuple[Result, dict | None]:
    """--dry-run: the test step's pytest command with --collect-only (one process; the GPU
    run adds pytest-xdist workers), the per-test log written as on the GPU machine: the
    plugin loads, the registry guards are selected and the plan is made. Here, without a
    GPU, only the gpu-marked tests are collected (the CUDA copies of the parity cases are
    generated where a GPU is)."""
    progress = DRY / "collect.progress.jsonl"
    progress.unlink(missing_ok=True)
    argv_env = pytest_commands(args.python, "not sanitizer", DRY / "collect.junit.xml",
                               use_make=bool(shutil.which("make")), workers=0, log=progress,
                               order=True, include=test_plan.GUARD_TESTS,
                               more=("--collect-only",))
    rehearsal = dataclasses.replace(step, commands=argv_env, skip=None, limit_s=300,
                                    junit=None, progress=None, coverage=None, notes=[])
    res = run_step(rehearsal, logs, "", 300, echo=False)
    log = test_plan.read_log(progress)
    if log is None:
        res.status = "fail"
        res.detail = "collection rehearsal: no plan in the per-test log; " + res.detail
        return res, None
    passes = [p for _, p in log["order"]]
    guards = [n for n, p in log["order"] if p == 0]
    found = {test_plan.function_name(n) for n in guards}
    missing = [g for g in test_plan.GUARD_TESTS if g not in found]
    plan = {"collected": log["n"], "guards": guards, "first_pass": passes.count(1),
            "rest": passes.count(2), "missing_guards": missing}
    res.detail = (f"collection rehearsal: {log['n']} gpu tests collected here; guards first: "
                  f"{', '.join(guards) or 'none'}; first pass {plan['first_pass']}, rest "
                  f"{plan['rest']}")
    if missing:
        res.status = "fail"
        res.detail += f"; registry guards not collected: {', '.join(missing)}"
    return res, plan


def wheel_plan(wheels: Path | None) -> list[str]:
    """--dry-run: the wheels that would be offered, each checked for Python 3.12 on
    x86_64 Linux by its file name."""
    if wheels is None:
        return ["no --wheels folder"]
    files = sorted(wheels.glob("*.whl"))
    if not files:
        return [f"no .whl file in {wheels}"]
    total = sum(f.stat().st_size for f in files)
    lines = [f"{len(files)} wheels in {wheels}, {total / 2**20:.1f} MiB:"]
    for f in files:
        ok = WHEEL_TAG_OK.search(f.name)
        lines.append(f"  {f.name} ({f.stat().st_size >> 10} KiB)"
                     + ("" if ok else "  NOT FOR PYTHON 3.12 ON X86_64 LINUX"))
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.verify_build:
        return verify_build()
    started = time.monotonic()
    meta = {"started": _now(),
            "command": shell_line(["python", "tools/gpu_check.py",
                                   *(argv if argv is not None else sys.argv[1:])])}
    compact = args.out is not None
    if compact:  # DIR/summary.md, DIR/summary.json, DIR/logs/<step>.log
        out_dir = args.out.resolve()
        WORK.mkdir(parents=True, exist_ok=True)
        results_dir = WORK
        logs = out_dir / "logs"
        work_logs = WORK
        meta["log_dir"] = "logs"
    else:
        results_dir = args.results_dir.resolve()
        logs = work_logs = results_dir / LOG_DIR
    pythonpath, wheels_note = None, None
    if args.wheels is not None and not args.skip_gpu and not args.dry_run:
        pythonpath, wheels_note = install_wheels(args.python, args.wheels, work_logs,
                                                 WHEEL_SITE)
    facts = collect_facts(args.python, pythonpath)
    if args.git_sha:
        facts["git_sha"], facts["git_dirty"] = f"{args.git_sha} (given with --git-sha)", None
    if wheels_note:
        facts["wheels"] = wheels_note if pythonpath or wheels_note.startswith("none needed") \
            else f"not installed: {wheels_note}"
    slug = args.name or device_slug(facts)
    if compact:
        summary_path, json_path = out_dir / "summary.md", out_dir / "summary.json"
        state_path = WORK / "state.json"
        log_slug = ""
    else:
        summary_path, json_path = results_dir / f"{slug}.md", None
        state_path = logs / f"{slug}.state.json"
        log_slug = slug
    earlier = {} if args.dry_run else load_state(state_path, facts, args.fresh)
    steps = select_steps(plan_steps(args, facts, work_logs, slug), args)
    if pythonpath:
        path = os.pathsep.join(p for p in (str(Path(pythonpath) / "bin"),
                                           os.environ.get("PATH")) if p)
        for s in steps:
            s.commands = [(a, dict(e, PYTHONPATH=_paths(e.get("PYTHONPATH"), pythonpath),
                                   PATH=e.get("PATH", path))) for a, e in s.commands]
    results: list[Result] = []
    benches: dict = {}
    dry_notes: dict = {}  # --dry-run: what the rehearsal of a step found

    def write():
        shown = list(results)
        done = {r.name for r in shown}
        for s in steps:  # steps still to come, or not selected: an earlier result if any
            if s.name in done:
                continue
            if s.name in earlier and s.name not in args.steps:
                shown.append(Result(**dict(earlier[s.name], earlier=True)))
            elif s.name not in args.steps or args.skip_gpu:
                shown.append(run_step(s, logs, log_slug, 0, echo=False))
            else:
                shown.append(Result(s.name, s.title, "skipped", limit_s=s.limit_s,
                                    commands=[shell_line(a, e) for a, e in s.commands],
                                    detail=dry_notes.get(s.name, "dry run: not run")
                                    if args.dry_run else "not run yet"))
        order = {n: i for i, n in enumerate(STEPS)}
        shown.sort(key=lambda r: order[r.name])
        b = {s.name: benches.get(s.name) or (load_bench(results_dir, s.bench_stem)
                                              if s.name in earlier else None)
             for s in steps if s.bench_stem}
        write_text_atomic(summary_path, render_summary(facts, shown, meta, b))
        if json_path is not None:
            write_text_atomic(json_path, json.dumps(
                {"meta": meta, "facts": facts, "budget_s": args.budget,
                 "steps": [dataclasses.asdict(r) for r in shown], "benchmarks": b},
                indent=1, default=str) + "\n")
        save_state(state_path, facts, shown, meta)
        return shown

    def probe_backends():
        facts["backends"] = probe_python(args.python, BACKENDS_PROBE, "BACKENDS",
                                         pythonpath=pythonpath)
        order = facts["backends"].get("cuda_order")
        for s in steps:  # the backends that must each run CUDA cases: the registry's
            if s.coverage is not None and order:
                s.coverage = tuple(order)

    if args.dry_run:
        probe_backends()  # this machine's registry: the backends it names for CUDA
        total = sum(s.limit_s for s in steps if s.name in args.steps)
        print("[gpu-check] dry run: the steps, their limits and commands "
              f"(limits {total} s + {OVERHEAD_S} s for the facts, wheels and probes, within "
              f"the budget of {args.budget} s)")
        for s in steps:
            why = f"  (here: {s.skip})" if s.skip else ""
            print(f"[gpu-check] {s.name} ({s.limit_s} s): {s.title}{why}")
            for note in s.notes:
                print(f"    {note}")
            for a, e in s.commands:
                print(f"    $ {shell_line(a, e)}")
        test = next(s for s in steps if s.name == "test")
        print(f"[gpu-check] registry guard: {', '.join(test_plan.GUARD_TESTS)} run first "
              f"(the first with --gpu-include: it has no gpu mark); the test step fails if "
              f"one of them does not pass, or if a backend the registry names for CUDA "
              f"({', '.join(test.coverage or ())}) runs no CUDA case")
        for line in wheel_plan(args.wheels):
            print(f"[gpu-check] wheels: {line}")
        if total + OVERHEAD_S > args.budget:
            print(f"[gpu-check] the limits ({total} s) and the overhead ({OVERHEAD_S} s) "
                  f"exceed the budget of {args.budget} s")
        build = next(s for s in steps if s.name == "build")
        print(f"[gpu-check] rehearsing the build step ({args.rehearse_build})", flush=True)
        res = rehearse_build(args, facts, build, logs)
        results.append(res)
        print("[gpu-check] rehearsing the test step's collection", flush=True)
        coll, _ = rehearse_collection(args, test, logs)
        print(f"[gpu-check] {coll.detail}", flush=True)
        dry_notes["test"] = f"dry run: not run; {coll.detail}"
        shown = write()
        for r in shown:
            print(f"[gpu-check] {r.name:9s} {r.status:10s} {r.detail}")
        print(f"[gpu-check] summary: {summary_path}")
        ok = res.status == "pass" and coll.status == "pass" and total + OVERHEAD_S <= args.budget
        return 0 if ok else 1

    if not args.skip_gpu and "build" not in args.steps:
        probe_backends()
    write()
    for s in steps:
        if s.name not in args.steps or args.skip_gpu:
            continue
        left = args.budget - (time.monotonic() - started)
        if s.bench_stem:  # no stale table from an earlier run
            for d in {RESULTS, results_dir}:
                for ext in ("json", "md"):
                    (d / f"{s.bench_stem}.{ext}").unlink(missing_ok=True)
        res = run_step(s, logs, log_slug, left, echo=not args.quiet)
        if s.name == "build":
            probe_backends()
            if res.status in ("fail", "timeout"):
                res.notes.append("the later steps use the extension that was there before "
                                 "(the native CUDA tests skip if it has no CUDA kernels)")
        if s.bench_stem and res.status != "cannot run":
            for ext in ("json", "md"):  # bench_all writes to bench/results
                src = RESULTS / f"{s.bench_stem}.{ext}"
                if results_dir != RESULTS and src.exists():
                    results_dir.mkdir(parents=True, exist_ok=True)
                    shutil.move(str(src), results_dir / src.name)
            benches[s.name] = load_bench(results_dir, s.bench_stem)
        results.append(res)
        write()
        print(f"[gpu-check] {s.name}: {res.status} ({res.seconds:.0f} s) {res.detail}",
              flush=True)
    shown = write()
    for r in shown:
        print(f"[gpu-check] {r.name:9s} {r.status:10s} {r.detail}")
    print(f"[gpu-check] summary: {summary_path}")
    return exit_code(shown)


if __name__ == "__main__":
    sys.exit(main())
