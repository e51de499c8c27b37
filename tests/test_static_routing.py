"""Replay targets in static buffers (`RouterReplay.use_static_buffer`), the CUDA-graph path:

* `set_routing`, `load` and R2's recording copy into the preallocated int32
  [max_tokens, L, K] indices and bool [max_tokens] mask, so each layer reads the same
  addresses every step; the replayed forward equals the rebinding path bitwise;
* capture-safe: a replayed MoE block forward ("grouped_mm" experts) reads nothing from the
  device on the host and runs the same ops with the same shapes whatever the routing
  (rows with or without a route), seen by a dispatch mode on the CPU;
* on a GPU: one replayed MoE block forward captured in a CUDA graph, replayed with new
  routing copied into the buffers, equal to eager.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _helpers import HostSyncCounter, capture_cuda_graph

pytest.importorskip("transformers")

from replay_ops.integrations import hf  # noqa: E402
from replay_ops.router_replay import ReplayAction, RouterReplayConfig, RouterReplayError  # noqa: E402,E501
from replay_ops.testing import tiny  # noqa: E402

E, K, H = 8, 2, 32


def _model(arch="qwen3_moe", device="cpu", dtype=torch.float32, mode="R3"):
    m = tiny.tiny_model(arch, seed=5, num_layers=2, num_experts=E, top_k=K, hidden_size=H,
                        expert_size=16).to(device, dtype)
    fallback = "topk_fn" if arch == "deepseek_v3" else "gate"
    return m, hf.patch_model(m, RouterReplayConfig(mode=mode, fallback=fallback))


def _routing(T, L, seed, empty_rows=()):
    g = torch.Generator().manual_seed(seed)
    r = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T * L)]).view(T, L, K)
    r[list(empty_rows)] = -1
    return r


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_static_buffer_keeps_addresses_and_equals_rebinding(arch):
    T = 10
    ms, ps = _model(arch)
    mr, pr = _model(arch)
    ps.replay.use_static_buffer(16)
    assert ps.replay.static_capacity == 16 and pr.replay.static_capacity is None
    lid = ps.moe_layer_ids[-1]
    ptrs = set()
    for step, empty in enumerate([(), (2, 7), ()]):
        r = _routing(T, ps.replay.num_moe_layers, step, empty)
        ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(step))
        for p in (ps, pr):
            p.replay.set_routing(r.to(torch.int64 if p is pr else torch.int16))
            p.replay.set_action(ReplayAction.REPLAY_FORWARD)
        view = ps.replay.routing_for(lid)
        ptrs.add((view.data_ptr(), ps.replay.replay_mask.data_ptr()))
        assert torch.equal(view, r[:, -1].int())
        want_mask = torch.ones(T, dtype=torch.bool)
        want_mask[list(empty)] = False
        assert torch.equal(ps.replay.replay_mask, want_mask)
        with torch.no_grad():
            assert torch.equal(ms(ids).logits, mr(ids).logits), f"step {step}"
    assert len(ptrs) == 1, ptrs  # the same memory every step


def test_static_buffer_r2_recording_and_errors():
    m, p = _model(mode="R2")
    rr = p.replay
    rr.use_static_buffer(8)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    rr.set_action(ReplayAction.RECORD)
    with torch.no_grad():
        rec_out = m(ids).logits
    buf = rr._store.static[0]
    rr.set_action(ReplayAction.REPLAY_FORWARD)  # the recording goes into the buffer
    assert rr.routing_for(p.moe_layer_ids[0]).data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:6], rr.recorded())
    with torch.no_grad():
        assert torch.equal(m(ids).logits, rec_out)
    with pytest.raises(RouterReplayError, match=r"T=9 tokens but the static buffer holds "
                                                r"max_tokens=8"):
        rr.set_routing(_routing(9, rr.num_moe_layers, 0))
    with pytest.raises(ValueError, match="max_tokens must be > 0, got 0"):
        rr.use_static_buffer(0)


class _OpLog(TorchDispatchMode):
    """Every aten op with the shapes of its outputs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        self.ops.append((str(func), tuple(tuple(t.shape) for t in flat
                                          if isinstance(t, torch.Tensor))))
        return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_replayed_block_is_capture_safe(arch):
    """No host read, no nonzero/item, and the same ops with the same output shapes for a
    routing with every row routed and one with fallback rows: nothing depends on the
    routing's values but the values."""
    m, p = _model(arch)
    rr = p.replay
    rr.use_static_buffer(12)
    lid = p.moe_layer_ids[-1]
    block = p.moe.blocks[lid]
    x = torch.randn(1, 10, H, generator=torch.Generator().manual_seed(3))
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    logs = []
    for seed, empty in ((0, ()), (1, (0, 4, 9))):
        rr.set_routing(_routing(10, rr.num_moe_layers, seed, empty))
        with torch.no_grad(), HostSyncCounter() as c, _OpLog() as log:
            block(x)
        assert c.events == [], c.events
        names = {op for op, _ in log.ops}
        assert not any(n.split(".")[1] in ("nonzero", "item", "_local_scalar_dense",
                                           "masked_select", "unique")
                       for n in names if "." in n), names
        logs.append(log.ops)
    assert len(logs[0]) > 5 and logs[0] == logs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_captures_a_replayed_moe_block():
    """One replayed MoE block forward captured in a CUDA graph; each replay of the graph,
    after set_routing copied a new routing into the static buffers, equals the eager
    forward of the same routing (bitwise: the same kernels on the same inputs)."""
    dev = torch.device("cuda")
    # F.grouped_mm (transformers' "grouped_mm") runs bf16 on sm90+; elsewhere batched_mm,
    # which reads nothing on the host either.
    impl = "grouped_mm" if torch.cuda.get_device_capability(dev) >= (9, 0) else "batched_mm"
    m, p = _model("qwen3_moe", device=dev, dtype=torch.bfloat16)
    m.set_experts_implementation(impl)
    rr = p.replay
    T = 16
    rr.use_static_buffer(T, device=dev)
    lid = p.moe_layer_ids[-1]
    block = p.moe.blocks[lid]
    L = rr.num_moe_layers
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    static_x = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16)
    rr.set_routing(_routing(T, L, 0).to(dev))
    with torch.no_grad():
        graph, static_out = capture_cuda_graph(lambda: block(static_x), warmup=2)
        for step, empty in enumerate([(), (1, 5), ()], start=1):
            r = _routing(T, L, step, empty).to(dev)
            x = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16,
                            generator=torch.Generator(device=dev).manual_seed(step))
            rr.set_routing(r)  # copies into the captured buffers
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            eager = block(x)  # the same routing, not captured
            assert torch.equal(static_out, eager), f"step {step}"
            other = _routing(T, L, step + 50).to(dev)
            rr.set_routing(other)
            assert not torch.equal(block(x), eager)  # the routing is what changed it
