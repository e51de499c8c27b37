"""GPU tests of the model's own selection, the agreement and the set log-prob in the native
CUDA gate kernels (csrc/cuda/gate_kernels.cu, the rules of csrc/include/replay_select.h;
CUDA only: they skip without a GPU, saying why). tests/test_selection.py runs its small
cases on every backend of every device (the native CUDA kernels included); these add what
only the CUDA kernels have:

* the three launch paths of the gate (single CTA, cooperative, three launches) with flagged
  rows, every Selection feature and the agreement outputs, against the reference (integer
  outputs exactly, floats with the flash-attention rule), and the paths bitwise equal;
* the set log-prob gradient of the backward (one warp per row) against autograd through the
  reference, bitwise deterministic;
* the limits: K = 32 selects natively, K = 33 is handed on, group sizes above 32 are refused
  by name;
* the registry: a selecting call on a GPU runs on the native kernels, and Megatron's router
  takes the one-launch in-kernel path there."""
from __future__ import annotations

import pytest
import torch

import replay_ops
from replay_ops import reference as ref
from replay_ops.options import Selection

from _helpers import assert_fa_close, assert_plan_ints_equal, gen, make_indices

import gpu_workloads as W  # tools/ (pyproject's pytest pythonpath)

TIME_LIMIT_S = 300


def on_native_cuda():
    reason = W.cuda_reason("native")
    return [pytest.mark.gpu, pytest.mark.skipif(bool(reason), reason=reason or "")]


@pytest.fixture(autouse=True)
def _bounded(request):
    with W.time_limit(TIME_LIMIT_S, request.node.nodeid):
        yield


def tie_free_logits(T, E, seed=0, dtype=torch.float32, device="cuda"):
    """Each row a random permutation of an even grid (step 6/E), jittered by up to a third of
    a step: no two values, scores or group sums of a row are within rounding of each other."""
    g = gen(seed)
    step = 6.0 / E
    grid = torch.arange(E, dtype=torch.float64) * step - 3.0
    rows = torch.stack([grid[torch.randperm(E, generator=g)] for _ in range(T)])
    jitter = torch.rand(T, E, generator=g, dtype=torch.float64) * step / 3
    return (rows + jitter).to(dtype).to(device)


def flagged_rows(T, E, K, seed=3, device="cuda", empty_rows=True):
    """Recorded rows with -1 slots, repeats and ids out of range among clean rows (and with
    `empty_rows`, rows of -1 alone)."""
    idx = make_indices(T, E, K, seed=seed).long()
    idx[1::7, 1] = -1
    idx[2::11, 0] = idx[2::11, 1]
    idx[3::13, K - 1] = E
    if empty_rows:
        idx[5::17] = -1
    return idx.to(device)


# name -> (score function, Selection for E experts); E = 64, K = 8 below
CASES = {
    "softmax": ("softmax", lambda E, d: Selection()),
    "softmax-logits": ("softmax", lambda E, d: Selection(source="logits")),
    "softmax-round-groups": ("softmax", lambda E, d: Selection(num_groups=4, group_topk=2,
                                                               round_scores=True)),
    "deepseek-v3": ("sigmoid", lambda E, d: Selection.deepseek_v3(
        expert_bias=torch.linspace(0.05, -0.05, E, device=d), n_group=8, topk_group=4)),
    "sqrtsoftplus-bias": ("sqrtsoftplus", lambda E, d: Selection(
        expert_bias=0.01 * torch.cos(torch.arange(E, dtype=torch.float32)).to(d))),
}


def check_selecting_gate(device, backend, name, T=1100, E=64, K=8, paths=(None,)):
    """gate and gate_dense with a replay mask, padding="select" and the agreement outputs
    equal the reference; every launch path in `paths` gives the same bits."""
    sf, make_sel = CASES[name]
    sel = make_sel(E, device)
    logits = tie_free_logits(T, E, seed=7, device=device)
    idx = flagged_rows(T, E, K, device=device)
    mask = (torch.rand(T, generator=gen(8)) > 0.1).to(device)
    kw = dict(score_func=sf, selection=sel, replay_mask=mask, padding="select",
              return_agreement=True, validate=False)
    want = ref.gate(logits, idx, align=4, **kw)
    lp64 = ref.set_logprob(logits.double(), want.expert_indices, sf)
    w64 = ref.gate_weights(logits.double(), want.expert_indices, sf, True, 1.0)
    dwant = ref.gate_dense(logits, idx, **{k: v for k, v in kw.items() if k != "validate"})
    runs = []
    for path in paths:
        with W.gate_path(path):
            out = replay_ops.gate(logits, idx, backend=backend, align=4, **kw)
            dense = replay_ops.gate_dense(logits, idx, backend=backend, **kw)
        assert_plan_ints_equal(out, want)
        assert_fa_close(out.weights, want.weights, w64, f"{name} weights")
        assert torch.equal(out.agreement, want.agreement), f"{name} agreement"
        assert_fa_close(out.set_logprob, want.set_logprob, lp64, f"{name} set_logprob")
        assert torch.equal(dense.row_flags, dwant.row_flags)
        assert torch.equal(dense.expert_indices, dwant.expert_indices), f"{name} dense ids"
        assert torch.equal(dense.routing_map, dwant.routing_map)
        assert_plan_ints_equal(dense.plan, dwant.plan)
        assert torch.equal(dense.agreement, dwant.agreement), f"{name} dense agreement"
        torch.testing.assert_close(dense.set_logprob, dwant.set_logprob, rtol=1e-5, atol=1e-6)
        runs.append((*out, *dense[:4], dense.agreement, dense.set_logprob))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a is b is None or torch.equal(a, b), "the launch paths differ"
    # the flagged rows hold the model's own choice (the reference's selection of every row,
    # computed apart from its gate)
    own = ref.select_experts(logits, K, sf, sel)
    flagged = ~mask.cpu() | torch.tensor([ref.padding_row(r, E) for r in idx.tolist()])
    assert flagged.any() and (~flagged).any()
    assert torch.equal(out.expert_indices.cpu()[flagged], own.cpu()[flagged].int())
    # every flagged row agrees (selected); a row replayed off the model's choice does not
    assert out.agreement.cpu()[flagged].all() and not out.agreement.cpu().all()


def check_set_logprob_gradient(device, backend, sf, normalize, T=300, E=64, K=8):
    """d(sum(weights * gw) + sum(set_logprob * glp)) / d logits of both gates equals autograd
    through the reference (fp32, the flash-attention rule against fp64), bitwise the same
    twice; a row without experts gives -inf and no gradient."""
    logits = tie_free_logits(T, E, seed=4, device=device)
    idx = flagged_rows(T, E, K, device=device, empty_rows=False)
    mask = (torch.rand(T, generator=gen(5)) > 0.2).to(device)
    gw = torch.randn(T, K, generator=gen(6)).to(device)
    gp = torch.randn(T, E, generator=gen(9)).to(device)
    glp = torch.randn(T, generator=gen(7)).to(device)
    kw = dict(score_func=sf, normalize=normalize, replay_mask=mask, return_agreement=True,
              validate=False)

    def grad(fn, x0, dense):
        x = x0.detach().clone().requires_grad_(True)
        out = fn(x)
        w, g = (out.probs, gp) if dense else (out.weights, gw)
        loss = (w * g.to(w.dtype)).sum() + (out.set_logprob * glp.to(w.dtype)).sum()
        (d,) = torch.autograd.grad(loss, x)
        return d

    for dense in (False, True):
        op = replay_ops.gate_dense if dense else replay_ops.gate
        rop = ref.gate_dense if dense else ref.gate
        extra = dict(padding="select") if dense else {}
        rkw = {k: v for k, v in kw.items() if not (dense and k == "validate")}
        got = grad(lambda x: op(x, idx, backend=backend, **extra, **kw), logits, dense)
        again = grad(lambda x: op(x, idx, backend=backend, **extra, **kw), logits, dense)
        assert torch.equal(got, again), "the backward is not deterministic"
        same = grad(lambda x: rop(x, idx, **extra, **rkw), logits, dense)
        exact = grad(lambda x: rop(x, idx, **extra, **rkw), logits.double(), dense)
        assert_fa_close(got, same, exact, f"{sf} normalize={normalize} dense={dense} grad")
    # a row without experts: -inf, not agreeing, and a zero gradient row
    empty = idx.clone()
    empty[0] = -1
    x = logits.detach().clone().requires_grad_(True)
    p = replay_ops.gate(x, empty, score_func=sf, return_agreement=True, validate=False,
                        backend=backend)
    assert p.set_logprob[0] == float("-inf") and not bool(p.agreement[0])
    (g,) = torch.autograd.grad(p.set_logprob[1:].sum(), x)
    assert (g[0] == 0).all()
    (gr,) = torch.autograd.grad(ref.set_logprob(x, empty, sf)[1:].sum(), x)
    torch.testing.assert_close(g, gr, rtol=1e-5, atol=1e-6)


def check_limits(device, backend):
    """K = MAX_TOPK selects on the native kernels; K = MAX_TOPK + 1 is handed to the next
    backend, and so is a group list above the per-thread lists (OpShape.select_list), which
    the native backend refuses by name when it is requested."""
    from replay_ops import backends as rb
    from replay_ops.backends import OpShape
    from replay_ops.backends import native
    from replay_ops.backends.protocol import AGREEMENT, SELECT

    feats = frozenset((SELECT, AGREEMENT))
    K = native.MAX_TOPK
    for op in ("gate_fwd", "gate_dense_fwd", "gate_bwd", "gate_dense_bwd"):
        assert rb.explain(op, device, OpShape(16, 64, K, 0, feats), torch.float32)[0] == "native"
        runs, skipped = rb.explain(op, device, OpShape(16, 64, K + 1, 0, feats), torch.float32)
        assert runs != "native" and "kMaxSelectList" in skipped["native"]
    T, E = 40, 64
    logits = tie_free_logits(T, E, seed=2, device=device)
    idx = flagged_rows(T, E, K, device=device)
    mask = (torch.arange(T) % 3 != 0).to(device)
    kw = dict(replay_mask=mask, padding="select", return_agreement=True, validate=False)
    out = replay_ops.gate(logits, idx, backend=backend, **kw)
    want = ref.gate(logits, idx, **kw)
    assert_plan_ints_equal(out, want)
    assert torch.equal(out.agreement, want.agreement)
    # a group list longer than the per-thread lists: the native backend, named, refuses
    # it by name; chosen automatically, the call goes on to the next backend
    sel = Selection(num_groups=64, group_topk=K + 1, group_score_topn=1)
    with pytest.raises(RuntimeError, match=rf"largest {K + 1}\).*kMaxSelectList"):
        replay_ops.gate(logits, idx[:, :8], selection=sel, backend=backend, **kw)
    out = replay_ops.gate(logits, idx[:, :8], selection=sel, **kw)
    want = ref.gate(logits, idx[:, :8], selection=sel, **kw)
    assert_plan_ints_equal(out, want)
    assert torch.equal(out.agreement, want.agreement)


# ------------------------------------------------------------------------------ tests
# the backend as a parameter id ("cuda-native"): tools/gpu_test_plan.py counts the executed
# CUDA cases of each backend by it
NATIVE = [pytest.param("native", id="cuda-native", marks=on_native_cuda())]


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_native_selection_on_every_launch_path(backend, name):
    """T*K = 8800 slots: past the single CTA, so each path runs as named."""
    check_selecting_gate("cuda", backend, name, paths=W.NATIVE_PATHS)


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("name", ["softmax", "deepseek-v3"])
def test_gpu_native_selection_in_one_cta(backend, name):
    check_selecting_gate("cuda", backend, name, T=200, paths=("single_cta",))


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalize"])
def test_gpu_native_set_logprob_gradient(backend, sf, normalize):
    check_set_logprob_gradient("cuda", backend, sf, normalize)


@pytest.mark.parametrize("backend", NATIVE)
def test_gpu_native_selection_limits(backend):
    check_limits("cuda", backend)


@pytest.mark.parametrize("backend", NATIVE)
def test_gpu_selecting_calls_run_on_the_native_kernels(backend):
    """On a GPU with the native library, the masked sync-free gate and the dense gate with
    padding="select" run the native gate alone (one op, no host read, no top-k, sort or
    softmax of every row)."""
    from _helpers import assert_native_gate_alone
    from replay_ops.api import selects_in_kernel

    T, E, K = 512, 64, 8
    for op in ("gate", "gate_dense"):
        assert selects_in_kernel(op, "cuda", T, E, K, torch.bfloat16)
    assert backend == "native"  # the calls below name no backend: the registry picks it
    lg = tie_free_logits(T, E, seed=1, dtype=torch.bfloat16).requires_grad_(True)
    idx = flagged_rows(T, E, K)
    mask = (torch.rand(T, generator=gen(2)) > 0.1).cuda()
    calls = [
        lambda: replay_ops.gate(lg, idx, replay_mask=mask, validate=False),
        lambda: replay_ops.gate(lg, idx, replay_mask=mask, padding="select",
                                return_agreement=True, validate=False),
        lambda: replay_ops.gate_dense(lg, idx, replay_mask=mask, padding="select",
                                      return_agreement=True, validate=False),
    ]
    assert_native_gate_alone(calls, lg, cpu=False)


@pytest.mark.parametrize("backend", NATIVE)
def test_gpu_megatron_router_selects_in_the_native_kernel(backend):
    """Megatron's router takes its one-launch in-kernel path on a GPU with the native
    library (`gate_selects_in_kernel`), and keeps its own top-k past K = MAX_TOPK."""
    from _helpers import require_client

    require_client("megatron.core", "megatron-core")
    from replay_ops.backends import native
    from replay_ops.integrations.megatron import router as rmod

    assert backend == "native"
    for dtype in (torch.bfloat16, torch.float32):
        assert rmod.gate_selects_in_kernel("cuda", 4096, 128, 8, dtype)
    assert not rmod.gate_selects_in_kernel("cuda", 64, 128, native.MAX_TOPK + 1, torch.float32,
                                           "native")
