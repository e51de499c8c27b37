"""One checked hand-off: a `ReplayBatch` checked once against a `ModelShape` reaches the
gate without another scan or mapping decision; the mark cannot outlive a change of the
data; a batch checked for another model is refused.

The scan of routing values is `_validate.first_bad_route`, the mapping decision
`shape.resolve_mapping`; `counting` wraps every binding of them in the package and counts
the calls and the values scanned along a path."""
from __future__ import annotations

import contextlib
import dataclasses
import pickle
import sys

import numpy as np
import pytest
import torch

import replay_ops
from replay_ops import _validate
from replay_ops.router_replay import (
    ModelShape,
    ReplayAction,
    ReplayBatch,
    RouterReplay,
    RouterReplayConfig,
    RouterReplayError,
    files,
)
from replay_ops.router_replay import shape as shape_mod
from replay_ops.router_replay.adapters import (
    RoutingMismatchError,
    encode_sglang,
    encode_vllm,
    sglang_batch,
    vllm_batch,
)

E, K = 8, 2
MOE_IDS = (1, 2, 4)
SHAPE = ModelShape(E, K, MOE_IDS, 5)
PROMPTS, RESPONSES = [3, 2], [2, 3]


def rows(n: int, L: int, seed: int) -> np.ndarray:
    """[n, L, K] distinct experts per (token, layer); an absolute payload's dense columns 0,
    as vLLM writes them."""
    rng = np.random.default_rng(seed)
    out = np.stack([rng.permutation(E)[:K] for _ in range(n * L)]).reshape(n, L, K)
    if L == SHAPE.num_hidden_layers:
        out[:, [i for i in range(L) if i not in MOE_IDS]] = 0
    return out.astype(np.uint8)


@contextlib.contextmanager
def counting():
    """Counts of the value scan (calls, and values scanned: tokens x layers x slots) and of
    the layer-mapping decision, across every module of the package that binds them."""
    counts = {"scans": 0, "scanned": 0, "mappings": 0}
    orig_scan, orig_map = _validate.first_bad_route, shape_mod.resolve_mapping

    def scan(routing, *a, **k):
        counts["scans"] += 1
        counts["scanned"] += routing.numel()
        return orig_scan(routing, *a, **k)

    def decide(*a, **k):
        counts["mappings"] += 1
        return orig_map(*a, **k)

    patched = []
    for mod in list(sys.modules.values()):
        if not getattr(mod, "__name__", "").startswith("replay_ops"):
            continue
        for name, orig, new in (("first_bad_route", orig_scan, scan),
                                ("resolve_mapping", orig_map, decide)):
            if getattr(mod, name, None) is orig:
                setattr(mod, name, new)
                patched.append((mod, name, orig))
    try:
        yield counts
    finally:
        for mod, name, orig in patched:
            setattr(mod, name, orig)


def own_topk(x):
    return torch.topk(x, K).indices


def replay_every_layer(rr: RouterReplay, T: int) -> dict:
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(1))
    return {lid: rr.route(lid, logits, topk_fn=own_topk) for lid in MOE_IDS}, logits


# ------------------------------------------------------------------ the path, counted
@pytest.mark.parametrize("L", [5, 3], ids=["absolute", "moe"])
@pytest.mark.parametrize("form", ["array", "server base64"])
def test_vllm_payload_reaches_the_gate_with_one_scan_and_one_mapping_decision(L, form):
    """vLLM payload -> ReplayBatch -> RouterReplay.set_routing -> route -> gate: each value
    scanned once, the mapping decided once per payload, nothing again after the adapter
    (measured on the previous code with the same counts: every value scanned twice, the
    mapping decided twice per payload and once more by set_routing)."""
    payloads = [rows(p + g - 1, L, seed=i) for i, (p, g) in enumerate(zip(PROMPTS, RESPONSES))]
    sent = payloads if form == "array" else [encode_vllm(a) for a in payloads]
    rr = RouterReplay(RouterReplayConfig(mode="R3"), shape=SHAPE)
    with counting() as c:
        batch = vllm_batch(sent, PROMPTS, RESPONSES, SHAPE, packing="thd")
        after_adapter = dict(c)
        rr.set_routing(batch)
        plans, logits = replay_every_layer(rr, batch.num_tokens)
    n_values = sum(a.shape[0] for a in payloads) * len(MOE_IDS) * K
    assert after_adapter == {"scans": 2, "scanned": n_values, "mappings": 2}
    assert c == after_adapter  # set_routing and the layers add nothing
    assert batch.checked_for(SHAPE) and batch.layer_ids == list(MOE_IDS)
    # and the gate replays the payload, the final token of each request with its own top-k
    cu = batch.cu_seqlens.tolist()
    for j, lid in enumerate(MOE_IDS):
        got = plans[lid].expert_indices
        for i, a in enumerate(payloads):
            col = lid if L == 5 else j
            assert torch.equal(got[cu[i]:cu[i + 1] - 1].long(), torch.from_numpy(a[:, col]).long())
            assert torch.equal(got[cu[i + 1] - 1].long(), own_topk(logits[cu[i + 1] - 1]).long())


def test_sglang_payload_reaches_the_gate_with_one_scan():
    lens = [p + g for p, g in zip(PROMPTS, RESPONSES)]
    metas = [{"routed_experts": encode_sglang(rows(n - 1, 5, seed=i).astype(np.int32))}
             for i, n in enumerate(lens)]
    rr = RouterReplay(RouterReplayConfig(mode="R3"), shape=SHAPE)
    with counting() as c:
        batch = sglang_batch(metas, lens, PROMPTS, SHAPE)  # padded [B, S]
        rr.set_routing(batch)
        replay_every_layer(rr, batch.num_tokens)
    assert c == {"scans": 2, "scanned": sum(n - 1 for n in lens) * 3 * K, "mappings": 2}


def test_record_file_reaches_the_gate_with_one_scan(tmp_path):
    """RouterReplay.load: the file's shape compared, its values scanned once (by
    set_routing, naming the file), the mapping decided once."""
    p = tmp_path / "r.safetensors"
    idx = torch.from_numpy(rows(9, 5, seed=3).astype(np.int16))
    idx[:, [0, 3]] = -1
    files.write_routing(p, idx, files.RecordMeta(shape=SHAPE, layer_index="absolute"),
                        cu_seqlens=[0, 4, 9])
    rr = RouterReplay(RouterReplayConfig(mode="R2"), shape=SHAPE)
    with counting() as c:
        rr.load(p)
        replay_every_layer(rr, 9)
    assert c == {"scans": 1, "scanned": 9 * 3 * K, "mappings": 1}
    # the file as a batch: checked once, against the model's shape
    rf = files.open_routing(p)
    with counting() as c:
        batch = rf.batch(SHAPE)
        rr.set_routing(batch)
    assert c == {"scans": 1, "scanned": 9 * 3 * K, "mappings": 1}
    assert batch.layer_index == "absolute" and batch.cu_seqlens.tolist() == [0, 4, 9]
    assert rr.layer_mapping == "absolute"


def test_an_unchecked_batch_or_a_tensor_is_checked_as_before():
    a = torch.from_numpy(rows(6, 3, seed=4).astype(np.int16))
    rr = RouterReplay(RouterReplayConfig(mode="R3"), shape=SHAPE)
    for given in (ReplayBatch(a, torch.ones(6, dtype=torch.bool)), a):
        with counting() as c:
            rr.set_routing(given)
        assert c == {"scans": 1, "scanned": a.numel(), "mappings": 1}
    bad = a.clone()
    bad[2, 1] = torch.tensor([5, 5])
    with pytest.raises(RouterReplayError, match=r"token 2, MoE layer 2 repeats an expert"):
        rr.set_routing(ReplayBatch(bad, torch.ones(6, dtype=torch.bool)))
    with pytest.raises(ValueError, match="a ReplayBatch carries its own replay_mask"):
        rr.set_routing(ReplayBatch(a, torch.ones(6, dtype=torch.bool)), torch.ones(6).bool())


# ------------------------------------------------------------------ the mark
def checked_batch(seed=5) -> ReplayBatch:
    payloads = [rows(p + g - 1, 5, seed=seed + i) for i, (p, g) in
                enumerate(zip(PROMPTS, RESPONSES))]
    return vllm_batch(payloads, PROMPTS, RESPONSES, SHAPE, packing="thd")


def test_check_scans_once_then_returns_the_batch_as_is():
    b = ReplayBatch(torch.from_numpy(rows(6, 3, seed=6).astype(np.int16)),
                    torch.ones(6, dtype=torch.bool))
    assert b.checked_shape is None and b.layer_ids is None
    with counting() as c:
        same = b.check(SHAPE)
        again = b.check(SHAPE)
    assert same is b and again is b and c["scans"] == 1
    assert b.checked_for(SHAPE) and not b.checked_for(ModelShape(E, K, (0, 1, 2), 5))
    # "auto" is resolved, unsigned indices are widened: a checked copy
    u = ReplayBatch(b.indices.to(torch.uint8), b.replay_mask, layer_index="auto").check(SHAPE)
    assert u.indices.dtype == torch.int16 and u.layer_index == "moe" and u.checked_for(SHAPE)


@pytest.mark.parametrize("how", ["in place", "through a view", "the mask", "replace",
                                 "pickle", "rebound"])
def test_the_mark_does_not_survive_a_change(how):
    b = checked_batch()
    assert b.checked_for(SHAPE)
    if how == "in place":
        b.indices[0, 0, 0] = 7
    elif how == "through a view":
        b.indices[1:3].fill_(-1)
    elif how == "the mask":
        b.replay_mask[-1] = True  # the final token, which has no route
    elif how == "replace":
        b = dataclasses.replace(b, indices=b.indices.clone())
    elif how == "pickle":
        b = pickle.loads(pickle.dumps(b))
    elif how == "rebound":
        with pytest.raises(dataclasses.FrozenInstanceError):
            b.indices = b.indices.clone()
        object.__setattr__(b, "indices", b.indices.clone())  # on purpose: still not checked
    assert b.checked_shape is None and not b.checked_for(SHAPE)


def test_a_write_after_the_check_is_checked_again_at_the_sink():
    b = checked_batch()
    b.replay_mask[-1] = True  # the final token has no route in any layer
    rr = RouterReplay(RouterReplayConfig(mode="R3"), shape=SHAPE)
    with pytest.raises(RouterReplayError, match=r"token 9 is marked for replay .* no route"):
        rr.set_routing(b)


def test_a_batch_checked_for_another_model_is_refused():
    other = ModelShape(E, K, (0, 1, 2), 5)  # as many MoE layers, other layers
    b = ReplayBatch(torch.from_numpy(rows(6, 3, seed=7).astype(np.int16)),
                    torch.ones(6, dtype=torch.bool)).check(other)
    rr = RouterReplay(RouterReplayConfig(mode="R3"), shape=SHAPE)
    with pytest.raises(RouterReplayError, match=r"checked against another model shape: "
                                                r"moe_layer_ids: batch \[0, 1, 2\], model "
                                                r"\[1, 2, 4\]"):
        rr.set_routing(b)


def test_check_refuses_what_set_routing_refuses():
    a = torch.from_numpy(rows(5, 3, seed=8).astype(np.int16))
    m = torch.ones(5, dtype=torch.bool)
    cases = [
        (lambda: a.clone().index_fill_(0, torch.tensor([3]), E), r"token 3, MoE layer 1 .*"
                                                                 r"routes to expert 8"),
        (lambda: torch.cat([a, a], dim=1), r"layer_index=.moe. needs L=3 .*got L=6"),
        (lambda: a[:, :, :1], r"K=1 slots per token but the model has top_k=2"),
    ]
    for make, msg in cases:
        with pytest.raises(RoutingMismatchError, match=msg):
            ReplayBatch(make(), m).check(SHAPE)
    holey = a.clone()
    holey[2, 1] = -1
    with pytest.raises(RoutingMismatchError, match=r"token 2 is marked for replay .* MoE "
                                                   r"layers \[2\]"):
        ReplayBatch(holey, m).check(SHAPE)
    m[2] = False  # not replayed: not read
    assert ReplayBatch(holey, m).check(SHAPE).checked_for(SHAPE)


def test_sources_give_checked_batches(tmp_path):
    b = checked_batch()
    back = ReplayBatch.from_bytes(b.to_bytes(num_experts=E), shape=SHAPE)
    assert back.checked_for(SHAPE) and torch.equal(back.indices, b.indices)
    assert ReplayBatch.from_bytes(b.to_bytes(num_experts=E)).checked_shape is None
    rr = RouterReplay(RouterReplayConfig(mode="R2"), shape=SHAPE)
    rr.set_action(ReplayAction.RECORD)
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(2))
    for lid in MOE_IDS:
        rr.route(lid, logits, topk_fn=own_topk)
    rec = rr.recorded_batch(cu_seqlens=[0, 2, 6])
    assert rec.checked_for(SHAPE) and rec.indices.dtype == torch.int16
    assert torch.equal(rec.indices, rr.recorded().to(torch.int16))
    assert rec.cu_seqlens.tolist() == [0, 2, 6] and bool(rec.replay_mask.all())
    with counting() as c:
        rr.set_routing(rec)
    assert c["scans"] == 0 and c["mappings"] == 0


def test_record_file_batch_refuses_another_model_and_names_the_layers(tmp_path):
    p = tmp_path / "other.safetensors"
    other = ModelShape(E, K, (0, 1, 2), 5)
    files.write_routing(p, torch.from_numpy(rows(4, 3, seed=9).astype(np.int16)),
                        files.RecordMeta(shape=other), cu_seqlens=[0, 4])
    rf = files.open_routing(p)
    with pytest.raises(files.RoutingShapeError, match=r"moe_layer_ids: file \[0, 1, 2\], model "
                                                      r"\[1, 2, 4\]"):
        rf.batch(SHAPE)
    b = rf.batch()  # the file's own shape: refused by a sink of another shape
    assert b.checked_for(other)
    rr = RouterReplay(RouterReplayConfig(mode="R3"), shape=SHAPE)
    with pytest.raises(RouterReplayError, match=r"moe_layer_ids: batch \[0, 1, 2\], model"):
        rr.set_routing(b)


def test_gate_output_equals_the_tensor_path():
    """Replaying a checked batch gives the same plans as replaying its tensors."""
    b = checked_batch(seed=11)
    a = RouterReplay(RouterReplayConfig(mode="R3"), shape=SHAPE)
    t = RouterReplay(RouterReplayConfig(mode="R3"), shape=SHAPE)
    a.set_routing(b)
    t.set_routing(b.indices.clone(), b.replay_mask.clone(), layer_index="moe")
    pa, _ = replay_every_layer(a, b.num_tokens)
    pt, _ = replay_every_layer(t, b.num_tokens)
    for lid in MOE_IDS:
        assert torch.equal(pa[lid].expert_indices, pt[lid].expert_indices)
        assert torch.equal(pa[lid].weights, pt[lid].weights)
    assert replay_ops.router_replay.ReplayBatch is ReplayBatch


def test_sources_refuse_a_row_to_replay_without_a_route_in_some_layer(tmp_path):
    """verl's padded routing and a record file: a token to replay with no route in one MoE
    layer is refused where the batch is made (it could not be marked checked)."""
    from replay_ops.router_replay.adapters import from_verl_padded

    r = torch.from_numpy(rows(8, 3, seed=12).astype(np.int16)).view(2, 4, 3, K)
    r[1, 1, 2] = -1
    am = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(RoutingMismatchError, match=r"row \(b=1, s=1\) is among the rows to "
                                                   r"replay but has no route .* MoE layers \[4\]"):
        from_verl_padded(r, am, SHAPE)
    keep = am.clone()
    keep[1, 1] = False
    b = from_verl_padded(r, am, SHAPE, replay_mask=keep)
    assert b.checked_for(SHAPE) and not bool(b.replay_mask[1, 1])
    p = tmp_path / "holey.safetensors"
    flat = r.view(8, 3, K).clone()
    files.write_routing(p, flat, files.RecordMeta(shape=SHAPE), cu_seqlens=[0, 8])
    with pytest.raises(files.RoutingFileError, match=r"token 5 has no route \(every slot -1\) "
                                                     r"in MoE layers \[4\] but routes in the "
                                                     r"other MoE layers"):
        files.open_routing(p).batch(SHAPE)


def test_recorded_batch_is_scanned_even_without_validate():
    """The mark promises a scan: recorded_batch scans the recording whatever validate says."""
    rr = RouterReplay(RouterReplayConfig(mode="R2", validate=False), shape=SHAPE)
    rr.set_action(ReplayAction.RECORD)
    logits = torch.randn(3, E, generator=torch.Generator().manual_seed(3))
    for lid in MOE_IDS:
        fn = (lambda x: torch.tensor([[1, 2], [4, 4], [0, 1]])) if lid == 4 else own_topk
        rr.route(lid, logits, topk_fn=fn)
    rr.recorded()  # not scanned: validate=False
    with pytest.raises(RouterReplayError, match=r"token 1, MoE layer 4 repeats an expert"):
        rr.recorded_batch()
