"""A patched Hugging Face model inside transformers' and accelerate's own machinery.

* Hooks on the experts module run in every mode, because the experts run through the
  module's own call: accelerate's offload (`cpu_offload` after patching; `from_pretrained`
  with a `device_map` that offloads to disk, hooks installed before patching), an offload
  written with plain module hooks, a forward hook that changes the output, a pre-hook that
  changes the inputs or the routing arguments. Each replays bitwise like the same patched
  model without offload (the same arithmetic), and a changed output like the unpatched
  model with the same hook, forced to the same routing (`forced_reference`, no replay_ops).
* A patched model pickles (pickle, torch.save of the whole model, copy.deepcopy) and loads
  back patched, with the replay's config and a fresh replay state.
* Activation checkpointing, non-reentrant and reentrant (`use_reentrant=True`), replays the
  queued routing in the recompute: gradients bitwise those of the same replay without
  checkpointing.
* The auxiliary load-balancing loss counts the routing the tokens were sent to: checked
  against the Switch Transformer formula written here from the replayed indices.
"""
from __future__ import annotations

import copy
import gc
import io
import pickle

import pytest
import torch

pytest.importorskip("transformers")

from replay_ops.integrations import hf  # noqa: E402
from replay_ops.integrations.hf import aux_loss  # noqa: E402
from replay_ops.router_replay import ReplayAction, RouterReplayConfig  # noqa: E402
from replay_ops.testing import tiny  # noqa: E402
from test_hf_integration import (  # noqa: E402
    capture_routing,
    forced_reference,
    loss_of,
    make_ids,
    random_routing,
)

IMPLS = ["grouped_mm", "eager"]


def make_model(arch="qwen3_moe", impl="grouped_mm", **kw):
    kw.setdefault("num_layers", 2)
    model = tiny.tiny_model(arch, seed=2024, **kw)
    model.set_experts_implementation(impl)
    return model


def experts_of(model):
    return {lid: b.experts for lid, b in hf.find_moe_blocks(model).blocks.items()}


def replay_logits(model, patch, ids, routing, grad=False):
    patch.replay.set_routing(routing)
    patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
    with torch.set_grad_enabled(grad):
        return model(ids).logits


def other_routing(model, ids, seed=5):
    _, own = capture_routing(model, ids)
    T, L, K = own.shape
    routing = random_routing(T, L, 8, K, seed=seed)
    assert not torch.equal(routing.sort(-1).values, own.sort(-1).values)
    return routing


# ------------------------------------------------------------------------------ offload


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_accelerate_cpu_offload_after_patching_replays_exactly(arch, impl):
    accelerate = pytest.importorskip("accelerate")
    base = make_model(arch, impl)
    ids = make_ids(2, 7, seed=1)
    routing = other_routing(base, ids)
    with torch.no_grad():
        unpatched = base(ids).logits
    ref_model = copy.deepcopy(base)
    ref_patch = hf.patch_model(ref_model, "R3")
    want = replay_logits(ref_model, ref_patch, ids, routing)

    model = copy.deepcopy(base)
    patch = hf.patch_model(model, RouterReplayConfig(mode="R3",
                                                     fallback=hf.SUPPORTED[arch].fallback))
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    for experts in experts_of(model).values():  # offloaded: loaded only inside its call
        assert experts.gate_up_proj.device.type == "meta"
    got = replay_logits(model, patch, ids, routing)
    assert torch.equal(got, want)
    assert torch.equal(patch.last_routing(), routing.to(torch.int32))
    patch.replay.set_action(ReplayAction.RECORD)
    with torch.no_grad():
        recorded = model(ids).logits
    torch.testing.assert_close(recorded, unpatched, rtol=1e-5, atol=1e-5)
    patch.replay.set_action(None)  # no action: the block's own forward
    with torch.no_grad():
        assert torch.equal(model(ids).logits, unpatched)
    patch.remove()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, unpatched)


def test_from_pretrained_device_map_disk_offload_then_patch(tmp_path):
    """from_pretrained with a device_map that offloads a layer to disk installs accelerate's
    hooks on every module (MoE block and experts included) before the model can be
    patched: the patch goes inside them, and remove() puts the original forward back."""
    pytest.importorskip("accelerate")
    import transformers as tf

    base = make_model("qwen3_moe", "grouped_mm")
    ids = make_ids(2, 7, seed=2)
    routing = other_routing(base, ids)
    with torch.no_grad():
        unpatched = base(ids).logits
    ref_patch = hf.patch_model(base, "R3")
    want = replay_logits(base, ref_patch, ids, routing)
    ref_patch.remove()
    base.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "disk",
                  "model.layers.1": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}
    model = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload")
    model.set_experts_implementation("grouped_mm")
    block = hf.find_moe_blocks(model).blocks[0]
    assert "_hf_hook" in block.__dict__ and "_hf_hook" in block.experts.__dict__
    assert block.experts.gate_up_proj.device.type == "meta"
    patch = hf.patch_model(model, "R3")
    got = replay_logits(model, patch, ids, routing)
    assert torch.equal(got, want)
    patch.remove()
    for module in (block, block.experts):
        assert "_replay_ops_old_forward" not in module.__dict__
        assert module._old_forward.__func__ is type(module).forward
    with torch.no_grad():
        assert torch.equal(model(ids).logits, unpatched)


class HookOffload:
    """An offload written with plain module hooks: the experts' weights live in a CPU
    store; a forward pre-hook puts them in the module, a forward hook takes them out
    (meta tensors in between)."""

    def __init__(self, module):
        self.store = {n: p.detach().clone() for n, p in module.named_parameters(recurse=False)}
        self.loads = 0
        for n, p in self.store.items():
            module._parameters[n] = torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                       requires_grad=False)
        module.register_forward_pre_hook(self.load)
        module.register_forward_hook(self.offload)

    def load(self, module, args):
        self.loads += 1
        for n, p in self.store.items():
            module._parameters[n] = torch.nn.Parameter(p, requires_grad=False)

    def offload(self, module, args, output):
        for n, p in self.store.items():
            module._parameters[n] = torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                       requires_grad=False)


@pytest.mark.parametrize("impl", IMPLS)
def test_offload_with_module_hooks_replays_exactly(impl):
    base = make_model("mixtral", impl)
    ids = make_ids(2, 7, seed=3)
    routing = other_routing(base, ids)
    with torch.no_grad():
        unpatched = base(ids).logits
    ref = copy.deepcopy(base)
    want = replay_logits(ref, hf.patch_model(ref, "R3"), ids, routing)
    model = copy.deepcopy(base)
    patch = hf.patch_model(model, "R3")
    offloads = [HookOffload(e) for e in experts_of(model).values()]
    got = replay_logits(model, patch, ids, routing)
    assert torch.equal(got, want)
    assert [o.loads for o in offloads] == [1] * len(offloads)
    patch.replay.set_action(None)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, unpatched)
    assert [o.loads for o in offloads] == [2] * len(offloads)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_experts_hooks_run_in_every_mode(arch, impl):
    """A forward hook that changes the experts' output and a pre-hook that scales their
    input: the replayed model equals the unpatched model with the same hooks, forced to the
    same routing; in every mode each hook runs once per block call."""
    base = make_model(arch, impl)
    ids = make_ids(2, 7, seed=4)
    routing = other_routing(base, ids)
    calls = []

    def hook(module, args, output):
        calls.append("post")
        return output * 1.5 + 0.01

    def pre_hook(module, args):
        calls.append("pre")
        return (args[0] * 0.75,) + tuple(args[1:])

    def add_hooks(model):
        for e in experts_of(model).values():
            e.register_forward_hook(hook)
            e.register_forward_pre_hook(pre_hook)
        return model

    with torch.no_grad():
        plain = forced_reference(base, arch, routing)(ids).logits
        want = add_hooks(forced_reference(base, arch, routing))(ids).logits
        unpatched_hooked = add_hooks(copy.deepcopy(base))(ids).logits
    assert (want - plain).abs().max() > 1e-2  # the hooks matter
    n_moe = len(experts_of(base))
    model = add_hooks(copy.deepcopy(base))
    calls.clear()
    patch = hf.patch_model(model, RouterReplayConfig(mode="R2",
                                                     fallback=hf.SUPPORTED[arch].fallback))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, unpatched_hooked)  # no action
    patch.replay.set_action(ReplayAction.RECORD)
    with torch.no_grad():
        recorded = model(ids).logits
    torch.testing.assert_close(recorded, unpatched_hooked, rtol=1e-5, atol=1e-5)
    got = replay_logits(model, patch, ids, routing)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == ["pre", "post"] * (3 * n_moe)


@pytest.mark.parametrize("impl", IMPLS)
def test_pre_hook_that_changes_the_routing_arguments_is_obeyed(impl):
    """On the grouped_mm plan path the plan goes with the routing arguments; a pre-hook
    that replaces them makes the experts run what it gave, as unpatched."""
    arch = "olmoe"
    base = make_model(arch, impl)
    ids = make_ids(2, 7, seed=6)
    routing = other_routing(base, ids)

    def halve(module, args):
        return args[0], args[1], args[2] * 0.5

    with torch.no_grad():
        ref = forced_reference(base, arch, routing)
        for e in experts_of(ref).values():
            e.register_forward_pre_hook(halve)
        want = ref(ids).logits
    model = copy.deepcopy(base)
    patch = hf.patch_model(model, "R3")
    for e in experts_of(model).values():
        e.register_forward_pre_hook(halve)
    got = replay_logits(model, patch, ids, routing)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ pickling


def _round_trips(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    yield "torch.save", torch.load(buf, weights_only=False)
    yield "pickle", pickle.loads(pickle.dumps(model))
    yield "deepcopy", copy.deepcopy(model)


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_patched_model_pickles_and_loads_patched(arch):
    model = make_model(arch)
    ids = make_ids(2, 5, seed=7)
    routing = other_routing(model, ids)
    with torch.no_grad():
        unpatched = model(ids).logits
    config = RouterReplayConfig(mode="R3", fallback=hf.SUPPORTED[arch].fallback,
                                max_queue=7)
    patch = hf.patch_model(model, config, auto_recompute=False)
    want = replay_logits(model, patch, ids, routing)  # state that is not saved
    for how, loaded in _round_trips(model):
        lp = loaded._replay_ops_patch
        assert lp is not patch and lp.active and lp.model is loaded, how
        assert lp.replay is not patch.replay and lp.replay.config == config, how
        assert lp.replay.shape == patch.replay.shape and not lp.auto_recompute, how
        assert lp.replay.action is None and lp.replay.routing_source is None, how
        assert lp.moe.spec is hf.SUPPORTED[arch], how  # the family, by its name
        assert all(b._replay_ops_layer == (lp, lid) for lid, b in lp.moe.blocks.items())
        assert lp.moe.blocks == hf.find_moe_blocks(loaded).blocks, how
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, unpatched), how  # no action
        assert torch.equal(replay_logits(loaded, lp, ids, routing), want), how
        assert torch.equal(lp.last_routing(), routing.to(torch.int32)), how
        hf.unpatch_model(loaded)
        assert not hasattr(loaded, "_replay_ops_patch"), how
        for b in lp.moe.blocks.values():
            assert "forward" not in b.__dict__ and "forward" not in b.experts.__dict__, how
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, unpatched), how
    assert torch.equal(replay_logits(model, patch, ids, routing), want)  # untouched


def test_disabled_patch_pickles():
    model = make_model("mixtral")
    ids = make_ids(1, 6, seed=8)
    with torch.no_grad():
        want = model(ids).logits
    hf.patch_model(model)
    loaded = pickle.loads(pickle.dumps(model))
    assert not loaded._replay_ops_patch.replay.enabled
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)


def test_pickled_registered_family_is_found_by_name():
    """A family pickles by its model type: loading it where it is not registered names it."""
    model = make_model("qwen3_moe")
    hf.patch_model(model, "R3")
    data = pickle.dumps(model)
    spec = hf.SUPPORTED.pop("qwen3_moe")
    try:
        with pytest.raises(hf.UnsupportedModelError, match="model_type='qwen3_moe'"):
            pickle.loads(data)
    finally:
        hf.SUPPORTED["qwen3_moe"] = spec
    assert pickle.loads(data)._replay_ops_patch.moe.spec is spec


# ------------------------------------------------------------------------------ checkpointing


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _replayed_step(model, ids, routing, checkpoint):
    if checkpoint is not None:
        model.activation_checkpointing_enable({"use_reentrant": checkpoint == "reentrant"})
    model.train()
    with hf.patch_model(model, "R3") as patch:
        rr = patch.replay
        rr.set_routing(routing)
        rr.set_action(ReplayAction.REPLAY_FORWARD)
        logits = model(ids).logits
        depth = [rr.queue_depth(lid) for lid in patch.moe_layer_ids]
        loss_of(logits, ids).backward()
        if checkpoint is not None:  # every recompute popped its entry
            assert all(rr.queue_depth(lid) == 0 for lid in patch.moe_layer_ids)
    return logits.detach(), _grads(model), depth


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_checkpointing_reentrant_and_not_replays_the_queue(arch):
    base = make_model(arch)
    ids = make_ids(2, 7, seed=9)
    routing = other_routing(base, ids)
    want, want_grads, _ = _replayed_step(copy.deepcopy(base), ids, routing, None)
    for kind in ("non-reentrant", "reentrant"):
        got, got_grads, depth = _replayed_step(copy.deepcopy(base), ids, routing, kind)
        assert depth == [1] * len(depth), kind  # one forward queued per layer
        assert torch.equal(got, want), kind
        assert got_grads.keys() == want_grads.keys(), kind
        for n in want_grads:
            assert torch.equal(got_grads[n], want_grads[n]), (kind, n)


def test_reentrant_forward_without_backward_leaves_nothing_queued():
    """A reentrant checkpoint's entry lives as long as its node: dropping the output, or a
    forward whose inputs need no grad, leaves an empty queue; a later step replays its own
    routing."""
    base = make_model("qwen3_moe")
    ids = make_ids(2, 7, seed=10)
    routing = other_routing(base, ids)
    _, want_grads, _ = _replayed_step(copy.deepcopy(base), ids, routing, None)
    model = copy.deepcopy(base)
    model.activation_checkpointing_enable({"use_reentrant": True})
    model.train()
    with hf.patch_model(model, "R3") as patch:
        rr = patch.replay
        rr.set_routing(routing.flip(0).contiguous())  # another batch's routing
        rr.set_action(ReplayAction.REPLAY_FORWARD)
        out = model(ids).logits
        assert all(rr.queue_depth(lid) == 1 for lid in patch.moe_layer_ids)
        del out  # a skipped step
        assert all(rr.queue_depth(lid) == 0 for lid in patch.moe_layer_ids)
        lid = patch.moe_layer_ids[0]
        block = patch.moe.blocks[lid]
        h = torch.randn(2, 7, model.config.hidden_size)  # needs no grad: never recomputed
        with pytest.warns(UserWarning, match="requires_grad"):
            torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
        assert rr.queue_depth(lid) == 0
        with torch.no_grad():  # forward-only: no checkpoint, nothing queued
            model(ids)
        assert all(rr.queue_depth(lid) == 0 for lid in patch.moe_layer_ids)
        model.zero_grad(set_to_none=True)
        rr.set_routing(routing)
        loss_of(model(ids).logits, ids).backward()
    got = _grads(model)
    for n in want_grads:
        assert torch.equal(got[n], want_grads[n]), n


def test_reentrant_record_records_once():
    base = make_model("mixtral")
    ids = make_ids(2, 7, seed=11)
    _, own = capture_routing(base, ids)
    model = copy.deepcopy(base)
    model.activation_checkpointing_enable({"use_reentrant": True})
    model.train()
    with hf.patch_model(model, "R2") as patch:
        patch.replay.set_action(ReplayAction.RECORD)
        loss_of(model(ids).logits, ids).backward()
        assert all(patch.replay.record_calls(lid) == 1 for lid in patch.moe_layer_ids)
        assert torch.equal(patch.replay.recorded(), own.to(torch.int32))


# ------------------------------------------------------------------------------ aux loss


def switch_loss(router_logits, routing, num_experts, attention_mask=None):
    """Switch Transformer's load-balancing loss over all MoE layers, from the replayed
    routing: E * sum_e f_e * P_e, f_e the share of top-k slots sent to e (one-hot of the
    replayed indices, all layers' rows concatenated), P_e the mean softmax probability;
    rows weighted by the attention mask."""
    logits = torch.cat(router_logits, dim=0).double()
    idx = torch.cat([routing[:, n] for n in range(routing.shape[1])], dim=0).long()
    one_hot = torch.nn.functional.one_hot(idx, num_experts).double()  # [N, K, E]
    probs = torch.softmax(logits, dim=-1)
    w = torch.ones(logits.shape[0], dtype=torch.float64)
    if attention_mask is not None:
        w = attention_mask.reshape(-1).double().repeat(routing.shape[1])
    f = (one_hot * w[:, None, None]).sum(dim=(0, 1)) / w.sum()
    p = (probs * w[:, None]).sum(dim=0) / w.sum()
    return num_experts * (f * p).sum()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_aux_loss_counts_the_replayed_routing(arch):
    model = make_model(arch)
    model.router_aux_loss_coef = 0.5
    ids = make_ids(2, 7, seed=12)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    routing = other_routing(model, ids)
    E = hf.find_moe_blocks(model).num_experts
    with torch.no_grad():
        ref = model(ids, output_router_logits=True, labels=ids)
        ref_masked = model(ids, attention_mask=mask, output_router_logits=True)
    with hf.patch_model(model, "R2") as patch:
        patch.replay.set_action(ReplayAction.RECORD)  # the model's own routing, counted
        with torch.no_grad():
            rec = model(ids, output_router_logits=True, labels=ids)
        assert torch.equal(rec.aux_loss, ref.aux_loss)
        patch.replay.set_routing(routing)
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        out = model(ids, output_router_logits=True, labels=ids)
        patch.replay.clear_queues()
        with torch.no_grad():
            masked = model(ids, attention_mask=mask, output_router_logits=True)
    want = switch_loss(out.router_logits, routing, E)
    torch.testing.assert_close(out.aux_loss.double(), want, rtol=1e-6, atol=0)
    assert (out.aux_loss - ref.aux_loss).abs() > 1e-3  # not the router's own choice
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]),
                                           ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ce + 0.5 * out.aux_loss, rtol=1e-6, atol=1e-6)
    want_masked = switch_loss(masked.router_logits, routing, E, mask)
    torch.testing.assert_close(masked.aux_loss.double(), want_masked, rtol=1e-6, atol=0)
    assert (masked.aux_loss - ref_masked.aux_loss).abs() > 1e-3
    # the router gets the loss's gradient through the probabilities
    g = torch.autograd.grad(out.aux_loss, out.router_logits[0])[0]
    assert g.abs().max() > 0


def test_aux_loss_fallback_rows_and_empty_slots():
    """Rows without a route count the model's own choice (what they were sent to); an
    empty slot (-1) counts for no expert."""
    arch = "qwen3_moe"
    model = make_model(arch)
    ids = make_ids(2, 5, seed=13)
    _, own = capture_routing(model, ids)
    routing = other_routing(model, ids)
    replay = torch.ones(10, dtype=torch.bool)
    replay[[0, 7]] = False
    used = torch.where(replay[:, None, None], routing, own)
    with hf.patch_model(model, "R3") as patch:
        patch.replay.set_routing(routing, replay)
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        with torch.no_grad():
            out = model(ids, output_router_logits=True)
        assert torch.equal(patch.last_routing(), used.to(torch.int32))
    want = switch_loss(out.router_logits, used, 8)
    torch.testing.assert_close(out.aux_loss.double(), want, rtol=1e-6, atol=0)
    # an empty slot, counted directly: the same logits, one slot of a row emptied
    logits = [lg.detach() for lg in out.router_logits]
    idx = used[:, 0].clone().to(torch.int32)
    aux_loss.mark_routed(logits[0], idx)
    full = aux_loss.load_balancing_loss(logits[:1], 8, 2)
    idx2 = idx.clone()
    idx2[3, 1] = -1
    aux_loss.mark_routed(logits[0], idx2)
    emptied = aux_loss.load_balancing_loss(logits[:1], 8, 2)
    probs = torch.softmax(logits[0], dim=-1).mean(0)
    torch.testing.assert_close(full - emptied, 8 * probs[idx[3, 1]] / 10, rtol=1e-5, atol=0)


def test_aux_loss_of_an_unpatched_model_is_transformers_own():
    """The wrapper is installed while a model of the architecture is patched (counted:
    removed patches, and collected ones, release it) and changes nothing for a model that
    is not patched."""
    import transformers.models.qwen3_moe.modeling_qwen3_moe as modeling

    gc.collect()  # patches other tests left unremoved
    fn = modeling.load_balancing_loss_func
    original = getattr(fn, "_replay_ops_original", fn)
    held = aux_loss._INSTALLED.get(modeling.__name__, [None, None, 0])[2]
    count = lambda: aux_loss._INSTALLED.get(modeling.__name__, [None, None, 0])[2]  # noqa
    other = make_model("qwen3_moe")
    ids = make_ids(2, 5, seed=14)
    with torch.no_grad():
        want = other(ids, output_router_logits=True).aux_loss
    a, b = make_model("qwen3_moe"), make_model("qwen3_moe")
    pa, pb = hf.patch_model(a, "R3"), hf.patch_model(b, "R3")
    assert modeling.load_balancing_loss_func is not original and count() == held + 2
    pa.remove()
    pa.remove()  # once only
    assert modeling.load_balancing_loss_func is not original and count() == held + 1
    with torch.no_grad():
        assert torch.equal(other(ids, output_router_logits=True).aux_loss, want)
    del b, pb  # collected without remove()
    gc.collect()
    assert count() == held
    if held == 0:
        assert modeling.load_balancing_loss_func is original


def test_aux_loss_under_torch_compile_counts_the_replayed_routing():
    """The marked indices travel through a compiled forward (fullgraph; Dynamo only, the
    marking is Python state of the trace)."""
    model = make_model("qwen3_moe")
    ids = make_ids(2, 5, seed=15)
    routing = other_routing(model, ids)
    with hf.patch_model(model, "R3") as patch:
        patch.replay.set_routing(routing)
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        with torch.no_grad():
            want = model(ids, output_router_logits=True)
            torch._dynamo.reset()
            got = torch.compile(model, fullgraph=True, backend="eager")(
                ids, output_router_logits=True)
        torch._dynamo.reset()
    assert torch.equal(got.aux_loss, want.aux_loss)
    torch.testing.assert_close(want.aux_loss.double(),
                               switch_loss(want.router_logits, routing, 8), rtol=1e-6, atol=0)
