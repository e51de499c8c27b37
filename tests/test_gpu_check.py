"""The CPU-side parts of `make gpu-check` (tools/gpu_check.py), checked on any machine: the
build step's command, why a step cannot run, the step runner (exit codes, time limits, logs),
the summary with a failing step, results kept across invocations, and the command line with
the GPU steps skipped. No step here needs CUDA; each test takes seconds."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import gpu_test_plan as tp  # tools/ (pyproject's pytest pythonpath)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


gc = _load()

H100 = {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.2, "sms": 132}
ALL_PACKAGES = {d: "1.0" for _, d, _ in gc.PACKAGES}


def facts(**over):
    """Facts of a GPU machine like the ones the check is for (override what a test needs)."""
    f = {"python": "3.12.3", "executable": "/usr/bin/python3", "torch": "2.11.0+cu130",
         "torch_cuda": "13.0", "cuda_available": True, "devices": [H100],
         "packages": dict(ALL_PACKAGES),
         "nvidia_smi": "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB",
         "driver": "580.159.04", "nvcc": "/usr/local/cuda/bin/nvcc",
         "nvcc_version": "Cuda compilation tools, release 13.0, V13.0.88",
         "compute_sanitizer": "/usr/local/cuda/bin/compute-sanitizer",
         "compute_sanitizer_version": "Version 2025.3.1", "make": "/usr/bin/make", "cpus": 16,
         "git_sha": "0123456789abcdef", "git_dirty": False}
    f.update(over)
    return f


def args(*argv):
    return gc.parse_args(list(argv))


def by_name(steps):
    return {s.name: s for s in steps}


# ----------------------------------------------------------------------------- planning
def test_build_command_is_offline_and_targets_the_device(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.delenv("MAX_JOBS", raising=False)
    steps = by_name(gc.plan_steps(args("--python", "/usr/bin/python3"), facts(), tmp_path, "h100"))
    (install, env), (verify, _) = steps["build"].commands
    assert install == ["/usr/bin/python3", "-m", "pip", "install", "--no-build-isolation",
                       "--no-deps", "--no-index", "-v", "-e", "."]
    assert env == {"REPLAY_OPS_CUDA": "1", "TORCH_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": "16",
                   "PIP_BREAK_SYSTEM_PACKAGES": "1"}
    assert verify == ["/usr/bin/python3", "tools/gpu_check.py", "--verify-build"]
    assert all(s.skip is None for s in steps.values()), {n: s.skip for n, s in steps.items()}
    line = gc.shell_line(install, env)
    assert line.startswith("REPLAY_OPS_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 ")
    # the arch: --arch, else $TORCH_CUDA_ARCH_LIST, else the device, else 9.0
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert gc.cuda_arch(facts(), None) == ("9.0a", "$TORCH_CUDA_ARCH_LIST")
    assert gc.cuda_arch(facts(), "8.0;9.0+PTX")[0] == "8.0;9.0+PTX"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert gc.cuda_arch(facts(devices=[]), None)[0] == gc.DEFAULT_ARCH


def test_test_steps_are_make_test_gpu_split_by_sanitizer(tmp_path):
    steps = by_name(gc.plan_steps(args(), facts(), tmp_path, "h100"))
    (argv, _), = steps["test"].commands
    assert argv[:2] == ["make", "test-gpu"]
    assert any(a.startswith("GPU_PYTEST_ARGS=-k 'not sanitizer' --junitxml=") for a in argv)
    (argv, _), = steps["sanitizer"].commands
    assert any(a.startswith("GPU_PYTEST_ARGS=-k sanitizer ") for a in argv)
    steps = by_name(gc.plan_steps(args(), facts(make=None), tmp_path, "h100"))
    (argv, _), = steps["test"].commands
    assert argv[1:6] == ["-m", "pytest", "-q", "-m", "gpu"] and argv[-1] == "tests"
    assert "make not found" in " ".join(steps["test"].notes)
    (argv, _), = steps["bench"].commands
    assert argv[1:] == ["bench/bench_all.py", "--device", "cuda", "--out", "h100_bench"]
    steps = by_name(gc.plan_steps(args("--bench-args", "--runs 2"), facts(), tmp_path, "h100"))
    assert steps["bench"].commands[0][0][-3:] == ["h100_bench", "--runs", "2"]
    (argv, _), = steps["megatron"].commands
    assert argv[1:] == ["bench/bench_megatron.py", "--device", "cuda", "--out", "h100_megatron"]
    assert steps["megatron"].bench_stem == "h100_megatron"
    # pytest-xdist, where installed: workers share the GPU (fewer for the sanitizer runs);
    # every core but four, 12 at most
    steps = by_name(gc.plan_steps(args(), facts(packages=dict(ALL_PACKAGES)), tmp_path, "h"))
    assert steps["test"].commands[0][0][-1].endswith(" -n 12")
    assert "-n 3" in steps["sanitizer"].commands[0][0][-1]
    steps = by_name(gc.plan_steps(args(), facts(cpus=6), tmp_path, "h"))
    assert steps["test"].commands[0][0][-1].endswith(" -n 2")
    # the test step's plugin: the per-test log, the order, the registry guards selected
    (argv, env), = by_name(gc.plan_steps(args(), facts(), tmp_path, "h"))["test"].commands
    line = argv[-1]
    for want in ("-p gpu_pytest_plugin", f"--gpu-log={tmp_path}/h.test.progress.jsonl",
                 "--gpu-order", "--gpu-include=test_backends_cover_the_registry",
                 "--gpu-include=test_every_cuda_backend_of_the_registry_has_cases"):
        assert want in line, want
    assert env["PYTHONPATH"] == str(gc.ROOT / "tools")
    assert gc.step_env(env, "/wheels")["PYTHONPATH"].startswith(
        f"{gc.ROOT / 'tools'}{os.pathsep}/wheels")
    steps = by_name(gc.plan_steps(args(), facts(packages=dict(
        ALL_PACKAGES, **{"pytest-xdist": None})), tmp_path, "h"))
    assert " -n " not in steps["test"].commands[0][0][-1]
    steps = by_name(gc.plan_steps(args("--workers", "0"), facts(), tmp_path, "h"))
    assert " -n " not in steps["test"].commands[0][0][-1]
    assert sum(gc.LIMITS_S.values()) <= gc.BUDGET_S <= 25 * 60


def test_a_second_run_resumes_from_the_last_one(tmp_path):
    """--resume last: the test step leaves out what passed in this machine's last run (its
    per-test log, moved aside when the step starts) and orders the rest by its durations;
    --resume FILE takes an earlier summary.json."""
    steps = by_name(gc.plan_steps(args(), facts(), tmp_path, "h"))
    assert "--gpu-durations" not in steps["test"].commands[0][0][-1]
    (tmp_path / "h.test.progress.jsonl").write_text("")
    prev = tmp_path / "h.test.progress.prev.jsonl"
    steps = by_name(gc.plan_steps(args("--resume", "last"), facts(), tmp_path, "h"))
    line = steps["test"].commands[0][0][-1]
    assert f"--gpu-skip-passed={prev}" in line and f"--gpu-durations={prev}" in line
    assert any("not run again" in n for n in steps["test"].notes)
    steps = by_name(gc.plan_steps(args("--resume", "s.json", "--test-durations", "d.json"),
                                  facts(), tmp_path, "h"))
    line = steps["test"].commands[0][0][-1]
    assert "--gpu-skip-passed=s.json" in line and "--gpu-durations=d.json" in line
    doc = {"steps": [{"name": "test", "tests": {"a[cuda-native]": ["passed", 1.5],
                                                "b[cuda-triton]": ["failed", 0.25]}}]}
    (tmp_path / "summary.json").write_text(json.dumps(doc))
    assert tp.load_passed(tmp_path / "summary.json") == {"a[cuda-native]"}
    assert tp.load_durations(tmp_path / "summary.json") == {"a[cuda-native]": 1.5,
                                                            "b[cuda-triton]": 0.25}


def test_a_step_that_cannot_run_says_why(tmp_path):
    def skips(**over):
        return {n: s.skip for n, s in by_name(gc.plan_steps(args(), facts(**over), tmp_path,
                                                            "x")).items()}

    s = skips(compute_sanitizer=None)
    assert s["sanitizer"].startswith("compute-sanitizer not found")
    assert s["test"] is None and s["build"] is None and s["bench"] is None
    s = skips(nvcc=None)
    assert s["build"].startswith("nvcc not found") and s["test"] is None
    s = skips(torch="2.13.0+cpu", torch_cuda=None, cuda_available=False, devices=[])
    assert "not a CUDA build" in s["build"]
    assert all("no CUDA device" in s[n] for n in ("test", "sanitizer", "bench"))
    s = skips(packages=dict(ALL_PACKAGES, pytest=None))
    assert "missing Python packages: pytest" in s["test"] and "wheels" in s["test"]
    assert s["sanitizer"].startswith("missing Python packages: pytest") and s["bench"] is None
    assert s["megatron"] is None  # bench_megatron needs no pytest (replay_ops.testing)
    s = skips(torch_error="ImportError: libcuda.so.1")
    assert all("libcuda.so.1" in v for v in s.values())
    # optional packages are named, the steps still run
    steps = by_name(gc.plan_steps(args(), facts(packages=dict(
        ALL_PACKAGES, omegaconf=None, **{"megatron-core": None})), tmp_path, "x"))
    assert steps["test"].skip is None
    note = " ".join(steps["test"].notes)
    assert "omegaconf" in note and "megatron-core" in note
    # ... but the Megatron benchmark needs megatron-core
    assert steps["megatron"].skip.startswith("missing Python packages: megatron-core")
    assert steps["bench"].skip is None
    # --skip-gpu and --steps are requests, not missing needs
    a = args("--skip-gpu")
    for n, s in by_name(gc.select_steps(gc.plan_steps(a, facts(), tmp_path, "x"), a)).items():
        assert s.requested and s.skip == "skipped (--skip-gpu)", n
    a = args("--steps", "test")
    steps = by_name(gc.select_steps(gc.plan_steps(a, facts(nvcc=None), tmp_path, "x"), a))
    assert steps["test"].skip is None
    assert steps["build"].requested and steps["build"].skip == "not selected (--steps)"


# ------------------------------------------------------------------------------ running
def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="1" skipped="2" tests="5"><testcase classname="tests.test_x" name="test_ok"/>
<testcase classname="tests.test_x" name="test_bad[cuda-native]"><failure message="boom"/></testcase>
</testsuite></testsuites>"""


BENCH = {"copy_bandwidth": {"gbps": 2950.5, "bytes": 256 << 20},
         "summary": ["gate fwd T=16384 E=64 K=2: native 0.100 ms vs torch 1.000 ms = 10.00x"],
         "rows": [{"op": "gate", "mode": "fwd", "provider": "native", "T": 16384, "E": 64,
                   "K": 2, "dtype": "bfloat16", "ms_median": 0.1, "gbps": 123.4567}]}


def _fake_steps(logs, bench_skip=None):
    junit = logs / "t.test.junit.xml"
    bench_json = gc.RESULTS / "t_bench.json"
    return [
        gc.Step("build", "build", [(_py("print('compiled')"), {"REPLAY_OPS_CUDA": "1"}),
                                   (_py("import os; print('env', os.environ['REPLAY_OPS_CUDA'])"),
                                    {"REPLAY_OPS_CUDA": "1"})], 60),
        gc.Step("test", "tests", [(_py(f"""
            import pathlib, sys
            pathlib.Path({str(junit)!r}).write_text({JUNIT!r})
            print("\\n".join(f"line {{i}}" for i in range(100)))
            sys.exit(3)
            """), {})], 60, junit=junit),
        gc.Step("sanitizer", "sanitizer", [(_py("import time; print('waiting', flush=True); "
                                                "time.sleep(60)"), {})], 2),
        gc.Step("bench", "bench", [(_py(f"""
            import pathlib
            pathlib.Path({str(bench_json)!r}).write_text({json.dumps(BENCH)!r})
            """), {})], 60, skip=bench_skip, bench_stem="t_bench"),
    ]


@pytest.fixture
def fake_machine(monkeypatch, tmp_path):
    """A GPU machine as the check sees it: the facts of an H100, and steps that are small
    commands (one passes, one fails with a pytest report, one runs past its limit, the
    benchmark writes its results where bench_all.py writes them)."""
    machine = {"bench_skip": None}
    monkeypatch.setattr(gc, "collect_facts", lambda py, pythonpath=None: facts())
    monkeypatch.setattr(gc, "probe_python", lambda *a, **k: {"active": {"cuda": "native"}})
    monkeypatch.setattr(gc, "MIN_STEP_S", 1)
    monkeypatch.setattr(gc, "RESULTS", tmp_path / "repo_results")
    gc.RESULTS.mkdir()
    monkeypatch.setattr(gc, "plan_steps", lambda a, f, logs, slug: _fake_steps(
        logs, machine["bench_skip"]))
    return SimpleNamespace(path=tmp_path, machine=machine)


def test_failing_and_timed_out_steps_in_the_summary(fake_machine, capsys):
    out = fake_machine.path / "results"
    rc = gc.main(["--results-dir", str(out), "--name", "t", "--quiet"])
    assert rc == 1
    md = (out / "t.md").read_text()
    assert "# GPU check: NVIDIA H100 80GB HBM3" in md
    assert "Overall: **FAIL**" in md
    for want in ("| driver | 580.159.04 |", "| torch | 2.11.0+cu130 (CUDA 13.0) |",
                 "| git | 0123456789abcdef |", "Version 2025.3.1", "release 13.0"):
        assert want in md, want
    rows = {line.split("|")[1].strip(): line for line in md.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in gc.STEPS}
    assert "| PASS |" in rows["build"]
    assert "| FAIL |" in rows["test"]
    assert "2 passed, 1 failed, 0 errors, 2 skipped; exit code 3" in rows["test"]
    assert "| TIMEOUT |" in rows["sanitizer"] and "ran past its limit of 2 s" in rows["sanitizer"]
    assert "| PASS |" in rows["bench"]
    # the benchmark's results move next to the summary, and their table goes into it
    assert (out / "t_bench.json").exists() and not (gc.RESULTS / "t_bench.json").exists()
    assert "Copy bandwidth measured in the same run: 2950.5 GB/s" in md
    assert "| gate | fwd | native | 16384 | 64 | 2 |  | bfloat16 | 0.1 |" in md
    # the failing steps: their failed tests and the last lines of their logs
    assert "### test: fail" in md and "`tests.test_x::test_bad[cuda-native]`" in md
    assert "line 99" in md and "line 59" not in md  # the last 40 lines only
    assert "### sanitizer: timeout" in md and "waiting" in md
    assert "### build" not in md and "### bench" not in md
    assert f"Last lines of the log ({gc.LOG_DIR}/t.test.log)" in md
    logs = out / gc.LOG_DIR
    build_log = (logs / "t.build.log").read_text()
    assert "compiled" in build_log and "env 1" in build_log
    assert "REPLAY_OPS_CUDA=1" in build_log  # each command is logged before it runs
    assert not (logs / "t.test.junit.xml").exists()  # parsed into the summary, then removed
    state = json.loads((logs / "t.state.json").read_text())
    assert state["steps"]["test"]["status"] == "fail"
    assert "summary:" in capsys.readouterr().out


def test_results_of_earlier_invocations_are_kept(fake_machine):
    out = fake_machine.path / "results"
    fake_machine.machine["bench_skip"] = "no CUDA device: torch.cuda.is_available() is False"
    assert gc.main(["--results-dir", str(out), "--name", "t", "--quiet", "--steps", "build"]) == 0
    md = (out / "t.md").read_text()
    assert "| build | PASS |" in md and "| test | skipped |" in md
    rc = gc.main(["--results-dir", str(out), "--name", "t", "--quiet", "--steps", "bench"])
    assert rc == 2  # bench cannot run; build passed earlier
    md = (out / "t.md").read_text()
    assert "| build | PASS (from an earlier run," in md
    assert "| bench | cannot run |" in md and "no CUDA device" in md
    rc = gc.main(["--results-dir", str(out), "--name", "t", "--quiet", "--steps", "bench",
                  "--fresh"])
    assert "| build | skipped |" in (out / "t.md").read_text()


def test_bench_results_become_the_benchmark_table():
    lines = gc.bench_markdown(BENCH)
    assert lines[0].startswith("Copy bandwidth measured in the same run: 2950.5 GB/s")
    assert any(line.startswith("- gate fwd T=16384") for line in lines)
    assert "| gate | fwd | native | 16384 | 64 | 2 |  | bfloat16 | 0.1 |" in "\n".join(lines)


def test_megatron_results_give_a_targets_table():
    doc = {"summary": ["T=4096 E=128 float32: route fwd 2.50x"],
           "targets": [{"case": "T=4096 E=128 float32", "target": "route fwd launches",
                        "value": 1, "bound": "<= 3", "met": True, "blocking": ""},
                       {"case": "T=4096 E=128 float32", "target": "step bytes / megatron",
                        "value": 0.86, "bound": "<= 0.8", "met": False,
                        "blocking": "MB by op: a|b 3.0"}],
           "rows": [{"op": "route", "mode": "fwd", "provider": "megatron", "T": 4096,
                     "E": 128, "dtype": "float32", "launches": 8, "syncs": 0,
                     "bytes": 1000, "ms_median": 0.25, "speedup_vs_megatron": 1.0}]}
    text = "\n".join(gc.bench_markdown(doc, gc.MEGATRON_COLS))
    assert "Targets: 1 of 2 met." in text
    assert "| T=4096 E=128 float32 | step bytes / megatron | 0.86 | <= 0.8 | False | " \
           "MB by op: a\\|b 3.0 |" in text
    assert "| route | fwd | megatron | 4096 | 128 | float32 | 8 | 0 | 1000 | 0.25 |" in text
    md = gc.render_summary(facts(), [], {"command": "x", "started": "now"},
                           {"megatron": doc})
    assert "## Megatron-Core benchmark" in md and "Targets: 1 of 2 met." in md
    assert "No result of the bench step from this run." in md


def test_long_logs_are_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "LOG_HEAD", 100)
    monkeypatch.setattr(gc, "LOG_TAIL", 200)
    p = tmp_path / "x.log"
    p.write_bytes(b"".join(f"{i:09d}\n".encode() for i in range(1000)))
    gc.cap_log(p)
    text = p.read_text()
    assert text.startswith("000000000\n") and text.endswith("000000999\n")
    assert "bytes left out" in text and len(text) < 400


def test_the_command_line_with_the_gpu_steps_skipped(tmp_path):
    """The script itself, on this machine: the machine facts, the assembled commands and the
    summary, no step run."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CUDA_ARCH_LIST", "MAX_JOBS")}
    out = subprocess.run([sys.executable, str(SCRIPT), "--skip-gpu", "--results-dir",
                          str(tmp_path), "--name", "ci"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    md = (tmp_path / "ci.md").read_text()
    assert "Overall: **NOT RUN (no step was run)**" in md
    for step in gc.STEPS:
        assert f"| {step} | skipped |" in md and f"- {step}: `" in md, step
    assert "REPLAY_OPS_CUDA=1 TORCH_CUDA_ARCH_LIST=" in md
    assert "-m pip install --no-build-isolation --no-deps --no-index -v -e ." in md
    assert "make test-gpu" in md or "-m pytest -q -m gpu" in md
    assert "bench/bench_all.py --device cuda" in md
    assert "bench/bench_megatron.py --device cuda --out ci_megatron" in md
    assert "## Megatron-Core benchmark" in md
    import torch

    assert f"| torch | {torch.__version__} " in md
    assert "| git | " in md and "| packages not installed | " in md
    out = subprocess.run([sys.executable, str(SCRIPT), "--skip-gpu", "--results-dir",
                          str(tmp_path), "--name", "ci", "--git-sha", "abc123"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0 and "| git | abc123 (given with --git-sha) |" in (
        tmp_path / "ci.md").read_text()
    assert str(tmp_path / "ci.md") in out.stdout


# ----------------------------------------------------------------- tools/gpu_run.sh
GPU_RUN = ROOT / "tools" / "gpu_run.sh"


def test_the_gpu_run_plan_fits_eight_minutes(tmp_path):
    """tools/gpu_run.sh's plan: every step's limit within the budget, which leaves room for
    the machine facts and the summary inside 8 minutes; the sanitizer subset; the HF and
    Megatron benchmarks with one run each; sm_90 only, every core."""
    # the steps' limits and the facts / wheels / probes within the budget; the budget, the
    # last step's TERM-then-KILL (10 s) and the summary (15 s) within the wall of 8 minutes
    assert sum(gc.LIMITS_S.values()) + gc.OVERHEAD_S <= gc.BUDGET_S == gc.WALL_S - 25
    assert gc.WALL_S == 8 * 60
    assert gc.STEPS == ("build", "test", "sanitizer", "bench", "hf", "megatron")
    a = args("--arch", "9.0", "--sanitizer-select", gc.SANITIZER_SUBSET, "--hf-args",
             "--runs 1", "--megatron-args", "--runs 1", "--workers", "0")
    steps = by_name(gc.plan_steps(a, facts(), tmp_path, "h100"))
    assert steps["build"].commands[0][1]["TORCH_CUDA_ARCH_LIST"] == "9.0"
    (argv, env), = steps["sanitizer"].commands
    assert f"-k {shlex_quote(gc.SANITIZER_SUBSET)}" in argv[-1]
    assert env["REPLAY_OPS_SANITIZER_TIMEOUT_S"] == str(gc.LIMITS_S["sanitizer"])
    (argv, _), = steps["test"].commands
    assert "-k 'not sanitizer'" in argv[-1] and " -n " not in argv[-1]
    assert steps["hf"].commands[0][0][1:] == ["bench/bench_hf.py", "--device", "cuda", "--out",
                                              "h100_hf", "--runs", "1"]
    assert steps["megatron"].commands[0][0][-2:] == ["--runs", "1"]
    s = by_name(gc.plan_steps(a, facts(packages=dict(ALL_PACKAGES, transformers=None)),
                              tmp_path, "h100"))
    assert s["hf"].skip.startswith("missing Python packages: transformers")
    text = GPU_RUN.read_text()
    assert "--arch \"$ARCH\"" in text and 'ARCH="${GPU_RUN_ARCH:-9.0}"' in text
    assert 'BUDGET_S="${GPU_RUN_BUDGET_S:-480}"' in text
    assert "--budget $((BUDGET_S - 25))" in text and "timeout -k 5 $((BUDGET_S - 5))" in text
    assert 'WORKERS="${GPU_RUN_WORKERS:-12}"' in text and '--workers "$WORKERS"' in text


def shlex_quote(s):
    import shlex

    return shlex.quote(s)


def test_out_holds_eight_files_at_most(fake_machine, monkeypatch):
    """--out DIR (what tools/gpu_run.sh passes): DIR/summary.md, DIR/summary.json and one
    log per step, nothing deeper than DIR/logs/; the rest goes to the work folder."""
    monkeypatch.setattr(gc, "WORK", fake_machine.path / "work")
    out = fake_machine.path / "out"
    rc = gc.main(["--out", str(out), "--quiet"])
    assert rc == 1
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["logs/bench.log", "logs/build.log", "logs/sanitizer.log", "logs/test.log",
                     "summary.json", "summary.md"], files
    md = (out / "summary.md").read_text()
    assert "Last lines of the log (logs/test.log)" in md
    assert "Copy bandwidth measured in the same run: 2950.5 GB/s" in md
    doc = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in doc["steps"]] == ["build", "test", "sanitizer", "bench"]
    assert [s["status"] for s in doc["steps"]] == ["pass", "fail", "timeout", "pass"]
    assert doc["benchmarks"]["bench"]["copy_bandwidth"]["gbps"] == 2950.5
    assert (gc.WORK / "state.json").exists() and (gc.WORK / "t_bench.json").exists()


def _wheel(folder: Path, name: str) -> Path:
    """A minimal valid pure-Python wheel of distribution `name` (one module)."""
    import zipfile

    path = folder / f"{name}-0.1-py3-none-any.whl"
    files = {f"{name}/__init__.py": "VALUE = 7\n",
             f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\n"
                                                "Version: 0.1\n",
             f"{name}-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
                                            "Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{k},,\n" for k in files) + f"{name}-0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{name}-0.1.dist-info/RECORD", record)
    return path


def test_carried_wheels_only_fill_what_is_missing(tmp_path):
    """The wheels are installed offline into their own folder, and only those whose
    distribution the Python lacks: the machine's own pytest is not replaced."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "replay_ops_probe_pkg")
    (wheels / "pytest-0.1-py3-none-any.whl").write_bytes(b"not even a zip: never opened")
    site = tmp_path / "site"
    path, note = gc.install_wheels(sys.executable, wheels, tmp_path / "logs", site)
    assert path == str(site), note
    assert (site / "replay_ops_probe_pkg" / "__init__.py").read_text() == "VALUE = 7\n"
    assert "replay_ops_probe_pkg-0.1-py3-none-any.whl" in note
    assert "already installed, not replaced: pytest " in note
    assert not (site / "pytest").exists()
    assert gc.wheel_dist("megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl") == \
        "megatron-core"
    lines = gc.wheel_plan(wheels)
    assert lines[0].startswith("2 wheels in ") and not any("NOT FOR" in x for x in lines)
    (wheels / "x-1.0-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"")
    assert any("x-1.0-cp311" in x and "NOT FOR PYTHON 3.12" in x for x in gc.wheel_plan(wheels))


def test_gpu_run_dry_run(tmp_path):
    """`tools/gpu_run.sh --dry-run --no-build` (`make gpu-check GPU_RUN_ARGS="--dry-run
    --no-build"`) on this CPU machine: every step's command and limit is printed, the test
    step as sized for the GPU machine (12 pytest-xdist workers, the plugin's log and order,
    the registry guards selected), the build step's install resolved offline in a copy of
    the tree (pip --dry-run: nothing compiled; `make install` and the CUDA build jobs
    compile the same build), the build's check on the tree's own library (a native gate
    call), and the test step's command run with --collect-only: the guards are collected
    first and the plan is written."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), PY=sys.executable)
    for k in ("TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "TRITON_INTERPRET", "GPU_RUN_BUDGET_S",
              "GPU_RUN_WORKERS"):
        env.pop(k, None)
    out = subprocess.run(["bash", str(GPU_RUN), "--dry-run", "--no-build"], capture_output=True,
                         text=True, timeout=900, cwd=tmp_path, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    for want in ("-m pip install --no-build-isolation --no-deps --no-index -v -e .",
                 "-m pip install --dry-run --no-build-isolation --no-deps --no-index -v -e .",
                 "Would install replay", "TORCH_CUDA_ARCH_LIST=9.0",
                 "PIP_BREAK_SYSTEM_PACKAGES=1", "tools/gpu_check.py --verify-build",
                 f"replay_ops from {ROOT / 'replay_ops'}", "native gate ran on the CPU",
                 "GPU_PYTEST_ARGS=-k 'not sanitizer'", "-p gpu_pytest_plugin", "--gpu-order",
                 "--gpu-include=test_backends_cover_the_registry", " -n 12",
                 "12 pytest-xdist workers", "registry guard: test_backends_cover_the_registry",
                 "(native, triton, torch) runs no CUDA case",
                 "limits 425 s + 30 s for the facts, wheels and probes, within the budget "
                 "of 455 s", "bench/bench_all.py --device cuda", "--runs 1",
                 "bench/bench_hf.py --device cuda", "bench/bench_megatron.py --device cuda",
                 "rehearsal passed", "===== steps ====="):
        assert want in text, want
    assert "test_cuda_compute_sanitizer or (test_gpu_sanitizer_mixed_chain and memcheck)" in text
    guards = ("guards first: tests/test_gate.py::test_backends_cover_the_registry[cpu], "
              "tests/test_gate.py::test_backends_cover_the_registry[cuda], "
              "tests/test_gpu_registry.py::test_every_cuda_backend_of_the_registry_has_cases;")
    assert guards in text
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| build | PASS |" in md and "| test | skipped |" in md and guards in md
    assert "build resolved offline only" in md
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(tmp_path / "out").parts) <= 2
                                   for p in files)


def test_the_build_check_refuses_a_library_from_elsewhere(tmp_path):
    """The rehearsal's check names the package it must load (the copy's, or the tree's):
    a replay_ops imported from anywhere else fails it."""
    env = dict(os.environ, GPU_CHECK_EXPECT_PACKAGE=str(tmp_path / "replay_ops"))
    out = subprocess.run([sys.executable, str(SCRIPT), "--verify-build"], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"expected replay_ops from {tmp_path / 'replay_ops'}, not " in out.stdout


def test_a_rehearsal_build_is_reused_only_for_the_same_inputs(tmp_path):
    """--dry-run --rehearse-build full keeps the library of a passing rehearsal with the
    sha256 of its inputs: csrc/, setup.py, pyproject.toml, CMakeLists.txt, torch, Python and
    the build's environment. Another input is another build; a file outside them is not."""
    src = tmp_path / "src"
    for rel, text in (("setup.py", "x"), ("pyproject.toml", "y"), ("csrc/a.cu", "k"),
                      ("csrc/include/h.h", "h"), ("replay_ops/api.py", "p")):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    f = facts()
    env = {"REPLAY_OPS_CUDA": "0", "TORCH_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": "2"}
    h = gc.build_inputs_hash(src, f, env)
    assert h == gc.build_inputs_hash(src, f, dict(env, MAX_JOBS="16"))
    (src / "replay_ops" / "api.py").write_text("changed")
    assert gc.build_inputs_hash(src, f, env) == h
    assert gc.build_inputs_hash(src, facts(torch="2.14.1+cu130"), env) != h
    assert gc.build_inputs_hash(src, f, dict(env, REPLAY_OPS_CUDA="1")) != h
    (src / "csrc" / "include" / "h.h").write_text("h2")
    assert gc.build_inputs_hash(src, f, env) != h
    (src / "csrc" / "include" / "h.h").write_text("h")
    (src / "csrc" / "include" / "h.h").rename(src / "csrc" / "include" / "g.h")
    assert gc.build_inputs_hash(src, f, env) != h


# ------------------------------------------------------------- the test step's plan and log


def test_the_plan_runs_guards_then_a_first_pass_then_the_rest_slowest_last():
    tests = [
        ("tests/test_gate.py::test_gate_parity[cuda-native-T7-float32]", ()),
        ("tests/test_gate.py::test_gate_parity[cuda-native-T9-float32]", ()),
        ("tests/test_gate.py::test_gate_parity[cuda-native-T7-bfloat16]", ()),
        ("tests/test_gate.py::test_gate_parity[cuda-triton-T7-float32]", ()),
        ("tests/test_gate.py::test_gate_gradcheck[cuda-torch-softmax]", ()),
        ("tests/test_gate.py::test_gate_gradcheck[cuda-torch-sigmoid]", ()),
        ("tests/test_ops_registration.py::test_compile_fullgraph_matches_eager[cuda-native]", ()),
        ("tests/test_unpermute.py::test_unpermute_dtypes[cuda-native-xbfloat16-wfloat32]", ()),
        ("tests/test_unpermute.py::test_unpermute_dtypes[cuda-native-xfloat32-wfloat32]", ()),
        ("tests/test_unpermute.py::test_unpermute_dtypes[cuda-native-xbfloat16-wbfloat16]", ()),
        ("tests/test_x.py::test_big[cuda-triton]", ("slow", "gpu")),
        ("tests/test_gate.py::test_backends_cover_the_registry", ()),
        ("tests/test_gpu_registry.py::test_every_cuda_backend_of_the_registry_has_cases", ()),
    ]
    names = [n for n, _ in tests]
    order = [(tp.function_name(names[i]), p) for i, p in tp.plan_order(tests)]
    assert [p for _, p in order] == sorted(p for _, p in order)  # passes in order
    assert order[:2] == [("test_backends_cover_the_registry", 0),
                         ("test_every_cuda_backend_of_the_registry_has_cases", 0)]
    first = [names[i] for i, p in tp.plan_order(tests) if p == 1]
    # one case per test function, device, backend and float dtype: the first of each
    assert "tests/test_gate.py::test_gate_parity[cuda-native-T9-float32]" not in first
    assert "tests/test_gate.py::test_gate_parity[cuda-native-T7-bfloat16]" in first
    assert "tests/test_gate.py::test_gate_parity[cuda-triton-T7-float32]" in first
    assert "tests/test_gate.py::test_gate_gradcheck[cuda-torch-sigmoid]" not in first
    assert "tests/test_unpermute.py::test_unpermute_dtypes[cuda-native-xbfloat16-wbfloat16]" \
        not in first  # the first float dtype of the id is the key's
    assert len(first) == 8
    # within a pass the slowest last: torch.compile, then the slow mark, then gradcheck
    tail = [n for n, p in order if p == 1][-3:]
    assert tail == ["test_gate_gradcheck", "test_big", "test_compile_fullgraph_matches_eager"]
    # measured durations of an earlier run come before the guesses
    d = {names[6]: 0.1, names[0]: 9.0}
    first_d = [names[i] for i, p in tp.plan_order(tests, d) if p == 1]
    assert first_d[0] == names[6] and first_d[-1] == names[0]
    assert tp.backends_of("t.py::f[cuda-torch-T0E7K2]") == {"torch"}
    assert tp.backends_of("t.py::f[torch.float32-native]") == {"native"}
    assert tp.backends_of("t.py::f[True-sigmoid-dtype2-1-8]") == set()


def _log_lines(order, reports, started=(), finish=None):
    ev = [{"event": "session"}, {"event": "collected", "n": len(order), "order": order}]
    ev += [{"event": "start", "nodeid": n} for n in started]
    ev += [dict(event="report", nodeid=n, when=w, outcome=o, duration=0.5, reason=r)
           for n, w, o, r in reports]
    if finish is not None:
        ev.append({"event": "finish", "exitstatus": finish})
    return "".join(json.dumps(e) + "\n" for e in ev)


G1, G2 = (f"tests/test_gate.py::{tp.GUARD_TESTS[0]}",
          f"tests/test_gpu_registry.py::{tp.GUARD_TESTS[1]}")


def test_the_per_test_log_gives_counts_coverage_and_gaps(tmp_path):
    """A log cut by a kill (its last line half written): the counts of what ran, the tests
    not reached and those running, the first pass's progress, the two-GPU tests apart, the
    CUDA cases each backend ran, and a backend of the registry with none is a problem."""
    order = [[G1, 0], [G2, 0], ["t.py::f[cuda-native-a]", 1], ["t.py::f[cuda-torch-a]", 1],
             ["t.py::g[cuda-triton-a]", 1], ["t.py::cuda1[native]", 1],
             ["t.py::cuda1[triton]", 1], ["t.py::f[cuda-native-b]", 2],
             ["t.py::f[cuda-native-c]", 2]]
    two = "needs two CUDA devices; this machine has 1"
    reports = [(G1, "call", "passed", None), (G2, "call", "passed", None),
               ("t.py::f[cuda-native-a]", "call", "passed", None),
               ("t.py::f[cuda-torch-a]", "call", "failed", None),
               ("t.py::f[cuda-torch-a]", "teardown", "failed", None),
               ("t.py::g[cuda-triton-a]", "setup", "skipped", "no Triton for CUDA"),
               ("t.py::cuda1[native]", "setup", "skipped", two),
               ("t.py::cuda1[triton]", "setup", "skipped", two)]
    started = [n for n, _ in order[:8]]
    p = tmp_path / "log.jsonl"
    p.write_text(_log_lines(order, reports, started) + '{"event": "rep')
    s = tp.summarize(tp.read_log(p))
    assert (s["passed"], s["failed"], s["error"], s["skipped"]) == (3, 1, 0, 1)
    assert s["two_gpu"] == ["t.py::cuda1[native]", "t.py::cuda1[triton]"]
    assert s["running"] == ["t.py::f[cuda-native-b]"]
    assert s["not_reached"] == ["t.py::f[cuda-native-c]"]
    assert s["first_pass"] == (5, 5) and s["finished"] is None
    assert s["coverage"] == {"native": 1, "triton": 0, "torch": 1}
    assert s["gaps"] == ["triton"] and s["failed_tests"] == ["t.py::f[cuda-torch-a]"]
    line, problems = tp.describe(s)
    assert line.startswith("3 passed, 1 failed, 0 errors, 1 skipped of 9 collected; "
                           "not runnable here (needs 2 GPUs): 2; not reached: 1, running "
                           "when stopped: 1 (first pass: 5 of 5 ran); CUDA cases run per "
                           "backend: native 1, triton 0, torch 1")
    assert problems == ["no CUDA case of the triton backend ran (the registry names it for "
                        "CUDA)"]
    # a guard that did not pass, or that is not collected, is a problem too
    p.write_text(_log_lines([o for o in order if o[0] != G2],
                            [(G1, "setup", "failed", None)] + reports[2:], finish=1))
    s = tp.summarize(tp.read_log(p), ("native", "torch"))
    assert s["guards"] == {tp.GUARD_TESTS[0]: "error", tp.GUARD_TESTS[1]: "not collected"}
    assert s["gaps"] == [] and s["finished"] == 1
    assert len(tp.describe(s)[1]) == 2
    # the durations and the passed tests, for the next run's order and --resume
    assert tp.load_durations(p)["t.py::f[cuda-torch-a]"] == 1.0
    assert tp.load_passed(p) == {"t.py::f[cuda-native-a]"}
    assert tp.read_log(tmp_path / "none.jsonl") is None


def test_the_test_step_counts_from_the_log_and_fails_on_a_missing_backend(tmp_path,
                                                                          monkeypatch):
    """run_step on the test step: the counts come from the per-test log; a pytest run that
    passes but ran no CUDA case of a backend the registry names fails the step; one killed
    at the step's limit still gives its counts and names the tests it was running."""
    monkeypatch.setattr(gc, "MIN_STEP_S", 1)
    log = tmp_path / "t.test.progress.jsonl"
    order = [[G1, 0], [G2, 0], ["t.py::f[cuda-native-a]", 1], ["t.py::f[cuda-torch-a]", 1],
             ["t.py::cuda1[triton]", 1]]
    reports = [(G1, "call", "passed", None), (G2, "call", "passed", None),
               ("t.py::f[cuda-native-a]", "call", "passed", None),
               ("t.py::f[cuda-torch-a]", "call", "passed", None),
               ("t.py::cuda1[triton]", "setup", "skipped", "needs two CUDA devices; 1")]
    text = _log_lines(order, reports, finish=0)
    write = f"import pathlib; pathlib.Path({str(log)!r}).write_text({text!r})"
    step = gc.Step("test", "tests", [(_py(write), {})], 30, progress=log,
                   coverage=("native", "triton", "torch"))
    res = gc.run_step(step, tmp_path, "t", 60, echo=False)
    assert res.status == "fail", res
    assert res.detail.startswith("4 passed, 0 failed, 0 errors, 0 skipped of 5 collected; "
                                 "not runnable here (needs 2 GPUs): 1;")
    assert "no CUDA case of the triton backend ran (the registry names it for CUDA)" in \
        res.notes
    assert "not runnable here (needs 2 GPUs): t.py::cuda1[triton]" in res.notes
    assert res.tests["t.py::f[cuda-native-a]"] == ["passed", 0.5]
    # the same log with the triton backend not asked for: a pass
    res = gc.run_step(dataclasses.replace(step, coverage=("native", "torch")), tmp_path, "t",
                      60, echo=False)
    assert res.status == "pass", res
    assert log.with_suffix(".prev.jsonl").exists()  # the last run's log: its durations
    # killed at its limit, half way: the counts so far, the tests it was running
    part = _log_lines(order, reports[:3], started=[n for n, _ in order[:4]])
    hang = (f"import pathlib, time; pathlib.Path({str(log)!r}).write_text({part!r}); "
            "time.sleep(60)")
    res = gc.run_step(dataclasses.replace(step, commands=[(_py(hang), {})], limit_s=3),
                      tmp_path, "t", 60, echo=False)
    assert res.status == "timeout"
    assert res.detail.startswith("3 passed, 0 failed, 0 errors, 0 skipped of 5 collected; "
                                 "not reached: 1, running when stopped: 1; CUDA cases")
    assert "ran past its limit of 3 s" in res.detail
    assert "running when the step was stopped: t.py::f[cuda-torch-a]" in res.notes
    # no log at all: the coverage cannot be counted, the step fails
    log.unlink()
    res = gc.run_step(dataclasses.replace(step, commands=[(_py("pass"), {})]), tmp_path, "t",
                      60, echo=False)
    assert res.status == "fail" and any("no per-test log" in n for n in res.notes)


PLUGIN_TESTS = """
import os, time, pytest

def test_backends_cover_the_registry():  # no gpu mark: selected by --gpu-include
    pass

@pytest.mark.gpu
@pytest.mark.parametrize("case", ["cuda-native-float32", "cuda-native-float32-T9",
                                  "cuda-triton-float32", "cuda-triton-bfloat16",
                                  "cuda-torch-float32"])
def test_parity(case):
    assert case != "cuda-torch-float32"

@pytest.mark.gpu
def test_every_cuda_backend_of_the_registry_has_cases():
    pass

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="needs two CUDA devices; this machine has 1")
@pytest.mark.parametrize("backend", ["native", "triton"])
def test_on_cuda1(backend):
    pass

@pytest.mark.gpu
def test_compile_slowest():
    time.sleep(float(os.environ.get("HANG_S", "0")))

def test_cpu_only():
    pass
"""


def _plugin_run(tmp_path, workers, hang_s=0.0, timeout=120, kill_at=None, extra=()):
    d = tmp_path / f"suite{workers}{int(hang_s)}{len(extra)}"
    d.mkdir()
    (d / "conftest.py").write_text("def pytest_configure(config):\n"
                                   "    config.addinivalue_line('markers', 'gpu: GPU')\n")
    (d / "test_a.py").write_text(PLUGIN_TESTS)
    log = d / "log.jsonl"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
            "-p", "gpu_pytest_plugin", f"--gpu-log={log}", "--gpu-order",
            *[f"--gpu-include={g}" for g in tp.GUARD_TESTS], *extra, "test_a.py"]
    if workers:
        argv += ["-n", str(workers)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tools"), HANG_S=str(hang_s))
    proc = subprocess.Popen(argv, cwd=d, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout
    while kill_at and time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and f'"start", "nodeid": "test_a.py::{kill_at}"' in log.read_text():
            break
        time.sleep(0.2)
    if kill_at:
        os.killpg(proc.pid, 9)  # what the step's limit does
    out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    return tp.read_log(log), out


@pytest.mark.parametrize("workers", [0, 2])
def test_the_plugin_writes_the_log_as_the_tests_run(tmp_path, workers):
    """The plugin in a real pytest run (one process, and two pytest-xdist workers where
    pytest-xdist is installed): the guard without a gpu mark is selected, the guards run
    first and the slowest last, every report is logged; killed while the slowest test
    runs, the log still holds the counts."""
    if workers:
        pytest.importorskip("xdist", reason="pytest-xdist is not installed here (the GPU "
                                            "machines have it)")
    log, out = _plugin_run(tmp_path, workers)
    assert log is not None, out
    names = [n.split("::")[1] for n, _ in log["order"]]
    assert names[:2] == list(tp.GUARD_TESTS), names
    # the first pass, slowest last, then the rest of the grid (the second native float32)
    assert names[-2:] == ["test_compile_slowest", "test_parity[cuda-native-float32-T9]"]
    assert "test_cpu_only" not in names and log["n"] == 10
    assert [p for _, p in log["order"]].count(2) == 1
    s = tp.summarize(log)
    assert (s["passed"], s["failed"], s["skipped"], len(s["two_gpu"])) == (7, 1, 0, 2), out
    assert s["guards"] == dict.fromkeys(tp.GUARD_TESTS, "passed")
    assert s["coverage"] == {"native": 2, "triton": 2, "torch": 1} and s["finished"] == 1
    if workers:
        return  # the rest in one process (a worker's reports reach the log alike)
    # a second run leaves out what passed in the first (--resume); the guards run again
    first = tmp_path / "first.jsonl"
    first.write_text((tmp_path / "suite000" / "log.jsonl").read_text())
    log, out = _plugin_run(tmp_path, workers, extra=(f"--gpu-skip-passed={first}",))
    assert [n.split("::")[1] for n, _ in log["order"]] == [
        *tp.GUARD_TESTS, "test_parity[cuda-torch-float32]", "test_on_cuda1[native]",
        "test_on_cuda1[triton]"], out
    assert log["skipped_earlier"] == 5
    s = tp.summarize(log)
    assert "passed in the earlier run, not run again: 5" in tp.describe(s)[0]
    # killed while the slowest case runs: the counts so far
    log, out = _plugin_run(tmp_path, workers, hang_s=60, kill_at="test_compile_slowest")
    s = tp.summarize(log)
    assert "test_a.py::test_compile_slowest" in s["running"], out
    assert s["finished"] is None
    done = s["passed"] + s["failed"] + s["error"] + s["skipped"] + len(s["two_gpu"])
    assert done + len(s["running"]) + len(s["not_reached"]) == 10
    # everything before the slowest case ran, nothing after it
    assert (s["passed"], s["failed"], s["first_pass"]) == (5, 1, (6, 7))
    assert s["not_reached"] == ["test_a.py::test_parity[cuda-native-float32-T9]"]


def test_the_plugin_logs_modules_that_do_not_collect(tmp_path):
    """A test module that fails to import is a collection error (the step fails, naming
    it); one that skips itself at import is listed with its reason."""
    (tmp_path / "conftest.py").write_text("def pytest_configure(config):\n"
                                          "    config.addinivalue_line('markers', 'gpu: GPU')\n")
    (tmp_path / "test_ok.py").write_text("import pytest\n@pytest.mark.gpu\n"
                                         "def test_a():\n    pass\n")
    (tmp_path / "test_broken.py").write_text("import not_a_module_anywhere\n")
    (tmp_path / "test_skipped.py").write_text(
        "import pytest\npytest.skip('zstandard is not installed', allow_module_level=True)\n")
    log = tmp_path / "log.jsonl"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-m", "gpu", "-p", "gpu_pytest_plugin", f"--gpu-log={log}",
                          "--continue-on-collection-errors", "."], cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(ROOT / "tools")),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    s = tp.summarize(tp.read_log(log), (), guards=())
    assert s["passed"] == 1 and list(s["collection_errors"]) == ["test_broken.py"]
    assert s["failed_tests"] == ["test_broken.py"]
    assert "zstandard is not installed" in s["collection_skips"]["test_skipped.py"]
    line, problems = tp.describe(s)
    assert "collection errors: 1" in line
    assert problems == ["test_broken.py did not collect: E   ModuleNotFoundError: No module "
                        "named 'not_a_module_anywhere'"]


def test_bench_cases_runs_with_a_flagged_fraction():
    """bench/bench_cases.py at its small shapes on the CPU: the permute against a copy of
    the same bytes, the gate against softmax + topk, unflagged and with 1% of the rows
    flagged (the model's own selection in the gate kernel), labelled with the backend that
    serves them."""
    import bench_cases

    assert bench_cases.FLAGGED_FRACTIONS == (0.0, 0.01)
    assert bench_cases.PERMUTE_CASE == {"T": 4096, "K": 8, "E": 128, "H": 7168}
    assert bench_cases.GATE_CASES == ((16384, 128, 8), (8192, 256, 8))
    a = bench_cases.parser().parse_args(["--device", "cpu", "--quick", "--runs", "1",
                                         "--reps", "1", "--warmup", "0", "--flagged", "0",
                                         "0.01"])
    rows, summary = bench_cases.run(a)
    perm = {r["provider"]: r for r in rows if r["op"] == "permute"}
    assert perm["copy (same bytes)"]["frac_of_copy_bw"] == pytest.approx(1.0)
    assert perm["torch"]["baseline"] == "copy (same bytes)" and perm["torch"]["gbps"] > 0
    gate = {r["provider"]: r for r in rows if r["op"] == "gate"}
    assert gate["softmax+topk"]["speedup_vs_softmax_topk"] == 1.0
    assert gate["torch replay"]["flagged"] == 0.0
    assert gate["torch replay, 1% flagged (selection of every row)"]["flagged"] == 0.01
    assert gate["torch replay, 1% flagged (selection of every row)"]["ms_median"] > 0
    assert any("selection in the gate kernel" in p for p in gate) == \
        any(p.startswith("native") for p in gate)
    assert summary[0].startswith("permute T=64 K=4 E=16 H=256 bf16 (R=256): ")
    assert "a copy of the same" in summary[0]
    assert summary[-1].startswith("flagged rows: replay_mask False; the model's own selection")
    mask = bench_cases.flagged_mask(1000, 0.01, "cpu")
    assert int((~mask).sum()) == 10
