"""GPU tests of how the ops run, rather than what they compute (CUDA only: they skip without a
GPU, saying why):

* CUDA-graph capture of the native path with a `replay_mask` (the fallback top-k on the
  rows without a recorded route) and `validate=False` (indices outside [0, E) among the
  recorded ones), on every native gate launch path: the replayed graph follows new inputs
  and gives the bits of an eager call and the reference's plan;
* tensors on `cuda:1` while `cuda:0` is the current device (machines with two GPUs): the
  results are on `cuda:1`, right, and nothing is allocated on `cuda:0`.

The count of host syncs per patched Hugging Face MoE block is tested in test_host_syncs.py."""
from __future__ import annotations


import pytest
import torch

import replay_ops
from replay_ops import reference as ref

from _helpers import (
    assert_fa_close,
    assert_plan_ints_equal,
    capture_cuda_graph,
    gen,
    make_indices,
    make_logits,
)

import gpu_workloads as W  # tools/ (pyproject's pytest pythonpath)

TIME_LIMIT_S = 300
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def on_cuda(*backends):
    reasons = [r for r in (W.cuda_reason(b) for b in backends or (None,)) if r]
    return [pytest.mark.gpu, pytest.mark.skipif(bool(reasons), reason="; ".join(reasons))]


@pytest.fixture(autouse=True)
def _bounded(request):
    with W.time_limit(TIME_LIMIT_S, request.node.nodeid):
        yield


def _inputs(T, E, K, H, seed, device="cuda"):
    """fp32 logits (no ties for the fallback top-k), int32 indices with -1 slots and values
    outside [0, E), a replay mask with about 10% fallback rows, hidden states."""
    idx = W.garbage_indices(T, E, K, torch.int32, seed=seed)
    mask = torch.rand(T, generator=gen(seed + 1)) > 0.1
    mask[0] = False
    logits = make_logits(T, E, torch.float32, seed=seed + 2)
    hidden = torch.randn(T, H, generator=gen(seed + 3))
    return tuple(t.to(device) for t in (logits, idx, mask, hidden))


# ------------------------------------------------------------------------ graph capture
@pytest.mark.parametrize("path,T", [
    pytest.param("auto", 5000, marks=on_cuda("native")),
    pytest.param("single_cta", 1000, marks=on_cuda("native")),
    pytest.param("cooperative", 5000, marks=on_cuda("native")),
    pytest.param("three_launches", 5000, marks=on_cuda("native")),
])
def test_gpu_graph_capture_native_with_replay_mask_and_validate_false(path, T):
    E, K, H, align = 64, 4, 128, 8
    logits, idx, mask, hidden = _inputs(T, E, K, H, seed=1)
    max_rows = T * K + E * (align - 1)

    def step():
        plan = replay_ops.gate(logits, idx, replay_mask=mask, validate=False, align=align,
                               backend="native")
        x = replay_ops.permute(hidden, plan, max_rows, validate=False, backend="native")
        return plan, replay_ops.unpermute(x, plan, backend="native")

    with W.gate_path(path if path != "auto" else None):
        graph, (plan_g, y_g) = capture_cuda_graph(step)
        # new inputs in the captured buffers, then replay
        for buf, new in zip((logits, idx, mask, hidden), _inputs(T, E, K, H, seed=7)):
            buf.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        plan_e, y_e = step()
    for name, a, b in zip((*plan_g._fields[:6], "unpermute"), (*plan_g[:6], y_g),
                          (*plan_e[:6], y_e)):
        assert torch.equal(a, b), f"graph replay differs from an eager call in {name}"
    want = ref.gate(logits, idx, replay_mask=mask, validate=False, align=align)
    assert_plan_ints_equal(plan_g, want)
    w64 = ref.gate(logits.double(), idx, replay_mask=mask, validate=False, align=align).weights
    assert_fa_close(plan_g.weights, want.weights, w64, "weights")
    fallback = ~mask.cpu()
    assert (plan_g.expert_indices.cpu()[fallback] >= 0).all(), "fallback rows take K experts"
    x_ref = ref.permute(hidden, want, max_rows)
    p64 = want._replace(weights=w64)
    assert_fa_close(y_g, ref.unpermute(x_ref, want), ref.unpermute(x_ref.double(), p64),
                    "unpermute")


# -------------------------------------------------------------------------- two GPUs
@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason=(
    "needs two CUDA devices; this machine has "
    f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"))
@pytest.mark.parametrize("backend", ["native", "triton"])
def test_gpu_tensors_on_cuda1_while_cuda0_is_current(backend):
    reason = W.cuda_reason(backend)
    if reason:
        pytest.skip(reason)
    dev = torch.device("cuda:1")
    T, E, K, H = 3000, 64, 4, 96  # T*K > 8192: the multi-CTA / chunked gate
    idx = make_indices(T, E, K, dtype=torch.int16, empty=0.1, seed=2).to(dev)
    logits_c = make_logits(T, E, torch.bfloat16, seed=3)
    hidden_c = torch.randn(T, H, generator=gen(4)).to(torch.bfloat16)
    torch.cuda.synchronize(0)
    with torch.cuda.device(0):
        before = torch.cuda.memory_allocated(0)
        paths = W.NATIVE_PATHS[1:] if backend == "native" else (None,)
        results = []
        for path in paths:
            lg = logits_c.to(dev).requires_grad_(True)
            hd = hidden_c.to(dev).requires_grad_(True)
            with W.gate_path(path):
                plan = replay_ops.gate(lg, idx, align=16, backend=backend)
                x = replay_ops.permute(hd, plan, plan.max_rows, backend=backend)
                y = replay_ops.unpermute(x * 2, plan, backend=backend)
                y.float().square().sum().backward()
            torch.cuda.synchronize(dev)
            assert torch.cuda.current_device() == 0
            for name, t in (*zip(plan._fields[:6], plan), ("x", x), ("y", y),
                            ("grad logits", lg.grad), ("grad hidden", hd.grad)):
                assert t.device == dev, f"{path}: {name} is on {t.device}"
            results.append((plan, y, lg.grad, hd.grad))
        assert torch.cuda.memory_allocated(0) == before, "memory was allocated on cuda:0"

    def chain(cast):
        lg = logits_c.to(dev, cast).requires_grad_(True)
        hd = hidden_c.to(dev, cast).requires_grad_(True)
        plan = ref.gate(lg, idx, align=16)
        y = ref.unpermute(ref.permute(hd, plan, plan.max_rows) * 2, plan)
        y.to(torch.float64 if cast == torch.float64 else torch.float32).square().sum().backward()
        return plan, y, lg.grad, hd.grad

    same, r64 = chain(torch.bfloat16), chain(torch.float64)
    for plan, y, g_lg, g_hd in results:
        assert_plan_ints_equal(plan, same[0])
        assert_fa_close(plan.weights, same[0].weights, r64[0].weights, "weights")
        for name, o, s, r in zip(("y", "grad logits", "grad hidden"), (y, g_lg, g_hd), same[1:],
                                 r64[1:]):
            assert_fa_close(o, s, r, name)
