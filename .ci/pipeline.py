#!/usr/bin/env python3
"""The steps of `make test` (and `make test-core`), run as a graph on every core.

    python3 .ci/pipeline.py test        # what `make test` runs (CI: .ci/run)
    python3 .ci/pipeline.py core        # `make test-core`: the installs and the main suite
    python3 .ci/pipeline.py test --list # the steps, their order and what each waits for
    python3 .ci/pipeline.py test --only main-1,main-2   # some steps (their inputs must exist)
    python3 .ci/pipeline.py weights build/ci/main-*.xml  # SHARD_WEIGHTS from a run's times

Every step is a `make` target of the Makefile, run with PIPELINE=1 (a target then leaves
its prerequisites to this graph) and its output in build/ci/<step>.log, printed when the
step ends. A step starts when the steps it waits for have passed and it gets the cores it
uses: the machine's cores are shared out (a step that downloads or unpacks uses none; a
build or a test uses one or two), the steps on the longest remaining path first. So the
downloads and unpacking of the engines' and the CUDA jobs' environments overlap the builds
and the suites, and no core waits while work is ready.

The main suite runs in shards, each a pytest process over whole test files, balanced by
the files' times of a measured run (SHARD_WEIGHTS below, seconds on the 2-core machine; a
file not listed counts as DEFAULT_WEIGHT). Every tests/test_*.py file that is not an
engine's runs in exactly one shard; each prints its own --durations.

A failed step stops the run: no new step starts, the running ones are stopped, and the
failure's log is printed (KEEP_GOING=1 runs every step whose inputs passed). At the end a
table gives every step's start, wall time, CPU time (its processes' user + system time)
and result; it is also written to build/ci/steps.md and build/ci/steps.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "build" / "ci"
MAKE = os.environ.get("MAKE", "make")

# Engine tests run in their own steps (they need their environments).
ENGINE_FILES = ("tests/test_vllm_engine.py", "tests/test_sglang_engine.py")

# Seconds per test file of the main suite: the times of a fresh-clone `.ci/run`'s shards
# (pytest --junitxml, summed per file) on the shared 2-core machine, with its
# tests/test_native.py without the CUDA compile check (the CUDA wheel jobs' here). Only the
# balance of the shards depends on them; a file not listed weighs DEFAULT_WEIGHT.
SHARD_WEIGHTS: dict[str, float] = {
    "tests/test_compile.py": 96, "tests/test_determinism.py": 60, "tests/test_gate.py": 69,
    "tests/test_gpu_check.py": 67, "tests/test_skyrl_clients.py": 60,
    "tests/test_gate_dense.py": 51, "tests/test_distributed_fsdp.py": 44,
    "tests/test_codec.py": 39, "tests/test_verl_clients.py": 37,
    "tests/test_msswift_clients.py": 36, "tests/test_selection_triton.py": 33,
    "tests/test_demo.py": 32, "tests/test_ops_registration.py": 29,
    "tests/test_gate_permute.py": 28, "tests/test_extension_load.py": 25,
    "tests/test_distributed.py": 25, "tests/test_distributed_edges.py": 22,
    "tests/test_triton_compile.py": 21, "tests/test_unpermute.py": 21,
    "tests/test_untrusted_routing.py": 20, "tests/test_distributed_errors.py": 20,
    "tests/test_native.py": 20, "tests/test_replay_files.py": 20,
    "tests/test_hf_experts.py": 19, "tests/test_fuzz_codec.py": 18,
    "tests/test_hf_machinery.py": 18, "tests/test_triton_kernels.py": 16,
    "tests/test_megatron_router.py": 12, "tests/test_fuzz_routing.py": 11,
    "tests/test_selection.py": 11, "tests/test_config.py": 10,
    "tests/test_distributed_example.py": 9, "tests/test_megatron_dist.py": 9,
    "tests/test_distributed_hf.py": 9, "tests/test_packaging.py": 9,
    "tests/test_hf_integration.py": 9, "tests/test_hf_families.py": 8,
    "tests/test_megatron_clients.py": 7, "tests/test_deprecations.py": 6,
    "tests/test_megatron_select.py": 6, "tests/test_sglang_launcher.py": 5,
    "tests/test_adapters.py": 5, "tests/test_e2e_moe.py": 5, "tests/test_inject.py": 5,
    "tests/test_require_flag.py": 5, "tests/test_router_replay.py": 5,
    "tests/test_hf_selection.py": 5, "tests/test_megatron_layers.py": 4,
    "tests/test_permute.py": 3, "tests/test_device_math.py": 2,
    "tests/test_megatron_data.py": 2, "tests/test_codec_golden.py": 2,
    "tests/test_vllm_launcher.py": 2, "tests/test_megatron_compile.py": 2,
    "tests/test_options.py": 1, "tests/test_layering.py": 1, "tests/test_reference.py": 1,
    "tests/test_routing_dtypes.py": 1, "tests/test_host_syncs.py": 1,
    "tests/test_checked_batch.py": 1, "tests/test_validation.py": 1,
    "tests/test_static_routing.py": 1, "tests/test_replay_padding.py": 1,
    "tests/test_doc_links.py": 1, "tests/test_direct_calls.py": 1,
    "tests/test_doc_examples.py": 1, "tests/test_vllm_adapter.py": 1,
    "tests/test_scores.py": 1, "tests/test_sglang_forms.py": 1, "tests/test_backends.py": 1,
    "tests/test_router_replay_agreement.py": 1, "tests/test_errors.py": 1,
    "tests/test_check_native_build.py": 1, "tests/test_mutants_apply.py": 1,
    "tests/test_gpu_gate_edges.py": 1, "tests/test_gpu_large.py": 1,
    "tests/test_gpu_sanitizer.py": 1, "tests/test_gpu_gate_dense.py": 1,
    "tests/test_gpu_registry.py": 1, "tests/test_gpu_selection.py": 1,
    "tests/test_gpu_runtime.py": 1,
}
DEFAULT_WEIGHT = 10.0


@dataclass
class Step:
    name: str
    target: str  # the make target (and its variables)
    cores: int  # 0: waits on the network or the disk; 1 or 2: computes
    after: tuple = ()
    est: float = 60.0  # expected wall seconds on an idle machine, for the order only
    env: dict = field(default_factory=dict)
    # run state
    proc: subprocess.Popen | None = None
    start: float | None = None
    end: float | None = None
    rc: int | None = None
    cpu: float = 0.0
    status: str = "waiting"
    cgroup: Path | None = None


def shards(n: int) -> list[list[str]]:
    """The main suite's files in `n` shards of about equal weight (largest first)."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    files = [f for f in files if f not in ENGINE_FILES]
    out: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for f in sorted(files, key=lambda f: -SHARD_WEIGHTS.get(f, DEFAULT_WEIGHT)):
        i = load.index(min(load))
        out[i].append(f)
        load[i] += SHARD_WEIGHTS.get(f, DEFAULT_WEIGHT)
    return [sorted(s) for s in out]


def graph(profile: str, nshards: int) -> list[Step]:
    main = [Step(f"main-{i + 1}", f"test-main JUNIT=build/ci/main-{i + 1}.xml "
                 f"TEST_FILES='{' '.join(files)}'", 1, ("install",),
                 est=sum(SHARD_WEIGHTS.get(f, DEFAULT_WEIGHT) for f in files))
            for i, files in enumerate(shards(nshards))]
    steps = [Step("install", "install-test", 2, est=90)] + main
    if profile == "core":
        return steps
    steps += [
        # downloads and unpacking (no core), started at once
        Step("triton-floor", "install-triton-floor", 0, est=60),
        Step("vllm-venv", "install-vllm", 0, est=240),
        Step("sglang-venv", "install-sglang", 0, est=600),
        Step("cuda-venv-ceiling", "cuda-job-venv CUDA_JOB=ceiling", 0, est=240),
        Step("cuda-venv-floor", "cuda-job-venv CUDA_JOB=floor", 0, ("cuda-venv-ceiling",),
             est=180),
        # builds and checks
        Step("check-triton", "check-triton-installed", 2, ("install",), est=190),
        Step("check-triton-floor", "check-triton-floor", 2, ("install", "triton-floor"), est=70),
        Step("cuda-wheel-ceiling", "cuda-job-build CUDA_JOB=ceiling", 2, ("cuda-venv-ceiling",),
             est=110),
        Step("cuda-wheel-floor", "cuda-job-build CUDA_JOB=floor", 2, ("cuda-venv-floor",),
             est=80),
        Step("cuda-check-ceiling", "cuda-job-check CUDA_JOB=ceiling", 1,
             ("cuda-wheel-ceiling", "install"), est=100),
        Step("cuda-check-floor", "cuda-job-check CUDA_JOB=floor", 1,
             ("cuda-wheel-floor", "install"), est=90),
        # the suites that need their own environments
        Step("triton-floor-tests", "test-triton-floor", 1, ("install", "triton-floor"), est=30),
        Step("mcore-new", "test-mcore-new", 1, ("install",), est=60),
        # an engine's server and its in-process copy: two busy processes, several GB
        Step("vllm", "test-vllm", 2, ("install", "vllm-venv"), est=90),
        Step("sglang", "test-sglang", 2, ("install", "sglang-venv"), est=110),
    ]
    return steps


def remaining(step: Step, by_name: dict, memo: dict) -> float:
    """The expected seconds from this step's start to the end of the longest path of the
    steps that wait for it (the order in which ready steps get cores)."""
    if step.name not in memo:
        after = [s for s in by_name.values() if step.name in s.after]
        memo[step.name] = step.est + max((remaining(s, by_name, memo) for s in after),
                                         default=0.0)
    return memo[step.name]


def fmt(sec: float) -> str:
    sec = int(round(sec))
    return f"{sec // 60}m{sec % 60:02d}s"


# CPU time per step: the cgroup (v1 cpuacct) of the step where this machine lets the run
# make one, which counts every process of the step, the ones its processes do not wait for
# included (a fork server's children); else the step's reaped processes' rusage.
CGROUP_ROOT = Path("/sys/fs/cgroup/cpuacct")


def make_cgroup(step: Step) -> Path | None:
    if not (CGROUP_ROOT.is_dir() and os.access(CGROUP_ROOT, os.W_OK)):
        return None
    d = CGROUP_ROOT / f"replay_ops_ci_{os.getpid()}_{step.name}"
    try:
        d.mkdir(exist_ok=True)
        return d if (d / "cpuacct.usage").exists() else None
    except OSError:
        return None


def cgroup_cpu(d: Path | None) -> float:
    try:
        return int((d / "cpuacct.usage").read_text()) / 1e9 if d else 0.0
    except (OSError, ValueError):
        return 0.0


def start(step: Step, t0: float) -> None:
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"{step.name}.log", "w")
    cmd = f"{MAKE} --no-print-directory {step.target}"
    log.write(f"$ {cmd}\n")
    log.flush()
    env = dict(os.environ, PIPELINE="1", **step.env)
    # a step that computes while others download gets no lower priority; the downloads and
    # unpacking run niced
    prefix = "nice -n 10 " if step.cores == 0 else ""
    step.cgroup = make_cgroup(step)
    enter = (f"echo $$ > {shlex.quote(str(step.cgroup / 'cgroup.procs'))} 2>/dev/null; "
             if step.cgroup else "")
    step.proc = subprocess.Popen(["bash", "-c", enter + "exec " + prefix + cmd], cwd=ROOT,
                                 stdout=log, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
    log.close()
    step.start = time.monotonic()
    step.status = "running"
    print(f"== {time.strftime('%H:%M:%S')} +{fmt(step.start - t0)} start {step.name}: make "
          f"{step.target.split(' TEST_FILES=')[0]}"
          + (f" ({len(shlex.split(step.target.split('TEST_FILES=')[1])[0].split())} files)"
             if "TEST_FILES=" in step.target else ""), flush=True)


def stop(step: Step) -> None:
    try:
        os.killpg(step.proc.pid, signal.SIGTERM)
        for _ in range(100):
            if step.proc.poll() is not None:
                return
            time.sleep(0.1)
        os.killpg(step.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(steps: list[Step], cores: int, keep_going: bool) -> int:
    by_name = {s.name: s for s in steps}
    memo: dict = {}
    order = sorted(steps, key=lambda s: -remaining(s, by_name, memo))
    t0 = time.monotonic()
    last_note = t0
    failed = False
    while True:
        # finished steps
        for s in steps:
            if s.status != "running":
                continue
            try:
                pid, status, usage = os.wait4(s.proc.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status, usage = s.proc.pid, 0, None
            if pid == 0:
                continue
            s.proc.returncode = os.waitstatus_to_exitcode(status)
            s.rc = s.proc.returncode
            s.end = time.monotonic()
            s.cpu = max((usage.ru_utime + usage.ru_stime) if usage else 0.0,
                        cgroup_cpu(s.cgroup))
            if s.cgroup is not None:
                try:
                    s.cgroup.rmdir()  # fails while a process of the step lives on
                except OSError:
                    pass
            s.status = "ok" if s.rc == 0 else "FAILED"
            text = (LOGS / f"{s.name}.log").read_text(errors="replace")
            print(f"== {time.strftime('%H:%M:%S')} +{fmt(s.end - t0)} {s.name} "
                  f"{'OK' if s.rc == 0 else f'FAILED (exit status {s.rc})'} in "
                  f"{fmt(s.end - s.start)} (CPU {s.cpu:.0f} s); its output "
                  f"(build/ci/{s.name}.log):", flush=True)
            print(text.rstrip("\n"), flush=True)
            print(f"== end of {s.name}", flush=True)
            if s.rc != 0:
                failed = True
                if not keep_going:
                    for r in steps:
                        if r.status == "running":
                            stop(r)
                            r.status = "stopped"
                            r.end = time.monotonic()
                    for r in steps:
                        if r.status == "waiting":
                            r.status = "not run"
        # steps that can no longer run
        for s in steps:
            if s.status == "waiting" and any(by_name[a].status in ("FAILED", "not run",
                                                                    "stopped")
                                             for a in s.after):
                s.status = "not run"
        if failed and not keep_going:
            break
        # start what is ready, longest remaining path first; a core left free by the steps
        # that fit goes to the first ready step that did not (a two-core build beside a
        # one-core test: the two share three processes' work, no core waits)
        busy = sum(s.cores for s in steps if s.status == "running")
        ready = [s for s in order if s.status == "waiting"
                 and all(by_name[a].status == "ok" for a in s.after)]
        left = []
        for s in ready:
            if s.cores == 0 or busy + s.cores <= cores:
                start(s, t0)
                busy += s.cores
            else:
                left.append(s)
        if left and busy < cores:
            start(left[0], t0)
        if not any(s.status in ("waiting", "running") for s in steps):
            break
        now = time.monotonic()
        if now - last_note >= 120:
            last_note = now
            running = ", ".join(f"{s.name} {fmt(now - s.start)}" for s in steps
                                if s.status == "running")
            waiting = ", ".join(s.name for s in steps if s.status == "waiting")
            print(f"== {time.strftime('%H:%M:%S')} +{fmt(now - t0)} running: {running}"
                  + (f"; waiting: {waiting}" if waiting else ""), flush=True)
        time.sleep(0.5)
    wall = time.monotonic() - t0
    report(steps, t0, wall, cores)
    return 1 if any(s.status != "ok" for s in steps) else 0


def report(steps: list[Step], t0: float, wall: float, cores: int) -> None:
    rows = sorted(steps, key=lambda s: (s.start is None, s.start or 0))
    lines = ["| step | make target | cores | start | wall | CPU s | result |",
             "|---|---|---|---|---|---|---|"]
    for s in rows:
        target = s.target.split(" TEST_FILES=")[0]
        if "TEST_FILES=" in s.target:
            n = len(shlex.split(s.target.split("TEST_FILES=")[1])[0].split())
            target += f" ({n} files)"
        lines.append(f"| {s.name} | `{target}` | {s.cores} | "
                     + (f"+{fmt(s.start - t0)} | {fmt((s.end or time.monotonic()) - s.start)} | "
                        f"{s.cpu:.0f}" if s.start is not None else " | | ")
                     + f" | {s.status} |")
    cpu = sum(s.cpu for s in steps)
    total = (f"{len(steps)} steps in {fmt(wall)} on {cores} cores; CPU {cpu / 60:.1f} min "
             f"({cpu / max(wall * cores, 1) * 100:.0f}% of the cores' time)")
    print("\n== steps (build/ci/steps.md)\n" + "\n".join(lines) + "\n" + total, flush=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    (LOGS / "steps.md").write_text("\n".join(lines) + "\n\n" + total + "\n")
    (LOGS / "steps.json").write_text(json.dumps({
        "wall_s": round(wall, 1), "cores": cores, "cpu_s": round(cpu, 1),
        "steps": [{"name": s.name, "target": s.target, "cores": s.cores,
                   "start_s": None if s.start is None else round(s.start - t0, 1),
                   "wall_s": None if s.start is None else round((s.end or 0) - s.start, 1),
                   "cpu_s": round(s.cpu, 1), "result": s.status} for s in rows]}, indent=1))


def weights(paths: list[str], slowdown: float) -> None:
    """SHARD_WEIGHTS from the main shards' JUnit files of a run (build/ci/main-*.xml): each
    file's summed test times divided by `slowdown` (how much slower that run's machine was
    than an idle one)."""
    import xml.etree.ElementTree as ET

    per: dict[str, float] = {}
    for path in paths:
        for tc in ET.parse(path).iter("testcase"):
            name = "tests/" + tc.get("classname", "").split(".")[-1] + ".py"
            per[name] = per.get(name, 0.0) + float(tc.get("time") or 0.0)
    items = sorted(per.items(), key=lambda kv: -kv[1])
    print("SHARD_WEIGHTS: dict[str, float] = {")
    line = "   "
    for name, sec in items:
        part = f' "{name}": {max(1, round(sec / slowdown))},'
        if len(line) + len(part) > 92:
            print(line)
            line = "   "
        line += part
    print(line + "\n}")


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["weights"]:
        ap = argparse.ArgumentParser(prog="pipeline.py weights",
                                     description=weights.__doc__.split("\n\n")[0])
        ap.add_argument("junit", nargs="+")
        ap.add_argument("--slowdown", type=float, default=1.0)
        a = ap.parse_args(sys.argv[2:])
        weights(a.junit, a.slowdown)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", choices=("test", "core"))
    ap.add_argument("--list", action="store_true", help="print the steps, run nothing")
    ap.add_argument("--only", default="", help="comma-separated step names")
    ap.add_argument("--cores", type=int, default=int(os.environ.get("PIPELINE_CORES", 0))
                    or os.cpu_count() or 2)
    ap.add_argument("--shards", type=int, default=int(os.environ.get("PIPELINE_SHARDS", 0)),
                    help="pytest processes for the main suite (default: `core` one per core; "
                         "`test` one more, so that shards fill the gaps the other steps leave)")
    args = ap.parse_args(argv)
    shards_n = args.shards or (args.cores if args.profile == "core" else args.cores + 1)
    steps = graph(args.profile, shards_n)
    if args.only:
        want = set(args.only.split(","))
        unknown = want - {s.name for s in steps}
        if unknown:
            ap.error(f"unknown steps: {', '.join(sorted(unknown))}")
        steps = [s for s in steps if s.name in want]
        for s in steps:
            s.after = tuple(a for a in s.after if a in want)
    if args.list:
        by_name = {s.name: s for s in steps}
        memo: dict = {}
        for s in sorted(steps, key=lambda s: -remaining(s, by_name, memo)):
            print(f"{s.name:20s} cores {s.cores}  ~{fmt(s.est):>7s}  path {fmt(memo[s.name]):>7s}"
                  f"  after {', '.join(s.after) or '-'}\n    make {s.target}")
        return 0
    keep_going = os.environ.get("KEEP_GOING") == "1"
    if args.profile == "test":
        # `make test` compiles the CUDA kernels with the checks of `make check-cuda`
        # (warnings, spills) in its CUDA wheel jobs, once per architecture: the suites'
        # standalone compile of the same files (tests/test_native.py, in the main shards and
        # the CUDA jobs' suites) is left to `make check-cuda` and `make test-core`.
        os.environ["REPLAY_OPS_CUDA_CHECKED_IN_WHEELS"] = "1"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(steps, args.cores, keep_going)
    except KeyboardInterrupt:
        return 130
    finally:  # interrupted: no step outlives the run
        for s in steps:
            if s.status == "running" and s.proc is not None and s.proc.poll() is None:
                stop(s)


if __name__ == "__main__":
    sys.exit(main())
