"""The model's own selection inside the gates (replay_ops.Selection): rows without a usable
route (replay_mask False; with padding="select" a -1 slot, an id out of range or a repeated
expert) get the model's choice computed in the gate kernel; the agreement outputs
(`plan.agreement`, `plan.set_logprob` and its gradient). Every backend against the
reference (integer outputs exactly), the tie rule, the models' own routers (Megatron-Core's
`topk_routing_with_score_function`, transformers' routers) on tie-free inputs, bad input,
host reads and launches, determinism, torch.compile."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import replay_ops
from replay_ops import reference as ref
from replay_ops.backends.protocol import AGREEMENT, SELECT, OpShape
from replay_ops.options import GateOptions, Selection

from _helpers import (
    SCORE_FUNCS,
    assert_fa_close,
    assert_int_equal,
    assert_plan_ints_equal,
    backend_params,
    make_indices,
    make_logits,
)

# the Triton interpreter runs its small cases in tests/test_selection_triton.py
BACKENDS = [p for p in backend_params() if p.values[0] != ("cpu", "triton")]


def tie_free_logits(T, E, seed=0, dtype=torch.float32, spread=6.0):
    """[T, E] logits whose values, scores and group sums have no ties: each row a random
    permutation of an even grid over [-spread/2, spread/2], jittered by up to a third of a
    step (so that no two sums of values coincide)."""
    g = torch.Generator().manual_seed(seed)
    step = spread / E
    grid = torch.arange(E, dtype=torch.float64) * step - spread / 2
    rows = torch.stack([grid[torch.randperm(E, generator=g)] for _ in range(T)]) if T else \
        torch.empty(0, E, dtype=torch.float64)
    jitter = torch.rand(T, E, generator=g, dtype=torch.float64) * step / 3
    return (rows + jitter).to(dtype)


def messy_rows(T, E, K, seed=3, device="cpu"):
    """Recorded rows with every kind of padding row: -1 slots, a repeated expert, an id out
    of range (E and -7), and clean rows."""
    idx = make_indices(T, E, K, seed=seed).long()
    if T >= 6 and K >= 2:
        idx[1, 1] = -1
        idx[2, 0] = idx[2, 1]
        idx[3, K - 1] = E
        idx[4, 0] = -7
        idx[5] = -1
    return idx.to(device)


SELECTIONS = {
    "default": lambda E, dev: Selection(),
    "logits": lambda E, dev: Selection(source="logits"),
    "bias": lambda E, dev: Selection(expert_bias=torch.linspace(-0.4, 0.3, E, device=dev)),
    "round": lambda E, dev: Selection(round_scores=True),
    "groups-megatron": lambda E, dev: Selection(num_groups=4, group_topk=2),
    "groups-top2-bias": lambda E, dev: Selection(
        expert_bias=0.1 * torch.cos(torch.arange(E, dtype=torch.float32)).to(dev),
        num_groups=4, group_topk=3, group_score_topn=2, round_scores=True),
    "groups-logits": lambda E, dev: Selection(source="logits", num_groups=2, group_topk=1),
}


def _valid(name, sf):
    return sf == "softmax" or not name.startswith("logits") and name != "groups-logits"


CASES = [(name, sf) for name in SELECTIONS for sf in SCORE_FUNCS if _valid(name, sf)]


# ----------------------------------------------------------------- every backend
@pytest.mark.parametrize("dev_backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gate_selects_flagged_rows_like_the_reference(dev_backend, case, dtype):
    device, backend = dev_backend
    name, sf = case
    T, E, K = 37, 16, 4
    sel = SELECTIONS[name](E, device)
    logits = make_logits(T, E, dtype=dtype, device=device, seed=7)
    idx = messy_rows(T, E, K, device=device)
    mask = (torch.rand(T, generator=torch.Generator().manual_seed(8)) > 0.3).to(device)
    for kw in (dict(replay_mask=mask), dict(padding="select"),
               dict(replay_mask=mask, padding="select", return_agreement=True)):
        out = replay_ops.gate(logits, idx, score_func=sf, selection=sel, validate=False,
                              backend=backend, align=4, **kw)
        want = ref.gate(logits, idx, score_func=sf, selection=sel, validate=False, align=4,
                        **kw)
        assert_plan_ints_equal(out, want)
        w64 = ref.gate_weights(logits.double(), want.expert_indices, sf, True, 1.0)
        assert_fa_close(out.weights, want.weights, w64, f"{name} {kw} weights")
        if kw.get("return_agreement"):
            assert out.agreement.dtype == torch.bool and out.agreement.shape == (T,)
            assert torch.equal(out.agreement, want.agreement), (out.agreement, want.agreement)
            lp64 = ref.set_logprob(logits.double(), want.expert_indices, sf)
            assert_fa_close(out.set_logprob, want.set_logprob, lp64, "set_logprob")
        else:
            assert out.agreement is None and out.set_logprob is None
    # the flagged rows hold the model's own choice; the others their recorded ids
    own = ref.select_experts(logits, K, sf, sel)
    out = replay_ops.gate(logits, idx, score_func=sf, selection=sel, padding="select",
                          replay_mask=mask, validate=False, backend=backend)
    flagged = ~mask.cpu() | torch.tensor([ref.padding_row(r, E) for r in idx.tolist()])
    assert torch.equal(out.expert_indices.cpu()[flagged], own[flagged].cpu())
    assert torch.equal(out.expert_indices.cpu()[~flagged], idx.cpu()[~flagged].int())


@pytest.mark.parametrize("dev_backend", BACKENDS)
@pytest.mark.parametrize("case", [c for c in CASES if c[1] != "sqrtsoftplus"],
                         ids=lambda c: f"{c[0]}-{c[1]}")
def test_gate_dense_select_padding_like_the_reference(dev_backend, case):
    device, backend = dev_backend
    name, sf = case
    T, E, K = 29, 16, 4
    sel = SELECTIONS[name](E, device)
    logits = make_logits(T, E, device=device, seed=11)
    idx = messy_rows(T, E, K, device=device)
    mask = (torch.rand(T, generator=torch.Generator().manual_seed(12)) > 0.3).to(device)
    fb = make_indices(T, E, K, seed=13, device=device)
    for kw in (dict(), dict(replay_mask=mask), dict(replay_mask=mask, fallback=fb),
               dict(replay_mask=mask, return_agreement=True, with_plan=False)):
        out = replay_ops.gate_dense(logits, idx, score_func=sf, padding="select", selection=sel,
                                    validate=False, backend=backend, **kw)
        rkw = {k: v for k, v in kw.items() if k != "with_plan"}
        want = ref.gate_dense(logits, idx, score_func=sf, padding="select", selection=sel, **rkw)
        assert torch.equal(out.row_flags, want.row_flags)
        assert_int_equal(out.expert_indices, want.expert_indices, f"{name} {kw}")
        assert torch.equal(out.routing_map, want.routing_map)
        torch.testing.assert_close(out.probs, want.probs, rtol=1e-6, atol=1e-7)
        if out.plan is not None:
            assert_plan_ints_equal(out.plan, want.plan)
        if kw.get("return_agreement"):
            assert torch.equal(out.agreement, want.agreement)
            torch.testing.assert_close(out.set_logprob, want.set_logprob, rtol=1e-6, atol=1e-6)
    # validate=True: a repeat is routed, an id out of range still raises
    replay_ops.gate_dense(logits, idx.clamp(max=E - 1).clamp(min=-1), padding="select",
                          selection=sel, score_func=sf, backend=backend)
    with pytest.raises(ValueError, match=r"expert_indices\[3, 3\] = 16 is out of range"):
        replay_ops.gate_dense(logits, idx, padding="select", score_func=sf, backend=backend)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_validate_with_select_padding(dev_backend):
    """padding="select" takes -1 slots and repeats as flagged rows under validate=True; an id
    outside [-1, E) is still an error, and the default padding still refuses a repeat."""
    device, backend = dev_backend
    T, E, K = 8, 8, 2
    logits = make_logits(T, E, device=device)
    idx = make_indices(T, E, K, device=device)
    idx[2] = torch.tensor([3, 3])
    idx[4, 1] = -1
    plan = replay_ops.gate(logits, idx, padding="select", backend=backend)
    own = ref.select_experts(logits, K, "softmax")
    assert torch.equal(plan.expert_indices[[2, 4]].cpu(), own[[2, 4]].cpu())
    with pytest.raises(ValueError, match=r"row 2 repeats expert 3"):
        replay_ops.gate(logits, idx, backend=backend)
    bad = idx.clone()
    bad[5, 0] = E
    with pytest.raises(ValueError, match=r"expert_indices\[5, 0\] = 8 is out of range"):
        replay_ops.gate(logits, bad, padding="select", backend=backend)
    # with the default padding a -1 slot stays an empty slot (weight 0, no row)
    rows = [0, 1, 3, 4]
    plan = replay_ops.gate(logits[rows], idx[rows], backend=backend)
    assert plan.expert_indices[3, 1] == -1 and plan.weights[3, 1] == 0


# ---------------------------------------------------------------------- tie rule
@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_tie_rule_lower_id_first(dev_backend):
    """Equal values: the lower expert id first (and the lower group id for equal group
    scores); NaN ranks above every number; the scores' rounding to the logits dtype makes
    ties the logits do not have."""
    device, backend = dev_backend
    nan = float("nan")
    logits = torch.tensor([
        [0.0, 2.0, 1.0, 2.0, 2.0, -1.0, 1.0, 0.5],   # three 2.0s: ids 1, 3 (then 4)
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],    # all equal: 0, 1
        [0.0, 1.0, nan, 3.0, nan, 0.0, 0.0, 0.0],    # NaN first, in id order: 2, 4
        [5.0, 4.0, 3.0, 2.0, 5.0, 4.0, 3.0, 2.0],    # groups of 4 tie: group 0 kept
    ], device=device)
    mask = torch.zeros(4, dtype=torch.bool, device=device)
    idx = torch.zeros(4, 2, dtype=torch.int32, device=device)
    out = replay_ops.gate(logits, idx, replay_mask=mask, validate=False, backend=backend)
    assert out.expert_indices[:3].tolist() == [[1, 3], [0, 1], [2, 4]]
    assert out.expert_indices[3].tolist() == [0, 4]
    # the agreement follows the same rule (slot order ignored)
    rec = torch.tensor([[3, 1], [1, 2], [4, 2], [0, 4]], dtype=torch.int32, device=device)
    a = replay_ops.gate(logits, rec, return_agreement=True, validate=False, backend=backend)
    assert a.agreement.tolist() == [True, False, True, True]
    rec[0] = torch.tensor([1, 4])  # 4 ties with 3 at 2.0 but has the higher id
    rec[2] = torch.tensor([2, 3])  # a NaN and the largest number: not the two NaNs
    a = replay_ops.gate(logits, rec, return_agreement=True, validate=False, backend=backend)
    assert a.agreement.tolist() == [False, False, False, True]
    g = replay_ops.gate(logits, idx, replay_mask=mask, validate=False, backend=backend,
                        selection=Selection(source="logits", num_groups=2, group_topk=1))
    assert g.expert_indices[3].tolist() == [0, 1]  # equal group sums: group 0
    assert torch.equal(g.expert_indices.cpu(), ref.select_experts(
        logits, 2, "softmax", Selection(source="logits", num_groups=2, group_topk=1)).cpu())
    # sigmoid of 20 and of 25 round to 1.0 in fp32: without rounding the logits rank
    # (25 first); rounded to bf16, 8 and 9 tie as well (both 1.0), and the lower id wins
    x = torch.tensor([[20.0, 25.0, 0.0, 8.0, 9.0, -3.0]], device=device)
    m1 = torch.zeros(1, dtype=torch.bool, device=device)
    i1 = torch.zeros(1, 2, dtype=torch.int32, device=device)
    out = replay_ops.gate(x, i1, score_func="sigmoid", replay_mask=m1, validate=False,
                          backend=backend)
    assert out.expert_indices.tolist() == [[1, 0]]
    xb = x.to(torch.bfloat16)
    out = replay_ops.gate(xb, i1, score_func="sigmoid", replay_mask=m1, validate=False,
                          backend=backend, selection=Selection(round_scores=True))
    assert out.expert_indices.tolist() == [[0, 1]]
    out = replay_ops.gate(xb[:, 2:], i1, score_func="sigmoid", replay_mask=m1, validate=False,
                          backend=backend, selection=Selection(round_scores=True))
    assert out.expert_indices.tolist() == [[1, 2]]  # 8.0 and 9.0: sigmoid 1.0 in bf16


# ---------------------------------------------------------------- agreement outputs
@pytest.mark.parametrize("dev_backend", BACKENDS)
@pytest.mark.parametrize("sf", SCORE_FUNCS)
def test_agreement_and_set_logprob(dev_backend, sf):
    device, backend = dev_backend
    T, E, K = 24, 12, 3
    logits = tie_free_logits(T, E, seed=5).to(device)
    sel = Selection(expert_bias=torch.linspace(0.2, -0.2, E, device=device), num_groups=3,
                    group_topk=2, group_score_topn=2)
    own = ref.select_experts(logits, K, sf, sel).to(device)
    rec = own.flip(1).clone()  # the model's own sets, slot order reversed: they agree
    rec[0, 0] = next(e for e in range(E) if e not in own[0].tolist())  # another expert
    rec[1, 1] = -1  # an empty slot (padding="empty")
    rec[2, 2] = rec[2, 0]  # a repeat (validate=False)
    out = replay_ops.gate(logits, rec, score_func=sf, selection=sel, return_agreement=True,
                          validate=False, backend=backend)
    want = [False, False, False] + [True] * (T - 3)
    assert out.agreement.tolist() == want
    # set_logprob from the definition, in fp64
    x = logits.double().cpu()
    for t in (0, 1, 2, 7):
        members = sorted({v for v in rec[t].tolist() if v >= 0})
        if sf == "softmax":
            lp = torch.log(torch.softmax(x[t], 0)[members].sum())
        else:
            f = torch.sigmoid(x[t]) if sf == "sigmoid" else torch.sqrt(
                torch.nn.functional.softplus(x[t]))
            lp = torch.log(f[members].sum() / f.sum())
        assert abs(float(out.set_logprob[t]) - float(lp)) < 1e-5, (t, out.set_logprob[t], lp)
    assert out.set_logprob.dtype == torch.float32
    # the dense gate gives the same
    d = replay_ops.gate_dense(logits, rec, score_func=sf, selection=sel, return_agreement=True,
                              validate=False, backend=backend)
    assert torch.equal(d.agreement, out.agreement)
    torch.testing.assert_close(d.set_logprob, out.set_logprob, rtol=0, atol=0)
    # a row with no expert: -inf (and a zero gradient, below)
    empty = rec.clone()
    empty[3] = -1
    e = replay_ops.gate(logits, empty, score_func=sf, return_agreement=True, validate=False,
                        backend=backend)
    assert e.set_logprob[3] == float("-inf") and not e.agreement[3]


@pytest.mark.parametrize("dev_backend", BACKENDS)
@pytest.mark.parametrize("sel_name", ["default", "bias", "logits"])
def test_agreement_one_expert_off_the_top_k(dev_backend, sel_name):
    """Without groups: a set holding the (K+1)-th expert instead of the K-th does not agree
    (nor one holding the last expert), in any slot order; the top-k itself does."""
    device, backend = dev_backend
    T, E, K = 12, 16, 4
    sel = SELECTIONS[sel_name](E, device)
    logits = tie_free_logits(T, E, seed=6).to(device)
    own = ref.select_experts(logits, K + 1, "softmax", sel).to(device)
    rec = own[:, :K].clone()
    rec[0, K - 1] = own[0, K]  # the next best instead of the K-th
    rec[1, 0] = own[1, K]  # the next best instead of the best
    rec[2] = rec[2].flip(0)  # the top-k, reordered
    last = ref.select_experts(-logits, 1, "softmax", Selection(source="logits"))[:, 0]
    if sel_name != "bias":
        rec[3, 1] = last[3].to(device)  # the lowest-ranked expert
    out = replay_ops.gate(logits, rec, selection=sel, return_agreement=True, validate=False,
                          backend=backend)
    want = [False, False, True, sel_name == "bias"] + [True] * (T - 4)
    assert out.agreement.tolist() == want
    assert torch.equal(out.agreement, ref.agreement(logits, rec, "softmax", sel))


@pytest.mark.parametrize("dev_backend", BACKENDS)
@pytest.mark.parametrize("sf", SCORE_FUNCS)
def test_set_logprob_gradcheck(dev_backend, sf):
    """fp64 gradcheck of (weights, set_logprob) together and of set_logprob alone, through
    both gates; a row without experts has a zero gradient."""
    device, backend = dev_backend
    T, E, K = 6, 7, 3
    idx = make_indices(T, E, K, device=device, empty=0.2)
    idx[1, 2] = idx[1, 0]  # a repeat: the set counts it once
    idx[T // 2, 0] = 2  # (make_indices empties one whole row: -inf is no finite difference)
    mask = torch.tensor([True, True, False, True, True, True], device=device)
    lg = make_logits(T, E, dtype=torch.float64, device=device).requires_grad_(True)
    for norm in (False, True):
        def both(x):
            p = replay_ops.gate(x, idx, score_func=sf, normalize=norm, replay_mask=mask,
                                return_agreement=True, validate=False, backend=backend)
            return p.weights, p.set_logprob

        torch.autograd.gradcheck(both, (lg,))
    torch.autograd.gradcheck(
        lambda x: replay_ops.gate(x, idx, score_func=sf, return_agreement=True,
                                  validate=False, backend=backend).set_logprob, (lg,))
    torch.autograd.gradcheck(
        lambda x: replay_ops.gate_dense(x, idx, score_func=sf, return_agreement=True,
                                        padding="select", validate=False,
                                        backend=backend).set_logprob, (lg,))
    # against autograd through the reference, fp32
    x32 = set_logprob_grad_like_reference(T, E, idx, sf, device, backend)
    no_set = torch.full_like(idx, -1)
    x = x32.clone().requires_grad_(True)
    p = replay_ops.gate(x, no_set, score_func=sf, return_agreement=True, validate=False,
                        backend=backend)
    (grad,) = torch.autograd.grad(p.set_logprob.clamp(min=-1e30).sum(), x)
    assert (grad == 0).all()


# ------------------------------------------------------- the models' own routers
def _megatron():
    from _helpers import require_client

    require_client("megatron.core", "megatron-core")
    from megatron.core.transformer.moe import moe_utils

    return moe_utils


MEGATRON = {
    "softmax": dict(score_function="softmax"),
    "presoftmax": dict(score_function="softmax", pre_softmax=True),
    "softmax-groups": dict(score_function="softmax", num_groups=4, group_topk=2),
    "presoftmax-groups": dict(score_function="softmax", pre_softmax=True, num_groups=4,
                              group_topk=2),
    "sigmoid": dict(score_function="sigmoid"),
    "sigmoid-bias-groups": dict(score_function="sigmoid", num_groups=8, group_topk=4,
                                bias=True),
}


@pytest.mark.parametrize("dev_backend", [p for p in BACKENDS if p.values[0][0] == "cpu"])
@pytest.mark.parametrize("name", list(MEGATRON))
def test_selection_equals_megatron_routing(dev_backend, name):
    """Megatron-Core's own `topk_routing_with_score_function` (and through it
    `group_limited_topk`) on tie-free fp32 logits: the gates' selection of every row
    (GateOptions.megatron, all rows flagged) is Megatron's routing map, with its probs, and
    replaying Megatron's routing agrees on every row."""
    moe_utils = _megatron()
    device, backend = dev_backend
    cfg = dict(MEGATRON[name])
    T, E, K = 40, 32, 4
    logits = tie_free_logits(T, E, seed=9)
    bias = 0.3 * torch.randn(E, generator=torch.Generator().manual_seed(1)) \
        if cfg.pop("bias", False) else None
    probs, rmap = moe_utils.topk_routing_with_score_function(
        logits, K, use_pre_softmax=cfg.get("pre_softmax", False),
        num_groups=cfg.get("num_groups"), group_topk=cfg.get("group_topk"),
        scaling_factor=2.5, score_function=cfg["score_function"], expert_bias=bias)
    opts = GateOptions.megatron(**cfg, scaling_factor=2.5, expert_bias=bias)
    none = torch.zeros(T, dtype=torch.bool)
    anything = torch.zeros(T, K, dtype=torch.int32)
    d = replay_ops.gate_dense(logits, anything, replay_mask=none, validate=False,
                              backend=backend, options=dataclasses.replace(opts, padding="select"))
    assert torch.equal(d.routing_map, rmap)
    torch.testing.assert_close(d.probs, probs, rtol=1e-6, atol=1e-7)
    p = replay_ops.gate(logits, anything, replay_mask=none, validate=False, backend=backend,
                        options=opts)
    assert torch.equal(p.to_dense()[1], rmap)
    # replaying Megatron's own routing: every row agrees
    mega_idx = torch.topk(rmap.to(torch.int8), K, dim=1).indices
    a = replay_ops.gate(logits, mega_idx, backend=backend,
                        options=dataclasses.replace(opts, return_agreement=True))
    assert a.agreement.all()
    torch.testing.assert_close(a.to_dense()[0], probs, rtol=1e-6, atol=1e-7)


def _hf_router(arch, E, K, seed):
    from replay_ops.testing.tiny import tiny_config
    import transformers as tf

    cfg = tiny_config(arch, num_experts=E, top_k=K, hidden_size=32, num_heads=4)
    if arch == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        cfg.n_group, cfg.topk_group = 4, 2
        router = DeepseekV3TopkRouter(cfg)
    else:
        mod = {"mixtral": tf.models.mixtral.modeling_mixtral,
               "qwen3_moe": tf.models.qwen3_moe.modeling_qwen3_moe,
               "olmoe": tf.models.olmoe.modeling_olmoe}[arch]
        cls = {"mixtral": "MixtralTopKRouter", "qwen3_moe": "Qwen3MoeTopKRouter",
               "olmoe": "OlmoeTopKRouter"}[arch]
        router = getattr(mod, cls)(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if arch == "deepseek_v3":
            router.e_score_correction_bias.copy_(0.2 * torch.randn(E, generator=g))
    return cfg, router


@pytest.mark.parametrize("dev_backend", [p for p in BACKENDS if p.values[0][0] == "cpu"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_selection_equals_transformers_routers(dev_backend, arch):
    """transformers' routers (their forward, random weights and hidden states): the gate's
    selection of every row from the router's logits is the router's top-k set, with its
    weights; DeepSeek-V3's bias and group limits (top-2 group scores) through
    Selection.deepseek_v3."""
    pytest.importorskip("transformers")
    device, backend = dev_backend
    T, E, K = 33, 16, 4
    cfg, router = _hf_router(arch, E, K, seed=3)
    hidden = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, weights, indices = router(hidden)
    if arch == "deepseek_v3":
        kw = dict(score_func="sigmoid", normalize=cfg.norm_topk_prob,
                  scaling_factor=cfg.routed_scaling_factor,
                  selection=Selection.deepseek_v3(expert_bias=router.e_score_correction_bias,
                                                  n_group=cfg.n_group,
                                                  topk_group=cfg.topk_group))
    else:
        kw = dict(score_func="softmax", normalize=bool(getattr(cfg, "norm_topk_prob", True)))
    none = torch.zeros(T, dtype=torch.bool)
    p = replay_ops.gate(logits, torch.zeros(T, K, dtype=torch.int32), replay_mask=none,
                        validate=False, backend=backend, **kw)
    ours = p.expert_indices.long().sort(dim=1).values
    theirs = indices.long().sort(dim=1).values
    assert torch.equal(ours, theirs)
    want = torch.zeros(T, E).scatter(1, indices.long(), weights.float())
    torch.testing.assert_close(p.to_dense()[0].float(), want, rtol=2e-6, atol=1e-7)
    a = replay_ops.gate(logits, indices, return_agreement=True, backend=backend, **kw)
    assert a.agreement.all()


# ------------------------------------------------------------------------ bad input
def test_bad_selection_is_refused_by_name():
    lg, idx = make_logits(4, 8), make_indices(4, 8, 2)
    mask = torch.ones(4, dtype=torch.bool)

    def gate(**kw):
        return replay_ops.gate(lg, idx, replay_mask=mask, **kw)

    with pytest.raises(ValueError, match=r"selection.expert_bias must have shape \[E\]=\(8,\)"
                                         r".* got \(7,\)"):
        gate(selection=Selection(expert_bias=torch.zeros(7)))
    with pytest.raises(TypeError, match=r"selection.expert_bias must be a float tensor \[E\], "
                                        r"got torch.int64"):
        gate(selection=Selection(expert_bias=torch.zeros(8, dtype=torch.long)))
    with pytest.raises(TypeError, match=r"expert_bias must be a float tensor \[E\] or None, "
                                        r"got list"):
        Selection(expert_bias=[0.0] * 8)
    with pytest.raises(ValueError, match=r"selection.num_groups=3 does not divide the number "
                                         r"of experts E=8"):
        gate(selection=Selection(num_groups=3, group_topk=1))
    with pytest.raises(ValueError, match=r"group_topk=3 is larger than num_groups=2"):
        Selection(num_groups=2, group_topk=3)
    with pytest.raises(ValueError, match=r"K=2 experts cannot be chosen from the kept groups: "
                                         r"group_topk=1 groups of E / num_groups = 1 experts"):
        gate(selection=Selection(num_groups=8, group_topk=1, group_score_topn=1))
    with pytest.raises(ValueError, match=r"top K // group_topk = 2 // 4 = 0 scores .*"
                                         r"group_topk=4 > K=2"):
        gate(selection=Selection(num_groups=4, group_topk=4))
    with pytest.raises(ValueError, match=r"sums the top 3 scores of a group .* a group has "
                                         r"E / num_groups = 2 experts"):
        gate(selection=Selection(num_groups=4, group_topk=2, group_score_topn=3))
    with pytest.raises(ValueError, match=r"needs both num_groups and group_topk"):
        Selection(num_groups=4)
    with pytest.raises(ValueError, match=r"source must be one of \('scores', 'logits'\), got "
                                         r"source='probs'"):
        Selection(source="probs")
    with pytest.raises(ValueError, match=r"selection.source='logits' .* needs "
                                         r"score_func='softmax', got score_func='sigmoid'"):
        gate(score_func="sigmoid", selection=Selection(source="logits"))
    with pytest.raises(ValueError, match=r"gate: unknown padding='spread'"):
        replay_ops.gate(lg, idx, padding="spread")
    with pytest.raises(ValueError, match=r"Megatron-Core applies expert_bias with the sigmoid "
                                         r"score function only"):
        Selection.megatron(score_function="softmax", expert_bias=torch.zeros(8))
    # the dense gate checks the same
    with pytest.raises(ValueError, match=r"gate_dense: selection.num_groups=3 does not divide"):
        replay_ops.gate_dense(lg, idx, padding="select",
                              selection=Selection(num_groups=3, group_topk=1))
    # and so do the native kernels when called directly
    from replay_ops import backends

    if backends.load("native") is not None:
        with pytest.raises(ValueError, match=r"group-limited selection needs num_groups > 0 "
                                             r"dividing E=8"):
            torch.ops.replay_native.gate_fwd(lg, idx, mask, None, 0, True, 1.0, 1, 0, 0, False,
                                             3, 1, 1, False)
        with pytest.raises(ValueError, match=r"expert_bias must be \[E\] with E=8"):
            torch.ops.replay_native.gate_fwd(lg, idx, mask, torch.zeros(3), 0, True, 1.0, 1, 0,
                                             0, False, 0, 0, 0, False)


def test_selection_value_and_presets():
    b = torch.zeros(8)
    assert Selection(expert_bias=b) == Selection(expert_bias=b)
    assert hash(Selection(expert_bias=b)) == hash(Selection(expert_bias=b))
    assert Selection() == replay_ops.options.DEFAULT_SELECTION
    m = Selection.megatron(score_function="softmax", num_groups=4, group_topk=2)
    assert (m.source, m.round_scores, m.num_groups, m.group_topk) == ("logits", False, 4, 2)
    m = Selection.megatron(score_function="softmax", pre_softmax=True, num_groups=4)
    assert (m.source, m.round_scores, m.grouped) == ("scores", True, False)  # no group_topk
    m = Selection.megatron(score_function="sigmoid", expert_bias=b, num_groups=4, group_topk=2)
    assert m.round_scores and m.expert_bias is b and m.group_topn(8) == 4
    d = Selection.deepseek_v3(expert_bias=b, n_group=4, topk_group=2)
    assert d.group_topn(8) == 2 and not d.round_scores
    o = GateOptions.megatron(score_function="softmax", pre_softmax=True, scaling_factor=2.0)
    assert (o.score_func, o.normalize, o.scaling_factor) == ("softmax", False, 2.0)
    assert GateOptions.megatron(score_function="sigmoid").normalize
    assert Selection().ranks_logits and not Selection(round_scores=True).ranks_logits
    assert Selection(source="logits", num_groups=2, group_topk=1).ranks_logits


# --------------------------------------------------- no top-k of every row, no host read
def test_masked_sync_free_gate_runs_one_kernel():
    """The masked sync-free path on the native CPU backend: no host read, and the only op
    dispatched is the native gate kernel (no aten topk, sort or softmax of every row); the
    same with padding="select", the agreement outputs, and the backward."""
    from replay_ops import backends

    from _helpers import assert_native_gate_alone

    if backends.load("native") is None:
        pytest.skip("the native extension is not built")
    T, E, K = 64, 16, 4
    lg = make_logits(T, E).requires_grad_(True)
    idx = messy_rows(T, E, K)
    mask = torch.rand(T, generator=torch.Generator().manual_seed(1)) > 0.1
    sel = Selection.megatron(score_function="sigmoid", expert_bias=torch.randn(E),
                             num_groups=4, group_topk=2)
    calls = [
        lambda: replay_ops.gate(lg, idx, replay_mask=mask, validate=False, backend="native"),
        lambda: replay_ops.gate(lg, idx, replay_mask=mask, padding="select", score_func="sigmoid",
                                selection=sel, return_agreement=True, validate=False),
        lambda: replay_ops.gate_dense(lg, idx, replay_mask=mask, padding="select",
                                      return_agreement=True, validate=False),
    ]
    assert_native_gate_alone(calls, lg, cpu=True)


def test_torch_backend_on_cpu_ranks_the_flagged_rows_only():
    """The torch backend on CPU tensors (the fallback where the native library is not
    built) ranks the flagged rows only: every top-k or sort it dispatches has as many rows
    as are flagged (a repeated expert's check sorts the K slots of every row, which is not a
    ranking of the E experts), none with no flagged row; with return_agreement every row.
    The routes equal the reference's."""
    from launch_counter import _python_impl  # bench/ (pytest pythonpath)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ranked(TorchDispatchMode):
        def __init__(self, E):
            super().__init__()
            self.E, self.rows = E, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "replay":  # into the Python op, as bench's counter does
                with self:
                    return _python_impl(func)(*args, **(kwargs or {}))
            if func in (torch.ops.aten.topk.default, torch.ops.aten.sort.stable,
                        torch.ops.aten.sort.default) and args[0].dim() == 2 \
                    and args[0].shape[-1] >= self.E:  # a ranking of the E experts
                self.rows.append(args[0].shape[0])
            return func(*args, **(kwargs or {}))

    T, E, K = 64, 16, 4
    lg = tie_free_logits(T, E)
    idx = messy_rows(T, E, K)
    sel = Selection(expert_bias=torch.linspace(-0.4, 0.3, E), num_groups=4, group_topk=2)
    for n_masked in (0, 3):
        mask = torch.ones(T, dtype=torch.bool)
        mask[torch.arange(n_masked) * 7 + 10] = False
        for padding, pad_rows in (("empty", 0), ("select", 5)):
            for s in (Selection(), sel):
                kw = dict(replay_mask=mask, padding=padding, selection=s, validate=False)
                # the gate selects masked rows; gate_dense with padding="empty" empties them
                for op, flagged in ((replay_ops.gate, n_masked + pad_rows),
                                    (replay_ops.gate_dense,
                                     n_masked + pad_rows if padding == "select" else 0)):
                    mode = Ranked(E)
                    with mode:
                        got = op(lg, idx, backend="torch", **kw)
                    assert (set(mode.rows) == {flagged}) if flagged else not mode.rows, \
                        (op.__name__, n_masked, padding, mode.rows)
                    want = op(lg, idx, backend="reference", **kw)
                    assert_int_equal(got.expert_indices, want.expert_indices, op.__name__)
    mode = Ranked(E)
    with mode:
        replay_ops.gate(lg, idx, replay_mask=mask, return_agreement=True, validate=False,
                        backend="torch")
    assert mode.rows and set(mode.rows) == {T}, mode.rows


def test_backends_without_the_features_pass_the_call_on(monkeypatch):
    """supports(): the native CUDA gate kernels and the Triton kernels take the selection and
    the agreement features; the native CUDA kernels up to K = MAX_TOPK (kMaxSelectList, their
    per-thread lists), refusing a larger K by name (the registry then runs the next
    backend); a native library whose kernels lack the features refuses them by name."""
    from replay_ops import backends

    if backends.load("triton") is not None:
        for op in ("gate_fwd", "gate_dense_fwd", "gate_bwd", "gate_dense_bwd"):
            assert backends.load("triton").supports(
                op, "cuda", OpShape(8, 16, 2, 0, frozenset((SELECT, AGREEMENT))), torch.float32)
    mod = backends.load("native")
    if mod is not None:
        K = mod.MAX_TOPK
        for op in ("gate_fwd", "gate_dense_fwd", "gate_bwd", "gate_dense_bwd"):
            for f in (SELECT, AGREEMENT):
                assert mod.supports(op, "cuda", OpShape(8, 64, K, 0, frozenset((f,))),
                                    torch.float32)
                why = mod.supports(op, "cuda", OpShape(8, 64, K + 1, 0, frozenset((f,))),
                                   torch.float32)
                assert not why and f"K={K + 1}" in why.reason and "kMaxSelectList" in why.reason
            # a plain gate forward above K = MAX_TOPK still runs natively
            if op.endswith("_fwd"):
                assert mod.supports(op, "cuda", OpShape(8, 64, K + 1), torch.float32)
            # a group list (group_topk, the group score's n) longer than the lists
            if op.endswith("_fwd"):
                feats = frozenset((SELECT,))
                assert mod.supports(op, "cuda", OpShape(8, 64, 8, 0, feats, K), torch.float32)
                why = mod.supports(op, "cuda", OpShape(8, 64, 8, 0, feats, K + 1),
                                   torch.float32)
                assert not why and f"largest {K + 1}" in why.reason and \
                    "kMaxSelectList" in why.reason
        assert mod.supports("gate_fwd", "cpu", OpShape(8, 16, 2, 0, frozenset((SELECT, AGREEMENT))),
                            torch.float32)
        for device, flag in (("cuda", "CUDA_FEATURES"), ("cpu", "CPU_FEATURES")):
            monkeypatch.setattr(mod, flag, False)
            for f in (SELECT, AGREEMENT):
                why = mod.supports("gate_fwd", device, OpShape(8, 16, 2, 0, frozenset((f,))),
                                   torch.float32)
                assert not why and f in why.reason and "protocol.py" in why.reason
            assert mod.supports("gate_fwd", device, OpShape(8, 16, 2), torch.float32)
            monkeypatch.undo()
    if backends.load("triton") is not None and backends.available("triton", "cpu"):
        runs, skipped = backends.explain("gate_fwd", "cpu",
                                         OpShape(8, 16, 2, 0, frozenset((SELECT,))),
                                         torch.float32, "triton")
        assert runs == "triton" and not skipped


def test_gate_ops_tell_the_backends_the_selection_lists(monkeypatch):
    """OpShape.select_list of the gate forwards: max(K, group_topk, the group score's n)
    when the call selects or reports agreement, K without groups, 0 without a feature; what
    the native CUDA supports() reads to hand a too-long group list on."""
    from replay_ops import backends
    from replay_ops.backends import torch as torch_backend

    seen = []

    def supports(op, device_type, shape, dtype):
        seen.append((op, shape.select_list))
        return backends.protocol.YES

    monkeypatch.setattr(torch_backend, "supports", supports)
    T, E, K = 12, 64, 4
    lg = tie_free_logits(T, E)
    idx = make_indices(T, E, K)
    mask = torch.ones(T, dtype=torch.bool)
    wide = Selection(num_groups=16, group_topk=6, group_score_topn=3)  # lists of 6
    deep = Selection(num_groups=2, group_topk=1, group_score_topn=20)  # lists of 20
    for kw, want in ((dict(), 0), (dict(replay_mask=mask), K),
                     (dict(replay_mask=mask, selection=wide), 6),
                     (dict(return_agreement=True, selection=deep), 20),
                     (dict(padding="select", selection=Selection(num_groups=4, group_topk=2)),
                      K)):
        for op, name in ((replay_ops.gate, "gate_fwd"), (replay_ops.gate_dense, "gate_dense_fwd")):
            if op is replay_ops.gate_dense and "replay_mask" in kw and "padding" not in kw:
                kw = dict(kw, padding="select")  # a dense mask alone selects nothing
                want = want or K
            seen.clear()
            op(lg, idx, backend="torch", validate=False, **kw)
            assert (name, want) in seen, (kw, seen)


# ------------------------------------------------------------ determinism, compile
@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_selection_bitwise_deterministic(dev_backend):
    device, backend = dev_backend
    T, E, K = 300, 32, 4
    lg0 = make_logits(T, E, dtype=torch.bfloat16, device=device, seed=2)
    idx = messy_rows(T, E, K, device=device)
    mask = (torch.rand(T, generator=torch.Generator().manual_seed(3)) > 0.2).to(device)
    sel = Selection(expert_bias=torch.linspace(-0.1, 0.1, E, device=device), num_groups=4,
                    group_topk=2, round_scores=True)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            lg = lg0.clone().requires_grad_(True)
            p = replay_ops.gate(lg, idx, replay_mask=mask, padding="select", selection=sel,
                                score_func="sigmoid", return_agreement=True, validate=False,
                                backend=backend, align=8)
            (g,) = torch.autograd.grad((p.weights.float().sum(), p.set_logprob.sum()), lg)
            runs.append((*p, g))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            if a is None or b is None:  # a field this call does not fill (plan.rows)
                assert a is None and b is None
                continue
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_compile_fullgraph_with_selection_and_agreement(dev_backend):
    device, backend = dev_backend
    torch._dynamo.reset()
    T, E, K = 13, 8, 2
    bias = torch.linspace(-0.2, 0.2, E, device=device)
    sel = Selection(expert_bias=bias, num_groups=4, group_topk=2)

    def step(logits, idx, mask):
        p = replay_ops.gate(logits, idx, replay_mask=mask, padding="select", selection=sel,
                            score_func="sigmoid", return_agreement=True, validate=False,
                            backend=backend)
        return p.weights, p.set_logprob, p.agreement, p.expert_indices

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    lg0 = make_logits(T, E, device=device, seed=3)
    idx = messy_rows(T, E, K, device=device)
    mask = (torch.rand(T, generator=torch.Generator().manual_seed(4)) > 0.3).to(device)
    res = []
    for fn in (step, compiled):
        lg = lg0.clone().requires_grad_(True)
        w, lp, agree, used = fn(lg, idx, mask)
        (g,) = torch.autograd.grad((w.sum(), lp.sum()), lg)
        res.append((w.detach(), lp.detach(), agree, used, g))
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_router_replay_route_passes_the_selection():
    """RouterReplay.route hands its selection to the gate: a row without a route gets the
    layer's own rule (here DeepSeek-V3's bias and groups)."""
    from replay_ops.router_replay import RouterReplay, RouterReplayConfig

    T, E, K = 10, 8, 2
    rr = RouterReplay(RouterReplayConfig(mode="R3"), num_experts=E, top_k=K, moe_layer_ids=[0])
    routing = make_indices(T, E, K)[:, None, :]
    mask = torch.ones(T, dtype=torch.bool)
    mask[-1] = False
    rr.set_routing(routing, replay_mask=mask)
    rr.set_action("replay_forward")
    lg = make_logits(T, E)
    sel = Selection.deepseek_v3(expert_bias=torch.linspace(0.5, -0.5, E), n_group=4,
                                topk_group=2)
    plan = rr.route(0, lg, score_func="sigmoid", selection=sel)
    assert torch.equal(plan.expert_indices[-1], ref.select_experts(lg, K, "sigmoid", sel)[-1])
    assert torch.equal(plan.expert_indices[:-1], routing[:-1, 0].int())


def test_a_backend_without_the_selection_is_passed_over_for_a_masked_gate(monkeypatch):
    """A replay_mask alone marks the call as selecting: a backend whose kernels do not select
    (here the native library, as one built without the feature reports itself) is passed
    over, and the next backend selects the masked rows."""
    from replay_ops.backends import native, torch as torch_backend
    if not native.available("cpu"):
        pytest.skip("the native library is not built here")
    monkeypatch.setattr(native, "CPU_FEATURES", False)
    served = []
    real = torch_backend.gate_fwd
    monkeypatch.setattr(torch_backend, "gate_fwd",
                        lambda *a, **k: served.append(1) or real(*a, **k))
    T, E, K = 12, 8, 2
    logits = make_logits(T, E, seed=5)
    idx = make_indices(T, E, K, seed=6)
    mask = torch.arange(T) % 3 != 0
    plan = replay_ops.gate(logits, idx, replay_mask=mask, validate=False, backend="native")
    assert served, "the masked gate ran on a backend that does not select"
    want = ref.gate(logits, idx, replay_mask=mask, validate=False)
    assert torch.equal(plan.expert_indices, want.expert_indices)


def set_logprob_grad_like_reference(T, E, idx, sf, device, backend):
    """The fp32 gradient of the gate's set_logprob equals autograd through the reference;
    returns the logits used."""
    x32 = make_logits(T, E, device=device, seed=4)
    g = torch.randn(T, generator=torch.Generator().manual_seed(2)).to(device)
    outs = []
    for f in (lambda x: replay_ops.gate(x, idx, score_func=sf, return_agreement=True,
                                        validate=False, backend=backend).set_logprob,
              lambda x: ref.set_logprob(x, idx, sf)):
        x = x32.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(f(x), x, g)
        outs.append(grad)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    return x32


@pytest.mark.parametrize("dev_backend", BACKENDS)
@pytest.mark.parametrize("sf", SCORE_FUNCS)
def test_backward_ops_give_ids_outside_the_row_no_gradient(dev_backend, sf):
    """The backward ops, called directly with ids outside [-1, E) and a set_logprob
    gradient: such an id is no expert (no weight gradient, not in the set) on every backend,
    equal to the reference, and no kernel reads or writes outside the row."""
    device, backend = dev_backend
    T, E, K = 9, 6, 2
    x = make_logits(T, E, dtype=torch.float64, device=device, seed=5)
    idx = torch.tensor([[7, 1], [-3, 2], [1, 1], [-1, 4], [6, 0], [1 << 30, -(1 << 30)],
                        [5, 0], [3, 3], [2, 4]], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(9)
    gw = torch.randn(T, K, generator=gen, dtype=torch.float64).to(device)
    gd = torch.randn(T, E, generator=gen, dtype=torch.float64).to(device)
    glp = torch.randn(T, generator=gen, dtype=torch.float64).to(device)
    # the same call with the outside ids written as -1: the meaning of "no expert"
    clean = torch.where((idx >= 0) & (idx < E), idx, -1)
    for norm in (False, True):
        flat = (sf, norm, 1.0)
        got = torch.ops.replay.gate_backward(gw, x, idx, *flat, glp, backend)
        want = torch.ops.replay.gate_backward(gw, x, clean, *flat, glp, "reference")
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        got = torch.ops.replay.gate_dense_backward(gd, x, idx, *flat, glp, backend)
        want = torch.ops.replay.gate_dense_backward(gd, x, clean, *flat, glp, "reference")
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
