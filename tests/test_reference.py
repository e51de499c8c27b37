"""The oracle itself (`replay_ops.reference`), checked against small cases derived by hand
from the math: explicit Python loops with the `math` module, literal plans worked out on
paper, and the gate-semantics table of Megatron-Core / TransformerEngine / HF models."""
from __future__ import annotations

import math

import pytest
import torch

from replay_ops import reference as ref

from _helpers import SCORE_FUNCS, check_plan_structure, make_indices, make_logits

LOGITS = [
    [0.5, -1.0, 2.0, 0.25, -0.75],
    [3.0, 1.0, -2.0, 0.0, 4.5],
    [-0.3, 0.2, 0.1, -1.7, 1.1],
    [1.0, 1.0, 1.0, 1.0, 1.0],
]
INDICES = [[2, 0, 4], [4, -1, 1], [-1, -1, -1], [3, -1, -1]]


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def _sqrtsoftplus(x):
    return math.sqrt(math.log1p(math.exp(x)))


def weights_by_loops(logits, indices, score_func, normalize, scale):
    """The gate semantics of docs/ops.md, one element at a time in Python floats."""
    out = []
    for x, row in zip(logits, indices):
        valid = [e for e in row if e >= 0]
        if score_func == "softmax" and not normalize:
            z = sum(math.exp(v) for v in x)
            w = {e: math.exp(x[e]) / z for e in valid}
        elif score_func == "softmax":
            z = sum(math.exp(x[e]) for e in valid)
            w = {e: math.exp(x[e]) / z for e in valid}
        else:
            f = _sigmoid if score_func == "sigmoid" else _sqrtsoftplus
            w = {e: f(x[e]) for e in valid}
            if normalize and len(valid) > 1:
                s = sum(w.values()) + 1e-20
                w = {e: v / s for e, v in w.items()}
        out.append([w[e] * scale if e >= 0 else 0.0 for e in row])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_gate_weights_match_loops(score_func, normalize, scale):
    logits = torch.tensor(LOGITS, dtype=torch.float64)
    idx = torch.tensor(INDICES, dtype=torch.int32)
    got = ref.gate_weights(logits, idx, score_func, normalize, scale)
    want = weights_by_loops(LOGITS, INDICES, score_func, normalize, scale)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
    # the fp32 path agrees with the fp64 one to fp32 precision
    got32 = ref.gate_weights(logits.float(), idx, score_func, normalize, scale)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, rtol=2e-6, atol=1e-7)


def test_gate_weights_literal_values():
    """A few numbers worked out by hand (logits [1, 2, 3], recorded experts [2, 1])."""
    x = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    idx = torch.tensor([[2, 1]])
    e = math.e
    cases = {
        # post-softmax (Mixtral, Qwen3-MoE norm_topk_prob=True): softmax([3, 2])
        ("softmax", True): [e / (e + 1), 1 / (e + 1)],
        # pre-softmax (Qwen1.5-MoE, OLMoE): softmax([1, 2, 3]) at [2, 1]
        ("softmax", False): [e**2 / (1 + e + e**2), e / (1 + e + e**2)],
        # sigmoid (DeepSeek-V3) without / with normalisation
        ("sigmoid", False): [1 / (1 + e**-3), 1 / (1 + e**-2)],
        ("sigmoid", True): [
            (1 / (1 + e**-3)) / (1 / (1 + e**-3) + 1 / (1 + e**-2)),
            (1 / (1 + e**-2)) / (1 / (1 + e**-3) + 1 / (1 + e**-2)),
        ],
        ("sqrtsoftplus", False): [math.log(1 + e**3) ** 0.5, math.log(1 + e**2) ** 0.5],
    }
    for (sf, norm), want in cases.items():
        got = ref.gate_weights(x, idx, sf, norm, 1.0)
        torch.testing.assert_close(got, torch.tensor([want], dtype=torch.float64),
                                   rtol=1e-14, atol=0, msg=f"{sf} normalize={norm}")
    assert abs(cases[("softmax", True)][0] - 0.7310585786300049) < 1e-15
    # DeepSeek-V3 routed_scaling_factor multiplies last
    got = ref.gate_weights(x, idx, "sigmoid", True, 2.5)
    torch.testing.assert_close(got, torch.tensor([cases[("sigmoid", True)]]) .double() * 2.5)


def test_single_valid_slot_is_not_normalised_for_sigmoid():
    """DeepSeek normalises only when K > 1: one valid slot keeps its raw score."""
    x = torch.tensor([[0.3, -1.0, 2.0]], dtype=torch.float64)
    for idx in ([[2]], [[2, -1]], [[-1, 2, -1]]):
        for sf, f in (("sigmoid", _sigmoid), ("sqrtsoftplus", _sqrtsoftplus)):
            got = ref.gate_weights(x, torch.tensor(idx), sf, True, 1.0)
            k = idx[0].index(2)
            assert abs(got[0, k].item() - f(2.0)) < 1e-15
    # while softmax normalisation of one slot gives exactly 1
    got = ref.gate_weights(x, torch.tensor([[-1, 2]]), "softmax", True, 1.0)
    assert got.tolist() == [[0.0, 1.0]]


def test_megatron_formulations():
    """Same as Megatron-Core's topk_routing_with_score_function given the indices:
    pre-softmax = softmax(logits).gather; post-softmax = softmax(logits.gather);
    sigmoid = sigmoid(logits).gather / (sum + 1e-20)."""
    logits = make_logits(9, 16, dtype=torch.float64)
    idx = make_indices(9, 16, 4).long()
    pre = torch.softmax(logits, -1).gather(1, idx)
    post = torch.softmax(logits.gather(1, idx), -1)
    sig = torch.sigmoid(logits).gather(1, idx)
    sig = sig / (sig.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(ref.gate_weights(logits, idx, "softmax", False, 1.0), pre)
    torch.testing.assert_close(ref.gate_weights(logits, idx, "softmax", True, 1.0), post)
    torch.testing.assert_close(ref.gate_weights(logits, idx, "sigmoid", True, 1.0), sig)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("score_func", SCORE_FUNCS)
def test_low_precision_logits_round_once(dtype, score_func):
    """Math in fp32, scaling applied last, then one cast to the logits dtype."""
    logits = make_logits(7, 9, dtype=dtype)
    idx = make_indices(7, 9, 3, empty=0.2)
    for norm in (False, True):
        got = ref.gate_weights(logits, idx, score_func, norm, 1.7)
        want = ref.gate_weights(logits.float(), idx, score_func, norm, 1.7).to(dtype)
        assert got.dtype == dtype
        assert torch.equal(got, want)


# --------------------------------------------------------------------------- plan
def test_build_plan_by_hand():
    """T=3, E=4, K=2: slots s0..s5 -> experts 2, 0 | 0, - | 3, 2."""
    idx = torch.tensor([[2, 0], [0, -1], [3, 2]], dtype=torch.int32)
    counts, offsets, row_id_map, sorted_slots = ref.build_plan(idx, 4, 1)
    assert counts.tolist() == [2, 0, 2, 1]
    assert offsets.tolist() == [0, 2, 2, 4, 5]
    assert sorted_slots.tolist() == [1, 2, 0, 5, 4, -1]
    assert row_id_map.tolist() == [[2, 0], [1, -1], [4, 3]]

    counts, offsets, row_id_map, sorted_slots = ref.build_plan(idx, 4, 4)
    assert counts.tolist() == [2, 0, 2, 1]
    assert offsets.tolist() == [0, 4, 4, 8, 12]
    assert sorted_slots.tolist() == [1, 2, -1, -1, 0, 5, -1, -1, 4, -1, -1, -1] + [-1] * 6
    assert row_id_map.tolist() == [[4, 0], [1, -1], [8, 5]]
    for t in (counts, offsets, row_id_map, sorted_slots):
        assert t.dtype == torch.int32


def test_build_plan_vllm_layout():
    """Same order as vLLM's moe_align_block_size: flat ids t*K+k, expert-major, each expert
    padded to a multiple of the block size (vLLM's padding sentinel T*K is -1 here)."""
    idx = torch.tensor([[1, 0], [1, 2], [0, 1]], dtype=torch.int32)
    _, offsets, _, sorted_slots = ref.build_plan(idx, 3, 2)
    assert offsets.tolist() == [0, 2, 6, 8]
    assert sorted_slots.tolist()[:8] == [1, 4, 0, 2, 5, -1, 3, -1]


@pytest.mark.parametrize("align", [1, 3, 16])
@pytest.mark.parametrize("shape", [(0, 5, 2), (1, 1, 1), (17, 7, 7), (40, 64, 3)])
def test_build_plan_structure(shape, align):
    T, E, K = shape
    idx = make_indices(T, E, K, empty=0.3 if K > 1 else 0.0)
    from replay_ops.plan import RoutingPlan

    plan = RoutingPlan(torch.zeros(T, K), idx.to(torch.int32), *ref.build_plan(idx, E, align))
    check_plan_structure(plan, idx, E, align)


def test_build_plan_megatron_order():
    """Megatron's permute order is a stable argsort of the transposed [E, T] routing map:
    expert-major, tokens ascending within an expert."""
    T, E, K = 30, 6, 2
    idx = make_indices(T, E, K)
    rmap = torch.zeros(T, E, dtype=torch.bool)
    rmap.scatter_(1, idx.long(), True)
    tokens_megatron = rmap.t().reshape(-1).nonzero().flatten() % T  # [E, T] row-major
    _, _, _, sorted_slots = ref.build_plan(idx, E, 1)
    assert (sorted_slots // K).tolist() == tokens_megatron.tolist()


# ------------------------------------------------------------- permute / combine
def test_permute_rows_by_loops():
    T, K, H = 3, 2, 4
    idx = torch.tensor([[2, 0], [0, -1], [3, 2]], dtype=torch.int32)
    _, _, _, ss = ref.build_plan(idx, 4, 4)
    hidden = torch.arange(T * H, dtype=torch.float32).view(T, H)
    out = ref.permute_rows(hidden, ss, K, 20)
    want = torch.zeros(20, H)
    for r, s in enumerate(ss.tolist()):
        if s >= 0:
            want[r] = hidden[s // K]
    assert torch.equal(out, want)
    assert torch.equal(out[:5], torch.stack([hidden[0], hidden[1], torch.zeros(H),
                                             torch.zeros(H), hidden[0]]))


def test_combine_by_loops_in_column_order():
    """fp32 accumulation over k = 0..K-1, bitwise."""
    T, K, H = 5, 3, 6
    R = 9
    g = torch.Generator().manual_seed(0)
    x = torch.randn(R, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, K, generator=g).to(torch.bfloat16)
    rid = torch.tensor([[0, 4, -1], [8, -1, 1], [-1, -1, -1], [2, 3, 5], [7, 6, -1]],
                       dtype=torch.int32)
    got = ref.combine(x, rid, w)
    want = torch.zeros(T, H, dtype=torch.bfloat16)
    for t in range(T):
        acc = torch.zeros(H, dtype=torch.float32)
        for k in range(K):
            if rid[t, k] >= 0:
                acc = acc + w[t, k].float() * x[rid[t, k]].float()
        want[t] = acc.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


# -------------------------------------------------------------------- selection
def test_select_experts_and_scores():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0], [5.0, -5.0, 0.0, 4.0]])
    for sf in SCORE_FUNCS:
        idx = ref.select_experts(logits, 2, sf)
        assert idx.dtype == torch.int32
        assert idx.tolist() == [[1, 3], [0, 3]]  # all three scores are monotonic
    s = ref.scores(logits.to(torch.bfloat16), "sigmoid")
    assert s.dtype == torch.float32
    assert ref.scores(logits.double(), "softmax").dtype == torch.float64


def test_resolve_indices_flags_rows():
    """The oracle's resolution: recorded rows as they are (out of range -> -1), the model's
    selection in masked rows, and with padding="select" in rows with a -1 slot, an id out
    of range or a repeat."""
    logits = make_logits(12, 8)
    idx = make_indices(12, 8, 3, dtype=torch.int16)
    idx[2] = torch.tensor([1, -1, 4])
    idx[3] = torch.tensor([5, 5, 0])
    idx[4] = torch.tensor([9, 2, 3])
    mask = torch.rand(12, generator=torch.Generator().manual_seed(4)) > 0.5
    mask[2:5] = True
    for sf in SCORE_FUNCS:
        own = ref.select_experts(logits, 3, sf)
        a = ref.resolve_indices(logits, idx, mask, sf)
        assert torch.equal(a[~mask], own[~mask])
        assert a[2].tolist() == [1, -1, 4] and a[3].tolist() == [5, 5, 0]
        assert a[4].tolist() == [-1, 2, 3]
        b = ref.resolve_indices(logits, idx, mask, sf, padding="select")
        assert torch.equal(b[2:5], own[2:5])
        keep = mask.clone()
        keep[2:5] = False
        assert torch.equal(b[keep], idx[keep].int())


# -------------------------------------------------------------------- gradients
@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("normalize", [False, True])
def test_reference_gradcheck(score_func, normalize):
    logits = torch.tensor(LOGITS, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor(INDICES)
    fn = lambda x: ref.gate(x, idx, score_func=score_func, normalize=normalize,  # noqa: E731
                            scaling_factor=1.3).weights
    assert torch.autograd.gradcheck(fn, (logits,))


def test_reference_gradient_reaches_replayed_experts():
    """Gradients come from the dense logits, also for experts the live top-k would skip."""
    logits = torch.tensor([[5.0, 4.0, -3.0, -4.0]], requires_grad=True)
    w = ref.gate(logits, torch.tensor([[3, 2]]), score_func="softmax", normalize=False).weights
    w.sum().backward()
    g = logits.grad[0]
    assert (g != 0).all()
    # d/dx_j sum_{i in S} p_i = p_j [j in S] - p_j sum_{i in S} p_i, by hand
    p = torch.softmax(logits.detach()[0].double(), -1)
    ps = p[2] + p[3]
    want = torch.tensor([-p[0] * ps, -p[1] * ps, p[2] - p[2] * ps, p[3] - p[3] * ps])
    torch.testing.assert_close(g.double(), want, rtol=1e-5, atol=1e-9)


def test_reference_gate_validates():
    with pytest.raises(ValueError, match="expert_indices\\[0, 1\\] = 9"):
        ref.gate(make_logits(2, 4), torch.tensor([[0, 9], [1, 2]]))
    with pytest.raises(ValueError, match="num_rows=1"):
        plan = ref.gate(make_logits(2, 4), torch.tensor([[0, 1], [1, 2]]))
        ref.permute(torch.randn(2, 3), plan, 1)


@pytest.mark.parametrize("normalize", [False, True])
def test_reference_sqrtsoftplus_gradient_finite_in_the_far_tail(normalize):
    """d sqrt(softplus(x))/dx = sigmoid(x) / (2 sqrt(softplus(x))) ~ exp(x/2)/2 -> 0 as x -> -inf.
    In fp32, softplus(x) underflows to 0 below about x = -103.3, and autograd through
    sqrt(0) gives inf * 0 = NaN. The oracle must give the (tiny, finite) true gradient,
    like the fp64 computation and like the kernels' closed-form backward."""
    logits = torch.tensor([[-200.0, 1.0, -120.0, 0.5]], requires_grad=True)
    idx = torch.tensor([[0, 1, 2]])
    gw = torch.tensor([[1.0, 2.0, 3.0]])
    w = ref.gate(logits, idx, score_func="sqrtsoftplus", normalize=normalize).weights
    (w * gw).sum().backward()
    x64 = logits.detach().double().requires_grad_(True)
    w64 = ref.gate(x64, idx, score_func="sqrtsoftplus", normalize=normalize).weights
    (w64 * gw.double()).sum().backward()
    assert torch.isfinite(logits.grad).all(), logits.grad
    torch.testing.assert_close(logits.grad.double(), x64.grad, rtol=1e-5, atol=1e-12)
