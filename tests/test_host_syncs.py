"""Host syncs: a Hugging Face MoE block patched by replay_ops with the "grouped_mm" experts
reads no device memory from the host in its forward or backward, whatever the action (the
routing's values are checked when it is set); the public calls sync as the table in docs/ops.md
says. Counted on the CPU with HostSyncCounter
(aten ops that read device memory, plus tolist/numpy/cpu), and on a GPU with
torch.cuda.set_sync_debug_mode."""
from __future__ import annotations

import warnings

import pytest
import torch

from _helpers import HostSyncCounter

pytest.importorskip("transformers")

from replay_ops.integrations import hf  # noqa: E402
from replay_ops.integrations.hf import block as hf_block  # noqa: E402
from replay_ops.router_replay import ReplayAction, RouterReplayConfig  # noqa: E402
from replay_ops.testing import tiny  # noqa: E402


def test_the_counter_counts():
    """The counter is not blind: it sees each kind of host read once."""
    x = torch.arange(6.0)
    for fn, n in ((lambda: x.sum().item(), 1), (lambda: x.nonzero(), 1), (lambda: x.tolist(), 1),
                  (lambda: bool(x[0] > 1), 1), (lambda: x[x > 2], 1), (lambda: x + 1, 0),
                  (lambda: x.cpu(), 1), (lambda: int(x[1]), 1)):
        with HostSyncCounter() as c:
            fn()
        assert c.count == n, (fn, c.events)


def _patched_block(arch, mode, fallback="gate"):
    model = tiny.tiny_model(arch, seed=3, num_layers=2, num_experts=8, top_k=2)
    lay = hf.find_moe_blocks(model)
    patch = hf.patch_model(model, RouterReplayConfig(mode=mode, fallback=fallback))
    lid = lay.moe_layer_ids[-1]
    return model, patch, lid, lay.blocks[lid]


def _routing(T, lay_shape, seed):
    g = torch.Generator().manual_seed(seed)
    E, K, L = lay_shape.num_experts, lay_shape.top_k, lay_shape.num_moe_layers
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T * L)]).view(T, L, K)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_no_host_sync_in_a_moe_block(arch):
    B, S = 2, 5
    T = B * S
    model, patch, lid, block = _patched_block(arch, "R3",
                                              "topk_fn" if arch == "deepseek_v3" else "gate")
    rr = patch.replay
    H = model.config.hidden_size
    hidden = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    routing = _routing(T, rr.shape, 2)
    mask = torch.ones(T, dtype=torch.bool)
    mask[[3, T - 1]] = False  # fallback rows: native top-k
    rr.set_routing(routing, mask)  # the values are checked here, once, not in the layers
    assert model.config._experts_implementation == "grouped_mm"
    counts = {}
    for action in (ReplayAction.REPLAY_FORWARD, ReplayAction.RECORD):
        rr.set_action(action)
        h = hidden.clone().requires_grad_(True)
        with HostSyncCounter() as c:
            out = block(h)
        counts[action.name] = c.events
        with HostSyncCounter() as c:
            out.sum().backward(retain_graph=True)
        counts[action.name + " backward"] = c.events
        if action is ReplayAction.REPLAY_FORWARD:
            # the recompute (REPLAY_BACKWARD) of the same block
            with HostSyncCounter() as c:
                rr.route(lid, block.gate(h.reshape(T, H))[0].float()
                         if hf.SUPPORTED[arch].weights_fp32 else block.gate(h.reshape(T, H))[0],
                         action=ReplayAction.REPLAY_BACKWARD)
            counts["REPLAY_BACKWARD (route only)"] = c.events
        out.sum().backward()
    assert all(v == [] for v in counts.values()), counts
    assert set(counts) == {"REPLAY_FORWARD", "REPLAY_FORWARD backward", "RECORD",
                           "RECORD backward", "REPLAY_BACKWARD (route only)"}


def test_set_routing_reads_once():
    """The routing is looked at once when it is set, without validate too (which rows have
    no route, to know whether the layers need a fallback selection)."""
    model, patch, lid, block = _patched_block("qwen3_moe", "R3")
    rr = patch.replay
    rr.config.validate = False
    routing = _routing(6, rr.shape, 0)
    with HostSyncCounter() as c:
        rr.set_routing(routing)
    assert c.count == 1, c.events
    assert rr.replay_mask is None  # every row has a route: no fallback in the layers
    routing[2] = -1
    rr.set_routing(routing)
    assert rr.replay_mask.tolist() == [True, True, False, True, True, True]


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_other_experts_implementations_sync_as_unpatched(implementation):
    """With another experts implementation the replayed block reads what that
    implementation reads for the same routing (eager: the experts hit; batched_mm:
    nothing), and nothing more."""
    model, patch, lid, block = _patched_block("qwen3_moe", "R3")
    model.set_experts_implementation(implementation)
    rr = patch.replay
    T, H = 10, model.config.hidden_size
    hidden = torch.randn(1, T, H, generator=torch.Generator().manual_seed(1))
    routing = _routing(T, rr.shape, 2)
    rr.set_routing(routing)
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    with HostSyncCounter() as c:
        block(hidden)
    fn = hf_block.experts_function(block.experts)
    idx = routing[:, rr.shape.moe_layer_ids.index(lid)].long()
    w = torch.full(idx.shape, 0.5)
    with HostSyncCounter() as n:
        fn(block.experts, hidden.reshape(T, H), idx, w)
    assert c.events == n.events
    if implementation == "batched_mm":
        assert c.events == []
    else:
        assert c.count > 0  # eager's own reads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_cuda_sync_in_a_moe_block():
    B, S = 2, 5
    T = B * S
    model, patch, lid, block = _patched_block("qwen3_moe", "R3")
    model.to("cuda", torch.bfloat16)  # grouped_mm's CUDA kernel is bf16
    rr = patch.replay
    routing = _routing(T, rr.shape, 2).cuda()
    rr.set_routing(routing)
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    hidden = torch.randn(B, S, model.config.hidden_size, device="cuda",
                         dtype=torch.bfloat16, requires_grad=True)
    block(hidden).sum().backward()  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            block(hidden).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(x.message) for x in w if "synchronizing" in str(x.message)]
    assert syncs == [], syncs
