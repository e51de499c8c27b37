"""Routing of every integer dtype an engine may send, at every entry point.

vLLM may return numpy uint8 (uint16 above 256 experts), verl's agent loop stores int16,
SGLang sends int32, record files hold uint8 or int16. Each entry point accepts int8/16/32/
64 and uint8/16/32/64, as numpy arrays and torch tensors, and gives the same result as for
int32. An unsigned type cannot hold -1: its values, its maximum included, are expert ids,
and one >= num_experts is refused with the row and the value named, never read as an
empty slot.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from replay_ops.integrations.megatron import data as md
from replay_ops.router_replay import RouterReplay, RouterReplayConfig, RouterReplayError
from replay_ops.router_replay.adapters import (
    ModelShape,
    RoutingMismatchError,
    SequenceRouting,
    from_verl_padded,
    pack_padded,
    pack_thd,
    sglang_batch,
    vllm_batch,
)

E, K = 8, 2
MOE_IDS = (1, 2, 4)
NUM_LAYERS = 5
LAYOUT = ModelShape(num_experts=E, top_k=K, moe_layer_ids=MOE_IDS, num_hidden_layers=NUM_LAYERS)
PROMPTS, RESPONSES = [3, 2], [2, 3]

DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
UNSIGNED = {"uint8", "uint16", "uint32", "uint64"}
KINDS = ["numpy", "torch"]


def routes(n: int, L: int, seed: int) -> np.ndarray:
    """[n, L, K] int32 with K distinct experts per (token, layer)."""
    rng = np.random.default_rng(seed)
    out = np.stack([rng.permutation(E)[:K] for _ in range(n * L)]).reshape(n, L, K)
    if L == NUM_LAYERS:  # a dense layer's column holds no route (vLLM writes 0)
        out[:, [i for i in range(L) if i not in MOE_IDS]] = 0
    return out


def cast(a: np.ndarray, dtype: str, kind: str, at=None):
    """`a` as `dtype` (numpy or torch), with the dtype's maximum written at index `at`."""
    a = a.astype(dtype)
    if at is not None:
        a[at] = top(dtype)
    return a if kind == "numpy" else torch.from_numpy(a)


def top(dtype: str) -> int:
    """The dtype's maximum: for an unsigned type, the usual stand-in for an empty slot."""
    return int(np.iinfo(dtype).max)


def check_message(exc, row: int, value: int, dtype: str) -> None:
    msg = str(exc)
    assert re.search(rf"\b(token|row) {row}\b", msg), msg
    assert str(value) in msg, msg
    if dtype in UNSIGNED:
        assert f"torch.{dtype}, which cannot hold -1" in msg, msg
        assert "its maximum" in msg, msg


def requests(seed=0):
    return [routes(p + g - 1, NUM_LAYERS, seed + i) for i, (p, g) in
            enumerate(zip(PROMPTS, RESPONSES))]


# ------------------------------------------------------------------ rollout adapters
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout_kind", ["padded", "thd"])
def test_vllm_batch_every_integer_dtype(dtype, kind, layout_kind):
    reqs = requests()
    want = vllm_batch(reqs, PROMPTS, RESPONSES, LAYOUT, packing=layout_kind)
    if dtype == "uint16":  # vLLM sends uint8 for <= 256 experts: uint16 is another model's
        with pytest.raises(RoutingMismatchError, match="request 0 turn 0: routing arrived as "
                                                       "uint16, but vLLM sends uint8"):
            vllm_batch([cast(r, dtype, kind) for r in reqs], PROMPTS, RESPONSES, LAYOUT)
        return
    got = vllm_batch([cast(r, dtype, kind) for r in reqs], PROMPTS, RESPONSES, LAYOUT,
                     packing=layout_kind)
    assert got.indices.dtype == torch.int16
    assert torch.equal(got.indices, want.indices)
    assert torch.equal(got.replay_mask, want.replay_mask)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_vllm_batch_dtype_maximum_is_refused_with_the_row(dtype, kind):
    # request 1, token 2, absolute layer 4 (a MoE layer)
    reqs = [cast(r, dtype, kind, (2, 4, 1) if i == 1 else None)
            for i, r in enumerate(requests())]
    with pytest.raises(RoutingMismatchError) as e:
        vllm_batch(reqs, PROMPTS, RESPONSES, LAYOUT)
    if dtype == "uint16":  # refused by its dtype first (see test_vllm_adapter.py)
        assert "request 0 turn 0: routing arrived as uint16" in str(e.value)
        return
    assert "request 1" in str(e.value)
    check_message(e.value, 2, top(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sglang_array_payload_every_integer_dtype(dtype):
    reqs = requests(seed=5)
    seq_lens = [p + g for p, g in zip(PROMPTS, RESPONSES)]
    want = sglang_batch([{"routed_experts": r} for r in reqs], seq_lens, PROMPTS, LAYOUT)
    got = sglang_batch([{"routed_experts": r.astype(dtype)} for r in reqs], seq_lens, PROMPTS,
                       LAYOUT)
    assert torch.equal(got.indices, want.indices) and got.indices.dtype == torch.int16
    bad = [r.astype(dtype) for r in reqs]
    bad[0][1, 2, 0] = top(dtype)
    with pytest.raises(RoutingMismatchError) as e:
        sglang_batch([{"routed_experts": r} for r in bad], seq_lens, PROMPTS, LAYOUT)
    check_message(e.value, 1, top(dtype), dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_from_verl_padded_every_integer_dtype(dtype, kind):
    B, S = 2, 5
    routed = routes(B * S, NUM_LAYERS, seed=9).reshape(B, S, NUM_LAYERS, K)
    att = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    routed[att == 0] = 0
    want = from_verl_padded(torch.from_numpy(routed.astype(np.int16)), att, LAYOUT)
    got = from_verl_padded(cast(routed, dtype, kind), att, LAYOUT)
    assert torch.equal(got.indices, want.indices) and got.indices.dtype == torch.int16
    assert torch.equal(got.replay_mask, want.replay_mask)
    bad = cast(routed, dtype, kind, (1, 2, 2, 1))  # token b * S + s = 7
    with pytest.raises(RoutingMismatchError) as e:
        from_verl_padded(bad, att, LAYOUT)
    if dtype == "uint64":  # refused before the layout is read: the [b, s, l, k] entry named
        assert "routed[1, 2, 2, 1]" in str(e.value)
    check_message(e.value, 1 if dtype == "uint64" else 7, top(dtype), dtype)


# ------------------------------------------------------------------ packing
@pytest.mark.parametrize("dtype", DTYPES)
def test_adapter_pack_thd_and_padded_every_integer_dtype(dtype):
    idx = [routes(n, len(MOE_IDS), seed=n) for n in (4, 3)]
    masks = [torch.tensor([True] * (len(i) - 1) + [False]) for i in idx]
    ref = [SequenceRouting(torch.from_numpy(i.astype(np.int16)), m) for i, m in zip(idx, masks)]
    seqs = [SequenceRouting(cast(i, dtype, "torch"), m) for i, m in zip(idx, masks)]
    for pack in (lambda s: pack_thd(s), lambda s: pack_padded(s, [2, 1])):
        got, want = pack(seqs), pack(ref)
        assert got.indices.dtype == torch.int16
        assert torch.equal(got.indices, want.indices)
    # without the expert count, a value that fits int16 is kept: set_routing refuses it
    fits = top(dtype) <= np.iinfo(np.int16).max
    bad = cast(idx[1], dtype, "torch", (1, 0, 1) if fits else None)
    if not fits:
        bad[1, 0, 1] = np.iinfo(np.int16).max
    batch = pack_thd([seqs[0], SequenceRouting(bad, masks[1])])  # token 4 + 1 = 5
    rr = RouterReplay(RouterReplayConfig(mode="R3"), num_experts=E, top_k=K,
                      moe_layer_ids=list(MOE_IDS), num_hidden_layers=NUM_LAYERS)
    with pytest.raises(RouterReplayError, match=r"token 5, MoE layer 1 \(slot 1\) routes to "
                                                rf"expert {int(bad[1, 0, 1])}, out of range"):
        batch.apply(rr)
    if not fits:  # and one that does not fit is refused at once
        with pytest.raises((RoutingMismatchError, ValueError)) as e:
            SequenceRouting(cast(idx[1], dtype, "torch", (1, 0, 1)), masks[1])
        check_message(e.value, 1, top(dtype), dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_megatron_pack_thd_every_integer_dtype(dtype, kind):
    lens = [5, 4]
    idx = [routes(n - 1, 3, seed=n) for n in lens]  # rollout rows: one fewer than tokens
    want = md.pack_megatron_thd([torch.from_numpy(i) for i in idx], lens, align=4, num_experts=E)
    got = md.pack_megatron_thd([cast(i, dtype, kind) for i in idx], lens, align=4, num_experts=E)
    assert got.indices.dtype == torch.int16
    assert torch.equal(got.indices, want.indices)
    assert torch.equal(got.replay_mask, want.replay_mask)
    bad = [cast(i, dtype, kind, (2, 1, 0) if j == 1 else None) for j, i in enumerate(idx)]
    with pytest.raises(md.LayoutError) as e:
        md.pack_megatron_thd(bad, lens, num_experts=E)
    assert "sequence 1" in str(e.value)
    check_message(e.value, 2, top(dtype), dtype)
    if top(dtype) > np.iinfo(np.int16).max:  # without num_experts: does not fit int16
        with pytest.raises(md.LayoutError) as e:
            md.pack_megatron_thd(bad, lens)
        check_message(e.value, 2, top(dtype), dtype)


# ------------------------------------------------------------------ RouterReplay
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("validate", [True, False])
def test_set_routing_every_integer_dtype(dtype, validate):
    def make():
        return RouterReplay(RouterReplayConfig(mode="R3", validate=validate), num_experts=E,
                            top_k=K, moe_layer_ids=list(MOE_IDS), num_hidden_layers=NUM_LAYERS)

    T = 6
    idx = routes(T, len(MOE_IDS), seed=3)
    if dtype not in UNSIGNED:
        idx[T - 1] = -1  # a token without a route: mask False
    want, got = make(), make()
    want.set_routing(torch.from_numpy(idx.astype(np.int64)))
    got.set_routing(cast(idx, dtype, "torch"))
    assert got.layer_mapping == "moe"
    if dtype in UNSIGNED:  # every row has a route: no mask (the layers skip the fallback)
        assert got.replay_mask is None and want.replay_mask is None
    else:
        assert want.replay_mask is not None and not bool(want.replay_mask[T - 1])
        assert torch.equal(got.replay_mask, want.replay_mask)
    for lid in MOE_IDS:
        r = got.routing_for(lid)
        assert r.dtype in (torch.int16, torch.int32, torch.int64)
        assert torch.equal(r.long(), want.routing_for(lid).long())
    bad = cast(idx, dtype, "torch", (4, 2, 0))
    if dtype not in UNSIGNED and not validate:
        make().set_routing(bad)  # validate=False: the caller vouches for signed data
        return
    # unsigned routing is checked even with validate=False: it cannot say "no route"
    with pytest.raises((RouterReplayError, ValueError)) as e:
        make().set_routing(bad)
    check_message(e.value, 4, top(dtype), dtype)


def test_float_and_bool_routing_are_refused_naming_the_argument():
    rr = RouterReplay(RouterReplayConfig(mode="R3"), num_experts=E, top_k=K,
                      moe_layer_ids=list(MOE_IDS), num_hidden_layers=NUM_LAYERS)
    with pytest.raises(TypeError, match=r"set_routing: indices must hold integer expert ids "
                                        r".*got torch.float32"):
        rr.set_routing(torch.zeros(2, 3, K))
    with pytest.raises(RoutingMismatchError, match=r"routing must hold integer expert ids .*"
                                                   r"got torch.bool"):
        vllm_batch([np.zeros((4, 5, K), dtype=bool), requests()[1]], PROMPTS, RESPONSES, LAYOUT)
    with pytest.raises(md.LayoutError, match=r"sequence 0: routing must hold integer expert ids "
                                             r".*got torch.float64"):
        md.pack_megatron_thd([np.zeros((4, 3, K))], [5])
