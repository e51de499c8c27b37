"""Benchmark harness shared by bench_gate.py, bench_permute.py and bench_all.py.

* Timing: `measure` runs a callable `reps` times after `warmup` calls and reports the median
  and the 20th/80th percentiles in milliseconds (CUDA events on GPU, perf_counter on CPU).
  Providers are interleaved round by round, so a burst of load from other processes hits
  every provider alike; the ratios of one run are what the docs report.
* Bandwidth: every run measures the device's own copy bandwidth (`dst.copy_(src)`, bytes
  read plus written) and reports each result's GB/s as a fraction of it.
* Provenance: every result row carries the device name, torch and triton versions, the
  git SHA and the command line.
* Providers: reference (replay_ops.reference, the pure-PyTorch oracle), torch (the eager
  backend through the registered ops), native (the C++/CUDA extension through the ops),
  native-raw (the extension's op called directly, to show the dispatch cost), triton (CUDA
  only), torch.compile (the reference compiled, when asked for), and peers when installed
  (vLLM's moe_align_block_size for the plan on CUDA).
* Results are written atomically (replay_ops._atomic: temporary file, fsync, rename).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


# --------------------------------------------------------------------------- provenance
def git_sha() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                "csrc", "replay_ops",
                                "triton_kernels", "bench"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return (sha or "unknown") + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    isa = ""
    try:
        from replay_ops.backends import native

        isa = f", native row kernels: {native.cpu_isa()}"
    except ImportError:
        pass
    return (f"{model} ({os.cpu_count()} logical CPUs, torch threads={torch.get_num_threads()}"
            f"{isa})")


def triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:
        return None


def env_info(device: str) -> dict:
    return {
        "device": device,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version(),
        "python": platform.python_version(),
        "git_sha": git_sha(),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


# ------------------------------------------------------------------------------ timing
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_once(fn: Callable[[], object], device: str) -> float:
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def quantiles(samples: list[float]) -> dict:
    s = sorted(samples)
    q = statistics.quantiles(s, n=10, method="inclusive") if len(s) > 1 else [s[0]] * 9
    return {"ms_median": statistics.median(s), "ms_p20": q[1], "ms_p80": q[7], "reps": len(s)}


def measure_interleaved(fns: dict[str, Callable[[], object]], device: str, *, warmup: int = 3,
                        reps: int = 20) -> dict[str, dict]:
    """Time several providers round-robin (one call of each per round)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            samples[name].append(_time_once(fn, device))
    return {k: quantiles(v) for k, v in samples.items()}


def copy_bandwidth(device: str, nbytes: int | None = None, reps: int = 20) -> dict:
    """Device copy bandwidth in GB/s (bytes read + bytes written), measured now."""
    if nbytes is None:
        nbytes = (256 << 20) if device.startswith("cuda") else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    r = measure_interleaved({"copy": lambda: dst.copy_(src)}, device, warmup=3, reps=reps)["copy"]
    return {"bytes": nbytes, "ms_median": r["ms_median"],
            "gbps": 2 * nbytes / (r["ms_median"] * 1e-3) / 1e9}


# ------------------------------------------------------------------------------ output
def add_bandwidth(row: dict, nbytes: int, copy_gbps: float) -> dict:
    row["bytes_moved"] = int(nbytes)
    row["gbps"] = nbytes / (row["ms_median"] * 1e-3) / 1e9 if row["ms_median"] > 0 else None
    row["frac_of_copy_bw"] = row["gbps"] / copy_gbps if row["gbps"] else None
    return row


def write_atomic(path: Path, text: str) -> None:
    from replay_ops._atomic import atomic_write

    atomic_write(path, text)


def to_markdown(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(out)


def save(rows: list[dict], summary: list[str], stem: str, env: dict, copy_bw: dict,
         cols: list[str], extra: dict | None = None) -> tuple[Path, Path]:
    """bench/results/<stem>.json (every row, with provenance) and <stem>.md (table+summary).
    `extra` adds sections {title: (rows, cols)} after the summary (and to the JSON)."""
    for r in rows:
        r.update({k: env[k] for k in ("device_name", "torch", "triton", "git_sha")})
    doc = {"env": env, "copy_bandwidth": copy_bw, "summary": summary, "rows": rows}
    for title, (xrows, _) in (extra or {}).items():
        doc[title.lower()] = xrows
    jpath, mpath = RESULTS / f"{stem}.json", RESULTS / f"{stem}.md"
    write_atomic(jpath, json.dumps(doc, indent=1) + "\n")
    md = [f"# {stem}", "", f"Command: `{env['command']}`", "",
          f"Device: {env['device_name']}; torch {env['torch']}; triton {env['triton']}; "
          f"git {env['git_sha']}; {env['utc']}", "",
          f"Copy bandwidth measured in the same run: {copy_bw['gbps']:.1f} GB/s "
          f"(read + write, {copy_bw['bytes'] >> 20} MiB buffer)", "", "## Summary", ""]
    md += [f"- {s}" for s in summary] + [""]
    for title, (xrows, xcols) in (extra or {}).items():
        md += [f"## {title}", "", to_markdown(xrows, xcols), ""]
    md += ["## All rows", "", to_markdown(rows, cols), ""]
    write_atomic(mpath, "\n".join(md))
    return jpath, mpath


def median_of_runs(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """Combine several interleaved runs: the median of the per-run medians, and the
    min/max of the per-run 20th/80th percentiles."""
    out = {}
    for name in runs[0]:
        meds = [r[name]["ms_median"] for r in runs]
        out[name] = {
            "ms_median": statistics.median(meds),
            "ms_p20": min(r[name]["ms_p20"] for r in runs),
            "ms_p80": max(r[name]["ms_p80"] for r in runs),
            "reps": sum(r[name]["reps"] for r in runs),
            "runs": len(runs),
            "run_medians": meds,
        }
    return out


def native_available(device: str) -> bool:
    from replay_ops import backends

    return bool(backends.available("native", "cuda" if device.startswith("cuda") else "cpu"))


def triton_available(device: str) -> bool:
    if not device.startswith("cuda"):
        return False  # the interpreter on CPU is a correctness tool, not a provider to time
    from replay_ops import backends

    return bool(backends.available("triton", "cuda"))


def start_run(args, name: str) -> tuple[str, dict, dict]:
    """The start of every benchmark's run(): (device, environment record, copy bandwidth).
    A CUDA device that torch does not see is refused; the copy bandwidth is the one the
    caller measured (`args.copy_bw`, set by bench_all.py for all its runs) or measured here."""
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"{name}: --device {device}, but torch sees no CUDA device")
    return device, env_info(device), getattr(args, "copy_bw", None) or copy_bandwidth(device)


def finish_run(args, rows: list[dict], device: str, env: dict, copy_bw: dict, **extra) -> None:
    """The end of every benchmark's run(): each row gets the device, and `args` carries the
    environment record, the copy bandwidth and any `extra` (e.g. targets) back to the caller
    (cli_main or bench_all.py), which writes the results."""
    for r in rows:
        r["device"] = device
    args.env, args.copy_bw = env, copy_bw
    for k, v in extra.items():
        setattr(args, k, v)


def add_run_args(ap, *, reps: int, warmup: int, runs: int = 3) -> None:
    """The options every bench script shares: repetitions, warm-up, independent runs, CPU
    threads and the results stem."""
    ap.add_argument("--reps", type=int, default=reps, help="timed repetitions per run")
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--runs", type=int, default=runs, help="independent interleaved runs; medians")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--out", default=None, help="stem under bench/results/ (default: print only)")
    ap.set_defaults(copy_bw=None)


def cli_main(parser: Callable, run: Callable, cols: list[str], argv=None,
             target_cols: list[str] | None = None, machine: bool = False):
    """Shared `main` of the bench scripts: parse, run, print the table, save with --out.
    With `target_cols`, the run's `args.targets` rows are printed and saved as the table
    'Targets', and the summary counts the targets met; with `machine`, `args.machine` heads
    the summary."""
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, summary = run(args)
    if machine and args.machine:
        summary.insert(0, f"Machine: {args.machine}")
    extra = None
    print(to_markdown(rows, cols))
    if target_cols is not None:
        met = sum(t["met"] for t in args.targets)
        summary = summary + [f"targets met: {met} of {len(args.targets)} (table 'Targets')"]
        extra = {"Targets": (args.targets, target_cols)}
        print(to_markdown(args.targets, target_cols))
    print("\n".join(summary))
    if args.out:
        print("wrote", *save(rows, summary, args.out, args.env, args.copy_bw, cols, extra=extra))
    return rows, summary
