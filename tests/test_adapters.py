"""Rollout adapters: vLLM and SGLang routing into verl's padded layout and packed THD.

Synthetic requests mirror the real shapes: prompts of different lengths, int16 and int32
payloads, L = all hidden layers (dense included) or MoE layers only, multi-turn, and a
request without routing. Expected layouts are built token by token in the tests.
"""
from __future__ import annotations

import base64
import struct

import numpy as np
import pytest
import torch

from replay_ops.router_replay import ReplayAction, RouterReplay, RouterReplayConfig
from replay_ops.router_replay.adapters import (
    ModelShape,
    MultiTurnRouting,
    RoutingMismatchError,
    decode_sglang,
    encode_sglang,
    from_verl_padded,
    routing_from_batch,
    sglang_batch,
    sglang_sequences,
    vllm_batch,
    vllm_sequences,
)

E, K = 8, 2
KINDS = ("dense", "moe", "moe", "dense", "moe")  # dense first layer, as in DeepSeek-V3
MOE_IDS = (1, 2, 4)
LAYOUT = ModelShape(num_experts=E, top_k=K, moe_layer_ids=MOE_IDS, num_hidden_layers=5)
PROMPTS = [3, 1, 4]
RESPONSES = [2, 4, 1]


def rows(n: int, L: int, seed: int, dtype=np.int32) -> np.ndarray:
    """[n, L, K] with K distinct experts per (token, layer); dense-layer columns of an
    absolute layout are zeros, as an engine might leave them."""
    rng = np.random.default_rng(seed)
    out = np.stack([rng.permutation(E)[:K] for _ in range(n * L)]).reshape(n, L, K)
    if L == len(KINDS):
        for i, kind in enumerate(KINDS):
            if kind == "dense":
                out[:, i] = 0
    return out.astype(dtype)


def moe_cols(a: np.ndarray) -> np.ndarray:
    return a[:, list(MOE_IDS)] if a.shape[1] == len(KINDS) else a


def requests(L=5, dtype=np.int32):
    return [rows(p + g - 1, L, seed=i, dtype=dtype) for i, (p, g) in
            enumerate(zip(PROMPTS, RESPONSES))]


# ------------------------------------------------------------------ vLLM
@pytest.mark.parametrize("L, dtype", [(5, np.int16), (3, np.int32), (5, np.int32)])
def test_vllm_padded_layout_token_by_token(L, dtype):
    reqs = requests(L, dtype)
    b = vllm_batch(reqs, PROMPTS, RESPONSES, LAYOUT, max_prompt_len=5, max_response_len=5)
    assert b.indices.shape == (3, 10, 3, K) and b.indices.dtype == torch.int16
    assert b.mappings == ["absolute" if L == 5 else "moe"] * 3
    ref_idx = np.full((3, 10, 3, K), -1)
    ref_mask = np.zeros((3, 10), dtype=bool)
    for i, (p, g) in enumerate(zip(PROMPTS, RESPONSES)):
        for j in range(p + g):  # token j of request i
            pos = 5 - p + j  # prompt left-padded to 5, response starts at column 5
            if j < p + g - 1:  # the final token has no route
                ref_idx[i, pos] = moe_cols(reqs[i])[j]
                ref_mask[i, pos] = True
    assert np.array_equal(b.indices.numpy(), ref_idx)
    assert np.array_equal(b.replay_mask.numpy(), ref_mask)


def test_vllm_thd_layout_and_boundaries():
    reqs = requests(5)
    b = vllm_batch(reqs, PROMPTS, RESPONSES, LAYOUT, packing="thd")
    lens = [p + g for p, g in zip(PROMPTS, RESPONSES)]
    assert b.cu_seqlens.tolist() == [0, 5, 10, 15]
    ref = []
    ref_mask = []
    for i, n in enumerate(lens):
        ref.append(moe_cols(reqs[i]))
        ref.append(np.full((1, 3, K), -1))
        ref_mask += [True] * (n - 1) + [False]
    assert np.array_equal(b.indices.numpy(), np.concatenate(ref))
    assert b.replay_mask.tolist() == ref_mask


def test_vllm_missing_routing_is_an_error_unless_allowed():
    reqs = requests(5)
    reqs[1] = None
    with pytest.raises(RoutingMismatchError, match=r"requests \[1\] have no routing \(2 of 3"):
        vllm_batch(reqs, PROMPTS, RESPONSES, LAYOUT)
    b = vllm_batch(reqs, PROMPTS, RESPONSES, LAYOUT, packing="thd", allow_missing=True)
    s1 = slice(5, 10)
    assert not b.replay_mask[s1].any() and (b.indices[s1] == -1).all()  # never expert 0
    assert b.replay_mask[:5].sum() == 4 and b.replay_mask[10:].sum() == 4
    assert b.mappings == ["absolute", None, "absolute"]


def test_vllm_routing_list_shorter_than_batch():
    """The shipped bug: one rollout without routes shortens the list and every later
    sample takes its neighbour's routing. Here it is an error."""
    reqs = requests(5)
    with pytest.raises(RoutingMismatchError, match="routing for 2 requests but the batch has 3"):
        vllm_batch(reqs[:1] + reqs[2:], PROMPTS, RESPONSES, LAYOUT)


def test_vllm_length_mismatch_names_request_and_lengths():
    reqs = requests(5)
    reqs[2] = rows(PROMPTS[2] + RESPONSES[2], 5, seed=9)  # one row too many
    with pytest.raises(RoutingMismatchError,
                       match=r"request 2: vLLM routed_experts has 5 token rows but prompt_len \+ "
                             r"response_len - 1 = 4 \(prompt_len=4, response_len=1\)"):
        vllm_sequences(reqs, PROMPTS, RESPONSES, LAYOUT)


def test_wrong_layer_count():
    reqs = requests(5)
    reqs[0] = rows(PROMPTS[0] + RESPONSES[0] - 1, 4, seed=3)
    with pytest.raises(RoutingMismatchError, match=r"request 0 turn 0: routing has L=4 layers, "
                                                   r"but the model has 3 MoE layers"):
        vllm_sequences(reqs, PROMPTS, RESPONSES, LAYOUT)


@pytest.mark.parametrize("value", [8, 300, -2])
def test_out_of_range_expert(value):
    reqs = requests(3)
    reqs[1] = reqs[1].copy()
    reqs[1][2, 1, 0] = value
    with pytest.raises(RoutingMismatchError,
                       match=rf"request 1 turn 0: token 2, MoE layer 2 \(slot 0\) routes to "
                             rf"expert {value}, out of range for num_experts=8"):
        vllm_sequences(reqs, PROMPTS, RESPONSES, LAYOUT)


def test_zero_filled_row_is_not_read_as_expert_zero():
    reqs = requests(3)
    reqs[0] = reqs[0].copy()
    reqs[0][1, 2] = 0  # an all-zero row (verl's "no data") inside a real token
    with pytest.raises(RoutingMismatchError, match=r"request 0 turn 0: token 1, MoE layer 4: "
                                                   r"all 2 slots are expert 0 .*zero-filled"):
        vllm_sequences(reqs, PROMPTS, RESPONSES, LAYOUT)
    with pytest.raises(RoutingMismatchError, match=r"token 1, MoE layer 4 repeats an expert "
                                                   r"\[0, 0\]"):
        sglang_sequences([{"routed_experts": encode_sglang(reqs[0])}], [5], LAYOUT,
                         num_layers=3)


def test_dense_layers_do_not_shift_the_layer_mapping():
    """Absolute layout: MoE layer 1 is column 1 (not column 0, a dense layer)."""
    a = rows(4, 5, seed=4)
    a[:, 0] = 0  # what vLLM writes in a dense layer's column (-1 is accepted too)
    a[2, 3] = -1
    seq = vllm_sequences([a], [2], [3], LAYOUT)[0]
    assert seq.mapping == "absolute"
    for n, lid in enumerate(MOE_IDS):
        assert np.array_equal(seq.indices[:4, n].numpy(), a[:, lid])


def test_routes_in_a_dense_layer_are_refused():
    """A route in a layer the model says is dense: the engine's model has other MoE layers,
    so its MoE columns cannot be trusted either."""
    a = rows(4, 5, seed=4)
    a[2, 3] = [5, 6]
    with pytest.raises(RoutingMismatchError,
                       match=r"request 0 turn 0: token 2, layer 3 routes to experts \[5, 6\], "
                             r"but the model's layer 3 is dense \(MoE layers \[1, 2, 4\] of 5\); "
                             r"1 of 4 token rows"):
        vllm_sequences([a], [2], [3], LAYOUT)
    with pytest.raises(RoutingMismatchError, match=r"token 2, layer 3 routes to experts"):
        sglang_sequences([{"routed_experts": encode_sglang(a)}], [5], LAYOUT, num_layers=5)


def test_vllm_multi_turn_appends_without_overwriting():
    t1 = rows(5, 3, seed=5)  # turn 1: 6 tokens
    t2 = rows(9, 3, seed=6)  # turn 2 re-routes the prefix (6 tokens) and adds 4
    seq = vllm_sequences([[(t1, 6), (t2, 10)]], [3], [7], LAYOUT)[0]
    assert seq.num_tokens == 10
    assert np.array_equal(seq.indices[:5].numpy(), t1)  # earlier turn kept
    assert np.array_equal(seq.indices[5:9].numpy(), t2[5:9])  # later turn appended
    assert seq.mask.tolist() == [True] * 9 + [False]


# ------------------------------------------------------------------ SGLang
def b64_int32(a: np.ndarray) -> str:
    """Independent encoder: struct-packed little-endian int32, base64."""
    flat = [int(v) for v in a.reshape(-1)]
    return base64.b64encode(struct.pack(f"<{len(flat)}i", *flat)).decode()


def test_sglang_decode_matches_wire_format():
    a = rows(4, 5, seed=7)
    assert b64_int32(a) == encode_sglang(a)
    assert np.array_equal(decode_sglang(b64_int32(a), num_layers=5, top_k=K).numpy(), a)
    with pytest.raises(RoutingMismatchError, match="not a whole number of"):
        decode_sglang(base64.b64encode(b"\x00" * 12).decode(), num_layers=5, top_k=K)
    with pytest.raises(RoutingMismatchError, match="not valid base64"):
        decode_sglang("!!!", num_layers=5, top_k=K)


@pytest.mark.parametrize("L", [5, 3])
def test_sglang_single_turn_padded(L):
    seq_lens = [p + g for p, g in zip(PROMPTS, RESPONSES)]
    reqs = [rows(n - 1, L, seed=10 + i) for i, n in enumerate(seq_lens)]
    metas = [{"routed_experts": b64_int32(r), "prompt_tokens": p} for r, p in zip(reqs, PROMPTS)]
    b = sglang_batch(metas, seq_lens, PROMPTS, LAYOUT)
    Pm, Rm = max(PROMPTS), max(RESPONSES)
    assert b.indices.shape == (3, Pm + Rm, 3, K)
    for i, (p, g) in enumerate(zip(PROMPTS, RESPONSES)):
        for j in range(p + g - 1):
            assert np.array_equal(b.indices[i, Pm - p + j].numpy(), moe_cols(reqs[i])[j])
        assert b.replay_mask[i].sum() == p + g - 1
        assert not b.replay_mask[i, Pm + g - 1]  # the final token


def test_sglang_multi_turn_with_start_offset_concatenates_in_order():
    t0 = rows(4, 3, seed=20)  # turn 0: seq_len 5, tokens 0..3 routed
    t1 = rows(4, 3, seed=21)  # turn 1: seq_len 9, start 4, tokens 4..7
    t2 = rows(2, 3, seed=22)  # turn 2: seq_len 11, start 8 (from meta_info)
    metas = [[{"routed_experts": b64_int32(t0)},
              {"routed_experts": b64_int32(t1)},
              {"routed_experts": b64_int32(t2), "routed_experts_start_len": 8}]]
    seq = sglang_sequences(metas, [[5, 9, 11]], LAYOUT, starts=[[0, 4, None]])[0]
    assert seq.num_tokens == 11
    assert np.array_equal(seq.indices[:10].numpy(), np.concatenate([t0, t1, t2]))
    assert seq.mask.tolist() == [True] * 10 + [False]


def test_sglang_multi_turn_gap_and_missing_key_are_errors():
    t0 = rows(4, 3, seed=20)
    t1 = rows(2, 3, seed=21)
    metas = [[{"routed_experts": b64_int32(t0)}, {"routed_experts": b64_int32(t1)}]]
    with pytest.raises(RoutingMismatchError, match=r"request 0 turn 1: SGLang returned no routing "
                                                   r"for tokens 4\.\.5 \(routed_experts_start_len"
                                                   r"=6\) and no earlier turn covers them"):
        sglang_sequences(metas, [[5, 9]], LAYOUT, starts=[[0, 6]])
    metas = [{"routed_experts": b64_int32(t0)}, {"text": "hi", "prompt_tokens": 3}]
    with pytest.raises(RoutingMismatchError, match=r"request 1 turn 0: meta_info has no "
                                                   r"'routed_experts'"):
        sglang_sequences(metas, [5, 4], LAYOUT)


def test_sglang_missing_routing_is_an_error_unless_allowed():
    metas = [{"routed_experts": b64_int32(rows(4, 3, seed=1))}, None]
    with pytest.raises(RoutingMismatchError, match=r"requests \[1\] have no routing \(1 of 2"):
        sglang_sequences(metas, [5, 3], LAYOUT)
    seqs = sglang_sequences(metas, [5, 3], LAYOUT, allow_missing=True)
    assert seqs[1].mask.tolist() == [False] * 3 and (seqs[1].indices == -1).all()
    assert seqs[0].mask.tolist() == [True] * 4 + [False]


def test_sglang_length_mismatch_names_request_and_lengths():
    metas = [{"routed_experts": b64_int32(rows(4, 3, seed=1))},
             {"routed_experts": b64_int32(rows(6, 3, seed=2))}]
    with pytest.raises(RoutingMismatchError, match=r"request 1 turn 0: 36 int32 values do not "
                                                   r"fit the expected 5 token rows"):
        sglang_sequences(metas, [5, 6], LAYOUT)


def test_multi_turn_out_of_order_turn():
    acc = MultiTurnRouting(LAYOUT, request=7)
    acc.add_turn(rows(6, 3, seed=1), 7)
    with pytest.raises(RoutingMismatchError, match=r"request 7 turn 1: seq_len=4 is shorter than "
                                                   r"the 7 tokens of the earlier turns"):
        acc.add_turn(rows(3, 3, seed=2), 4)
    with pytest.raises(RoutingMismatchError, match="the sequence has 9 tokens but its routing "
                                                   "covers 6 tokens"):
        acc.sequence(9)


# ------------------------------------------------------------------ verl, batch, replay
def test_from_verl_padded_masks_zero_rows_and_final_token():
    B, S = 2, 6
    routed = torch.zeros(B, S, 5, K, dtype=torch.int16)
    att = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    real = torch.from_numpy(rows(B * S, 5, seed=30)).view(B, S, 5, K).to(torch.int16)
    routed[att.bool()] = real[att.bool()]
    routed[0, 4] = 0  # verl leaves the last real token's row zero
    routed[1, 5] = 0
    b = from_verl_padded(routed, att, LAYOUT)
    assert b.replay_mask.tolist() == [[False, False, True, True, False, False],
                                      [True, True, True, True, True, False]]
    assert (b.indices[~b.replay_mask] == -1).all()
    assert torch.equal(b.indices[0, 2], real[0, 2][list(MOE_IDS)])


def test_routing_dropped_between_generator_and_trainer():
    with pytest.raises(RoutingMismatchError,
                       match=r"no 'routed_experts' \(keys: \['attention_mask', 'input_ids'\]"):
        routing_from_batch({"input_ids": 1, "attention_mask": 2})


def test_adapter_batch_replays_in_the_model_layout():
    reqs = requests(5)
    b = vllm_batch(reqs, PROMPTS, RESPONSES, LAYOUT)
    rr = RouterReplay(RouterReplayConfig(mode="R3"), num_experts=E, top_k=K,
                      moe_layer_ids=list(MOE_IDS), num_hidden_layers=5)
    b.apply(rr)
    assert rr.layer_mapping == "moe"
    B, S = b.replay_mask.shape
    rr.set_action(ReplayAction.REPLAY_FORWARD)
    logits = torch.randn(B * S, E)
    plan = rr.route(4, logits, topk_fn=lambda x: torch.topk(x, K).indices)
    got = plan.expert_indices.view(B, S, K)
    Pm = max(PROMPTS)
    for i, (p, g) in enumerate(zip(PROMPTS, RESPONSES)):
        for j in range(p + g - 1):
            assert np.array_equal(got[i, Pm - p + j].numpy(), reqs[i][j, 4])
    # padding rows fell back to native top-k, not expert 0
    native = torch.topk(logits, K).indices.to(torch.int32).view(B, S, K)
    assert torch.equal(got[~b.replay_mask], native[~b.replay_mask])


def test_sglang_payload_that_fits_two_layer_counts_is_refused():
    """DeepSeek-V3 has 61 hidden and 58 MoE layers. A payload of 58 rows x 61 layers has the
    length of 61 rows x 58 layers: for a request of 62 tokens (61 rows expected) it used to
    be read as 61 rows of 58 MoE layers, the routes landing on the wrong layers. The
    engine's layer count settles it; without it the payload is refused."""
    Kd = 2
    ds = ModelShape(num_experts=16, top_k=Kd, moe_layer_ids=tuple(range(3, 61)),
                     num_hidden_layers=61)
    rng = np.random.default_rng(0)
    true = np.stack([rng.permutation(16)[:Kd] for _ in range(58 * 61)]).reshape(58, 61, Kd)
    true[:, :3] = 0  # the dense layers, as the engine leaves them
    payload = {"routed_experts": b64_int32(true.astype(np.int32))}
    with pytest.raises(RoutingMismatchError, match=r"fit both 61 token rows x L=58 and 58 rows "
                                                   r"x L=61.*num_layers=58.*num_layers=61"):
        sglang_sequences([payload], [62], ds)
    # the engine says L=61 (all hidden layers): 58 rows, not the 61 the request needs
    with pytest.raises(RoutingMismatchError, match=r"do not fit the expected 61 token rows"):
        sglang_sequences([payload], [62], ds, num_layers=61)
    # the right request (59 tokens) with the engine's layer count reads correctly
    seq = sglang_sequences([payload], [59], ds, num_layers=61)[0]
    assert np.array_equal(seq.indices[:58].numpy(), true[:, 3:])
    # an unambiguous payload needs no layer count (57 rows x 61 layers: 57*61 is not a
    # multiple of 58)
    ok = {"routed_experts": b64_int32(true[:57].astype(np.int32))}
    assert sglang_sequences([ok], [58], ds)[0].num_tokens == 58
    with pytest.raises(RoutingMismatchError, match="num_layers=7 is neither"):
        sglang_sequences([ok], [58], ds, num_layers=7)


# ------------------------------------------------------------------ verl: zero rows in the mask
def verl_multi_turn(k: int):
    """verl's tool agent loop, two rows of S=8: row 0 is left-padded by 2, its rollout
    routing covers positions 2..4 (the last generation's request), positions 5, 6 are tool
    tokens appended after the last generation and 7 the final token: zero rows inside the
    attention mask. Row 1 is routed at 0..6, its final token 7 is zero. Experts are drawn
    from 1..15, so no routed row is zero by chance. Returns the layout, routed int16
    [2, 8, 3, k] (absolute layers; layer 1 dense), attention_mask, and the rows that hold
    routing."""
    layout = ModelShape(num_experts=16, top_k=k, moe_layer_ids=(0, 2), num_hidden_layers=3)
    rng = np.random.default_rng(k)
    routed = np.stack([rng.permutation(np.arange(1, 16))[:k] for _ in range(2 * 8 * 3)])
    routed = routed.reshape(2, 8, 3, k)
    routed[:, :, 1] = 0  # the dense layer
    att = torch.ones(2, 8, dtype=torch.int64)
    att[0, :2] = 0
    routed[0, :2] = 0
    routed[0, 5:] = 0
    routed[1, 7] = 0
    has = torch.zeros(2, 8, dtype=torch.bool)
    has[0, 2:5] = True
    has[1, :7] = True
    return layout, torch.from_numpy(routed.astype(np.int16)), att, has


def expect_rows(batch, routed, has):
    assert torch.equal(batch.replay_mask, has)
    assert (batch.indices[~has] == -1).all()
    assert torch.equal(batch.indices[has], routed[has][:, [0, 2]])


@pytest.mark.parametrize("k", [1, 2, 8])
def test_verl_zero_rows_inside_the_attention_mask_are_refused_by_default(k):
    layout, routed, att, _ = verl_multi_turn(k)
    hint = "zero_rows='missing'" if k > 1 else "zero_rows='expert0'"
    with pytest.raises(RoutingMismatchError, match=rf"row \(b=0, s=5\) is all zeros in every MoE "
                                                   rf"layer .*\(2 such rows\).*{hint}"):
        from_verl_padded(routed, att, layout)


@pytest.mark.parametrize("k", [1, 2, 8])
def test_verl_zero_rows_as_missing(k):
    layout, routed, att, has = verl_multi_turn(k)
    if k == 1:  # a zero row is also a real route to expert 0: never dropped on a guess
        with pytest.raises(ValueError, match=r"zero_rows='missing' needs top_k >= 2"):
            from_verl_padded(routed, att, layout, zero_rows="missing")
        return
    expect_rows(from_verl_padded(routed, att, layout, zero_rows="missing"), routed, has)
    # a token that is zero in one MoE layer only is a broken row, not a missing one
    routed[1, 3, 2] = 0
    with pytest.raises(RoutingMismatchError, match=r"token 11, MoE layer 2 repeats an expert"):
        from_verl_padded(routed, att, layout, zero_rows="missing")


@pytest.mark.parametrize("k", [1, 2, 8])
def test_verl_replay_mask_says_which_rows_hold_routing(k):
    layout, routed, att, has = verl_multi_turn(k)
    expect_rows(from_verl_padded(routed, att, layout, replay_mask=has), routed, has)
    expect_rows(from_verl_padded(routed, att, layout, replay_mask=has.numpy()), routed, has)
    if k > 1:
        with pytest.raises(ValueError, match=r"zero_rows='expert0' needs top_k=1"):
            from_verl_padded(routed, att, layout, replay_mask=has, zero_rows="expert0")
        return
    # top_k=1: a real route to expert 0 in every MoE layer is a zero row too; inside the
    # mask it is refused until the caller says zero rows are routes
    routed[1, 3] = 0
    with pytest.raises(RoutingMismatchError, match=r"row \(b=1, s=3\) .*zero_rows='expert0'"):
        from_verl_padded(routed, att, layout, replay_mask=has)
    b = from_verl_padded(routed, att, layout, replay_mask=has, zero_rows="expert0")
    expect_rows(b, routed, has)
    assert (b.indices[1, 3] == 0).all() and b.replay_mask[1, 3]


@pytest.mark.parametrize("k", [1, 2, 8])
def test_verl_own_r3_replay_mask(k):
    """verl's build_r3_replay_mask (jagged, over the unpadded tokens) replays every row but
    the final one, so it covers the trailing zero rows."""
    utils = pytest.importorskip("verl.utils.megatron.router_replay_utils",
                                reason="verl (with its Megatron utilities) is not installed")
    layout, routed, att, has = verl_multi_turn(k)
    lens = att.sum(dim=1)
    input_ids = torch.nested.nested_tensor([torch.arange(int(n)) for n in lens],
                                           layout=torch.jagged)
    response_mask = torch.ones(2, 4, dtype=torch.int64)
    verl_mask = utils.build_r3_replay_mask(input_ids, response_mask)
    with pytest.raises(RoutingMismatchError, match=r"row \(b=0, s=5\)"):
        from_verl_padded(routed, att, layout, replay_mask=verl_mask)
    if k > 1:
        b = from_verl_padded(routed, att, layout, replay_mask=verl_mask, zero_rows="missing")
        expect_rows(b, routed, has)
    # the jagged mask must match the attention mask's lengths
    short = torch.nested.nested_tensor([torch.ones(3, dtype=torch.bool)] * 2,
                                       layout=torch.jagged)
    with pytest.raises(RoutingMismatchError, match=r"jagged replay_mask has sequence lengths "
                                                   r"\[3, 3\] but the attention mask has \[6, 8\]"):
        from_verl_padded(routed, att, layout, replay_mask=short)


def test_verl_bad_replay_mask_and_zero_rows_arguments():
    layout, routed, att, has = verl_multi_turn(2)
    bad = has.clone()
    bad[0, 1] = True  # padding
    with pytest.raises(RoutingMismatchError, match=r"replay_mask is True at row \(b=0, s=1\), "
                                                   r"outside the attention mask"):
        from_verl_padded(routed, att, layout, replay_mask=bad)
    with pytest.raises(RoutingMismatchError, match=r"replay_mask must be bool \[B, S\]=\(2, 8\)"):
        from_verl_padded(routed, att, layout, replay_mask=has.long())
    with pytest.raises(ValueError, match=r"zero_rows must be one of .*got 'skip'"):
        from_verl_padded(routed, att, layout, zero_rows="skip")


# ------------------------------------------------------------------ ReplayBatch as bytes
def _same_batch(a, b):
    assert torch.equal(a.indices, b.indices) and a.indices.dtype == b.indices.dtype
    assert torch.equal(a.replay_mask, b.replay_mask)
    assert (a.cu_seqlens is None) == (b.cu_seqlens is None)
    if a.cu_seqlens is not None:
        assert torch.equal(a.cu_seqlens, b.cu_seqlens)
    assert a.mappings == b.mappings and a.layer_index == b.layer_index


@pytest.mark.parametrize("kind", ["padded", "thd"])
def test_replay_batch_bytes_and_pickle_round_trip(kind):
    import pickle

    from replay_ops.router_replay.adapters import ReplayBatch

    reqs = requests(5)
    reqs[1] = None
    b = vllm_batch(reqs, PROMPTS, RESPONSES, LAYOUT, packing=kind, allow_missing=True)
    _same_batch(b, ReplayBatch.from_bytes(b.to_bytes(num_experts=E)))
    _same_batch(b, pickle.loads(pickle.dumps(b)))  # Ray pickles task arguments
    # the order of each row's experts is kept (replay must not sort it)
    assert not torch.equal(b.indices, b.indices.sort(dim=-1).values)


def test_replay_batch_bytes_are_compact_and_checked():
    import pickle

    from replay_ops.router_replay.adapters import ReplayBatch
    import os

    d = np.load(os.path.join(os.path.dirname(__file__), "..", "bench", "data",
                             "dev_qwen3moe_e128_k8_l8.npz"))
    r = torch.from_numpy(d["routing_trained"][:4096].astype(np.int16))
    cu = torch.arange(0, 4097, 512)
    b = ReplayBatch(r, torch.ones(4096, dtype=torch.bool), cu, ["moe"] * 8)
    data = pickle.dumps(b)
    assert len(data) * 3 < r.numel() * 2  # order kept, no token ids: > 3x below int16
    _same_batch(b, pickle.loads(data))
    blob = b.to_bytes(num_experts=128)
    for i in (5, 30, len(blob) - 1):  # header, mask/JSON, codec payload
        bad = bytearray(blob)
        bad[i] ^= 0x10
        with pytest.raises(RoutingMismatchError, match="ReplayBatch.from_bytes"):
            ReplayBatch.from_bytes(bytes(bad))
    with pytest.raises(RoutingMismatchError, match="not a ReplayBatch payload"):
        ReplayBatch.from_bytes(b"RRCODEC\x00" + bytes(40))


def test_deprecated_adapter_names_warn_and_still_work():
    import replay_ops.router_replay as rr
    from replay_ops.router_replay import adapters
    from replay_ops.router_replay.adapters import batch

    for mod in (adapters, rr, batch):
        with pytest.warns(DeprecationWarning, match="ModelLayout is deprecated; use ModelShape"):
            assert mod.ModelLayout is ModelShape
    shape = ModelShape(8, 2, (0, 1), 2)
    routed = [torch.tensor([[[0, 1], [2, 3]]] * 3)]
    new = adapters.vllm_batch(routed, [2], [2], shape, packing="thd")
    with pytest.warns(DeprecationWarning, match=r"vllm_batch\(layout_kind=...\) is deprecated; "
                                                r"use packing="):
        old = adapters.vllm_batch(routed, [2], [2], shape, layout_kind="thd")
    assert torch.equal(old.indices, new.indices) and torch.equal(old.cu_seqlens, new.cu_seqlens)
    meta = [{"routed_experts": adapters.encode_sglang(routed[0])}]
    new = adapters.sglang_batch(meta, [4], [2], shape, packing="thd")
    with pytest.warns(DeprecationWarning, match=r"sglang_batch\(layout_kind=...\)"):
        old = adapters.sglang_batch(meta, [4], [2], shape, layout_kind="thd")
    assert torch.equal(old.indices, new.indices) and old.cu_seqlens.tolist() == [0, 4]
    with pytest.raises(ValueError, match="unknown packing='bshd'"):
        adapters.vllm_batch(routed, [2], [2], shape, packing="bshd")


def test_deprecated_layout_keyword_warns_and_still_works():
    """The model shape's argument was `layout=`; it is `model_shape=` now (one release)."""
    from replay_ops.router_replay import adapters

    shape = ModelShape(8, 2, (0, 1), 2)
    routed = [torch.tensor([[[0, 1], [2, 3]]] * 3)]
    meta = [{"routed_experts": adapters.encode_sglang(routed[0])}]
    calls = {
        "vllm_batch": lambda **kw: adapters.vllm_batch(routed, [2], [2], packing="thd", **kw),
        "vllm_sequences": lambda **kw: adapters.vllm_sequences(routed, [2], [2], **kw),
        "sglang_batch": lambda **kw: adapters.sglang_batch(meta, [4], [2], packing="thd", **kw),
        "sglang_sequences": lambda **kw: adapters.sglang_sequences(meta, [4], **kw),
        "MultiTurnRouting": lambda **kw: adapters.MultiTurnRouting(**kw),
        "missing_sequence": lambda **kw: adapters.missing_sequence(n=3, **kw),
    }
    for who, call in calls.items():
        new = call(model_shape=shape)
        with pytest.warns(DeprecationWarning,
                          match=rf"{who}: the argument layout= is deprecated; use model_shape="):
            old = call(layout=shape)
        if hasattr(new, "indices"):
            assert torch.equal(old.indices, new.indices), who
        elif isinstance(new, list):
            assert all(torch.equal(a.indices, b.indices) for a, b in zip(old, new)), who
        with pytest.raises(TypeError, match=rf"{who}: got both layout= \(deprecated\) and "
                                            r"model_shape="):
            call(layout=shape, model_shape=shape)
    acc = adapters.MultiTurnRouting(shape)
    with pytest.warns(DeprecationWarning, match="MultiTurnRouting.layout is deprecated"):
        assert acc.layout is shape

def test_deprecated_layout_module_warns_and_still_works():
    import importlib
    import sys

    from replay_ops.router_replay.adapters import batch

    sys.modules.pop("replay_ops.router_replay.adapters.layout", None)
    with pytest.warns(DeprecationWarning, match=r"adapters.layout is deprecated; import "
                                                r"replay_ops.router_replay.adapters.batch"):
        old = importlib.import_module("replay_ops.router_replay.adapters.layout")
    assert old.ReplayBatch is batch.ReplayBatch and old.pack_thd is batch.pack_thd
    with pytest.warns(DeprecationWarning, match="use ModelShape"):
        assert old.ModelLayout is ModelShape
