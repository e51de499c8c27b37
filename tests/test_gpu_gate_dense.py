"""GPU tests of the dense gate (replay_ops.gate_dense) and the permuted probs on the native
CUDA kernels and the Triton kernels (CUDA only: they skip without a GPU, saying why):

* every launch path of the native gate (single CTA, cooperative, three launches), with and
  without the plan, against the torch backend (integers exactly, floats by the
  flash-attention rule against the fp64 reference);
* shapes that leave the single CTA because of the dense output alone (T*K small, T*E large);
* bitwise determinism run to run, the backward against the reference;
* validate=False + padding="spread": gate_dense -> permute(probs) -> unpermute(weights=None),
  forward and backward, captured in a CUDA graph (no host sync) and replayed."""
from __future__ import annotations


import pytest
import torch

import replay_ops
from replay_ops import reference as ref

from _helpers import (
    assert_fa_close,
    assert_int_equal,
    capture_cuda_graph,
    make_indices,
    make_logits,
)

import gpu_workloads as W  # tools/ (pyproject's pytest pythonpath)


def on_cuda(backend):
    reason = W.cuda_reason(backend)
    return [pytest.mark.gpu, pytest.mark.skipif(bool(reason), reason=reason or "")]


BACKENDS = [pytest.param(b, id=f"cuda-{b}", marks=on_cuda(b)) for b in ("native", "triton")]
SHAPES = [(7, 8, 2), (1000, 64, 8), (3000, 256, 8), (4100, 1024, 2), (20000, 128, 8)]


def messy(T, E, K, seed=1):
    idx = make_indices(T, E, K, dtype=torch.int64, seed=seed)
    idx[0] = -1
    idx[1, 1] = idx[1, 0]
    idx[2, 0] = E + 4
    idx[3] = 0
    return idx.cuda()


def check(out, want, want64):
    assert_fa_close(out.probs, want.probs, want64.probs, "probs")
    for name in ("routing_map", "row_flags", "expert_indices"):
        assert_int_equal(getattr(out, name), getattr(want, name), name)
    if want.plan is not None:
        for f in ("tokens_per_expert", "expert_offsets", "row_id_map", "sorted_slots"):
            assert_int_equal(getattr(out.plan, f), getattr(want.plan, f), f)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}E{}K{}".format(*s))
def test_dense_paths_match_torch(backend, shape):
    T, E, K = shape
    logits = make_logits(T, E, dtype=torch.bfloat16, device="cuda")
    idx = messy(T, E, K)
    mask = (torch.rand(T, generator=torch.Generator().manual_seed(3)) > 0.1).cuda()
    fb = make_indices(T, E, K, seed=5).cuda()
    paths = W.NATIVE_PATHS if backend == "native" else (None,)
    for padding in ("spread", "fallback", "empty"):
        kw = dict(score_func="sigmoid", normalize=True, scaling_factor=2.0, replay_mask=mask,
                  fallback=fb, padding=padding, ep_size=4, spread_offset=9,
                  underflow_guard=True, align=16)
        want = replay_ops.gate_dense(logits, idx, validate=False, backend="torch", **kw)
        want64 = replay_ops.gate_dense(logits.double(), idx, validate=False, backend="torch",
                                       **kw)
        for path in paths:
            if path == "single_cta" and T * K > 8192:
                continue
            with W.gate_path(path):
                for with_plan in (True, False):
                    out = replay_ops.gate_dense(logits, idx, validate=False, backend=backend,
                                                with_plan=with_plan, **kw)
                    check(out, want if with_plan else want._replace(plan=None), want64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_backward_and_determinism(backend):
    T, E, K = 5000, 128, 8
    idx = messy(T, E, K)
    for sf, norm in (("softmax", False), ("softmax", True), ("sqrtsoftplus", True)):
        logits0 = make_logits(T, E, device="cuda", seed=7)
        g = torch.randn(T, E, device="cuda")
        grads = []
        for _ in range(2):
            lg = logits0.clone().requires_grad_(True)
            out = replay_ops.gate_dense(lg, idx, score_func=sf, normalize=norm,
                                        padding="spread", validate=False, backend=backend)
            (gl,) = torch.autograd.grad(out.probs, lg, g)
            grads.append((out.probs, gl))
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
        lr = logits0.cpu().double().requires_grad_(True)
        kw = dict(score_func=sf, normalize=norm, padding="spread")
        (g64,) = torch.autograd.grad(ref.gate_dense(lr, idx.cpu(), **kw).probs, lr,
                                     g.cpu().double())
        lr32 = logits0.cpu().requires_grad_(True)
        (g32,) = torch.autograd.grad(ref.gate_dense(lr32, idx.cpu(), **kw).probs, lr32,
                                     g.cpu())
        assert_fa_close(grads[0][1].cpu(), g32, g64, f"grad {sf} {norm}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_step_captures_in_cuda_graph(backend):
    T, E, K, H = 256, 64, 4, 32
    logits = make_logits(T, E, device="cuda").requires_grad_(True)
    idx = messy(T, E, K)
    hidden = torch.randn(T, H, device="cuda", requires_grad=True)

    def step():
        d = replay_ops.gate_dense(logits, idx, padding="spread", underflow_guard=True,
                                  validate=False, backend=backend)
        x, p = replay_ops.permute(hidden, d.plan, T * K, probs=d.probs, validate=False,
                                  backend=backend)
        out = replay_ops.unpermute(x * p[:, None], d.plan, validate=False, backend=backend)
        gl, gh = torch.autograd.grad(out.sum(), (logits, hidden))
        return out.detach(), gl, gh

    want = step()
    graph, static = capture_cuda_graph(step, warmup=3)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(static, want):
        assert torch.equal(a, b)
