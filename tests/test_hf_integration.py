"""Parity of the Hugging Face integration (replay_ops.integrations.hf) with unpatched models.

Every supported architecture is built as a tiny random-weight model (no download). The
oracle for a *forced* routing is `forced_reference`: the unpatched model, whose router
modules are made to return given indices, with gate weights written here from each
architecture's own router code. It never calls replay_ops.
"""
from __future__ import annotations

import copy
import types

import pytest
import torch

pytest.importorskip("transformers")

from replay_ops.integrations import hf  # noqa: E402
from replay_ops.testing import tiny  # noqa: E402
from replay_ops.router_replay import (  # noqa: E402
    ReplayAction,
    RouterReplay,
    RouterReplayConfig,
    RouterReplayError,
)

ARCHS = list(tiny.ARCHS)
SHAPES = [(2, 12), (1, 1), (3, 7)]  # (batch, seq): T = 24, 1 (one token), 21 (odd)
# dtype -> (rtol, atol) for logits of a 3-layer tiny model against the unpatched model.
TOL = {torch.float32: (1e-5, 1e-5)}


def make_model(arch, dtype=torch.float32, **kw):
    return tiny.tiny_model(arch, seed=1234, dtype=dtype, **kw)


def make_ids(B, S, seed=0, vocab=256):
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def gates_of(model):
    """{absolute layer id: router module} of the MoE blocks."""
    return {lid: blk.gate for lid, blk in hf.find_moe_blocks(model).blocks.items()}


def capture_routing(model, ids):
    """Logits and the routing [T, L_moe, K] the *unpatched* model picks, via router hooks."""
    seen, hooks = {}, []
    for lid, g in gates_of(model).items():
        hooks.append(g.register_forward_hook(lambda m, i, o, lid=lid: seen.__setitem__(lid, o[2])))
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, torch.stack([seen[lid] for lid in sorted(seen)], dim=1)


def forced_reference(model, arch, routing):
    """A deep copy of the unpatched `model` whose routers return `routing` [T, L_moe, K];
    weights follow each architecture's router code (transformers 5.x)."""
    ref = copy.deepcopy(model)
    for n, (lid, g) in enumerate(sorted(gates_of(ref).items())):
        orig = type(g).forward
        idx_l = routing[:, n, :].long()

        def fwd(self, hidden, orig=orig, idx=idx_l):
            logits = orig(self, hidden)[0]
            if arch == "deepseek_v3":
                w = logits.sigmoid().gather(1, idx)
                if self.norm_topk_prob:
                    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
                return logits, w * self.routed_scaling_factor, idx
            probs = torch.softmax(logits.float(), dim=-1)
            w = probs.gather(1, idx)
            if arch == "mixtral" or self.norm_topk_prob:
                w = w / w.sum(dim=-1, keepdim=True)
            if arch != "mixtral":
                w = w.to(logits.dtype)
            return logits, w, idx

        g.forward = types.MethodType(fwd, g)
    return ref


def random_routing(T, L, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T * L)]).view(T, L, K)


def grads(model):
    """Gradients of every router weight and expert weight, by parameter name."""
    out = {}
    for name, p in model.named_parameters():
        if any(s in name for s in ("gate.weight", "experts.", "shared_expert")):
            out[name] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
    return out


def assert_grads_close(out, ref, rtol=1e-4):
    assert out.keys() == ref.keys() and out
    for name in ref:
        scale = ref[name].abs().max().item() + 1e-12
        err = (out[name] - ref[name]).abs().max().item()
        assert err <= rtol * scale, f"{name}: max err {err:.3e} vs scale {scale:.3e}"


def loss_of(logits, ids):
    w = torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)
    return (logits * w).sum() + torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), ids.reshape(-1)
    )


# ------------------------------------------------------------------------------ layout


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_and_own_topk(arch):
    model = make_model(arch)
    lay = hf.find_moe_blocks(model)
    dense = {"qwen2_moe": [1], "deepseek_v3": [0]}.get(arch, [])
    assert lay.moe_layer_ids == [i for i in range(3) if i not in dense]
    assert (lay.num_experts, lay.top_k, lay.num_hidden_layers) == (8, 2, 3)
    want = {
        "mixtral": ("softmax", True, 1.0), "qwen2_moe": ("softmax", False, 1.0),
        "qwen3_moe": ("softmax", True, 1.0), "olmoe": ("softmax", False, 1.0),
        "deepseek_v3": ("sigmoid", True, 2.5),
    }[arch]
    assert (lay.score_func, lay.normalize, lay.scaling_factor) == want
    # The integration's own-routing selection equals the router module's, index for index.
    g = lay.blocks[lay.moe_layer_ids[0]].gate
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, _, idx = g(x)
    assert torch.equal(hf.own_topk(arch, g, logits), idx)


def test_unsupported_architecture_lists_supported():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = tf.LlamaForCausalLM(cfg)
    with pytest.raises(hf.UnsupportedModelError) as e:
        hf.patch_model(model, "R3")
    msg = str(e.value)
    assert "'llama'" in msg
    for arch in ARCHS:
        assert arch in msg
    with pytest.raises(hf.UnsupportedModelError, match="no config.model_type"):
        hf.patch_model(torch.nn.Linear(2, 2))


def test_patch_twice_and_mismatched_replay():
    model = make_model("qwen3_moe")
    patch = hf.patch_model(model, "R3")
    with pytest.raises(RuntimeError, match="already patched"):
        hf.patch_model(model, "R3")
    patch.remove()
    wrong = RouterReplay(RouterReplayConfig(mode="R3"), num_experts=16, top_k=2,
                         moe_layer_ids=[0, 1, 2], num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"num_experts.*\(16, 2"):
        hf.patch_model(model, wrong)
    assert getattr(model, "_replay_ops_patch", None) is None


def test_block_with_its_own_forward_is_refused_and_later_wrappers_are_kept():
    """A forward installed on the block instance (accelerate's device_map/offload hooks do
    this) would be bypassed by the patch and dropped by remove(): refused, naming the
    layer. A wrapper installed after patching wraps the patched forward and survives
    remove()."""
    model = make_model("qwen3_moe")
    lid, block = next(iter(hf.find_moe_blocks(model).blocks.items()))
    calls = []
    inner = block.forward

    def hooked(*a, **k):
        calls.append(1)
        return inner(*a, **k)

    block.forward = hooked
    with pytest.raises(hf.UnsupportedModelError, match=rf"layer {lid}'s MoE block already has a "
                                                       r"forward of its own instance"):
        hf.patch_model(model, "R3")
    del block.forward
    ids = make_ids(1, 5)
    patch = hf.patch_model(model, "R3")
    patched = block.forward
    block.forward = lambda *a, **k: (calls.append(1), patched(*a, **k))[1]
    with pytest.warns(UserWarning, match="wrapped after patching"):
        patch.remove()
    with torch.no_grad():
        model(ids)
    assert calls, "the later wrapper was dropped"
    del block.forward
    hf.patch_model(model, "R3").remove()  # patchable again once the wrapper is gone
    assert "forward" not in block.__dict__


def test_unsupported_expert_layout_is_an_error():
    model = make_model("qwen3_moe")
    experts = hf.find_moe_blocks(model).blocks[0].experts
    experts.is_transposed = True
    with pytest.raises(hf.UnsupportedModelError, match=r"model.layers.0.mlp.experts has "
                                                      r"is_transposed=True"):
        hf.patch_model(model, "R3")
    experts.is_transposed = False
    del experts.gate_up_proj  # e.g. transformers 4.x: one nn.Module per expert
    with pytest.raises(hf.UnsupportedModelError, match="no fused gate_up_proj tensor"):
        hf.patch_model(model, "R3")
    assert getattr(model, "_replay_ops_patch", None) is None


# ------------------------------------------------------------------------------ disabled


@pytest.mark.parametrize("arch", ARCHS)
def test_disabled_equals_unpatched(arch):
    model = make_model(arch)
    ids = make_ids(2, 12)
    with torch.no_grad():
        ref = model(ids).logits
    for mode in ("disabled", "R2"):  # R2 with no action set also takes the native path
        with hf.patch_model(model, mode) as patch:
            assert "forward" in hf.find_moe_blocks(model).blocks[patch.moe_layer_ids[0]].__dict__
            with torch.no_grad():
                out = model(ids).logits
        assert torch.equal(out, ref), mode
    # Undone: the blocks run their class forward again.
    assert all("forward" not in b.__dict__ for b in hf.find_moe_blocks(model).blocks.values())


# ------------------------------------------------------------------------------ record/replay


@pytest.mark.parametrize("B,S", SHAPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_record_then_replay_reproduces_unpatched(arch, B, S):
    model = make_model(arch)
    ids = make_ids(B, S, seed=B * 100 + S)
    ref, ref_routing = capture_routing(model, ids)
    rtol, atol = TOL[torch.float32]
    patch = hf.patch_model(model, "R2")
    rr = patch.replay
    rr.set_action(ReplayAction.RECORD)
    with torch.no_grad():
        out_rec = model(ids).logits
    rec = rr.recorded()
    assert rec.dtype == torch.int32 and rec.shape == (B * S, len(patch.moe_layer_ids), 2)
    assert torch.equal(rec, ref_routing.to(torch.int32))  # identical routing
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    with torch.no_grad():
        out_rep = model(ids).logits
        out_rep2 = model(ids).logits
    assert torch.equal(patch.last_routing(), ref_routing.to(torch.int32))
    torch.testing.assert_close(out_rec, ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(out_rep, ref, rtol=rtol, atol=atol)
    assert torch.equal(out_rep, out_rec)  # replaying the record is the record, bitwise
    assert torch.equal(out_rep2, out_rep)  # deterministic
    for lid in patch.moe_layer_ids:
        assert rr.calls(lid) == 3  # no layer bypassed the replay
    patch.remove()


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_replay_error_within_twice_native_error(arch):
    """bf16: the patched model's error against an fp32 oracle (same routing forced) is at
    most about 2x the unpatched bf16 model's own error (flash-attention rule)."""
    model16 = make_model(arch, dtype=torch.bfloat16)
    model32 = make_model(arch, dtype=torch.float32)
    ids = make_ids(2, 12, seed=7)
    ref16, routing16 = capture_routing(model16, ids)
    with torch.no_grad():
        oracle = forced_reference(model32, arch, routing16)(ids).logits
    with hf.patch_model(model16, "R3") as patch:
        patch.replay.set_routing(routing16)
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        with torch.no_grad():
            out16 = model16(ids).logits
        assert torch.equal(patch.last_routing(), routing16.to(torch.int32))
    err_native = (ref16.float() - oracle).abs().max().item()
    err_out = (out16.float() - oracle).abs().max().item()
    assert err_native > 0
    assert err_out <= 2 * err_native + 1e-6, (err_out, err_native)


# ------------------------------------------------------------------------------ forced routing


@pytest.mark.parametrize("arch", ARCHS)
def test_replaying_other_routing_matches_forced_reference(arch):
    model = make_model(arch)
    ids = make_ids(2, 12, seed=11)
    native, native_routing = capture_routing(model, ids)
    L = native_routing.shape[1]
    other = random_routing(24, L, 8, 2, seed=5)
    assert (other.sort(-1).values != native_routing.sort(-1).values).any()
    ref_model = forced_reference(model, arch, other)
    ref = ref_model(ids).logits
    loss_of(ref, ids).backward()
    ref_grads = grads(ref_model)

    with hf.patch_model(model, "R3") as patch:
        patch.replay.set_routing(other.to(torch.int16))  # int16, as verl stores it
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        out = model(ids).logits
        loss_of(out, ids).backward()
        assert torch.equal(patch.last_routing(), other.to(torch.int32))
        patch.replay.clear_queues()
    rtol, atol = TOL[torch.float32]
    torch.testing.assert_close(out.detach(), ref.detach(), rtol=rtol, atol=atol)
    # The routing matters: the forced outputs are far from the native ones.
    assert (out.detach() - native).abs().max().item() > 1e-3
    # Router gradients reach the replayed experts that live top-k would not pick.
    assert_grads_close(grads(model), ref_grads)


# ------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("arch", ARCHS)
def test_top1_replay_reproduces_unpatched(arch):
    """top_k = 1 with each architecture's default normalization: DeepSeek-V3 normalizes a
    single sigmoid weight (s / (s + 1e-20), then the scaling); the gate alone would not."""
    model = make_model(arch, top_k=1)
    ids = make_ids(2, 7, seed=5)
    ref, ref_routing = capture_routing(model, ids)
    rtol, atol = TOL[torch.float32]
    with hf.patch_model(model, "R2") as patch:
        patch.replay.set_action(ReplayAction.RECORD)
        with torch.no_grad():
            out_rec = model(ids).logits
        assert torch.equal(patch.replay.recorded(), ref_routing.to(torch.int32))
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        with torch.no_grad():
            out_rep = model(ids).logits
    torch.testing.assert_close(out_rec, ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(out_rep, ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_gradients_match_unpatched(arch):
    model = make_model(arch)
    ref_model = copy.deepcopy(model)
    ids = make_ids(2, 12, seed=21)
    ref = ref_model(ids).logits
    loss_of(ref, ids).backward()
    ref_grads = grads(ref_model)

    patch = hf.patch_model(model, "R2")
    patch.replay.set_action(ReplayAction.RECORD)
    with torch.no_grad():
        model(ids)
    patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
    out = model(ids).logits
    loss_of(out, ids).backward()
    patch.replay.clear_queues()
    patch.remove()
    router = [n for n in ref_grads if "gate.weight" in n and "shared" not in n]
    assert router and all(ref_grads[n].abs().max() > 0 for n in router)
    assert_grads_close(grads(model), ref_grads)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_gradient_checkpointing_replays_from_queue(arch):
    model = make_model(arch)
    ref_model = copy.deepcopy(model)
    ids = make_ids(2, 12, seed=31)
    ref_model.train()
    loss_of(ref_model(ids).logits, ids).backward()
    ref_grads = grads(ref_model)

    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with hf.patch_model(model, "R2") as patch:
        rr = patch.replay
        rr.set_action(ReplayAction.RECORD)
        with torch.no_grad():
            model(ids)
        rr.set_action(ReplayAction.REPLAY_FORWARD)
        loss = loss_of(model(ids).logits, ids)
        assert all(rr.queue_depth(lid) == 1 for lid in patch.moe_layer_ids)
        loss.backward()  # each recompute pops its layer's queue
        assert all(rr.queue_depth(lid) == 0 for lid in patch.moe_layer_ids)
    assert_grads_close(grads(model), ref_grads)


def _checkpointed(model):
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def test_gradient_checkpointing_ignores_a_forward_never_backpropagated():
    """A grad-enabled replayed forward whose graph is dropped without a backward (a skipped
    step, an evaluation forward without no_grad) leaves nothing for the next step's
    recompute: its queue entry dies with its graph. Before, the next recompute popped it
    and replayed the other batch's routing (a token permutation of the real one passes
    torch's checkpoint checks), so the gradients were silently wrong."""
    base = make_model("qwen3_moe")
    ids = make_ids(2, 12, seed=41)
    _, routing = capture_routing(base, ids)
    routing = routing.to(torch.int32)
    stale = routing.flip(0).contiguous()  # same per-expert row counts, other tokens

    def step(model, skipped_first):
        with hf.patch_model(_checkpointed(model), "R3") as patch:
            rr = patch.replay
            rr.set_action(ReplayAction.REPLAY_FORWARD)
            if skipped_first:
                rr.set_routing(stale)
                model(ids)  # grad enabled, never backpropagated; the output is dropped
                assert all(rr.queue_depth(lid) == 0 for lid in patch.moe_layer_ids)
            rr.set_routing(routing)
            loss_of(model(ids).logits, ids).backward()
            assert all(rr.queue_depth(lid) == 0 for lid in patch.moe_layer_ids)
        return grads(model)

    clean = step(copy.deepcopy(base), False)
    after_skip = step(copy.deepcopy(base), True)
    assert clean.keys() == after_skip.keys()
    for name in clean:
        assert torch.equal(after_skip[name], clean[name]), name


def test_gradient_checkpointing_record_records_once():
    model = make_model("mixtral")
    ref_model = copy.deepcopy(model)
    ids = make_ids(2, 12, seed=33)
    ref_model.train()
    loss_of(ref_model(ids).logits, ids).backward()
    _, ref_routing = capture_routing(ref_model.eval(), ids)
    ref_grads = grads(ref_model)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with hf.patch_model(model, "R2") as patch:
        patch.replay.set_action(ReplayAction.RECORD)
        loss_of(model(ids).logits, ids).backward()  # the recompute must not record again
        for lid in patch.moe_layer_ids:
            assert patch.replay.record_calls(lid) == 1
        assert torch.equal(patch.replay.recorded(), ref_routing.to(torch.int32))
    assert_grads_close(grads(model), ref_grads)


# ------------------------------------------------------------------------------ DeepSeek-V3


def test_deepseek_bias_and_groups_do_not_affect_replay():
    model = make_model("deepseek_v3")
    ids = make_ids(2, 12, seed=41)
    _, routing = capture_routing(model, ids)
    other = random_routing(24, routing.shape[1], 8, 2, seed=9)
    with hf.patch_model(model, "R3") as patch:
        patch.replay.set_routing(other)
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        with torch.no_grad():
            out_a = model(ids).logits
            for g in gates_of(model).values():
                g.e_score_correction_bias.copy_(torch.linspace(-3, 3, 8))
                g.topk_group = 1
            out_b = model(ids).logits
        assert torch.equal(out_a, out_b)
        assert torch.equal(patch.last_routing(), other.to(torch.int32))


def test_deepseek_fallback_rows_use_biased_group_limited_selection():
    model = make_model("deepseek_v3")
    with torch.no_grad():
        for g in gates_of(model).values():  # a bias strong enough to change the choice
            g.e_score_correction_bias.copy_(torch.tensor([0.0, 0, 0, 0, 0, 0, 0.6, 0.6]))
    ids = make_ids(2, 12, seed=43)
    first = gates_of(model)[min(gates_of(model))]
    seen = {}
    h = first.register_forward_hook(lambda m, i, o: seen.__setitem__("logits", o[0]))
    _, native_routing = capture_routing(model, ids)
    h.remove()
    # Rows where a plain top-k of the sigmoid scores (no bias, no groups) picks other experts.
    plain = torch.topk(seen["logits"].sigmoid(), 2, dim=-1).indices
    differs = (plain.sort(-1).values != native_routing[:, 0].sort(-1).values).any(-1)
    assert differs.sum() >= 2
    mask = ~differs
    other = random_routing(24, native_routing.shape[1], 8, 2, seed=13)
    patch = hf.patch_model(model, "R3")
    # the gate selects the rows without a route itself, with DeepSeek-V3's rule (bias,
    # groups): no top-k of every row runs in the block
    assert patch.replay.config.fallback == "gate"
    patch.replay.set_routing(other, mask)
    patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
    with torch.no_grad():
        model(ids)
    used = patch.last_routing()
    assert torch.equal(used[mask], other[mask].to(torch.int32))
    # The first MoE layer (layer 1, after a dense layer) sees the native hidden states, so
    # its fallback rows must hold the model's own biased, group-limited selection (the
    # gate lists it in descending selection value, the router unsorted: compare the sets).
    assert torch.equal(used[~mask, 0].sort(-1).values,
                       native_routing[~mask, 0].to(torch.int32).sort(-1).values)
    patch.remove()


# ------------------------------------------------------------------------------ mapping/errors


def test_absolute_layer_mapping_skips_dense_layer():
    """Qwen2-MoE with a dense layer 1: a [T, num_hidden_layers, K] routing is read by
    absolute layer id, a [T, L_moe, K] one by MoE ordinal; both replay the same."""
    model = make_model("qwen2_moe")
    ids = make_ids(2, 12, seed=51)
    moe = random_routing(24, 2, 8, 2, seed=17)
    absolute = torch.full((24, 3, 2), -1, dtype=torch.int64)
    absolute[:, 0], absolute[:, 2] = moe[:, 0], moe[:, 1]
    outs = []
    with hf.patch_model(model, "R3") as patch:
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        for routing, mapping in ((moe, "moe"), (absolute, "absolute")):
            patch.replay.set_routing(routing)
            assert patch.replay.layer_mapping == mapping
            with torch.no_grad():
                outs.append(model(ids).logits)
            assert torch.equal(patch.last_routing(), moe.to(torch.int32))
    assert torch.equal(outs[0], outs[1])


def test_routing_for_wrong_batch_is_an_error():
    model = make_model("olmoe")
    with hf.patch_model(model, "R3") as patch:
        patch.replay.set_routing(random_routing(10, 3, 8, 2, seed=1))
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        with pytest.raises(RouterReplayError, match=r"10 tokens but the logits have T=24"):
            model(make_ids(2, 12))


def test_replay_without_routing_is_an_error():
    model = make_model("mixtral")
    with hf.patch_model(model, "R3") as patch:
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        with pytest.raises(RouterReplayError, match="no routing is set"):
            model(make_ids(1, 4))


def test_router_logits_output_still_recorded():
    model = make_model("qwen3_moe")
    ids = make_ids(2, 6, seed=61)
    with torch.no_grad():
        ref = model(ids, output_router_logits=True)
    with hf.patch_model(model, "R2") as patch:
        patch.replay.set_action(ReplayAction.RECORD)
        with torch.no_grad():
            out = model(ids, output_router_logits=True)
    assert len(out.router_logits) == len(ref.router_logits) == 3
    for a, b in zip(out.router_logits, ref.router_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-5, atol=1e-6)
