"""The GPU test step's plan and its record, without pytest: the order the tests run in, and
the per-test log that tools/gpu_pytest_plugin.py writes as they run (read back here by
tools/gpu_check.py, so a run stopped at its time limit still gives its counts).

Order (`plan_order`):

  0  the registry guards (GUARD_TESTS): every backend the registry names has its cases;
  1  a first pass: one case per test function, backend and float dtype (the first of each
     in collection order), so that a run stopped early has still run every op on every
     backend;
  2  the rest of the grid.

Within a pass the cases run fastest first: by the durations of an earlier run where they
are known (`load_durations`), else by name (SLOW_WORDS, the `slow` mark), so the slowest
cases of each pass come last. A slow test's first case still runs before the rest of the
grid: what it covers (torch.compile, opcheck, 2**31 elements) nothing else does.

The log (`read_log`) is JSON Lines, one event per line, flushed as it is written:

  {"event": "collected", "n": N, "order": [[nodeid, pass], ...], "passed_earlier": n}
                                                                   the plan, in run order
  {"event": "collect", "nodeid": ..., "outcome": "failed"|"skipped", "reason": ...}
                                                                   a module that did not collect
  {"event": "start", "nodeid": ...}                                a test started
  {"event": "report", "nodeid": ..., "when": "setup"|"call"|"teardown",
   "outcome": "passed"|"failed"|"skipped", "duration": s, "reason": ...}
  {"event": "finish", "exitstatus": n}                             pytest ended by itself

`summarize` turns it into counts: passed, failed, errors, skipped, collection errors (and
the modules skipped at collection), the tests that need two
GPUs on a machine with one (not counted: "not runnable here"), those not reached and those
running when the run was stopped, the first pass's progress, and the executed (not skipped)
CUDA cases of each backend (`coverage`): a backend the registry names for CUDA with none is
a gap that fails the step.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

# The registry guards, by function name (they may move between files): run first, and
# the step fails when one of them is missing or does not pass.
GUARD_TESTS = ("test_backends_cover_the_registry",
               "test_every_cuda_backend_of_the_registry_has_cases")
# The backends of the registry (replay_ops.backends.AUTO_ORDER["cuda"]); the probe after
# the build step gives the order of the tree that is tested.
DEFAULT_CUDA_BACKENDS = ("native", "triton", "torch")
# Guessed seconds of the cases expected to be slow, where no duration of an earlier run is
# known: torch.compile (Inductor compiles its own Triton kernels), tensors past 2**31
# elements, opcheck, many repeats, numerical gradients in fp64, the end-to-end layers. The
# rest (and the `slow` mark's default) is guessed at FAST_GUESS_S and SLOW_GUESS_S.
SLOW_WORDS = {"compile": 60.0, "2_31": 60.0, "opcheck": 15.0, "100_runs": 10.0,
              "gradcheck": 5.0, "e2e_moe": 5.0, "deterministic_algorithms": 5.0,
              "do_not_depend_on_the_batch": 3.0}
SLOW_GUESS_S, FAST_GUESS_S = 5.0, 1.0
# A skip for want of a second GPU (tests/test_gpu_runtime.py's cuda:1 tests): reported as
# "not runnable here (needs 2 GPUs)", not counted as skipped.
TWO_GPU_REASON = re.compile(r"needs (two|2) (CUDA devices|GPUs)", re.I)
# Float dtypes as they appear in parameter ids ("bfloat16", "xbfloat16", "fp32", "dtype2").
_DTYPE = re.compile(r"bfloat16|float16|float32|float64|bf16|fp16|fp32|fp64|dtype\d+")


# ------------------------------------------------------------------------------ ids
def split_nodeid(nodeid: str) -> tuple[str, str]:
    """("tests/test_x.py::test_f", "cuda-native-T7") for "tests/test_x.py::test_f[cuda-...]"."""
    base, sep, params = nodeid.partition("[")
    return base, params[:-1] if sep and params.endswith("]") else params


def function_name(nodeid: str) -> str:
    return split_nodeid(nodeid)[0].rsplit("::", 1)[-1]


def backends_of(nodeid: str, names=DEFAULT_CUDA_BACKENDS) -> set[str]:
    """The backends a case names in its parameter id ("cuda-triton-T7" -> {"triton"})."""
    tokens = set(re.split(r"[-\[\]]", split_nodeid(nodeid)[1]))
    return {n for n in names if n in tokens}


def first_pass_key(nodeid: str) -> tuple:
    """(test function, device, backends, float dtype): the first case of each key is in
    pass 1."""
    base, params = split_nodeid(nodeid)
    tokens = set(re.split(r"[-\[\]]", params))
    device = next((d for d in ("cuda", "cpu") if d in tokens), None)
    m = _DTYPE.search(params)
    return base, device, tuple(sorted(backends_of(nodeid))), m.group(0) if m else None


def is_guard(nodeid: str) -> bool:
    return function_name(nodeid) in GUARD_TESTS


def guess_seconds(nodeid: str, marks=()) -> float:
    guesses = [s for w, s in SLOW_WORDS.items() if w in nodeid]
    if "slow" in marks:
        guesses.append(SLOW_GUESS_S)
    return max(guesses, default=FAST_GUESS_S)


def plan_order(tests: list[tuple[str, tuple]], durations: dict | None = None) -> list[tuple[int, int]]:
    """[(index into `tests`, pass)] in run order; `tests` holds (nodeid, marks) in collection
    order, `durations` seconds by nodeid from an earlier run."""
    durations = durations or {}
    seen: set = set()
    keyed = []
    for i, (nodeid, marks) in enumerate(tests):
        if is_guard(nodeid):
            p = 0
        else:
            key = first_pass_key(nodeid)
            p = 2 if key in seen else 1
            seen.add(key)
        est = durations.get(nodeid)
        if est is None:
            est = guess_seconds(nodeid, marks)
        keyed.append((p, est, i))
    keyed.sort()  # by pass, then fastest first; ties keep the collection order
    return [(i, p) for p, _, i in keyed]


def load_durations(path: str | Path | None) -> dict[str, float]:
    """Seconds per nodeid (setup + call + teardown) from an earlier run: its log (JSON
    Lines) or its summary.json (the test step's "tests" table). {} when unreadable."""
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except OSError:
        return {}
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):  # summary.json
        out = {}
        for step in doc.get("steps", []):
            for nodeid, row in (step.get("tests") or {}).items():
                if isinstance(row, (list, tuple)) and len(row) > 1 and row[1] is not None:
                    out[nodeid] = float(row[1])
        return out
    return {k: v["duration"] for k, v in _outcomes(_events(text)).items()
            if v.get("duration") is not None}


def load_passed(path: str | Path | None) -> set[str]:
    """The nodeids that passed in an earlier run (its log or summary.json)."""
    if not path:
        return set()
    try:
        text = Path(path).read_text()
    except OSError:
        return set()
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        return {n for step in doc.get("steps", []) for n, row in (step.get("tests") or {}).items()
                if row and row[0] == "passed"}
    return {k for k, v in _outcomes(_events(text)).items() if v["outcome"] == "passed"}


# ------------------------------------------------------------------------------ the log
def _events(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if isinstance(ev, dict):
            out.append(ev)
    return out


def _outcomes(events: list[dict]) -> dict[str, dict]:
    """{nodeid: {"outcome", "duration", "reason"}} from the report events: failed (the test
    itself), error (its setup or teardown), skipped, passed."""
    res: dict[str, dict] = {}
    for ev in events:
        if ev.get("event") != "report":
            continue
        r = res.setdefault(ev["nodeid"], {"outcome": None, "duration": 0.0, "reason": None})
        r["duration"] += float(ev.get("duration") or 0.0)
        when, outcome = ev.get("when"), ev.get("outcome")
        if outcome == "failed":
            new = "failed" if when == "call" else "error"
        elif outcome == "skipped":
            new = "skipped"
            r["reason"] = ev.get("reason")
        else:
            new = "passed" if when == "call" else None
        rank = {None: 0, "passed": 1, "skipped": 2, "error": 3, "failed": 4}
        if new is not None and rank[new] > rank[r["outcome"]]:
            r["outcome"] = new
    return {k: v for k, v in res.items() if v["outcome"] is not None}


def read_log(path: str | Path) -> dict | None:
    """The log as {"order": [(nodeid, pass)], "outcomes": {...}, "started": set, "finished":
    exit status or None, "skipped_earlier": n}; None without a log or a plan in it."""
    try:
        events = _events(Path(path).read_text())
    except OSError:
        return None
    plan = next((ev for ev in events if ev.get("event") == "collected"), None)
    if plan is None:
        return None
    finish = [ev for ev in events if ev.get("event") == "finish"]
    collect = {}
    for ev in events:
        if ev.get("event") == "collect":
            collect[ev["nodeid"]] = (ev.get("outcome"), ev.get("reason"))
    return {"n": int(plan.get("n", len(plan.get("order", [])))),
            "collect": collect,
            "order": [tuple(x) for x in plan.get("order", [])],
            "skipped_earlier": int(plan.get("passed_earlier", 0)),
            "outcomes": _outcomes(events),
            "started": {ev["nodeid"] for ev in events if ev.get("event") == "start"},
            "finished": finish[-1].get("exitstatus") if finish else None}


def summarize(log: dict, cuda_backends=DEFAULT_CUDA_BACKENDS, guards=GUARD_TESTS) -> dict:
    """Counts, coverage per backend and the gaps of a read log (see the module docstring);
    `cuda_backends` and `guards` empty: no coverage and no guards asked for."""
    out = log["outcomes"]
    two_gpu = sorted(n for n, r in out.items()
                     if r["outcome"] == "skipped" and TWO_GPU_REASON.search(r["reason"] or ""))
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped")}
    for n, r in out.items():
        if n not in two_gpu:
            counts[r["outcome"]] += 1
    order = log["order"]
    planned = {n for n, _ in order}
    first = [n for n, p in order if p == 1]
    coverage = {b: 0 for b in cuda_backends}
    for n, r in out.items():
        if r["outcome"] != "skipped":
            for b in backends_of(n, cuda_backends):
                coverage[b] += 1
    guard_state = {}
    for name in guards:
        hits = [n for n, _ in order if function_name(n) == name]
        guard_state[name] = (out.get(hits[0], {}).get("outcome") or "not run") if hits \
            else "not collected"
    return {
        "collected": log["n"],
        **counts,
        "two_gpu": two_gpu,
        "not_reached": sorted(planned - set(out) - log["started"]),
        "running": sorted(log["started"] - set(out)),
        "first_pass": (sum(1 for n in first if n in out), len(first))
        if any(p == 2 for _, p in order) else None,  # None: no plan of passes
        "coverage": coverage,
        "gaps": [b for b, c in coverage.items() if c == 0],
        "guards": guard_state,
        "failed_tests": [n for n, r in out.items() if r["outcome"] in ("failed", "error")]
        + [n for n, (o, _) in log.get("collect", {}).items() if o == "failed"],
        "collection_errors": {n: why for n, (o, why) in log.get("collect", {}).items()
                              if o == "failed"},
        "collection_skips": {n: why for n, (o, why) in log.get("collect", {}).items()
                             if o == "skipped"},
        "finished": log["finished"],
        "passed_earlier": log["skipped_earlier"],
        "tests": {n: [r["outcome"], round(r["duration"], 3)] for n, r in out.items()},
    }


def describe(s: dict) -> tuple[str, list[str]]:
    """(the counts in one line, the problems that fail the step)."""
    parts = [f"{s['passed']} passed, {s['failed']} failed, {s['error']} errors, "
             f"{s['skipped']} skipped of {s['collected']} collected"]
    if s["two_gpu"]:
        parts.append(f"not runnable here (needs 2 GPUs): {len(s['two_gpu'])}")
    if s["passed_earlier"]:
        parts.append(f"passed in the earlier run, not run again: {s['passed_earlier']}")
    if s["not_reached"] or s["running"]:
        done, total = s["first_pass"] or (None, None)
        parts.append(f"not reached: {len(s['not_reached'])}, running when stopped: "
                     f"{len(s['running'])}" + (f" (first pass: {done} of {total} ran)"
                                               if total else ""))
    if s["coverage"]:
        parts.append("CUDA cases run per backend: " + ", ".join(
            f"{b} {c}" for b, c in s["coverage"].items()))
    if s["collection_errors"]:
        parts.append(f"collection errors: {len(s['collection_errors'])}")
    problems = [f"no CUDA case of the {b} backend ran (the registry names it for CUDA)"
                for b in s["gaps"]]
    problems += [f"{n} did not collect: {why.strip().splitlines()[-1] if why else '?'}"
                 for n, why in s["collection_errors"].items()]
    problems += [f"registry guard {name}: {state}" for name, state in s["guards"].items()
                 if state != "passed"]
    return "; ".join(parts), problems
