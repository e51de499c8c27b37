"""Bad input to replay_ops.distributed on a gloo group of 4 local processes: each case
raises on every rank, within a time bound, with a message naming the rank and the value;
the group stays usable afterwards (a valid exchange follows every error)."""
from __future__ import annotations

import time

import torch

from _dist_spawn import run_group

WORLD = 4
BOUND_S = 10.0  # the group's own collective timeout is 30 s: a hang cannot pass this


def _inputs(rank, T=6, E=8, K=2, H=4, dtype=torch.float32, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed + rank)
    logits = torch.randn(T, E, generator=g).requires_grad_(grad)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    hidden = torch.randn(T, H, generator=g).to(dtype).requires_grad_(grad)
    return logits, idx, hidden


def _round(rank, **kw):
    """A full valid dispatch + combine + backward."""
    from replay_ops import distributed as ep

    logits, idx, hidden = _inputs(rank, **kw)
    plan = ep.gate(logits, idx)
    x_local, handle = ep.dispatch(hidden, plan)
    out = ep.combine(x_local * 2, handle)
    out.sum().backward()
    return out


def _attempt(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def _error_checks(rank, world):
    import replay_ops
    from replay_ops import distributed as ep

    results = {}
    _round(rank)  # connections set up and every rank started: the timings are the errors'

    def case(name, fn):
        results[name] = _attempt(fn)
        _round(rank)  # the group is still in step: a valid exchange completes
        return results[name]

    def e_not_divisible():
        logits, idx, hidden = _inputs(rank, E=6)
        ep.dispatch(hidden, ep.gate(logits, idx))

    def e_disagree():
        logits, idx, hidden = _inputs(rank, E=16 if rank == 2 else 8)
        ep.dispatch(hidden, ep.gate(logits, idx))

    def k_disagree():
        logits, idx, hidden = _inputs(rank, K=3 if rank == 1 else 2)
        ep.dispatch(hidden, ep.gate(logits, idx))

    def dtype_disagree():
        logits, idx, hidden = _inputs(rank, dtype=torch.bfloat16 if rank == 3 else torch.float32)
        ep.dispatch(hidden, ep.gate(logits, idx))

    def out_of_range():
        logits, idx, hidden = _inputs(rank)
        if rank == 1:
            idx[2, 1] = 99
        ep.dispatch(hidden, ep.gate(logits, idx))

    def negative():
        logits, idx, hidden = _inputs(rank)
        if rank == 3:
            idx[5, 0] = -7
        ep.dispatch(hidden, ep.gate(logits, idx))

    def duplicate():
        logits, idx, hidden = _inputs(rank)
        if rank == 0:
            idx[1] = torch.tensor([3, 3], dtype=torch.int32)
        ep.dispatch(hidden, ep.gate(logits, idx))

    def gate_raised_before_dispatch():
        logits, idx, hidden = _inputs(rank)
        if rank == 2:
            idx[4, 0] = 64
        try:
            plan = replay_ops.gate(logits, idx)  # validate=True: raises on rank 2 only
        except ValueError as exc:
            ep.report_failure(exc)
        ep.dispatch(hidden, plan)

    def rows_mismatch():
        logits, idx, hidden = _inputs(rank)
        if rank == 3:
            hidden = torch.cat([hidden, hidden[:1]]).detach().requires_grad_(True)
        ep.dispatch(hidden, ep.gate(logits, idx))

    def grad_disagree():
        logits, idx, hidden = _inputs(rank)
        if rank == 1:
            hidden = hidden.detach()
        ep.dispatch(hidden, ep.gate(logits, idx))

    case("E not divisible by W", e_not_divisible)
    case("ranks disagree on E", e_disagree)
    case("ranks disagree on K", k_disagree)
    case("ranks disagree on dtype", dtype_disagree)
    case("index out of range", out_of_range)
    case("index below -1", negative)
    case("duplicate expert", duplicate)
    case("gate raised on one rank", gate_raised_before_dispatch)
    case("hidden rows != T", rows_mismatch)
    case("requires_grad disagree", grad_disagree)

    # combine with a wrong-shaped expert_out on rank 1: rank 1 raises, the others are not
    # left waiting and get NaN (never a plausible value) for the rows rank 1 owns.
    logits, idx, hidden = _inputs(rank)
    plan = ep.gate(logits, idx)
    x_local, handle = ep.dispatch(hidden, plan)
    y = x_local[:-1] if rank == 1 else x_local
    out_holder = {}
    t0 = time.monotonic()
    try:
        out_holder["out"] = ep.combine(y, handle)
        kind, msg = "no error", ""
    except Exception as exc:  # noqa: BLE001
        kind, msg = type(exc).__name__, str(exc)
    n = plan.num_experts // world
    owned_by_1 = ((plan.expert_indices >= n) & (plan.expert_indices < 2 * n)).any(dim=1)
    nan_rows = (torch.isnan(out_holder["out"]).any(dim=1) if "out" in out_holder else None)
    results["combine shape"] = (kind, msg, time.monotonic() - t0,
                                None if nan_rows is None else torch.equal(nan_rows, owned_by_1))
    _round(rank)
    return results


EXPECT = {
    # case: (exception, substrings every rank's message contains)
    "E not divisible by W": ("DistributedInputError",
                             ["rank 0: ValueError: num_experts E=6 is not divisible",
                              "W=4", "rank 3:"]),
    "ranks disagree on E": ("DistributedInputError",
                            ["ranks disagree on num_experts E", "rank 2: 16", "rank 0: 8"]),
    "ranks disagree on K": ("DistributedInputError",
                            ["ranks disagree on top_k K", "rank 1: 3", "rank 0: 2"]),
    "ranks disagree on dtype": ("DistributedInputError",
                                ["ranks disagree on dtype of hidden", "rank 3: bfloat16",
                                 "rank 0: float32"]),
    "index out of range": ("DistributedInputError",
                           ["rank 1: expert_indices[2, 1] = 99 is out of range",
                            "num_experts E=8"]),
    "index below -1": ("DistributedInputError",
                       ["rank 3: expert_indices[5, 0] = -7 is out of range"]),
    "duplicate expert": ("DistributedInputError",
                         ["rank 0: expert_indices row 1 repeats expert 3 (column 1)"]),
    "gate raised on one rank": ("DistributedInputError",
                                ["rank 2: ValueError: replay_ops.gate: expert_indices[4, 0] = 64"]),
    "hidden rows != T": ("DistributedInputError",
                         ["rank 3: ValueError: hidden has 7 rows but the plan routes T=6"]),
    "requires_grad disagree": ("DistributedInputError",
                               ["ranks disagree on hidden.requires_grad", "rank 1: False"]),
}


def test_bad_input_raises_on_every_rank():
    results = run_group("test_distributed_errors:_error_checks", WORLD, timeout=300)
    for name, (kind, subs) in EXPECT.items():
        msgs = []
        for rank, res in enumerate(results):
            got_kind, msg, dt = res[name]
            assert got_kind == kind, f"{name}: rank {rank} raised {got_kind}: {msg}"
            for s in subs:
                assert s in msg, f"{name}: rank {rank}: {s!r} not in message:\n{msg}"
            assert dt < BOUND_S, f"{name}: rank {rank} took {dt:.1f} s to raise"
            msgs.append(msg)
        assert len(set(msgs)) == 1, f"{name}: ranks raised different messages: {msgs}"
    for rank, res in enumerate(results):
        kind, msg, dt, nan_ok = res["combine shape"]
        assert dt < BOUND_S, f"combine shape: rank {rank} took {dt:.1f} s"
        if rank == 1:
            assert kind == "ValueError" and "rank 1: expert_out must be" in msg, msg
        else:
            assert kind == "no error", f"rank {rank}: {kind}: {msg}"
            assert nan_ok, f"rank {rank}: NaN rows are not exactly the rows routed to rank 1"
