"""The Hugging Face integration as a package: `register_family` for an architecture the
package does not ship (FlexOlmo), checked against the unpatched model with the same
experts; the checks on what is registered; and the deprecated module paths and names.

The oracle for a forced routing is the unpatched FlexOlmo model whose routers return the
given indices, with gate weights written here from FlexOlmo's router code
(`FlexOlmoTopKRouter.forward`, transformers 5.x). It never calls replay_ops.
"""
from __future__ import annotations

import copy
import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import replay_ops  # noqa: E402
from replay_ops.integrations import hf  # noqa: E402
from replay_ops.router_replay import ReplayAction  # noqa: E402
from test_hf_experts import _imports  # noqa: E402
from test_hf_integration import capture_routing  # noqa: E402  (router hooks: own routing)

FAMILY = "flex_olmo"


@pytest.fixture
def flex_olmo():
    """FlexOlmo registered for the test (softmax scores, norm_topk_prob from the router),
    unregistered after it."""
    assert FAMILY not in hf.SUPPORTED  # not shipped: the test adds it
    spec = hf.register_family(FAMILY, block_class="FlexOlmoSparseMoeBlock",
                              score_func="softmax",
                              normalize=lambda gate: bool(gate.norm_topk_prob))
    try:
        yield spec
    finally:
        hf.unregister_family(FAMILY)
    assert FAMILY not in hf.SUPPORTED


def flex_olmo_model(norm_topk_prob: bool, experts_impl: str = "eager", seed: int = 7):
    import transformers as tf

    config = tf.FlexOlmoConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        use_cache=False, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    config._experts_implementation = experts_impl
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.FlexOlmoForCausalLM(config)
    return model.float().eval()


def routers(model):
    return {int(n.split(".")[2]): m for n, m in model.named_modules()
            if type(m).__name__ == "FlexOlmoTopKRouter"}


def forced_reference(model, routing):
    """A copy of the unpatched model whose routers return `routing` [T, L, K], with the
    gate weights of FlexOlmo's router code: softmax in fp32, gathered, renormalized when
    norm_topk_prob."""
    ref = copy.deepcopy(model)
    for n, (lid, g) in enumerate(sorted(routers(ref).items())):
        orig = type(g).forward
        idx_l = routing[:, n, :].long()

        def fwd(self, hidden, orig=orig, idx=idx_l):
            logits = orig(self, hidden)[0]
            w = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, idx)
            if self.norm_topk_prob:
                w = w / w.sum(dim=-1, keepdim=True)
            return logits, w.to(logits.dtype), idx

        g.forward = types.MethodType(fwd, g)
    return ref


def make_ids(B, S, seed):
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(seed))


def expert_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if "experts." in n or "gate.weight" in n}


# ------------------------------------------------------------------------------ a new family


def test_unregistered_family_is_refused_with_the_way_to_add_it():
    model = flex_olmo_model(False)
    with pytest.raises(hf.UnsupportedModelError, match="flex_olmo.*register_family"):
        hf.patch_model(model, "R3")


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_registered_family_record_reproduces_the_model(flex_olmo, norm, impl):
    """RECORD through a registered family: the unpatched model's logits, and the routing
    its own routers pick."""
    model = flex_olmo_model(norm, impl)
    ids = make_ids(2, 9, seed=1)
    ref_logits, ref_routing = capture_routing(model, ids)
    patch = hf.patch_model(model, "R2")
    lay = patch.layout
    assert (lay.model_type, lay.moe_layer_ids, lay.num_experts, lay.top_k) == (
        FAMILY, [0, 1], 8, 2)
    assert (lay.score_func, lay.normalize, lay.scaling_factor) == ("softmax", norm, 1.0)
    patch.replay.set_action(ReplayAction.RECORD)
    with torch.no_grad():
        out = model(ids).logits
    torch.testing.assert_close(out, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(patch.last_routing().long(), ref_routing.long())
    # the family's own selection, index for index with the router module
    g = lay.blocks[0].gate
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, _, idx = g(x)
    assert torch.equal(hf.own_topk(FAMILY, g, logits), idx)
    patch.remove()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref_logits)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_registered_family_replay_matches_forced_model(flex_olmo, norm, impl):
    """R3 replay of a routing unlike the model's own, through a registered family: logits
    and gradients of the unpatched model forced to that routing (same experts)."""
    model = flex_olmo_model(norm, impl)
    ids = make_ids(2, 8, seed=2)
    T = ids.numel()
    _, own = capture_routing(model, ids)
    g = torch.Generator().manual_seed(5)
    routing = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T * 2)]).view(
        T, 2, 2)
    assert (routing.sort(-1).values != own.sort(-1).values).any()
    ref = forced_reference(model, routing)
    ref_out = ref(ids).logits
    ref_out.square().mean().backward()

    patch = hf.patch_model(model, "R3")
    patch.replay.set_routing(routing.to(torch.int32))
    patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
    out = model(ids).logits
    out.square().mean().backward()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(patch.last_routing(), routing.to(torch.int32))
    got, want = expert_grads(model), expert_grads(ref)
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    # the routing matters: the model's own routing gives other logits
    patch.remove()
    with torch.no_grad():
        assert (model(ids).logits - ref_out.detach()).abs().max() > 1e-4


def test_register_family_replace_and_unregister(flex_olmo):
    with pytest.raises(ValueError, match="model_type='flex_olmo' is already registered"):
        hf.register_family(FAMILY, block_class="FlexOlmoSparseMoeBlock")
    from transformers.models.flex_olmo.modeling_flex_olmo import FlexOlmoSparseMoeBlock

    spec = hf.register_family(FAMILY, block_class=FlexOlmoSparseMoeBlock, normalize=True,
                              scaling_factor=2, replace=True)
    assert hf.SUPPORTED[FAMILY] is spec
    assert spec.block_class == "FlexOlmoSparseMoeBlock"
    assert (spec.normalize(None), spec.scaling_factor(None)) == (True, 2.0)
    with pytest.raises(ValueError, match="model_type='mixtral' ships with the package"):
        hf.unregister_family("mixtral")
    with pytest.raises(ValueError, match="model_type='nope' is not registered"):
        hf.unregister_family("nope")


@pytest.mark.parametrize("kwargs,arg", [
    (dict(model_type=""), "model_type"),
    (dict(model_type=3), "model_type"),
    (dict(block_class="Not A Name"), "block_class"),
    (dict(block_class=int), "block_class"),
    (dict(score_func="tanh"), "score_func"),
    (dict(score_func="sigmoid"), "selection"),  # no default selection for sigmoid scores
    (dict(topk="softmax"), "topk"),
    (dict(selection="top-k"), "selection"),
    (dict(logits="linear"), "logits"),
    (dict(normalize="yes"), "normalize"),
    (dict(normalize=1), "normalize"),
    (dict(scaling_factor=0.0), "scaling_factor"),
    (dict(scaling_factor=float("nan")), "scaling_factor"),
    (dict(scaling_factor=True), "scaling_factor"),
    (dict(scaling_factor="2"), "scaling_factor"),
    (dict(weights_fp32=1), "weights_fp32"),
    (dict(jitter=None), "jitter"),
    (dict(add_shared=3), "add_shared"),
    (dict(fallback="native"), "fallback"),
])
def test_register_family_checks_every_argument(kwargs, arg):
    args = dict(model_type="my_moe", block_class="MyMoeBlock")
    args.update(kwargs)
    model_type = args.pop("model_type")
    with pytest.raises(ValueError, match=rf"register_family: {arg}="):
        hf.register_family(model_type, **args)
    assert "my_moe" not in hf.SUPPORTED


# ------------------------------------------------------------------------------ the package


def test_distributed_never_imports_the_integrations():
    """replay_ops.distributed provides the exchange; the HF package imports it, never the
    other way round (the deprecated `distributed/hf.py` alias looks its names up lazily,
    and importing the package does not load it)."""
    root = Path(replay_ops.__file__).parent
    for path in sorted((root / "distributed").glob("*.py")):
        if path.name == "hf.py":
            continue
        bad = {m for m in _imports(path) if m.startswith("replay_ops.integrations")}
        assert not bad, (path.name, bad)
    assert any(m.startswith("replay_ops.distributed")
               for m in _imports(root / "integrations" / "hf" / "ep.py"))
    code = ("import sys, replay_ops.distributed; "
            "print(sorted(m for m in sys.modules if 'integrations' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out


def test_one_patched_forward_for_one_device_and_expert_parallel():
    """Both paths install the same forward: block.patched_forward (no second copy)."""
    from replay_ops.integrations.hf import block

    src = {p.name: p.read_text() for p in
           (Path(replay_ops.__file__).parent / "integrations" / "hf").glob("*.py")}
    defs = {name for name, text in src.items() if "def patched_forward" in text
            or "def _ep_forward" in text or "def _patched_forward" in text}
    assert defs == {"block.py"}, defs
    assert hf.patch.patched_forward is block.patched_forward


# ------------------------------------------------------------------------------ deprecated


def _fresh_import(name):
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    if parent in sys.modules and hasattr(sys.modules[parent], child):
        delattr(sys.modules[parent], child)
    return importlib.import_module(name)


def test_old_hf_block_module_warns_and_aliases():
    from replay_ops.integrations.hf import block

    with pytest.warns(DeprecationWarning, match="replay_ops.integrations.hf.block"):
        old = _fresh_import("replay_ops.integrations.hf_block")
    for name in old.__all__:
        assert getattr(old, name) is getattr(block, name), name


def test_old_distributed_hf_module_warns_and_aliases():
    from replay_ops.integrations.hf import ep

    with pytest.warns(DeprecationWarning, match="replay_ops.integrations.hf.ep"):
        old = _fresh_import("replay_ops.distributed.hf")
    assert old.enable_expert_parallel is ep.enable_expert_parallel
    assert old.EPState is ep.EPState
    assert hf.enable_expert_parallel is ep.enable_expert_parallel
    with pytest.raises(AttributeError):
        old.no_such_name  # noqa: B018


def test_old_integrations_hf_names_still_import():
    # the package replaces the module: every public name the module had is still there
    for name in ("SUPPORTED", "ArchSpec", "BlockRouting", "MoELayout", "ReplayPatch",
                 "UnsupportedModelError", "moe_layout", "make_router_replay", "native_topk",
                 "patch_model", "route_block", "unpatch_model", "supported_architectures"):
        assert hasattr(hf, name), name


def test_moe_layout_names_warn_and_are_the_moe_blocks():
    import transformers  # noqa: F401
    from replay_ops.integrations.hf import patch as patch_mod
    from replay_ops.testing import tiny

    for mod in (hf, patch_mod):
        with pytest.warns(DeprecationWarning, match="use MoEBlocks"):
            assert mod.MoELayout is hf.MoEBlocks
        with pytest.warns(DeprecationWarning, match="use find_moe_blocks"):
            assert mod.moe_layout is hf.find_moe_blocks
    model = tiny.tiny_model("qwen3_moe", seed=5)
    with hf.patch_model(model, "R3") as p:
        assert isinstance(p.moe, hf.MoEBlocks) and p.moe.moe_layer_ids == p.moe_layer_ids
        with pytest.warns(DeprecationWarning, match="ReplayPatch.layout is deprecated; use "
                                                    "ReplayPatch.moe"):
            assert p.layout is p.moe


def test_native_topk_warns_and_is_own_topk():
    import transformers  # noqa: F401
    from replay_ops.testing import tiny

    model = tiny.tiny_model("deepseek_v3", seed=3)
    g = hf.find_moe_blocks(model).blocks[1].gate
    logits = torch.randn(30, 8, generator=torch.Generator().manual_seed(4))
    with pytest.warns(DeprecationWarning, match="own_topk"):
        old = hf.native_topk("deepseek_v3", g, logits)
    assert torch.equal(old, hf.own_topk("deepseek_v3", g, logits))


def test_block_routing_native_names_warn():
    t = [torch.full((2,), float(i)) for i in range(4)]
    r = hf.BlockRouting(t[0], t[0], t[1], t[2], t[3], None, False)
    with pytest.warns(DeprecationWarning, match="own_weights"):
        assert r.native_weights is r.own_weights
    with pytest.warns(DeprecationWarning, match="own_indices"):
        assert r.native_indices is r.own_indices
