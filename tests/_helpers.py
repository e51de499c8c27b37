"""Helpers shared by the test files: backend discovery and parameters, the reference
shortcuts and the real clients' import rule. The input builders, the tolerance rule, the
plan's structural checks and the host-sync counter live in `replay_ops.testing.checks`
(the GPU workloads and benchmarks use them too) and are imported here."""
from __future__ import annotations

import pytest
import torch

from replay_ops import backends as _backend
from replay_ops import reference as ref
from replay_ops import scores
from replay_ops.testing.checks import (  # noqa: F401  (the test files import them from here)
    FLOOR,
    HOST_READ_OPS,
    HostSyncCounter,
    PLAN_INT_FIELDS,
    assert_fa_close,
    assert_int_equal,
    assert_plan_ints_equal,
    capture_cuda_graph,
    check_plan_structure,
    gen,
    make_indices,
    make_logits,
    strided_indices,
)

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
SCORE_FUNCS = scores.NAMES  # every function of the table, so a new one is tested too
INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# ------------------------------------------------------------------------- backends
def usable_backends(device_type: str) -> list[str]:
    """Backends of the registry that are available for this device."""
    return [name for name in sorted(_backend.MODULES) if _backend.available(name, device_type)]


def is_interpreted(device: str, backend: str) -> bool:
    """Triton on CPU tensors runs under the (slow, numpy) interpreter."""
    return backend == "triton" and device == "cpu"


def _marks(device: str) -> list:
    return [pytest.mark.gpu] if device == "cuda" else []


def with_marks(marks: list):
    """A decorator applying a list of pytest marks (the first one outermost)."""
    def deco(f):
        for m in reversed(marks):
            f = m(f)
        return f
    return deco


def backend_params() -> list:
    """pytest params (device, backend) for every usable backend on every present device."""
    return [
        pytest.param((dev, b), id=f"{dev}-{b}", marks=_marks(dev))
        for dev in DEVICES
        for b in usable_backends(dev)
    ]


def case_params(full: list, small: list | None = None, ids=None) -> list:
    """pytest params (device, backend, case): `small` cases for the Triton interpreter,
    `full` cases everywhere else. Every case that is generated runs; none is skipped."""
    params = []
    for dev in DEVICES:
        for b in usable_backends(dev):
            cases = small if (small is not None and is_interpreted(dev, b)) else full
            for case in cases:
                cid = ids(case) if ids else str(case)
                params.append(pytest.param(dev, b, case, id=f"{dev}-{b}-{cid}", marks=_marks(dev)))
    return params


def dense_by_loops(weights, idx, E):
    """Megatron's dense (probs, routing_map), built element by element."""
    T, K = idx.shape
    probs = torch.zeros(T, E, dtype=weights.dtype)
    rmap = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        for k in range(K):
            e = int(idx[t, k])
            if e >= 0:
                probs[t, e] = weights[t, k].cpu()
                rmap[t, e] = True
    return probs, rmap


def ref_gate64(logits, idx, **kw):
    """Reference gate on the fp64 copy of the logits (the fp64 oracle)."""
    return ref.gate(logits.detach().double(), idx, **kw)



# ------------------------------------------------------------------------- real clients
def require_client(module: str, package: str, load=None) -> None:
    """Import `module` of a real client (megatron-core, verl) or skip the calling test
    module. `make test` installs the clients and sets REPLAY_OPS_REQUIRE_CLIENTS=1: then a
    client that does not import is an error, never a skip that reads as a pass. `load`, if
    given, imports the client instead (a client loaded from its files, e.g. SkyRL or
    ms-swift: tests/_client_loaders.py)."""
    import importlib
    import os

    try:
        load() if load is not None else importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("REPLAY_OPS_REQUIRE_CLIENTS") == "1":
            raise RuntimeError(f"{package} is required here (REPLAY_OPS_REQUIRE_CLIENTS=1) but "
                               f"`import {module}` failed: {e}") from e
        pytest.skip(f"{package} is not installed (`make test` installs it)",
                    allow_module_level=True)
    want = os.environ.get("REPLAY_OPS_EXPECT_MCORE")
    if module == "megatron.core" and want:  # the run against the newest release
        import megatron.core

        if megatron.core.__version__.split("+")[0] != want:
            raise RuntimeError(f"REPLAY_OPS_EXPECT_MCORE={want} but megatron-core "
                               f"{megatron.core.__version__} was imported from "
                               f"{megatron.core.__file__}")


def assert_native_gate_alone(calls, logits, cpu: bool) -> None:
    """Each of `calls` (a gate that selects flagged rows) runs the native gate kernel alone:
    no host read, only `replay_native.gate_fwd` / `gate_dense_fwd` forward, and a backward
    to `logits` with one native gate backward op and no top-k, sort or softmax of every row.
    `cpu`: also one launch forward, and no host read in the backward (on a GPU autograd runs
    the backward on its own thread, where the host-read counter does not look)."""
    from launch_counter import LaunchCounter  # bench/ (pytest pythonpath)

    import replay_ops

    for fn in calls:
        with HostSyncCounter() as syncs, LaunchCounter() as c:
            out = fn()
        assert syncs.count == 0, syncs.events
        assert set(c.ops) <= {"replay_native.gate_fwd", "replay_native.gate_dense_fwd"}, c.ops
        if cpu:
            assert c.launches == 1, c.summary()
        w = out.weights if isinstance(out, replay_ops.RoutingPlan) else out.probs
        loss = w.float().sum() + (out.set_logprob.sum() if out.set_logprob is not None else 0)
        with HostSyncCounter() as syncs, LaunchCounter() as c:
            torch.autograd.grad(loss, logits)
        if cpu:
            assert syncs.count == 0, syncs.events
        assert not {"topk", "sort", "_softmax", "softmax"} & set(c.ops), c.ops
        native = {k: v for k, v in c.ops.items() if k.startswith("replay_native")}
        assert set(native) <= {"replay_native.gate_bwd", "replay_native.gate_dense_bwd"}, c.ops
        assert sum(native.values()) == 1, c.ops
