"""Run a test function on a gloo process group of W local processes, with a hard deadline.

    from _dist_spawn import run_group
    results = run_group("test_distributed:_layer_checks", world=2, timeout=300, case="x")

Each rank is a new process, forked from multiprocessing's fork server, which imported torch,
replay_ops and transformers once (one server per test process; the ranks do not pay those
imports again). A rank joins a gloo group over the loopback interface only (a FileStore in
a temporary folder for the rendezvous, GLOO_SOCKET_IFNAME=lo for the pair connections),
calls `function(rank, world, **kwargs)` from the named module in tests/, and writes its
pickled return value or its traceback; its output goes to a log that the failure messages
quote. The parent waits at most `timeout` seconds for all ranks; a rank still running then
is killed and the test fails, naming the ranks that hung. Any rank's exception fails the
test with every rank's traceback.
"""
from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# The group's own timeout: a collective that waits longer raises inside the rank. It bounds
# a hang, not a speed: on a loaded machine one rank can reach a collective a minute after
# its peer (starting Python and torch). The callers' deadlines are above it (300 s), so a
# hang surfaces as an error where possible.
PG_TIMEOUT_S = 240


def tiny_model(*args, **kwargs):
    """The tiny random-weight transformers models, imported in one place (the module is
    moving to replay_ops.testing.tiny)."""
    from replay_ops.testing.tiny import tiny_model as _tiny_model

    return _tiny_model(*args, **kwargs)


# What every rank imports before it runs anything, once, in the fork server.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "numpy", "replay_ops", "transformers"]


def run_group(target: str, world: int, *, timeout: float = 300.0, threads: int = 1,
              **kwargs) -> list:
    """`target` = "module:function" in tests/. Returns the W return values, rank order."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="replay_ops_dist_") as tmp:
        tmp = Path(tmp)
        procs, logs = [], []
        for rank in range(world):
            spec = {"target": target, "rank": rank, "world": world, "kwargs": kwargs,
                    "store": str(tmp / "store"), "out": str(tmp / f"rank{rank}.pkl"),
                    "threads": threads, "log": str(tmp / f"rank{rank}.log")}
            logs.append(Path(spec["log"]))
            procs.append(ctx.Process(target=_rank, args=(spec,), daemon=True))
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        texts = [log.read_text(errors="replace")[-4000:] if log.exists() else ""
                 for log in logs]
        if hung:
            raise AssertionError(
                f"{target} on {world} ranks: ranks {hung} still running after {timeout:.0f} s "
                f"(killed). Output:\n" + "\n".join(f"--- rank {r}:\n{t}" for r, t in
                                                   enumerate(texts)))
        results, errors = [], []
        for rank in range(world):
            out = tmp / f"rank{rank}.pkl"
            if not out.exists():
                errors.append(f"--- rank {rank}: exit code {procs[rank].exitcode}, no "
                              f"result\n{texts[rank]}")
                results.append(None)
                continue
            status, value = pickle.loads(out.read_bytes())
            if status != "ok":
                errors.append(f"--- rank {rank}:\n{value}")
            results.append(value)
        if errors:
            raise AssertionError(f"{target} failed on {world} ranks:\n" + "\n".join(errors))
        return results


def _rank(spec: dict) -> None:
    """One rank, in a process forked from the fork server: its output to its log, gloo, the
    function, the result file; then it leaves at once."""
    fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["OMP_NUM_THREADS"] = str(spec["threads"])
    import datetime
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{spec['store']}", rank=spec["rank"],
            world_size=spec["world"], timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        module, fn = spec["target"].split(":")
        value = getattr(importlib.import_module(module), fn)(
            spec["rank"], spec["world"], **spec["kwargs"])
        result = ("ok", value)
    except BaseException:
        result = ("error", traceback.format_exc())
    Path(spec["out"]).write_bytes(pickle.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without waiting for the peers (destroy_process_group can block on a peer
    # that failed); the parent reads the result file.
    os._exit(0)
