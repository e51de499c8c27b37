"""compute-sanitizer runs over the workloads of tools/gpu_workloads.py (CUDA only: they skip
without a GPU or without compute-sanitizer, saying why):

* memcheck, racecheck, initcheck and synccheck over the mixed chain: bf16, strided int16
  indices (a [T, L, K] recording sliced at one layer), misaligned views (`expert_out[1:]`,
  `hidden[:, 1:]`, and bases 2 bytes off at whole-vector row sizes), every native gate
  launch path (single_cta, cooperative, three_launches) and both Triton gate paths, forward
  and backward;
* memcheck over `validate=False` with indices outside [0, E) on both backends and every path;
* memcheck and initcheck over the model's own selection of flagged rows with the agreement
  outputs (the per-thread ranked lists of the native kernels, every output written), forward
  and backward, on both backends and every path.

Each run is a child process (`compute-sanitizer --tool <tool> --error-exitcode 3 python
tools/gpu_workloads.py <workload>`) with a time limit; the workload checks its own results,
so a run passes when the sanitizer reports no error (racecheck: no hazard, warnings included)
and the workload prints OK.
PYTORCH_NO_CUDA_MEMORY_CACHING=1 makes every tensor its own allocation, so that an access
past a tensor's end is past an allocation's end (memcheck) and a read of memory that no kernel
wrote is not hidden by an earlier user of a cached block (initcheck).

`make gpu-check` runs these in its sanitizer step (`pytest -m gpu -k sanitizer`), together
with the memcheck and racecheck runs of tests/test_native.py."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
import gpu_workloads as W  # tools/ (pyproject's pytest pythonpath)
from _helpers import with_marks

# Per run; a run that hangs fails with its output instead of stalling the whole check.
RUN_TIMEOUT_S = int(os.environ.get("REPLAY_OPS_SANITIZER_TIMEOUT_S", "300"))


def _sanitizer() -> str | None:
    exe = shutil.which("compute-sanitizer")
    if exe:
        return exe
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            for rel in ("bin/compute-sanitizer", "compute-sanitizer/compute-sanitizer"):
                cand = Path(home) / rel
                if cand.is_file() and os.access(cand, os.X_OK):
                    return str(cand)
    return None


def _skip_reason() -> str | None:
    reasons = [r for r in (W.cuda_reason("native"), W.cuda_reason("triton")) if r]
    if reasons:
        return "; ".join(dict.fromkeys(reasons))
    if _sanitizer() is None:
        return "compute-sanitizer not found (PATH, $CUDA_HOME or /usr/local/cuda)"
    return None


_SKIP = _skip_reason()
gpu_sanitizer = [pytest.mark.gpu, pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))]



def _tool_flags(exe: str, tool: str) -> list[str]:
    flags = ["--tool", tool, "--error-exitcode", "3", "--print-limit", "50"]
    if tool == "memcheck":
        out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
        if "--padding" in out.stdout:
            # guard bytes after each allocation: an access just past a tensor is reported
            flags += ["--padding", "64"]
    return flags


def _run(tool: str, workload: str) -> None:
    exe = _sanitizer()
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    cmd = [exe, *_tool_flags(exe, tool), sys.executable, str(ROOT / "tools" / "gpu_workloads.py"),
           workload]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                             cwd=ROOT, env=env)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-4000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        pytest.fail(f"compute-sanitizer --tool {tool} {workload}: no result within "
                    f"{RUN_TIMEOUT_S} s (REPLAY_OPS_SANITIZER_TIMEOUT_S)\n{tail}")
    text = out.stdout + out.stderr
    # racecheck ends with "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)",
    # the other tools with "ERROR SUMMARY: 0 errors"; the workload's own OK line shows that it
    # ran to the end (a crashed target can come with a clean summary).
    clean = (re.search(r"RACECHECK SUMMARY: 0 hazards displayed", text) if tool == "racecheck"
             else re.search(r"ERROR SUMMARY: 0 errors", text))
    ok = out.returncode == 0 and "OK " in out.stdout and clean is not None
    summary = "\n".join(line for line in text.splitlines() if "SUMMARY" in line)
    assert ok, (f"compute-sanitizer --tool {tool} on the {workload} workload: exit code "
                f"{out.returncode}; {summary or 'no summary line'}\n"
                f"{out.stdout[-6000:]}\n{out.stderr[-6000:]}")


@with_marks(gpu_sanitizer)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "initcheck", "synccheck"])
def test_gpu_sanitizer_mixed_chain(tool):
    _run(tool, "mix")


@with_marks(gpu_sanitizer)
def test_gpu_sanitizer_memcheck_garbage_indices():
    _run("memcheck", "garbage")


@with_marks(gpu_sanitizer)
@pytest.mark.parametrize("tool", ["memcheck", "initcheck"])
def test_gpu_sanitizer_selection_of_flagged_rows(tool):
    _run(tool, "select")
