"""The Triton gate kernels' selection of flagged rows and agreement outputs
(triton_kernels/select.py) against the reference: integer outputs exactly, weights and
set_logprob closely, agreement exactly, the set log-prob gradient by gradcheck in fp64 and
against autograd through the reference in fp32. Small shapes: on CPU these kernels run
under the Triton interpreter (tests/test_selection.py runs its larger cases on every other
backend, and on the Triton backend on a GPU)."""
from __future__ import annotations

import pytest
import torch

import replay_ops
from replay_ops import reference as ref
from replay_ops.options import Selection

from _helpers import (
    assert_fa_close,
    assert_int_equal,
    assert_plan_ints_equal,
    backend_params,
    is_interpreted,
    make_indices,
    make_logits,
)
from test_selection import (
    messy_rows,
    set_logprob_grad_like_reference,
    test_backward_ops_give_ids_outside_the_row_no_gradient as _outside_ids,
    tie_free_logits,
)

TRITON = [p for p in backend_params() if p.values[0][1] == "triton"]
if not TRITON:
    pytest.skip("the Triton backend is not usable here", allow_module_level=True)

T, E, K = 8, 8, 2

SELECTIONS = {
    "default": lambda dev: Selection(),
    "logits": lambda dev: Selection(source="logits"),
    "bias-round": lambda dev: Selection(expert_bias=torch.linspace(-0.4, 0.3, E, device=dev),
                                        round_scores=True),
    "groups-megatron": lambda dev: Selection(num_groups=4, group_topk=2),
    "groups-top2-bias": lambda dev: Selection(
        expert_bias=0.1 * torch.cos(torch.arange(E, dtype=torch.float32)).to(dev),
        num_groups=2, group_topk=1, group_score_topn=2, round_scores=True),
}
CASES = [("default", "softmax"), ("logits", "softmax"), ("bias-round", "sigmoid"),
         ("groups-megatron", "softmax"), ("groups-top2-bias", "sigmoid"),
         ("default", "sqrtsoftplus")]


def _rows(device):
    idx = messy_rows(T, E, K, device=device)  # rows 1-5: -1, repeat, out of range, empty
    mask = torch.tensor([1, 1, 0, 1, 1, 0, 1, 0], dtype=torch.bool, device=device)
    return idx, mask


@pytest.mark.parametrize("dev_backend", TRITON)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_gate_selects_like_the_reference(dev_backend, case, dtype):
    device, backend = dev_backend
    name, sf = case
    sel = SELECTIONS[name](device)
    logits = make_logits(T, E, dtype=dtype, device=device, seed=7)
    idx, mask = _rows(device)
    for kw in (dict(replay_mask=mask), dict(padding="select"),
               dict(replay_mask=mask, padding="select", return_agreement=True),
               dict(return_agreement=True)):
        out = replay_ops.gate(logits, idx, score_func=sf, selection=sel, validate=False,
                              backend=backend, align=4, **kw)
        want = ref.gate(logits, idx, score_func=sf, selection=sel, validate=False, align=4,
                        **kw)
        assert_plan_ints_equal(out, want)
        w64 = ref.gate_weights(logits.double(), want.expert_indices, sf, True, 1.0)
        assert_fa_close(out.weights, want.weights, w64, f"{name} {kw} weights")
        if kw.get("return_agreement"):
            assert torch.equal(out.agreement.cpu(), want.agreement.cpu()), \
                (out.agreement, want.agreement)
            lp64 = ref.set_logprob(logits.double(), want.expert_indices, sf)
            fin = torch.isfinite(lp64).to(device)
            assert torch.equal(torch.isfinite(out.set_logprob), fin)
            assert_fa_close(out.set_logprob[fin], want.set_logprob[fin], lp64[fin.cpu()],
                            "set_logprob")
        else:
            assert out.agreement is None and out.set_logprob is None
    # the selection is not a no-op here: some flagged row changed its experts
    sel_rows = replay_ops.gate(logits, idx, score_func=sf, selection=sel, replay_mask=mask,
                               validate=False, backend=backend).expert_indices
    assert not torch.equal(sel_rows.cpu()[~mask.cpu()], idx.cpu()[~mask.cpu()].int())


@pytest.mark.parametrize("dev_backend", TRITON)
@pytest.mark.parametrize("case", CASES[:5], ids=lambda c: f"{c[0]}-{c[1]}")
def test_triton_gate_dense_selects_like_the_reference(dev_backend, case):
    device, backend = dev_backend
    name, sf = case
    sel = SELECTIONS[name](device)
    logits = make_logits(T, E, device=device, seed=11)
    idx, mask = _rows(device)
    fb = make_indices(T, E, K, seed=13, device=device)
    for kw in (dict(), dict(replay_mask=mask, fallback=fb),
               dict(replay_mask=mask, return_agreement=True, with_plan=False)):
        out = replay_ops.gate_dense(logits, idx, score_func=sf, padding="select", selection=sel,
                                    validate=False, backend=backend, **kw)
        rkw = {k: v for k, v in kw.items() if k != "with_plan"}
        want = ref.gate_dense(logits, idx, score_func=sf, padding="select", selection=sel,
                              **rkw)
        assert torch.equal(out.row_flags.cpu(), want.row_flags.cpu())
        assert_int_equal(out.expert_indices, want.expert_indices, f"{name} {kw}")
        assert torch.equal(out.routing_map.cpu(), want.routing_map.cpu())
        torch.testing.assert_close(out.probs.cpu(), want.probs.cpu(), rtol=1e-6, atol=1e-7)
        if out.plan is not None:
            assert_plan_ints_equal(out.plan, want.plan)
        if kw.get("return_agreement"):
            assert torch.equal(out.agreement.cpu(), want.agreement.cpu())
            torch.testing.assert_close(out.set_logprob.cpu(), want.set_logprob.cpu(),
                                       rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dev_backend", TRITON)
def test_triton_agreement_of_near_misses(dev_backend):
    """A set one rank off the selection disagrees, any slot order of the selection agrees,
    a row without experts is -inf; with groups the kept groups decide."""
    device, backend = dev_backend
    logits = tie_free_logits(6, E, seed=6).to(device)
    for sel in (Selection(), Selection(num_groups=4, group_topk=2)):
        own = ref.select_experts(logits, K + 1, "softmax", sel).to(device)
        rec = own[:, :K].clone()
        rec[0, K - 1] = own[0, K]  # the next best instead of the K-th
        rec[1] = rec[1].flip(0)  # reordered: agrees
        rec[2] = -1  # no expert
        rec[3, 1] = rec[3, 0]  # a repeat
        out = replay_ops.gate(logits, rec, selection=sel, return_agreement=True,
                              validate=False, backend=backend)
        want = ref.agreement(logits, rec, "softmax", sel)
        assert out.agreement.tolist() == want.tolist()
        assert out.agreement.tolist()[:4] == [False, True, False, False]
        assert out.set_logprob[2] == float("-inf")


@pytest.mark.parametrize("dev_backend", TRITON)
@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_triton_set_logprob_gradient(dev_backend, sf):
    """fp64 gradcheck of set_logprob (with the weights) through both gates, and the fp32
    gradient against autograd through the reference; a row without experts has none. Under
    the interpreter (each launch costs a fraction of a second) gradcheck runs in its fast
    mode, random projections of the Jacobian; the fp32 comparison below is the whole
    gradient."""
    device, backend = dev_backend
    fast = is_interpreted(device, backend)
    t, e, k = 4, 5, 2
    idx = make_indices(t, e, k, device=device)
    idx[1, 1] = idx[1, 0]  # a repeat: the set counts it once
    idx[2, 1] = -1
    lg = make_logits(t, e, dtype=torch.float64, device=device).requires_grad_(True)

    if sf == "softmax":  # the weights' and the set's gradients added in one pass
        def both(x):
            p = replay_ops.gate(x, idx, score_func=sf, return_agreement=True, validate=False,
                                backend=backend)
            return p.weights, p.set_logprob

        torch.autograd.gradcheck(both, (lg,), fast_mode=fast)
    else:  # the dense gate's backward kernel
        torch.autograd.gradcheck(
            lambda x: replay_ops.gate_dense(x, idx, score_func=sf, return_agreement=True,
                                            validate=False, backend=backend).set_logprob,
            (lg,), fast_mode=fast)
    x32 = set_logprob_grad_like_reference(t, e, idx, sf, device, backend)
    x = x32.clone().requires_grad_(True)
    p = replay_ops.gate(x, torch.full_like(idx, -1), score_func=sf, return_agreement=True,
                        validate=False, backend=backend)
    (grad,) = torch.autograd.grad(p.set_logprob.clamp(min=-1e30).sum(), x)
    assert (grad == 0).all()


@pytest.mark.parametrize("dev_backend", TRITON)
def test_triton_selection_multi_chunk_and_deterministic(dev_backend):
    """Past one program (the 3-launch plan) the flagged rows' selection feeds the plan;
    two runs give the same bits."""
    device, backend = dev_backend
    from replay_ops.triton_kernels import gate as tg

    e, k = 64, 32
    t = tg.SINGLE_PROGRAM_MAX_SLOTS // k + 3
    logits = make_logits(t, e, device=device, seed=1)
    idx = make_indices(t, e, k, device=device, seed=2)
    mask = torch.ones(t, dtype=torch.bool, device=device)
    mask[[0, 5, t - 1]] = False
    sel = Selection(num_groups=4, group_topk=2)
    runs = [replay_ops.gate(logits, idx, replay_mask=mask, selection=sel, validate=False,
                            backend=backend) for _ in range(2)]
    want = ref.gate(logits, idx, replay_mask=mask, selection=sel, validate=False)
    assert_plan_ints_equal(runs[0], want)
    assert torch.equal(runs[0].weights, runs[1].weights)


@pytest.mark.parametrize("dev_backend", TRITON)
def test_triton_tie_rule_lower_id_first(dev_backend):
    """tests/test_selection.py's tie rule (equal values: lower id first, for experts and
    groups; NaN above every number; the rounding of the scores) on the Triton kernels."""
    import test_selection

    test_selection.test_tie_rule_lower_id_first(dev_backend)


@pytest.mark.parametrize("dev_backend", TRITON)
@pytest.mark.parametrize("sf", ["softmax", "sigmoid"])
def test_backward_ops_give_ids_outside_the_row_no_gradient(dev_backend, sf):
    """The backward kernels with ids outside [-1, E) and a set_logprob gradient: no gradient
    for them, equal to the reference (tests/test_selection.py's case)."""
    _outside_ids(dev_backend, sf)
