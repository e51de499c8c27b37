"""The SGLang adapter on the forms a real SGLang sends (no server needed).

The payloads are synthetic but shaped exactly like those captured from sglang 0.5.23's server
(tests/test_sglang_engine.py runs the real one): `/generate`'s meta_info keys, the OpenAI
response with one response-level `sglext.routed_experts` for n choices, a batched body with
one int start, a meta_info without the field. Expected values are built here with struct
and numpy, never by the adapter.
"""
from __future__ import annotations

import base64
import struct

import numpy as np
import pytest

from replay_ops.router_replay.adapters import ModelShape, RoutingMismatchError, sglang_batch
from replay_ops.router_replay.adapters import sglang_sequences
from replay_ops.router_replay.adapters.sglang import (
    decode_sglang,
    encode_sglang,
    openai_meta_infos,
    wire_dtype,
)

L, E, K = 3, 16, 2
LAYOUT = ModelShape(E, K, (0, 1, 2), L)
# the keys of a real 0.5.23 /generate meta_info with routing (and without: the field is gone)
META_KEYS = ["cached_tokens", "cached_tokens_details", "completion_tokens", "dp_rank",
             "e2e_latency", "finish_reason", "id", "input_token_logprobs", "num_retractions",
             "output_token_logprobs", "output_token_logprobs_length", "prompt_tokens",
             "reasoning_tokens", "response_sent_to_client_ts", "weight_version",
             "weight_versions"]


def rows(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(E)[:K] for _ in range(n * L)]).reshape(n, L, K)


def b64(a: np.ndarray, fmt: str = "i") -> str:
    """Independent encoder: struct-packed little-endian values, base64."""
    flat = [int(v) for v in np.asarray(a).reshape(-1)]
    return base64.b64encode(struct.pack(f"<{len(flat)}{fmt}", *flat)).decode()


def meta(a: np.ndarray, **extra) -> dict:
    m = {k: 0 for k in META_KEYS}
    m["routed_experts"] = b64(a)
    m.update(extra)
    return m


def test_start_comes_from_the_request_never_from_meta_info():
    """Form 1: 0.5.23 never echoes routed_experts_start_len; the start is taken from the
    request the caller sent (requests=) or starts=, and a shorter payload without either is
    refused with the start it suggests."""
    a = rows(6, 1)  # a request of 10 tokens sent with start 3
    m = meta(a)
    with pytest.raises(RoutingMismatchError, match=r"request 0 turn 0: 36 int32 values do not "
                                                   r"fit the expected 9 token rows.*6 rows, 3 "
                                                   r"fewer.*routed_experts_start_len=3\?"):
        sglang_sequences([m], [10], LAYOUT)
    body = {"input_ids": list(range(10)), "return_routed_experts": True,
            "routed_experts_start_len": 3}
    prefix = rows(3, 2)
    for kw in (dict(requests=[body]), dict(starts=[3]), dict(starts=3)):
        s = sglang_sequences([m], [10], LAYOUT, prefix_routing=[prefix], **kw)[0]
        assert np.array_equal(s.indices[:9].numpy(), np.concatenate([prefix, a]))
    with pytest.raises(RoutingMismatchError, match=r"request 0 turn 0: starts gives 2 but the "
                                                   r"request body's routed_experts_start_len is 3"):
        sglang_sequences([m], [10], LAYOUT, starts=[2], requests=[body])


def test_multi_turn_gap_of_one_token_is_named_and_filled_or_masked():
    """Form 2: start = the previous turn's full length leaves that turn's last token without
    a route: refused naming the start to send, supplied (prefix_routing={turn: rows}), or
    masked (omitted='mask')."""
    n1, n2 = 7, 12
    t1 = rows(n1 - 1, 3)
    t2 = rows(n2 - 1 - n1, 4)  # sent with start = n1
    conv = [[meta(t1), meta(t2)]]
    with pytest.raises(RoutingMismatchError,
                       match=r"request 0 turn 1: SGLang returned no routing for tokens 6\.\.6 "
                             r"\(routed_experts_start_len=7\) and no earlier turn covers them\. "
                             r"With routed_experts_start_len = the previous turn's full length, "
                             r"its last token \(token 6\) is routed in neither turn: send "
                             r"routed_experts_start_len = the previous turn's length - 1 = 6"):
        sglang_sequences(conv, [[n1, n2]], LAYOUT, starts=[[0, n1]])
    gap = rows(1, 5)
    s = sglang_sequences(conv, [[n1, n2]], LAYOUT, starts=[[0, n1]],
                         prefix_routing=[{1: b64(gap)}])[0]
    assert np.array_equal(s.indices[:n2 - 1].numpy(), np.concatenate([t1, gap, t2]))
    assert s.mask.tolist() == [True] * (n2 - 1) + [False]
    with pytest.raises(RoutingMismatchError, match=r"prefix_routing\[1\].*do not fit the "
                                                   r"expected 1 token rows"):
        sglang_sequences(conv, [[n1, n2]], LAYOUT, starts=[[0, n1]],
                         prefix_routing=[{1: b64(rows(2, 6))}])
    b = sglang_batch(conv, [[n1, n2]], [9], LAYOUT, starts=[[0, n1]], omitted="mask",
                     packing="thd")
    assert b.replay_mask.tolist() == [True] * 6 + [False] + [True] * 4 + [False]
    assert (b.indices[6] == -1).all()
    # the gap-free start: previous length - 1
    t2b = rows(n2 - 1 - (n1 - 1), 7)
    s = sglang_sequences([[meta(t1), meta(t2b)]], [[n1, n2]], LAYOUT,
                         requests=[[{"routed_experts_start_len": 0},
                                    {"routed_experts_start_len": n1 - 1}]])[0]
    assert np.array_equal(s.indices[:n2 - 1].numpy(), np.concatenate([t1, t2b]))


def openai_response(payload: str | None, n_choices: int) -> dict:
    """A real 0.5.23 /v1/completions response: one response-level sglext for n choices."""
    r = {"id": "x", "object": "text_completion", "created": 0, "model": "replay-demo",
         "metadata": None, "usage": {"prompt_tokens": 8, "completion_tokens": 12},
         "choices": [{"index": j, "text": "", "logprobs": None, "finish_reason": "length",
                      "matched_stop": None, "prompt_token_ids": [3, 4, 5],
                      "token_ids": [6, 7, 8]} for j in range(n_choices)]}
    if payload is not None:
        r["sglext"] = {"routed_experts": payload, "spec_tokens_details": None}
    return r


def test_openai_payload_is_the_first_choice_only():
    """Form 3: the response-level sglext.routed_experts belongs to choice 0; the other
    choices are refused by name unless allow_missing."""
    a = rows(5, 8)
    r = openai_response(b64(a), 4)
    with pytest.raises(RoutingMismatchError, match=r"choices \[1, 2, 3\] \(of 4\) have no "
                                                   r"routing payload.*first choice"):
        openai_meta_infos(r)
    metas = openai_meta_infos(r, allow_missing=True)
    assert metas[1:] == [None] * 3
    seqs = sglang_sequences(metas, [6] * 4, LAYOUT, allow_missing=True)
    assert np.array_equal(seqs[0].indices[:5].numpy(), a)
    assert not any(s.mask.any() for s in seqs[1:])
    one = sglang_sequences(openai_meta_infos(openai_response(b64(a), 1)), [6], LAYOUT)[0]
    assert np.array_equal(one.indices[:5].numpy(), a)
    with pytest.raises(RoutingMismatchError, match=r"none of the 2 choices has a routing "
                                                   r"payload.*not started with "
                                                   r"--enable-return-routed-experts"):
        openai_meta_infos(openai_response(None, 2))


def test_batched_request_takes_one_int_start():
    """Form 4: a batched /generate body has one int start for all its requests."""
    a, b = rows(3, 9), rows(7, 10)
    body = {"input_ids": [[1] * 5, [2] * 9], "return_routed_experts": True,
            "routed_experts_start_len": 1}
    seqs = sglang_sequences([meta(a), meta(b)], [5, 9], LAYOUT, requests=body, omitted="mask")
    assert np.array_equal(seqs[0].indices[1:4].numpy(), a)
    assert np.array_equal(seqs[1].indices[1:8].numpy(), b)
    assert [s.mask[0].item() for s in seqs] == [False, False]
    body["routed_experts_start_len"] = [1, 1]
    with pytest.raises(RoutingMismatchError, match=r"the batched request's "
                                                   r"routed_experts_start_len=\[1, 1\] is not "
                                                   r"one int.*HTTP 400"):
        sglang_sequences([meta(a), meta(b)], [5, 9], LAYOUT, requests=body)


def test_missing_field_names_the_engine_flag():
    """Form 5: the field silently absent (a server without the flag)."""
    m = {k: 0 for k in META_KEYS if k not in ("input_token_logprobs", "output_token_logprobs",
                                              "output_token_logprobs_length")}
    with pytest.raises(RoutingMismatchError,
                       match=r"request 0 turn 0: meta_info has no 'routed_experts' \(keys: "
                             r"\['cached_tokens'.*\]\): the engine was not started with "
                             r"--enable-return-routed-experts \(the request asked for it"):
        sglang_sequences([m], [5], LAYOUT, requests=[{"return_routed_experts": True}])


@pytest.mark.parametrize("name,fmt", [("uint8", "B"), ("uint16", "H"), ("int32", "i")])
def test_wire_dtype_is_read_from_meta_info(name, fmt):
    """Form 6: meta_info["routed_experts_dtype"] names the bytes; int32 when absent."""
    a = rows(4, 11)
    m = {"routed_experts": b64(a, fmt), "routed_experts_dtype": name}
    s = sglang_sequences([m], [5], LAYOUT)[0]
    assert np.array_equal(s.indices[:4].numpy(), a)
    assert np.array_equal(decode_sglang(b64(a, fmt), num_layers=L, top_k=K, dtype=name).numpy(),
                          a)
    assert encode_sglang(a, name) == b64(a, fmt)
    assert wire_dtype({"routed_experts_dtype": name.upper() + " "}).name == name


def test_narrow_payload_is_never_read_as_int32_or_the_reverse():
    """Form 6: a uint8 payload without its dtype field is read as int32 and refused (a
    quarter of the values); int32 bytes labelled uint8 are four times too many values."""
    a = rows(4, 12)
    with pytest.raises(RoutingMismatchError, match=r"6 int32 values do not fit the expected 4 "
                                                   r"token rows"):
        sglang_sequences([{"routed_experts": b64(a, "B")}], [5], LAYOUT)
    with pytest.raises(RoutingMismatchError, match=r"96 uint8 values do not fit the expected 4 "
                                                   r"token rows"):
        sglang_sequences([{"routed_experts": b64(a), "routed_experts_dtype": "uint8"}], [5],
                         LAYOUT)
    with pytest.raises(RoutingMismatchError, match=r"48 uint16 values do not fit"):
        sglang_sequences([{"routed_experts": b64(a), "routed_experts_dtype": "uint16"}], [5],
                         LAYOUT)
    with pytest.raises(RoutingMismatchError, match=r"routed_experts_dtype='float16' is not a "
                                                   r"routing wire dtype"):
        sglang_sequences([{"routed_experts": b64(a), "routed_experts_dtype": "float16"}], [5],
                         LAYOUT)
    # uint8 bytes of 4 rows read as int32 when the row count happens to fit: ids out of range
    a16 = rows(16, 13)
    with pytest.raises(RoutingMismatchError, match=r"out of range for num_experts=16"):
        sglang_sequences([{"routed_experts": b64(a16, "B")}], [5], LAYOUT)


def test_decode_helper_array_positions_by_layers_times_k():
    """Form 6: SGLang's own decode helper returns [positions, L*K]; taken as it comes."""
    a = rows(4, 14)
    s = sglang_sequences([{"routed_experts": a.reshape(4, L * K).astype(np.uint8),
                           "routed_experts_dtype": "uint8"}], [5], LAYOUT)[0]
    assert np.array_equal(s.indices[:4].numpy(), a)
    with pytest.raises(RoutingMismatchError, match=r"\[positions, L\*K\] has 3 token rows but "
                                                   r"seqlen - 1 - start = 4"):
        sglang_sequences([{"routed_experts": a[:3].reshape(3, L * K)}], [5], LAYOUT)


def test_dense_layer_rows_zero_or_minus_one_are_accepted_routes_refused():
    """Form 7, as a real SGLang 0.5.23 sent it for a DeepSeek-V3 with first_k_dense_replace=1
    (tests/test_sglang_engine.py): L is every hidden layer, int32, no dtype field, and the
    dense layer's rows are [0, 0] for every token: accepted (-1 also means no route), the MoE
    layers' rows taken by absolute id. Routes there mean another model (e.g. SGLang's
    Qwen3-MoE ignoring mlp_only_layers): refused."""
    dense0 = ModelShape(E, K, (1, 2), L)  # DeepSeek-V3-style first_k_dense_replace=1
    a = rows(4, 15)
    a[:, 0] = 0
    s = sglang_sequences([meta(a)], [5], dense0, num_layers=L)[0]
    assert s.mapping == "absolute" and np.array_equal(s.indices[:4].numpy(), a[:, 1:])
    assert s.mask[:4].all()
    # the same rows read with layer 1 dense (misaligned layers): layer 1 holds routes
    with pytest.raises(RoutingMismatchError, match=r"token 0, layer 1 routes to experts"):
        sglang_sequences([meta(a)], [5], ModelShape(E, K, (0, 2), L), num_layers=L)
    a[1, 0] = -1
    sglang_sequences([{"routed_experts": b64(a)}], [5], dense0, num_layers=L)
    a[2, 0] = [3, 5]
    with pytest.raises(RoutingMismatchError, match=r"token 2, layer 0 routes to experts \[3, 5\]"
                                                   r", but the model's layer 0 is dense"):
        sglang_sequences([{"routed_experts": b64(a)}], [5], dense0, num_layers=L)
