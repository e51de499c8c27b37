"""Run decoding cases under a memory cap and measure what each costs.

`run_capped(module, names, cap_mib)` starts one fresh Python process (one thread) that
imports `module` (a test module's name, tests/ on the path: it defines `CAPPED_CASES`, a dict of
name -> function returning a thunk), and for each case forks a child that builds the
input (the function), resets its peak RSS, sets RLIMIT_AS to its current address space
plus `cap_mib`, runs the thunk, and reports the outcome: "ok", or the exception's type
and message, plus the growth of its peak RSS while the thunk ran (MiB). A child killed by
a signal reports the signal. The whole run is bounded by `timeout`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

TESTS = os.path.dirname(os.path.abspath(__file__))


def run_capped(module: str, names, cap_mib: int = 1024, timeout: int = 300) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(TESTS, "_capped.py"), module,
                        str(cap_mib), *names], cwd=TESTS, env=env, capture_output=True,
                       text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"capped runner failed ({p.returncode}):\n{p.stdout[-3000:]}\n"
                           f"{p.stderr[-3000:]}")
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith("CASE "):
            r = json.loads(line[5:])
            out[r["name"]] = r
    return out


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _child(fn, cap: int, w: int) -> None:
    import resource

    res = {}
    try:
        thunk = fn()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS to the current RSS
        except OSError:
            pass
        base = _status("VmHWM")
        limit = _status("VmSize") + cap
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            thunk()
            res.update(outcome="ok", type="", message="")
        except BaseException as e:  # noqa: BLE001 - the outcome is what is reported
            res.update(outcome="raised", type=type(e).__name__,
                       module=type(e).__module__, message=str(e)[:500])
        res["peak_mib"] = (_status("VmHWM") - base) / 2**20
    except BaseException as e:  # noqa: BLE001
        res.update(outcome="setup failed", type=type(e).__name__, message=str(e)[:500],
                   peak_mib=0.0)
    os.write(w, json.dumps(res).encode())
    os._exit(0)


def main(argv) -> None:
    import importlib

    import torch

    torch.set_num_threads(1)
    mod = importlib.import_module(argv[0])
    cap = int(argv[1]) << 20
    warm = getattr(mod, "capped_warm_up", None)
    if warm is not None:
        warm()  # lazy imports and first-call allocations, before any fork
    for name in argv[2:]:
        fn = mod.CAPPED_CASES[name]
        t0 = time.perf_counter()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(fn, cap, w)
        os.close(w)
        chunks = []
        while True:
            b = os.read(r, 65536)
            if not b:
                break
            chunks.append(b)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        if chunks:
            res = json.loads(b"".join(chunks))
        else:
            res = {"outcome": f"child died (wait status {status})", "type": "", "message": "",
                   "peak_mib": float("nan")}
        res["name"] = name
        res["seconds"] = time.perf_counter() - t0
        print("CASE " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
