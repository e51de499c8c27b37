"""replay_ops.distributed on 2 gloo ranks where the ranks differ in what their experts do:
a rank whose experts receive no rows and return something not computed from them, frozen
router and input with trained experts, and expert outputs of different dtypes (autocast,
or a rank with no rows returning its fp32 input). Every rank must take part in both
backward exchanges and the exchange must carry one dtype; otherwise a rank waits for ever
or reads bytes of another dtype. Plus: the deferred checks of a CheckedRoutingPlan
survive `_replace`, and a copy that lost them is refused.

Each rank computes the whole batch (every rank's tokens come from seeded generators) in
one process as the oracle."""
from __future__ import annotations

import pytest
import torch

from _dist_spawn import run_group

WORLD, T, E, H = 2, 4, 4, 8  # experts 0, 1 on rank 0; 2, 3 on rank 1


def _inputs(rank, K=1, seed=0):
    """Rank `rank`'s tokens, router logits and indices; only experts 0 and 1 (rank 0's)
    are used, so rank 1's experts receive no rows."""
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    idx = torch.tensor([[(t + k) % 2 for k in range(K)] for t in range(T)], dtype=torch.int32)
    return x, logits, idx


def _weights():
    return torch.randn(H, H, generator=torch.Generator().manual_seed(99))


def _no_rows_backward(rank, world):
    """hidden and the router need gradients; rank 1's experts get no rows and return
    zeros not computed from them (nothing to do). Rank 1's tokens went to rank 0's expert,
    so their gradient must come back through dispatch's backward exchange."""
    from replay_ops import distributed as ep

    W = _weights()
    x, logits, idx = _inputs(rank)
    x.requires_grad_(True)
    logits.requires_grad_(True)
    plan = ep.gate(logits, idx)
    x_local, h = ep.dispatch(x, plan)
    y = x_local @ W if h.num_rows else torch.zeros_like(x_local)
    out = ep.combine(y, h)
    out.sum().backward()
    # oracle: this rank's tokens through expert 0/1, which is x @ W for both
    x1, l1, _ = _inputs(rank)
    x1.requires_grad_(True)
    l1.requires_grad_(True)
    w = torch.softmax(l1.gather(1, idx.long()), dim=1)  # K = 1: weight 1, gradient 0
    ref = w * (x1 @ W)
    ref.sum().backward()
    return dict(num_rows=h.num_rows, out=out.detach(), ref=ref.detach(), x_grad=x.grad,
                ref_x_grad=x1.grad)


def _frozen_input_and_router(rank, world):
    """Only the experts train; rank 1 has no rows and hands its (empty) input back. Rank
    0's expert processed rank 1's tokens, so it needs rank 1's output gradient."""
    from replay_ops import distributed as ep

    W = _weights().requires_grad_(True)
    x, logits, idx = _inputs(rank, K=2)
    plan = ep.gate(logits, idx)
    x_local, h = ep.dispatch(x, plan)
    y = x_local @ W if h.num_rows else x_local
    out = ep.combine(y, h)
    out.sum().backward()
    W1 = _weights().requires_grad_(True)  # oracle: every rank's tokens in one process
    total = 0
    for r in range(world):
        xr, lr, ir = _inputs(r, K=2)
        wr = torch.softmax(lr.gather(1, ir.long()), dim=1)
        total = total + (wr.sum(1, keepdim=True) * (xr @ W1)).sum()
    total.backward()
    return dict(num_rows=h.num_rows, grad=W.grad, ref_grad=W1.grad if rank == 0 else None)


def _mixed_dtypes(rank, world):
    """hidden fp32 on both ranks; rank 0's experts return bf16 (autocast), rank 1's, with
    no rows, return their fp32 input. Then the other way round: rank 1 returns bf16 rows."""
    from replay_ops import distributed as ep

    x, logits, idx = _inputs(rank, K=2)
    plan = ep.gate(logits, idx)
    x_local, h = ep.dispatch(x, plan)
    # elementwise experts: the oracle's values are the same bits as the ranks'
    y = (x_local * 2).to(torch.bfloat16) if h.num_rows else x_local
    out = ep.combine(y, h)
    y_ref = (x * 2).to(torch.bfloat16).float()  # what rank 0's expert returned for our rows
    ref = (plan.weights[:, :, None] * y_ref[:, None, :]).sum(1)
    # all experts used, a different dtype per rank: rank 1 bf16, rank 0 fp32
    g = torch.Generator().manual_seed(7 + rank)
    idx2 = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)]).to(torch.int32)
    plan2 = ep.gate(logits, idx2)
    x_local2, h2 = ep.dispatch(x, plan2)
    y2 = x_local2 * 3
    out2 = ep.combine(y2.to(torch.bfloat16) if rank == 1 else y2, h2)
    owner = idx2.long() // (E // world)
    y_ref2 = torch.where((owner == 1)[:, :, None], (3 * x).to(torch.bfloat16).float()[:, None, :],
                         (3 * x)[:, None, :])
    ref2 = (plan2.weights[:, :, None] * y_ref2).sum(1)
    return dict(num_rows=h.num_rows, out=out, ref=ref, out2=out2, ref2=ref2,
                recv2=h2.recv_counts)


@pytest.mark.parametrize("fn", ["_no_rows_backward", "_frozen_input_and_router",
                                "_mixed_dtypes"])
def test_ranks_that_differ_finish_with_the_right_values(fn):
    res = run_group(f"test_distributed_edges:{fn}", WORLD, timeout=300)
    assert res[0]["num_rows"] > 0 and res[1]["num_rows"] == 0, "rank 1 must receive no rows"
    for rank, r in enumerate(res):
        if fn == "_no_rows_backward":
            torch.testing.assert_close(r["out"], r["ref"], rtol=1e-6, atol=1e-6)
            assert r["x_grad"].abs().sum() > 0, f"rank {rank}: no input gradient came back"
            torch.testing.assert_close(r["x_grad"], r["ref_x_grad"], rtol=1e-6, atol=1e-6)
        elif fn == "_frozen_input_and_router":
            if rank == 0:
                torch.testing.assert_close(r["grad"], r["ref_grad"], rtol=1e-5, atol=1e-5)
            else:  # rank 1's expert weights were not used
                assert r["grad"] is None or r["grad"].abs().sum() == 0
        else:
            assert r["out"].dtype == torch.float32, "the exchange runs in hidden's dtype"
            torch.testing.assert_close(r["out"], r["ref"], rtol=1e-6, atol=1e-6)
            assert all(n > 0 for n in r["recv2"]), "both ranks must receive rows"
            torch.testing.assert_close(r["out2"], r["ref2"], rtol=1e-6, atol=1e-6)


def test_checked_plan_keeps_its_checks():
    """A deferred range error survives plan._replace; a tuple copy that lost it is refused
    (before, both dispatched the bad row as empty, without an error)."""
    from replay_ops import distributed as ep

    x, logits, _ = _inputs(0, K=2)
    idx = torch.tensor([[0, 1], [2, 9], [1, 3], [3, 0]], dtype=torch.int32)  # 9 >= E
    plan = ep.gate(logits, idx)
    with pytest.raises(ep.DistributedInputError, match=r"expert_indices\[1, 1\] = 9"):
        ep.dispatch(x, plan)
    with pytest.raises(ep.DistributedInputError, match=r"expert_indices\[1, 1\] = 9"):
        ep.dispatch(x, plan._replace(weights=plan.weights * 1.0))
    with pytest.raises(ep.DistributedInputError, match="without its deferred checks"):
        ep.dispatch(x, type(plan)(*plan))
