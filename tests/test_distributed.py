"""Expert-parallel dispatch and combine (replay_ops.distributed) on gloo groups of 2 and 4
local processes (loopback only), against the single-process layer on the same routing.

The oracle for every case is the whole batch (rank 0's tokens, then rank 1's, ...) run
through one MoE layer in one process: `replay_ops.gate/permute/unpermute` with all E
experts (bitwise comparisons), and `replay_ops.reference` written from the math (a
tolerance comparison, independent of the kernels). Counts are also checked against
counts taken from the indices with Python loops.

Each spawned group runs several cases, to pay the process start-up once.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from _dist_spawn import run_group

# (name, per-rank token counts per world size, E, K, H, Fh, align, score_func, normalize,
#  scaling, pattern); patterns:
#   random      distinct random experts per token
#   no_expert0  expert 0 gets no token
#   skip_rank1  no token routes to rank 1's experts (rank 1 receives nothing)
#   holes       -1 slots, a row of only -1, and replay_mask fallback rows holding garbage
CASES = [
    ("softmax-a1", {2: [9, 7], 4: [5, 6, 3, 7]}, 8, 2, 16, 12, 1, "softmax", True, 1.0,
     "random"),
    ("sigmoid-a16-scaled", {2: [11, 5], 4: [4, 6, 5, 3]}, 8, 3, 16, 12, 16, "sigmoid", True,
     2.5, "random"),
    ("no-expert0-rank0-empty", {2: [0, 10], 4: [0, 5, 6, 4]}, 8, 2, 16, 12, 1, "softmax",
     False, 1.0, "no_expert0"),
    ("skip-rank1-a16", {2: [6, 8], 4: [5, 4, 6, 3]}, 8, 2, 16, 12, 16, "softmax", True, 1.0,
     "skip_rank1"),
    ("holes-fallback-a16", {2: [10, 9], 4: [6, 5, 7, 4]}, 8, 3, 16, 12, 16, "sqrtsoftplus",
     True, 1.0, "holes"),
    ("holes-fallback-a1", {2: [8, 12], 4: [4, 7, 5, 6]}, 16, 4, 8, 6, 1, "softmax", True, 1.0,
     "holes"),
]


# --------------------------------------------------------------------------- the data
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def make_case(case, world, seed=0):
    """Global inputs, identical on every rank: x [T, H], indices [T, K], replay_mask,
    output gradient, and the layer's parameters."""
    name, Ts, E, K, H, Fh, align, *_rest, pattern = case
    Ts = Ts[world]
    T = sum(Ts)
    g = _gen(seed)
    x = torch.randn(T, H, generator=g)
    allowed = list(range(E))
    if pattern == "no_expert0":
        allowed = allowed[1:]
    if pattern == "skip_rank1":
        n = E // world
        allowed = [e for e in allowed if not n <= e < 2 * n]
    rows = []
    for _ in range(T):
        perm = torch.randperm(len(allowed), generator=g)[:K].tolist()
        rows.append([allowed[p] for p in perm])
    idx = torch.tensor(rows, dtype=torch.int32).view(T, K)
    mask = None
    if pattern == "holes":
        drop = torch.rand(T, K, generator=g) < 0.25
        idx = torch.where(drop, -1, idx)
        idx[T // 3] = -1  # a replayed row with no expert at all
        mask = torch.ones(T, dtype=torch.bool)
        for t in (1, T - 2):  # no route recorded: garbage that must be ignored
            mask[t] = False
            idx[t] = torch.tensor([999] + [0] * (K - 1), dtype=torch.int32)
    params = {
        "router": torch.randn(H, E, generator=g) / H ** 0.5,
        "w1": torch.randn(E, H, Fh, generator=g) / H ** 0.5,
        "b1": torch.randn(E, Fh, generator=g) * 0.5,  # padding rows give nonzero outputs
        "w2": torch.randn(E, Fh, H, generator=g) / Fh ** 0.5,
    }
    gout = torch.randn(T, H, generator=g)
    return Ts, x, idx, mask, params, gout


def expert(p, e, x):
    return F.gelu(x @ p["w1"][e] + p["b1"][e]) @ p["w2"][e]


def gate_opts(case):
    _, _, _, _, _, _, align, score_func, normalize, scaling, _ = case
    return dict(score_func=score_func, normalize=normalize, scaling_factor=scaling, align=align)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


# ----------------------------------------------------------------------- single process
def single_process_layer(case, x, idx, mask, params, gout):
    """The whole batch in one process with the plain ops: the bitwise oracle."""
    import replay_ops

    p = {k: leaf(v) for k, v in params.items()}
    xr = leaf(x)
    logits = xr @ p["router"]
    plan = replay_ops.gate(logits, idx, replay_mask=mask, **gate_opts(case))
    xd = xr.view_as(xr)  # the experts' path alone, for its gradient
    xd.retain_grad()
    xp = replay_ops.permute(xd, plan)
    offs = plan.expert_offsets.tolist()
    y = torch.cat([expert(p, e, xp[offs[e]:offs[e + 1]]) for e in range(len(offs) - 1)])
    out = replay_ops.unpermute(y, plan)
    (out * gout).sum().backward()
    return dict(out=out.detach(), x_grad=xr.grad, xd_grad=xd.grad, xp=xp.detach(), plan=plan,
                grads={k: v.grad for k, v in p.items()})


def reference_layer(case, x, idx, mask, params):
    """The whole batch with replay_ops.reference (pure PyTorch, from the math)."""
    from replay_ops import reference as ref

    logits = x @ params["router"]
    plan = ref.gate(logits, idx, replay_mask=mask, **gate_opts(case))
    xp = ref.permute(x, plan)
    offs = plan.expert_offsets.tolist()
    y = torch.cat([expert(params, e, xp[offs[e]:offs[e + 1]]) for e in range(len(offs) - 1)])
    return ref.unpermute(y, plan)


# ----------------------------------------------------------------------- expert parallel
class SyncCounter:
    """Counts host reads of tensor data (each is a device sync on a GPU) by patching the
    Tensor methods that make them."""

    NAMES = ("tolist", "item", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__",
             "__index__")

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        self.saved_nonzero = torch.nonzero
        for n, fn in self.saved.items():
            def wrapped(t, *a, _fn=fn, _n=n, **k):
                self.calls.append(_n)
                return _fn(t, *a, **k)
            setattr(torch.Tensor, n, wrapped)

        def nz(*a, **k):
            self.calls.append("torch.nonzero")
            return self.saved_nonzero(*a, **k)
        torch.nonzero = nz
        return self

    def __exit__(self, *exc):
        for n, fn in self.saved.items():
            setattr(torch.Tensor, n, fn)
        torch.nonzero = self.saved_nonzero


def ep_layer(case, x_mine, idx_mine, mask_mine, params, gout_mine, rank, world, syncs=None):
    """This rank's tokens through dispatch -> this rank's experts -> combine."""
    from replay_ops import distributed as ep

    E = params["router"].shape[1]
    n = E // world
    local = range(rank * n, (rank + 1) * n)
    p = {"router": leaf(params["router"])}
    p.update({k: leaf(params[k][local.start:local.stop]) for k in ("w1", "b1", "w2")})
    x = leaf(x_mine)
    logits = x @ p["router"]
    counter = SyncCounter() if syncs is not None else None
    with counter or _null():
        plan = ep.gate(logits, idx_mine, replay_mask=mask_mine, **gate_opts(case))
    if syncs is not None:
        syncs["gate"] = list(counter.calls)
    counter = SyncCounter() if syncs is not None else None
    with counter or _null():
        xd = x.view_as(x)  # the experts' path alone, for its gradient
        xd.retain_grad()
        x_local, handle = ep.dispatch(xd, plan)
    if syncs is not None:
        syncs["dispatch"] = list(counter.calls)
    offs = handle.local_offsets.tolist()  # this test's own read, for the expert loop
    ys = [expert(p, j, x_local[offs[j]:offs[j + 1]]) for j in range(n)]
    ys.append(x_local[offs[-1]:] * 0)  # the static tail (align > 1) is not an expert's
    y = torch.cat(ys)
    counter = SyncCounter() if syncs is not None else None
    with counter or _null():
        out = ep.combine(y, handle)
    if syncs is not None:
        syncs["combine"] = list(counter.calls)
    counter = SyncCounter() if syncs is not None else None
    with counter or _null():
        (out * gout_mine).sum().backward()
    if syncs is not None:
        syncs["backward"] = list(counter.calls)
    return dict(out=out.detach(), x_grad=x.grad, xd_grad=xd.grad, x_local=x_local.detach(),
                handle=handle,
                local=local, grads={k: v.grad for k, v in p.items()})


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _bitwise(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if not torch.equal(a, b):
        diff = (a - b).abs().max().item() if a.numel() else 0.0
        raise AssertionError(f"{what}: not bitwise equal (max abs diff {diff:.3e})")


def _close(a, b, what, rtol):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if a.numel() == 0:
        return
    scale = b.abs().max().item() + 1e-30
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= rtol * scale, f"{what}: max error {err:.3e} > {rtol:g} x scale {scale:.3e}"


def _counts_by_loops(idx_used, E, world, Ts):
    """send[s][d]: rows rank s sends to rank d, and C[s][e]: rows of expert e from rank s,
    counted from the indices the plan used."""
    n = E // world
    rows = idx_used.tolist()
    send = [[0] * world for _ in range(world)]
    C = [[0] * E for _ in range(world)]
    start = 0
    for s, T_s in enumerate(Ts):
        for t in range(start, start + T_s):
            for e in rows[t]:
                if e >= 0:
                    send[s][e // n] += 1
                    C[s][e] += 1
        start += T_s
    return send, C


# ------------------------------------------------------------------- the spawned checks
def _layer_checks(rank, world, case_names):
    import torch.distributed as dist

    done = []
    for case in CASES:
        if case[0] not in case_names:
            continue
        name, _, E, K, H, _, align, *_ = case
        Ts, x, idx, mask, params, gout = make_case(case, world)
        lo = sum(Ts[:rank])
        mine = slice(lo, lo + Ts[rank])
        m_mine = mask[mine] if mask is not None else None
        syncs = {}
        got = ep_layer(case, x[mine], idx[mine], m_mine, params, gout[mine], rank, world, syncs)
        one = single_process_layer(case, x, idx, mask, params, gout)
        n = E // world
        where = f"[{name}, rank {rank}/{world}]"

        # Host reads: exactly one in dispatch, none in gate, combine and the backward.
        assert syncs["dispatch"] == ["tolist"], f"{where} dispatch host reads: {syncs['dispatch']}"
        for k in ("gate", "combine", "backward"):
            assert syncs[k] == [], f"{where} {k} host reads: {syncs[k]}"

        # Counts, from the indices by loops.
        h = got["handle"]
        send, C = _counts_by_loops(one["plan"].expert_indices, E, world, Ts)
        assert h.send_counts == send[rank], f"{where} send {h.send_counts} != {send[rank]}"
        assert h.recv_counts == [send[s][rank] for s in range(world)], f"{where} recv counts"
        tpe = [sum(C[s][e] for s in range(world)) for e in h.local_experts]
        assert h.tokens_per_local_expert.tolist() == tpe, f"{where} local counts"
        padded = [-(-c // align) * align for c in tpe]
        want_offs = [sum(padded[:j]) for j in range(n + 1)]
        assert h.local_offsets.tolist() == want_offs, f"{where} offsets {h.local_offsets}"
        assert h.num_rows == sum(h.recv_counts) + n * (align - 1)

        # The local layout is the single-process layout's slice for this rank's experts.
        offs = one["plan"].expert_offsets.tolist()
        seg = one["xp"][offs[rank * n]:offs[(rank + 1) * n]]
        _bitwise(got["x_local"][:seg.shape[0]], seg, f"{where} local rows")
        assert not got["x_local"][seg.shape[0]:].any(), f"{where} tail rows must be zero"

        # Outputs and gradients: bitwise where the arithmetic is the same per element.
        _bitwise(got["out"], one["out"][mine], f"{where} output")
        # The input gradient through dispatch (its backward: rows sent back, summed per
        # token in column order) is bitwise. The full input gradient adds the router's
        # part, grad_logits @ router^T: a GEMM whose per-row result depends on the number
        # of rows on this CPU BLAS (T_r rows here, T in one process), so it gets a
        # tolerance.
        _bitwise(got["xd_grad"], one["xd_grad"][mine], f"{where} input gradient via dispatch")
        _close(got["x_grad"], one["x_grad"][mine], f"{where} input gradient", 1e-6)
        for k in ("w1", "b1", "w2"):
            _bitwise(got["grads"][k], one["grads"][k][got["local"].start:got["local"].stop],
                     f"{where} {k} gradient of this rank's experts")
        # The router is replicated: its gradient is the sum of the ranks' parts, which adds
        # the per-token terms in another order than one process does (not bitwise).
        g_router = got["grads"]["router"].clone()
        dist.all_reduce(g_router)
        _close(g_router, one["grads"]["router"], f"{where} router gradient (summed)", 1e-5)

        # Independent oracle: replay_ops.reference on the whole batch (other accumulation
        # order in the experts' padding and the combine: tolerance).
        _close(got["out"], reference_layer(case, x, idx, mask, params)[mine],
               f"{where} output vs replay_ops.reference", 1e-5)

        # Determinism: a second run gives the same bits.
        again = ep_layer(case, x[mine], idx[mine], m_mine, params, gout[mine], rank, world)
        _bitwise(again["out"], got["out"], f"{where} rerun output")
        _bitwise(again["x_grad"], got["x_grad"], f"{where} rerun input gradient")
        for k in got["grads"]:
            _bitwise(again["grads"][k], got["grads"][k], f"{where} rerun {k} gradient")
        done.append((name, h.recv_counts, h.send_counts))
    return done


@pytest.mark.parametrize("world", [2, 4])
def test_ep_layer_matches_single_process(world):
    names = [c[0] for c in CASES]
    results = run_group("test_distributed:_layer_checks", world, timeout=300, case_names=names)
    for rank, done in enumerate(results):
        assert [d[0] for d in done] == names, f"rank {rank} ran {done}"
    # the uneven cases really are uneven
    by_case = {name: [r[i] for r in results] for i, name in enumerate(names)}
    rank0_sent = [d[2] for d in by_case["no-expert0-rank0-empty"]][0]
    assert rank0_sent == [0] * world, "rank 0 should have no tokens of its own"
    assert by_case["skip-rank1-a16"][1][1] == [0] * world, "rank 1 should receive nothing"


def test_single_rank_without_a_group():
    """No process group: W = 1, no collectives, the same layout as one device."""
    from replay_ops import distributed as ep

    case = CASES[1]
    Ts, x, idx, mask, params, gout = make_case(case, 2)
    got = ep_layer(case, x, idx, mask, params, gout, 0, 1, syncs={})
    one = single_process_layer(case, x, idx, mask, params, gout)
    _bitwise(got["out"], one["out"], "W=1 output")
    _bitwise(got["x_grad"], one["x_grad"], "W=1 input gradient")
    _bitwise(got["grads"]["router"], one["grads"]["router"], "W=1 router gradient")
    assert got["handle"].world_size == 1 and ep.group_info(None)[2] == 1


def _hang(rank, world, pid_file=None):
    import time

    if rank == 1:
        if pid_file:
            with open(pid_file, "w") as f:
                f.write(str(os.getpid()))
        time.sleep(600)
    return rank


def test_spawn_helper_kills_a_hung_rank(tmp_path):
    """The helper's deadline: a rank that never returns is killed and the test fails. Rank 0
    returns at once, but on a loaded machine it may not have got that far by the deadline
    (starting Python and torch), so the message may name it too: either way rank 1 is named
    and killed."""
    import time

    pid_file = tmp_path / "rank1.pid"
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[(0, )?1\] still running after 8 s"):
        run_group("test_distributed:_hang", 2, timeout=8, pid_file=str(pid_file))
    assert time.monotonic() - t0 < 8 + 300  # the deadline, then the kill (bounds a hang)
    if pid_file.exists():  # rank 1 reached its sleep: the process is gone
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)
