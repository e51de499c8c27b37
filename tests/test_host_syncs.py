"""Host syncs: a Hugging Face MoE block patched by replay_ops reads device memory from the
host exactly once per forward (the plan's expert offsets), whatever the action; the
public calls sync as the README's table says. Counted on the CPU with HostSyncCounter
(aten ops that read device memory, plus tolist/numpy/cpu), and on a GPU with
torch.cuda.set_sync_debug_mode."""
from __future__ import annotations

import warnings

import pytest
import torch

import replay_ops
from _helpers import HostSyncCounter, make_indices, make_logits

pytest.importorskip("transformers")

from replay_ops.integrations import hf  # noqa: E402
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
    lay = hf.moe_layout(model)
    patch = hf.patch_model(model, RouterReplayConfig(mode=mode, fallback=fallback))
    lid = lay.moe_layer_ids[-1]
    return model, patch, lid, lay.blocks[lid]


def _routing(T, lay_shape, seed):
    g = torch.Generator().manual_seed(seed)
    E, K, L = lay_shape.num_experts, lay_shape.top_k, lay_shape.num_moe_layers
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T * L)]).view(T, L, K)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_one_host_sync_per_moe_block(arch):
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
    counts = {}
    for action in (ReplayAction.REPLAY_FORWARD, ReplayAction.RECORD):
        rr.set_action(action)
        h = hidden.clone().requires_grad_(True)
        with HostSyncCounter() as c:
            out = block(h)
        counts[action.name] = c.events
        if action is ReplayAction.REPLAY_FORWARD:
            # the recompute (REPLAY_BACKWARD) of the same block
            with HostSyncCounter() as c:
                rr.route(lid, block.gate(h.reshape(T, H))[0].float()
                         if hf.SUPPORTED[arch].weights_fp32 else block.gate(h.reshape(T, H))[0],
                         action=ReplayAction.REPLAY_BACKWARD)
            counts["REPLAY_BACKWARD (route only)"] = c.events
        out.sum().backward()
    assert counts["REPLAY_FORWARD"] == ["Tensor.tolist"], counts
    assert counts["RECORD"] == ["Tensor.tolist"], counts
    assert counts["REPLAY_BACKWARD (route only)"] == [], counts


def test_public_calls_sync_as_documented():
    """The README's table: gate with validate=False, permute with num_rows and unpermute
    with max_rows rows, and every backward op do not read device memory."""
    T, E, K, H = 9, 6, 2, 4
    logits = make_logits(T, E).requires_grad_(True)
    idx = make_indices(T, E, K, empty=0.2)
    mask = torch.ones(T, dtype=torch.bool)
    mask[2] = False
    hidden = torch.randn(T, H, requires_grad=True)
    with HostSyncCounter() as c:
        plan = replay_ops.gate(logits, idx, replay_mask=mask, validate=False)
        x = replay_ops.permute(hidden, plan, plan.max_rows, validate=False)
        y = replay_ops.unpermute(x * 2, plan)
        y.sum().backward()
    assert c.events == [], c.events
    with HostSyncCounter() as c:
        replay_ops.gate(logits, idx)  # validate=True: one read for the index checks
    assert c.count == 1, c.events
    with HostSyncCounter() as c:
        replay_ops.permute(hidden, plan)  # the rows used, expert_offsets[E]
    assert c.count == 1, c.events


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_cuda_sync_per_moe_block():
    B, S = 2, 5
    T = B * S
    model, patch, lid, block = _patched_block("qwen3_moe", "R3")
    model.cuda()
    rr = patch.replay
    routing = _routing(T, rr.shape, 2).cuda()
    rr.set_routing(routing)
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    hidden = torch.randn(B, S, model.config.hidden_size, device="cuda")
    block(hidden)  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            block(hidden)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(x.message) for x in w if "synchronizing" in str(x.message)]
    assert len(syncs) == 1, syncs
