"""Run a test function on a gloo process group of W local processes, with a hard deadline.

    from _dist_spawn import run_group
    results = run_group("test_distributed:_layer_checks", world=2, timeout=60, case="x")

Each rank is a fresh `python` process (this file run as a script) that joins a gloo group
over the loopback interface only (a FileStore in a temporary folder for the rendezvous,
GLOO_SOCKET_IFNAME=lo for the pair connections), calls `function(rank, world, **kwargs)`
from the named module in tests/, and writes its pickled return value or its traceback. The
parent waits at most `timeout` seconds for all ranks; a rank still running then is killed
(with its process group, which only it and its children are in) and the test fails,
naming the ranks that hung. Any rank's exception fails the test with every rank's
traceback.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
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


def run_group(target: str, world: int, *, timeout: float = 300.0, threads: int = 1,
              **kwargs) -> list:
    """`target` = "module:function" in tests/. Returns the W return values, rank order."""
    with tempfile.TemporaryDirectory(prefix="replay_ops_dist_") as tmp:
        tmp = Path(tmp)
        procs, logs = [], []
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS=str(threads),
                   PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
        for rank in range(world):
            spec = {"target": target, "rank": rank, "world": world, "kwargs": kwargs,
                    "store": str(tmp / "store"), "out": str(tmp / f"rank{rank}.pkl"),
                    "threads": threads}
            spec_path = tmp / f"spec{rank}.pkl"
            spec_path.write_bytes(pickle.dumps(spec))
            log = open(tmp / f"rank{rank}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(spec_path)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # this rank's own session
                p.wait()
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read()[-4000:])
            log.close()
        if hung:
            raise AssertionError(
                f"{target} on {world} ranks: ranks {hung} still running after {timeout:.0f} s "
                f"(killed). Output:\n" + "\n".join(f"--- rank {r}:\n{t}" for r, t in
                                                   enumerate(texts)))
        results, errors = [], []
        for rank in range(world):
            out = tmp / f"rank{rank}.pkl"
            if not out.exists():
                errors.append(f"--- rank {rank}: exit code {procs[rank].returncode}, no "
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


def _child(spec_path: str) -> None:
    spec = pickle.loads(Path(spec_path).read_bytes())
    sys.path.insert(0, str(TESTS))
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
    # Leave without waiting for the peers (destroy_process_group can block on a peer
    # that failed); the parent reads the result file.
    os._exit(0)


if __name__ == "__main__":
    _child(sys.argv[1])
