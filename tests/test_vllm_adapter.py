"""The vLLM adapter on every form vLLM 0.32 sends (no engine; the engine tests are in
tests/test_vllm_engine.py): uint8 and uint16 arrays, the server's base64 `.npy` field,
responses sent with `routed_experts_prompt_start`, multi-turn conversations with a start per
turn, and the silent failures seen in the field, each refused naming the request, the layer
and the row. Expected layouts are built row by row in the tests."""
from __future__ import annotations

import base64
import io
import struct

import numpy as np
import pytest
import torch

from replay_ops.router_replay.adapters import (
    ModelShape,
    RoutingMismatchError,
    decode_vllm,
    encode_vllm,
    vllm_batch,
    vllm_dtype,
    vllm_sequences,
)

K = 2
MOE_IDS = (0, 2, 3)  # layer 1 is dense, as in a Qwen3-MoE with mlp_only_layers=[1]
L_ALL = 4


def layout(E: int = 8, k: int = K) -> ModelShape:
    return ModelShape(num_experts=E, top_k=k, moe_layer_ids=MOE_IDS, num_hidden_layers=L_ALL)


def vllm_rows(n: int, seed: int, E: int = 8, k: int = K) -> np.ndarray:
    """What vLLM returns: [n, all hidden layers, K] of vLLM's dtype, a dense layer's column
    all 0, K distinct ids per (token, MoE layer)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((n, L_ALL, k), dtype=np.int64)
    for t in range(n):
        for lid in MOE_IDS:
            out[t, lid] = rng.permutation(E)[:k]
    return out.astype(vllm_dtype(E))


def npy_b64(a: np.ndarray) -> str:
    """Independent encoder of the server's field: the .npy v1.0 format written by hand
    (magic, version, header length, header dict padded to 64 bytes, raw C-order data)."""
    descr = {np.dtype(np.uint8): "|u1", np.dtype(np.uint16): "<u2"}[a.dtype]
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {a.shape}, }}"
    pad = 64 - (10 + len(header) + 1) % 64
    header = header + " " * pad + "\n"
    blob = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1")
    return base64.b64encode(blob + a.astype(a.dtype.newbyteorder("<")).tobytes()).decode()


# ------------------------------------------------------------------ dtypes and encodings
@pytest.mark.parametrize("E, dtype", [(8, np.uint8), (256, np.uint8), (257, np.uint16),
                                      (300, np.uint16)])
def test_vllm_dtype_rule(E, dtype):
    assert vllm_dtype(E) == dtype


@pytest.mark.parametrize("E", [8, 256, 300])
def test_in_process_arrays_uint8_and_uint16(E):
    lay = layout(E)
    reqs = [vllm_rows(4, seed=1, E=E), vllm_rows(6, seed=2, E=E)]
    if E == 256:
        reqs[0][1, 2] = [255, 0]  # the top uint8 value is an expert id, not a sentinel
    reqs[1] = reqs[1][::-1]  # a read-only / negative-stride view is taken as it is
    reqs[1].setflags(write=False)
    b = vllm_batch(reqs, [2, 3], [3, 4], lay, packing="thd")
    assert b.indices.dtype == torch.int16 and b.mappings == ["absolute", "absolute"]
    ref = np.full((5 + 7, 3, K), -1)
    ref[0:4] = reqs[0][:, list(MOE_IDS)]
    ref[5:11] = reqs[1][:, list(MOE_IDS)]
    assert np.array_equal(b.indices.numpy(), ref)
    assert b.replay_mask.tolist() == [True] * 4 + [False] + [True] * 6 + [False]


@pytest.mark.parametrize("E", [8, 300])
def test_server_field_base64_npy(E):
    a = vllm_rows(5, seed=3, E=E)
    text = npy_b64(a)
    assert encode_vllm(a) == text  # numpy's writer and the hand-written one agree
    back = decode_vllm(text)
    assert back.dtype == a.dtype and np.array_equal(back, a)
    seq = vllm_sequences([text], [2], [4], layout(E))[0]
    assert np.array_equal(seq.indices[:5].numpy(), a[:, list(MOE_IDS)])


def test_server_field_refusals():
    with pytest.raises(RoutingMismatchError, match="not valid base64"):
        decode_vllm("@@not base64@@")
    with pytest.raises(RoutingMismatchError, match=r"are not an \.npy blob"):
        decode_vllm(base64.b64encode(b"\x00" * 40).decode())
    good = base64.b64decode(npy_b64(vllm_rows(5, seed=3)))
    with pytest.raises(RoutingMismatchError, match=r"corrupt or truncated \.npy blob"):
        decode_vllm(base64.b64encode(good[:-7]))
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(RoutingMismatchError, match="corrupt or truncated"):
        decode_vllm(base64.b64encode(buf.getvalue()))  # pickles are never loaded
    buf = io.BytesIO()
    np.save(buf, np.zeros((3, 4), dtype=np.uint8))
    with pytest.raises(RoutingMismatchError, match=r"holds a uint8 array of shape \(3, 4\)"):
        decode_vllm(base64.b64encode(buf.getvalue()))
    with pytest.raises(RoutingMismatchError, match="request 1 turn 0: not valid base64"):
        vllm_sequences([vllm_rows(4, 1), "%%"], [2, 2], [3, 3], layout())


def test_uint16_for_a_model_with_256_or_fewer_experts_is_refused():
    a = vllm_rows(4, seed=1).astype(np.uint16)
    with pytest.raises(RoutingMismatchError,
                       match=r"request 0 turn 0: routing arrived as uint16, but vLLM sends uint8 "
                             r"for a model with at most 256 experts and this model has "
                             r"num_experts=8"):
        vllm_sequences([a], [2], [3], layout())
    with pytest.raises(RoutingMismatchError, match="request 0 turn 0: routing arrived as uint16"):
        vllm_sequences([npy_b64(a)], [2], [3], layout())
    with pytest.raises(RoutingMismatchError, match="arrived as uint8, which cannot hold"):
        vllm_sequences([vllm_rows(4, seed=1, E=300).astype(np.uint8)], [2], [3], layout(300))
    # converted on the way to a signed type: accepted, values checked
    seq = vllm_sequences([a.astype(np.int32)], [2], [3], layout())[0]
    assert np.array_equal(seq.indices[:4].numpy(), a[:, list(MOE_IDS)])


# ------------------------------------------------------------------ prompt_start
def test_prompt_start_without_the_omitted_rows_is_refused_naming_the_request():
    full = vllm_rows(10, seed=4)  # prompt 7 + response 4 -> 10 rows
    with pytest.raises(RoutingMismatchError,
                       match=r"request 1: vLLM routed_experts has 7 token rows but prompt_len \+ "
                             r"response_len - 1 = 10 \(prompt_len=7, response_len=4\); 3 rows "
                             r"fewer .*routed_experts_prompt_start=3\? Pass prompt_starts"):
        vllm_sequences([vllm_rows(4, 0), full[3:]], [2, 7], [3, 4], layout())
    with pytest.raises(RoutingMismatchError,
                       match=r"request 1 turn 0: vLLM omitted the routing of tokens 0\.\.2 "
                             r"\(routed_experts_prompt_start=3\) and nothing supplies them.*"
                             r"never zero-filled"):
        vllm_sequences([vllm_rows(4, 0), full[3:]], [2, 7], [3, 4], layout(),
                       prompt_starts=[0, 3])
    with pytest.raises(RoutingMismatchError,
                       match=r"request 1: vLLM routed_experts has 7 token rows but prompt_len \+ "
                             r"response_len - 1 - prompt_start = 8 .*prompt_start=2\)"):
        vllm_sequences([vllm_rows(4, 0), full[3:]], [2, 7], [3, 4], layout(),
                       prompt_starts=[0, 2], omitted="mask")


def test_prompt_start_with_the_prefix_supplied():
    full = vllm_rows(10, seed=4)
    seq = vllm_sequences([full[3:]], [7], [4], layout(), prompt_starts=[3],
                         prefix_routing=[full[:3]])[0]
    assert np.array_equal(seq.indices[:10].numpy(), full[:, list(MOE_IDS)])
    assert seq.mask.tolist() == [True] * 10 + [False]
    with pytest.raises(RoutingMismatchError,
                       match=r"request 0 prefix_routing: has 5 token rows but the request "
                             r"omitted rows 0\.\.2 \(3 rows"):
        vllm_sequences([full[3:]], [7], [4], layout(), prompt_starts=[3],
                       prefix_routing=[full[:5]])


def test_prompt_start_past_the_prompt_is_clamped_as_vllm_does():
    """vLLM clamps routed_experts_prompt_start to the prompt length: a start of 50 on a
    7-token prompt returns the rows from token 7 on."""
    full = vllm_rows(10, seed=4)
    seq = vllm_sequences([full[7:]], [7], [4], layout(), prompt_starts=[50],
                         prefix_routing=[full[:7]])[0]
    assert np.array_equal(seq.indices[:10].numpy(), full[:, list(MOE_IDS)])


def test_prompt_start_masked_explicitly():
    full = vllm_rows(10, seed=4)
    b = vllm_batch([full[3:]], [7], [4], layout(), prompt_starts=[3], omitted="mask",
                   packing="thd")
    ref = np.full((11, 3, K), -1)
    ref[3:10] = full[3:, list(MOE_IDS)]
    assert np.array_equal(b.indices.numpy(), ref)
    assert b.replay_mask.tolist() == [False] * 3 + [True] * 7 + [False]
    with pytest.raises(ValueError, match="unknown omitted='zero'"):
        vllm_sequences([full[3:]], [7], [4], layout(), prompt_starts=[3], omitted="zero")


def test_multi_turn_with_a_start_per_turn():
    """Turn 0: prompt 4 + 3 generated (7 tokens, 6 rows). Turn 1 sends the conversation so
    far plus 2 user tokens as its prompt (9) and generates 3 (12 tokens), with
    routed_experts_prompt_start=6: only rows 6..10 come back."""
    t0 = vllm_rows(6, seed=5)
    t1 = vllm_rows(5, seed=6)
    for form in ([(t0, 7, 0), (t1, 12, 6)], [(t0, 7), (t1, 12)]):
        starts = None if len(form[0]) == 3 else [[0, 6]]
        seq = vllm_sequences([form], [9], [3], layout(), prompt_starts=starts)[0]
        assert np.array_equal(seq.indices[:6].numpy(), t0[:, list(MOE_IDS)])
        assert np.array_equal(seq.indices[6:11].numpy(), t1[:, list(MOE_IDS)])
        assert seq.mask.tolist() == [True] * 11 + [False]
    # the same start told twice, differently
    with pytest.raises(RoutingMismatchError, match=r"request 0 turn 1: start 6 in the turn but "
                                                   r"prompt_starts\[0\]\[1\] = 5"):
        vllm_sequences([[(t0, 7, 0), (t1, 12, 6)]], [9], [3], layout(), prompt_starts=[[0, 5]])
    # a turn that starts past the rows held: a gap
    with pytest.raises(RoutingMismatchError, match=r"request 0 turn 1: vLLM omitted the routing "
                                                   r"of tokens 6\.\.7 .*no earlier turn covers"):
        vllm_sequences([[(t0, 7, 0), (t1[2:], 12, 8)]], [9], [3], layout())
    # the last turn must be the whole training sequence
    with pytest.raises(RoutingMismatchError, match=r"request 0: the last turn's seq_len=12 "
                                                   r"differs from prompt_len \+ response_len = 13"):
        vllm_sequences([[(t0, 7, 0), (t1, 12, 6)]], [9], [4], layout())
    with pytest.raises(RoutingMismatchError, match="takes one start per turn"):
        vllm_sequences([[(t0, 7), (t1, 12)]], [9], [3], layout(), prompt_starts=[6])


# ------------------------------------------------------------------ silent failures
def test_zero_filled_routing_is_refused():
    """vLLM issue 54730: a kernel path bypassed the capture and returned the zero-initialised
    buffer. With top_k >= 2 a zero (token, layer) repeats expert 0 and is never a route."""
    a = vllm_rows(6, seed=7)
    a[4:] = 0
    with pytest.raises(RoutingMismatchError,
                       match=r"request 1 turn 0: token 4, MoE layer 0: all 2 slots are expert 0 "
                             r"\(6 of 18 \(token, MoE layer\) rows are\); zero-filled routing"):
        vllm_sequences([vllm_rows(4, 0), a], [2, 3], [3, 4], layout())
    with pytest.raises(RoutingMismatchError, match="request 0 turn 0: token 0, MoE layer 0: all"):
        vllm_sequences([np.zeros((4, L_ALL, K), np.uint8)], [2], [3], layout())


def test_zero_filled_routing_top_k_1_policy():
    """top_k=1: a zero is also a route to expert 0. A turn that is 0 in every row and every
    MoE layer is refused when uniform routing makes that rarer than 1e-6; a shorter one,
    or one with any other id, is accepted as routes to expert 0."""
    lay = layout(E=8, k=1)
    zeros = np.zeros((7, L_ALL, 1), np.uint8)  # 8^-21
    with pytest.raises(RoutingMismatchError,
                       match=r"request 0 turn 0: all 7 token rows are expert 0 in every MoE "
                             r"layer \(3 layers, top_k=1; uniform routing gives this a chance of "
                             r"8\^-21\); zero-filled"):
        vllm_sequences([zeros], [3], [5], lay)
    seq = vllm_sequences([zeros[:2]], [1], [2], lay)[0]  # 8^-6 > 1e-6: accepted
    assert (seq.indices[:2] == 0).all() and seq.mask[:2].all()
    some = zeros.copy()
    some[3, 2, 0] = 5
    seq = vllm_sequences([some], [3], [5], lay)[0]
    assert int(seq.indices[3, 1, 0]) == 5 and (seq.indices[:7, 0] == 0).all()


@pytest.mark.parametrize("E", [8, 300])
def test_expert_id_out_of_range(E):
    a = vllm_rows(5, seed=8, E=E)
    a[3, 2, 1] = E if E == 8 else 65535
    with pytest.raises(RoutingMismatchError,
                       match=rf"request 0 turn 0: token 3, MoE layer 2 \(slot 1\) routes to "
                             rf"expert {a[3, 2, 1]}, out of range for num_experts={E}.*arrived as "
                             rf"torch.uint(8|16)"):
        vllm_sequences([a], [2], [4], layout(E))


def test_rows_that_do_not_match_the_tokens():
    """A routing array of another request (another length) in this request's place."""
    a, b = vllm_rows(4, 1), vllm_rows(6, 2)
    with pytest.raises(RoutingMismatchError,
                       match=r"request 0: vLLM routed_experts has 6 token rows but prompt_len \+ "
                             r"response_len - 1 = 4"):
        vllm_sequences([b, a], [2, 3], [3, 4], layout())


def test_routes_in_a_layer_the_model_says_is_dense():
    a = vllm_rows(5, seed=9)
    a[2, 1] = [3, 4]  # layer 1 is dense in this layout
    with pytest.raises(RoutingMismatchError,
                       match=r"request 0 turn 0: token 2, layer 1 routes to experts \[3, 4\], but "
                             r"the model's layer 1 is dense"):
        vllm_sequences([a], [2], [4], layout())
