"""The experts of a patched Hugging Face MoE block (replay_ops.integrations.hf.block).

* Patching changes nothing while not replaying: per experts implementation (grouped_mm,
  eager, batched_mm, one registered through transformers' ExpertsInterface) the outputs
  and gradients are bitwise those of the unpatched model, and the same implementation runs.
* The replayed forward runs the implementation the config names, with the replayed
  routing; against the unpatched model forced to the same routing (`forced_reference`, which
  never calls replay_ops) logits and gradients agree within fp32 tolerance.
* The grouped GEMM over the plan computes bitwise what transformers' grouped_mm function
  computes where the arithmetic is the same (fp32, rows of an expert in the same order: its
  torch.sort made stable here), and padding rows (align > 1) change nothing but rounding.
* In bf16 its error against an fp64 oracle is within twice transformers' own.
* Where transformers' rule refuses F.grouped_mm, its fallback op runs, as unpatched.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

import replay_ops  # noqa: E402
from replay_ops.integrations import hf  # noqa: E402
from replay_ops.integrations.hf import block as hf_block  # noqa: E402
from replay_ops.router_replay import ReplayAction, RouterReplayConfig  # noqa: E402
from replay_ops.testing import tiny  # noqa: E402
from test_hf_integration import (  # noqa: E402
    assert_grads_close,
    capture_routing,
    forced_reference,
    make_ids,
)
from transformers.integrations import moe  # noqa: E402

ARCHS = list(tiny.ARCHS)
IMPLS = ["grouped_mm", "eager", "batched_mm", "custom"]
CUSTOM = "replay_ops_test_experts"
# dtype -> (rtol, atol): replayed vs the forced unpatched model (the gate weights are
# recomputed in fp32 by replay_ops.gate, equal to a few ulp).
TOL = {torch.float32: (1e-5, 1e-5)}

_calls: list = []


def _custom_experts(experts, hidden_states, top_k_index, top_k_weights):
    """A user's experts implementation: batched_mm, recording what it was given."""
    _calls.append((top_k_index.clone(), top_k_weights.detach().clone()))
    return moe.batched_mm_experts_forward(experts, hidden_states, top_k_index, top_k_weights)


moe.ExpertsInterface.register(CUSTOM, _custom_experts)


def make_model(arch, impl, dtype=torch.float32, **kw):
    kw.setdefault("num_layers", 2)
    model = tiny.tiny_model(arch, seed=99, dtype=dtype, **kw)
    model.set_experts_implementation(CUSTOM if impl == "custom" else impl)
    return model


class OpNames(TorchDispatchMode):
    """The op names ('namespace::name') a region runs."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(f"{func.namespace}::{func.__name__.split('.')[0]}")
        return func(*args, **(kwargs or {}))


def run(model, ids, ops=None):
    """Logits and every parameter's gradient of a forward+backward (loss: sum of logits)."""
    model.zero_grad(set_to_none=True)
    with ops if ops is not None else contextlib.nullcontext():
        logits = model(ids).logits
        (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.fixture
def deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def impl_marker(impl):
    """An op that only the named implementation runs on these models (CPU, fp32)."""
    return {"grouped_mm": "aten::_grouped_mm", "batched_mm": "aten::bmm",
            "custom": "aten::bmm", "eager": "aten::nonzero"}[impl]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("arch", ARCHS)
def test_patched_not_replaying_is_bitwise_unpatched(arch, impl, deterministic):
    # deterministic algorithms: batched_mm's own backward (index_put with accumulate) does
    # not give the same bits twice otherwise, patched or not
    model = make_model(arch, impl)
    ids = make_ids(2, 7, seed=3)
    ref_ops, out_ops = OpNames(), OpNames()
    ref_logits, ref_grads = run(model, ids, ref_ops)
    # R3 with no action set, and mode disabled: the block's own forward runs
    for replay in (RouterReplayConfig(mode="R3", fallback=hf.SUPPORTED[arch].fallback), None):
        patch = hf.patch_model(model, replay)
        try:
            out_logits, out_grads = run(model, ids, out_ops)
        finally:
            patch.remove()
        assert torch.equal(out_logits, ref_logits)
        assert out_grads.keys() == ref_grads.keys()
        for n in ref_grads:
            assert torch.equal(out_grads[n], ref_grads[n]), n
    assert model.config._experts_implementation == (CUSTOM if impl == "custom" else impl)
    assert impl_marker(impl) in ref_ops.names
    assert out_ops.names == ref_ops.names  # the same implementation, no replay_ops op
    assert not any(n.startswith("replay::") for n in out_ops.names)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("arch", ARCHS)
def test_replay_runs_the_config_implementation_and_matches_forced_routing(arch, impl):
    model = make_model(arch, impl)
    ids = make_ids(3, 5, seed=4)
    T = ids.numel()
    E, K = hf.find_moe_blocks(model).num_experts, hf.find_moe_blocks(model).top_k
    # a routing other than the native one: every token, every layer, K random experts
    g = torch.Generator().manual_seed(5)
    L = len(hf.find_moe_blocks(model).moe_layer_ids)
    routing = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T * L)])
    routing = routing.view(T, L, K).to(torch.int32)
    ref_logits, ref_grads = run(forced_reference(model, arch, routing), ids)
    patch = hf.patch_model(model, RouterReplayConfig(mode="R3", validate=False,
                                                     fallback=hf.SUPPORTED[arch].fallback))
    patch.replay.set_routing(routing)
    patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
    ops = OpNames()
    _calls.clear()
    out_logits, out_grads = run(model, ids, ops)
    rtol, atol = TOL[torch.float32]
    torch.testing.assert_close(out_logits, ref_logits, rtol=rtol, atol=atol)
    assert_grads_close(out_grads, ref_grads)
    router = [n for n in ref_grads if "gate.weight" in n and "shared" not in n]
    assert router and all(ref_grads[n].abs().max() > 0 for n in router)
    assert impl_marker(impl) in ops.names
    # the routing goes through replay_ops' gate; the plan path only for grouped_mm, where
    # the gate also writes the experts' input rows (one op: no separate permute)
    grouped = impl == "grouped_mm"
    assert ("replay::gate_permute" in ops.names) == grouped
    assert ("replay::gate" in ops.names) == (not grouped)
    assert "replay::permute" not in ops.names
    assert ("replay::unpermute" in ops.names) == grouped
    if impl == "custom":  # the user's function got the replayed indices, in recorded order
        assert [torch.equal(i, routing[:, n].long()) for n, (i, _) in enumerate(_calls)] == \
            [True] * L


def _stable_sort(t, *args, **kwargs):
    kwargs.setdefault("stable", True)
    return _torch_sort(t, *args, **kwargs)


_torch_sort = torch.sort


def _plan_case(arch, dtype, T=29, empty=0.0, align=1, seed=0):
    model = make_model(arch, "grouped_mm", dtype=dtype)
    block = hf.find_moe_blocks(model).blocks[max(hf.find_moe_blocks(model).blocks)]
    experts = block.experts
    E, K, H = experts.num_experts, block.gate.top_k, model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if empty:
        idx[torch.rand(T, K, generator=g) < empty] = -1
    plan = replay_ops.gate(logits, idx, align=align)
    return experts, x, logits, idx, plan


@pytest.mark.parametrize("arch", ARCHS)
def test_grouped_plan_path_bitwise_transformers_grouped_mm_fp32(arch):
    """Same rows in the same order through the same GEMMs, the same fp32 combine: outputs
    and gradients (hidden, both expert weights) bitwise equal, the gate weights' gradient
    within fp32 rounding; padding rows of align 8 change the results by rounding only."""
    experts, x, logits, idx, _ = _plan_case(arch, torch.float32)
    results = {}
    for name in ("ours align 1", "ours align 8", "transformers"):
        experts.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        lg = logits.clone().requires_grad_(True)
        plan = replay_ops.gate(lg, idx, align=8 if "8" in name else 1)
        if name.startswith("ours"):
            out = hf_block.plan_experts(experts, xg, plan)
        else:
            with mock.patch.object(torch, "sort", _stable_sort):
                out = moe.grouped_mm_experts_forward(experts, xg, idx, plan.weights)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results[name] = (out.detach(), xg.grad, lg.grad, experts.gate_up_proj.grad,
                         experts.down_proj.grad)
    what = ("output", "grad hidden", "grad logits", "grad gate_up_proj", "grad down_proj")
    for w, a, b in zip(what, results["ours align 1"], results["transformers"]):
        if w == "grad logits":
            # d loss / d gate weight is a dot product over H: unpermute's backward and
            # autograd's mul backward reduce it in their own orders
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
        else:
            assert torch.equal(a, b), w
    # Padding rows shift the rows' positions in the GEMM's blocks, and the CPU GEMM's
    # rounding of a row depends on its position: equal within fp32 rounding, not bitwise.
    for w, a, b in zip(what, results["ours align 8"], results["ours align 1"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8, msg=lambda m, w=w: f"{w}: {m}")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_grouped_plan_path_with_empty_slots(arch):
    """-1 slots (weight 0, no row) are left out: equal to transformers' grouped_mm given
    the same routing with those slots' weights zeroed and any expert id."""
    experts, x, logits, idx, plan = _plan_case(arch, torch.float32, empty=0.3, align=4)
    assert (plan.expert_indices < 0).any()
    out = hf_block.plan_experts(experts, x, plan)
    filled = torch.where(idx < 0, 0, idx)
    with mock.patch.object(torch, "sort", _stable_sort):
        ref = moe.grouped_mm_experts_forward(experts, x, filled, plan.weights)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    # eager with the same plan: empty slots as expert 0 with weight 0
    experts.config._experts_implementation = "eager"
    torch.testing.assert_close(hf_block.plan_experts(experts, x, plan), ref, rtol=1e-6,
                               atol=1e-7)


def _fp64_oracle(experts, x, idx, w):
    out = torch.zeros(x.shape, dtype=torch.float64)
    gu, dn = experts.gate_up_proj.double(), experts.down_proj.double()
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            gate, up = (gu[e] @ x[t].double()).chunk(2)
            out[t] += float(w[t, k]) * (dn[e] @ (experts.act_fn(gate) * up))
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_grouped_plan_path_bf16_error_within_twice_transformers(arch):
    experts, x, logits, idx, plan = _plan_case(arch, torch.bfloat16, T=41)
    oracle = _fp64_oracle(experts, x, idx, plan.weights)
    err_out = (hf_block.plan_experts(experts, x, plan).double() - oracle).abs().max()
    err_ref = (moe.grouped_mm_experts_forward(experts, x, idx, plan.weights).double()
               - oracle).abs().max()
    assert err_out <= 2 * err_ref, (float(err_out), float(err_ref))


def test_transformers_fallback_rule_is_followed():
    """Where `_can_use_grouped_mm` says no, transformers' fallback op runs (one host read
    of the offsets per GEMM, as unpatched); the result is the grouped_mm one."""
    experts, x, logits, idx, plan = _plan_case("qwen3_moe", torch.float32, align=8)
    ref = hf_block.plan_experts(experts, x, plan)
    ops = OpNames()
    with mock.patch.object(moe, "_can_use_grouped_mm", lambda *a: False), ops:
        out = hf_block.plan_experts(experts, x, plan)
    assert "transformers::grouped_mm_fallback" in ops.names
    assert "aten::_grouped_mm" not in ops.names
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)


def test_unknown_experts_implementation_is_transformers_error():
    model = make_model("qwen3_moe", "grouped_mm")
    patch = hf.patch_model(model, RouterReplayConfig(mode="R2"))
    patch.replay.set_action(ReplayAction.RECORD)
    model.config._experts_implementation = "no_such_experts"
    with pytest.raises(KeyError, match="no_such_experts"):
        model(make_ids(1, 4))


@pytest.mark.parametrize("arch", ARCHS)
def test_record_native_routing_reproduces_unpatched_per_implementation(arch):
    """RECORD (native choice, replay_ops gate) with batched_mm experts reproduces the
    unpatched batched_mm model's logits and picks its routing."""
    model = make_model(arch, "batched_mm")
    ids = make_ids(2, 6, seed=8)
    ref_logits, ref_routing = capture_routing(model, ids)
    patch = hf.patch_model(model, RouterReplayConfig(mode="R2",
                                                     fallback=hf.SUPPORTED[arch].fallback))
    patch.replay.set_action(ReplayAction.RECORD)
    with torch.no_grad():
        out = model(ids).logits
    torch.testing.assert_close(out, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(patch.last_routing().long(), ref_routing.long())


def _imports(path):
    """Every module a file imports (module level or inside functions), absolute."""
    import ast
    from pathlib import Path

    pkg = path.relative_to(Path(replay_ops.__file__).parents[1]).with_suffix("").parts
    pkg = pkg if path.name == "__init__.py" else pkg[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = list(pkg[: len(pkg) - node.level + 1]) if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            out |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return out


@pytest.mark.parametrize("a,b", [
    ("replay_ops/integrations/hf/ep.py", "replay_ops/integrations/hf/patch.py"),
    ("replay_ops/integrations/megatron/router.py",
     "replay_ops/integrations/megatron/dispatcher.py"),
])
def test_no_import_circle(a, b):
    """The expert-parallel HF path and the plain one share hf/block.py; Megatron's router
    and dispatcher share nothing but what wiring.py imports from both."""
    from pathlib import Path

    root = Path(replay_ops.__file__).parents[1]
    name = lambda p: p[:-3].replace("/", ".")  # noqa: E731

    def reaches(imports, mod):
        return any(m == mod or m.startswith(mod + ".") for m in imports)

    ia, ib = _imports(root / a), _imports(root / b)
    assert not (reaches(ia, name(b)) and reaches(ib, name(a))), (a, b)
