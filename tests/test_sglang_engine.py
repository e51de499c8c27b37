"""R3 against a real SGLang: the routing an SGLang server returns, replayed through replay_ops.

SGLang (sglang 0.5.23 in build/sglang-venv on a CPU machine, its CPU engine behind the hook
in replay_ops/demo/sglang_cpu, `make install-sglang`; the installed sglang on a GPU machine)
serves two small checkpoints built here with random weights (3 layers, 16 experts, top-2)
on 127.0.0.1, both started at once for the module: a Qwen3-MoE (every layer MoE) in bf16
that most tests use, and a DeepSeek-V3 whose layer 0 is dense in fp32 (form 7). The
training side is the same checkpoint in fp32 through transformers, patched with
`replay_ops.integrations.hf`.

The Qwen3-MoE's server runs with replay_ops' route-injection plugin turned on
(REPLAY_OPS_SGLANG_INJECT=1, replay_ops.integrations.sglang), which is inert for requests
without routes: the same server serves the plain tests and the injection tests (after
`# route injection` below).

Expected values come from SGLang's payload decoded here with numpy (not by the adapter),
and are compared with the routing the patched model actually used. With
REPLAY_OPS_REQUIRE_CLIENTS=1 (`make test`) an SGLang that is missing or does not start
fails these tests; otherwise they skip.
"""
from __future__ import annotations

import base64
import types

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from replay_ops.demo import (  # noqa: E402
    metrics,
    sglang_engine,
    sglang_rollout,
    vllm_rollout,
)
from replay_ops.demo.engine_server import HttpError  # noqa: E402
from replay_ops.router_replay.adapters import (  # noqa: E402
    ModelShape,
    RoutingMismatchError,
    sglang_batch,
    sglang_sequences,
)
from replay_ops.router_replay.adapters.sglang import openai_meta_infos  # noqa: E402
from replay_ops.router_replay import inject  # noqa: E402
from replay_ops.testing import tiny  # noqa: E402

import _engine_helpers as h  # noqa: E402

L, E, K = 3, 16, 2
MODEL = dict(vocab_size=256, hidden_size=64, num_heads=2, top_k=K, expert_size=32,
             initializer_range=0.06, num_layers=L, num_experts=E)
GEN = 8
PROMPT_LENS = h.PROMPT_LENS
MAX_PAYLOAD = 65536  # REPLAY_OPS_INJECT_MAX_BYTES of the Qwen3-MoE's server
QWEN = ModelShape(E, K, (0, 1, 2), L)


def _unavailable(msg: str):
    h.unavailable("SGLang", msg)




# a chat template that joins the messages' texts (a message's content is a string, or a
# list of text parts)
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}"
                 "{% endif %}{% if not loop.last %} {% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The module's two SGLang servers, started at once (a start takes 70-250 s on 2 shared
    cores): the Qwen3-MoE (bf16, every layer MoE, with a chat template) that most tests use,
    and the DeepSeek-V3 with a dense first layer (fp32) of form 7."""
    try:
        runtime = sglang_engine.find_sglang(install=False)
    except sglang_engine.SglangUnavailable as e:
        _unavailable(str(e))
    root = tmp_path_factory.mktemp("sglang_models")
    model = tiny.tiny_model("qwen3_moe", seed=0, **MODEL)
    path = sglang_engine.save_checkpoint(model, str(root / "qwen3_moe"))
    template = root / "chat_template.jinja"  # the checkpoint's tokenizer has none
    template.write_text(CHAT_TEMPLATE)
    qwen = sglang_engine.SglangServer(path, runtime, dtype="bfloat16", context_length=512,
                                      start_timeout=600, inject=True,
                                      extra_args=("--chat-template", str(template)),
                                      env={inject.MAX_BYTES_ENV: str(MAX_PAYLOAD)})
    ds_model = tiny.tiny_model("deepseek_v3", seed=0, **MODEL)  # layer 0 dense
    ds_path = sglang_engine.save_checkpoint(ds_model, str(root / "deepseek_v3"))
    ds = sglang_engine.SglangServer(ds_path, runtime, dtype="float32", context_length=512,
                                    start_timeout=600)
    started = []
    try:
        for srv in (qwen, ds):
            srv.launch()
            started.append(srv)
        for srv in started:
            srv.wait_ready()
    except sglang_engine.SglangUnavailable as e:
        for srv in started:
            srv.stop()
        _unavailable(str(e))
    print(f"sglang servers: started in {qwen.start_s:.1f} s and {ds.start_s:.1f} s "
          f"({runtime.source})")
    yield {"qwen3_moe": qwen, "deepseek_v3": ds}
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers["qwen3_moe"]


@pytest.fixture(scope="module")
def trainer(server):
    cfg = types.SimpleNamespace(vocab_size=MODEL["vocab_size"], progress=False)
    eng = vllm_rollout.TrainingEngine(cfg, server.model_dir, torch.device("cpu"))
    yield eng
    eng.remove()


def decode(payload: str) -> np.ndarray:
    """SGLang's field decoded as its own helper does (little-endian int32), [rows, L, K]."""
    return np.frombuffer(base64.b64decode(payload), dtype="<i4").reshape(-1, L, K)


def prompts(seed: int):
    return h.prompts(seed, MODEL["vocab_size"], PROMPT_LENS)


def layout(eng) -> ModelShape:
    return ModelShape.of(eng.moe)


def test_generate_routing_replays_with_zero_mismatch(server, trainer):
    """A batched /generate (start 0): the payloads through the adapter with the requests that
    were sent, replayed by the fp32 training engine: 0.00% mismatch on every MoE layer,
    the same ids in the same order; the model's own routing agrees with SGLang's rows, not with
    them shifted by one token."""
    gens = server.generate_batch(prompts(1), [GEN] * len(PROMPT_LENS),
                                 seeds=list(range(len(PROMPT_LENS))))
    lay = layout(trainer)
    assert lay.moe_layer_ids == (0, 1, 2) and lay.num_hidden_layers == L
    raw = {}
    for i, g in enumerate(gens):
        assert len(g.prompt_ids) == PROMPT_LENS[i] and len(g.token_ids) == GEN
        assert len(g.logprobs) == GEN
        # form 1: the start is never echoed; form 6: 0.5.23 names no dtype (int32)
        assert "routed_experts_start_len" not in g.meta_info
        assert "routed_experts_dtype" not in g.meta_info
        a = decode(g.meta_info["routed_experts"])
        assert a.shape == (PROMPT_LENS[i] + GEN - 1, L, K)
        assert ((a >= 0) & (a < E)).all() and (a[..., 0] != a[..., 1]).all()
        raw[i] = a
    ids = list(range(len(gens)))
    P = {i: PROMPT_LENS[i] for i in ids}
    routing, mask, batch = sglang_rollout.routing_from_generations(dict(zip(ids, gens)),
                                                                   trainer.moe)
    assert batch.mappings == ["moe"] * len(ids)  # L = every hidden layer = the MoE layers
    seqs = {i: torch.tensor(gens[i].prompt_ids + gens[i].token_ids) for i in ids}
    used, lp = h.replay(trainer, seqs, P, routing, mask)
    per_layer_r3 = torch.zeros(L)
    per_layer_own = torch.zeros(L)
    shifted = torch.zeros(L)
    rows = 0
    for i in ids:
        n = len(seqs[i]) - 1
        ref = torch.from_numpy(raw[i].astype(np.int64))
        r3 = used["R3"][i][:n].long()
        assert torch.equal(r3, ref), f"request {i}: replayed routing differs from SGLang's"
        per_layer_r3 += h.set_mismatch(r3, ref).sum(0)
        nat = used["own"][i][:n]
        per_layer_own += h.set_mismatch(nat, ref).sum(0)
        shifted += h.set_mismatch(nat[1:], ref[:-1]).sum(0)
        rows += n
    r3_pct = (100 * per_layer_r3 / rows).tolist()
    own_pct = (100 * per_layer_own / rows).tolist()
    print(f"{rows} routed tokens; per MoE layer: own routing vs SGLang "
          f"{[f'{v:.2f}%' for v in own_pct]}, R3 {[f'{v:.2f}%' for v in r3_pct]}")
    assert r3_pct == [0.0] * L
    assert per_layer_own.sum() < 0.3 * rows * L
    assert per_layer_own.sum() * 2 < shifted.sum()
    sg_lp = {i: torch.tensor(gens[i].logprobs) for i in ids}
    res = metrics.compare(used, lp, routing, sg_lp, ids, infer_mask=mask)
    print(f"k3 KL own routing {res['own']['kl_k3_mean']:.3e}, R3 {res['R3']['kl_k3_mean']:.3e}")
    assert res["R3"]["routing_mismatch"] == 0.0
    if res["own"]["routing_mismatch"] > 0:
        assert res["R3"]["kl_k3_mean"] < res["own"]["kl_k3_mean"]
    assert res["R3"]["abs_dlogprob_max"] < 0.1  # bf16 vs fp32, same routing


def test_multi_turn_start_is_previous_length_minus_one(server, trainer):
    """Form 2: turn 2 sends the whole conversation with routed_experts_start_len = turn 1's
    length - 1: the two payloads cover every token once and replay with 0.00% mismatch.
    With start = turn 1's full length, turn 1's last token is routed in neither turn: the
    adapter refuses it, takes a supplied row for it, or masks it under omitted='mask'."""
    lay = layout(trainer)
    p1 = prompts(2)[2]  # 12 tokens
    t1 = server.generate(p1, 6, seed=11)
    n1 = t1.seq_len
    p2 = t1.prompt_ids + t1.token_ids + [7, 8, 9, 10]  # 22 tokens
    t2 = server.generate(p2, 5, seed=12, start=n1 - 1)
    n2 = t2.seq_len
    a1, a2 = decode(t1.meta_info["routed_experts"]), decode(t2.meta_info["routed_experts"])
    assert a1.shape[0] == n1 - 1 and a2.shape[0] == n2 - 1 - (n1 - 1)  # only the new rows
    # the same prompt without a start: its rows from n1 - 1 on (prompt rows) are the same
    full = server.generate(p2, 5, seed=12)
    af = decode(full.meta_info["routed_experts"])
    assert np.array_equal(af[:n1 - 1], a1)  # the prefix's rows come from turn 1's run
    assert np.array_equal(af[n1 - 1:len(p2) - 1], a2[:len(p2) - n1])
    conv = [[t1.meta_info, t2.meta_info]]
    seq = sglang_sequences(conv, [[n1, n2]], lay, requests=[[t1.request, t2.request]])[0]
    ref = np.concatenate([a1, a2])
    assert np.array_equal(seq.indices[:n2 - 1].numpy(), ref) and seq.mask[:n2 - 1].all()
    tokens = torch.tensor(t2.prompt_ids + t2.token_ids)
    used, _ = h.replay(trainer, {0: tokens}, {0: len(p2)}, {0: seq.indices}, {0: seq.mask})
    assert torch.equal(used["R3"][0][:n2 - 1].long(), torch.from_numpy(ref.astype(np.int64)))
    # without the requests the turn-2 payload is read with start 0 and refused, with a hint
    with pytest.raises(RoutingMismatchError, match=rf"was it sent with routed_experts_start_len"
                                                   rf"={n1 - 1}\?"):
        sglang_sequences(conv, [[n1, n2]], lay)
    # start = turn 1's full length: token n1 - 1 is routed in neither turn
    t3 = server.generate(p2, 5, seed=12, start=n1)
    a3 = decode(t3.meta_info["routed_experts"])
    assert a3.shape[0] == n2 - 1 - n1
    conv3 = [[t1.meta_info, t3.meta_info]]
    with pytest.raises(RoutingMismatchError,
                       match=rf"request 0 turn 1: SGLang returned no routing for tokens "
                             rf"{n1 - 1}\.\.{n1 - 1} \(routed_experts_start_len={n1}\).*send "
                             rf"routed_experts_start_len = the previous turn's length - 1 = "
                             rf"{n1 - 1}"):
        sglang_sequences(conv3, [[n1, n2]], lay, starts=[[0, n1]])
    row = af[n1 - 1:n1].copy()  # that token's row, from a request that routed it
    s3 = sglang_sequences(conv3, [[n1, n2]], lay, starts=[[0, n1]],
                          prefix_routing=[{1: row}])[0]
    assert np.array_equal(s3.indices[:n2 - 1].numpy(), np.concatenate([a1, row, a3]))
    b = sglang_batch(conv3, [[n1, n2]], [len(p2)], lay, starts=[[0, n1]], omitted="mask",
                     packing="thd")
    assert b.replay_mask.tolist() == [True] * (n1 - 1) + [False] + [True] * (n2 - 1 - n1) \
        + [False]


def test_batched_generate_takes_one_int_start(server, trainer):
    """Form 4: a batched /generate takes a single int routed_experts_start_len (a list is
    answered with HTTP 400); the adapter takes that one int, or the batched body itself."""
    lay = layout(trainer)
    ps = [prompts(3)[0], prompts(3)[3]]  # 5 and 16 tokens
    body = {"input_ids": ps, "sampling_params": server.sampling(4, 1.0, None),
            "return_routed_experts": True, "routed_experts_start_len": [1, 2]}
    with pytest.raises(HttpError, match=r"routed_experts_start_len.*valid integer") as e:
        server.post("/generate", body)
    assert e.value.status == 400
    body["routed_experts_start_len"] = 3
    outs = server.post("/generate", body)
    metas = [o["meta_info"] for o in outs]
    lens = [len(p) + len(o["output_ids"]) for p, o in zip(ps, outs)]
    rows = [decode(m["routed_experts"]) for m in metas]
    assert [r.shape[0] for r in rows] == [n - 1 - 3 for n in lens]
    a = sglang_sequences(metas, lens, lay, starts=3, omitted="mask")
    b = sglang_sequences(metas, lens, lay, requests=body, omitted="mask")
    for s, t, r in zip(a, b, rows):
        assert torch.equal(s.indices, t.indices) and torch.equal(s.mask, t.mask)
        assert np.array_equal(s.indices[3:-1].numpy(), r) and not s.mask[:3].any()
    with pytest.raises(RoutingMismatchError, match=r"SGLang returned no routing for tokens "
                                                   r"0\.\.2 \(routed_experts_start_len=3\)"):
        sglang_sequences(metas, lens, lay, requests=body)
    # the demo's client: one batch per distinct start, results in request order
    gens = server.generate_batch(ps, [4, 4], starts=[0, 3])
    assert [g.request["routed_experts_start_len"] for g in gens] == [0, 3]
    assert [decode(g.meta_info["routed_experts"]).shape[0] for g in gens] == \
        [gens[0].seq_len - 1, gens[1].seq_len - 4]


def test_openai_completions_payload_and_choices(server, trainer):
    """Form 3: /v1/completions carries the payload in the response's sglext.routed_experts,
    for the first choice only: with 2 prompts and n=2, 4 choices and one payload; the
    adapter refuses the other choices by name. One prompt with n=1 replays exactly, and a
    second turn sent with routed_experts_start_len through the endpoint joins it."""
    lay = layout(trainer)
    p = prompts(4)
    resp = server.completions([p[0], p[2]], 3, n=2)
    assert len(resp["choices"]) == 4 and "routed_experts" in resp["sglext"]
    assert all("sglext" not in c for c in resp["choices"])
    with pytest.raises(RoutingMismatchError, match=r"choices \[1, 2, 3\] \(of 4\) have no "
                                                   r"routing payload"):
        openai_meta_infos(resp)
    metas = openai_meta_infos(resp, allow_missing=True)
    assert metas[1:] == [None, None, None]
    c0 = resp["choices"][0]
    n0 = len(c0["prompt_token_ids"]) + len(c0["token_ids"])
    assert decode(metas[0]["routed_experts"]).shape[0] == n0 - 1
    one = server.completions(p[3], GEN, seed=3)
    (c,) = one["choices"]
    n1 = len(c["prompt_token_ids"]) + len(c["token_ids"])
    seq1 = sglang_sequences(openai_meta_infos(one), [n1], lay)[0]
    ref1 = decode(one["sglext"]["routed_experts"])
    assert np.array_equal(seq1.indices[:-1].numpy(), ref1)
    tokens = c["prompt_token_ids"] + c["token_ids"]
    used, _ = h.replay(trainer, {0: torch.tensor(tokens)}, {0: len(c["prompt_token_ids"])},
                     {0: seq1.indices}, {0: seq1.mask})
    assert torch.equal(used["R3"][0][:-1].long(), torch.from_numpy(ref1.astype(np.int64)))
    # turn 2 through the same endpoint, start = turn 1's length - 1
    two = server.completions(tokens + [5, 6], 4, start=n1 - 1)
    (c2,) = two["choices"]
    n2 = len(c2["prompt_token_ids"]) + len(c2["token_ids"])
    conv = [openai_meta_infos(one) + openai_meta_infos(two)]
    seq = sglang_sequences(conv, [[n1, n2]], lay, starts=[[0, n1 - 1]])[0]
    assert np.array_equal(seq.indices[:n2 - 1].numpy(),
                          np.concatenate([ref1, decode(two["sglext"]["routed_experts"])]))


def test_openai_chat_completions_payload_and_choices(server, trainer):
    """Form 3 through /v1/chat/completions: the payload is in the response's
    sglext.routed_experts for the first choice only (n=2: choice 1 refused by name); with n=1
    it covers the prompt as SGLang templated it (the choice's prompt_token_ids) and the reply,
    and replays exactly."""
    lay = layout(trainer)
    p = prompts(7)[1]  # 9 tokens
    messages = [{"role": "user", "content": " ".join(f"t{t}" for t in p)}]
    resp = server.chat_completions(messages, 3, n=2, seed=1)
    assert len(resp["choices"]) == 2 and "routed_experts" in resp["sglext"]
    with pytest.raises(RoutingMismatchError, match=r"choices \[1\] \(of 2\) have no routing "
                                                   r"payload"):
        openai_meta_infos(resp, who="chat")
    one = server.chat_completions(messages, GEN, seed=2)
    (c,) = one["choices"]
    prompt, out = c["prompt_token_ids"], c["response_token_ids"]  # the templated prompt
    assert len(prompt) == one["usage"]["prompt_tokens"] and len(out) == GEN
    n = len(prompt) + GEN
    ref = decode(one["sglext"]["routed_experts"])
    assert ref.shape == (n - 1, L, K)
    seq = sglang_sequences(openai_meta_infos(one), [n], lay)[0]
    assert np.array_equal(seq.indices[:-1].numpy(), ref) and seq.mask[:-1].all()
    used, _ = h.replay(trainer, {0: torch.tensor(prompt + out)}, {0: len(prompt)},
                       {0: seq.indices}, {0: seq.mask})
    assert torch.equal(used["R3"][0][:-1].long(), torch.from_numpy(ref.astype(np.int64)))


def test_dense_layer_rows_and_replay_deepseek(servers):
    """Form 7, from a real DeepSeek-V3 with a dense first layer (first_k_dense_replace=1):
    SGLang's payload has every hidden layer (L=3); the dense layer's rows are all 0 (its
    capture buffer is zero-initialised and only MoE layers write to it); the MoE layers'
    rows replay with 0.00% mismatch, the same ids in the same order. The same payload read
    with layer 1 dense (misaligned layers) is refused."""
    srv = servers["deepseek_v3"]
    cfg = types.SimpleNamespace(vocab_size=MODEL["vocab_size"], progress=False)
    eng = vllm_rollout.TrainingEngine(cfg, srv.model_dir, torch.device("cpu"))
    try:
        lay = layout(eng)
        assert lay.moe_layer_ids == (1, 2) and lay.num_hidden_layers == L
        gens = srv.generate_batch(prompts(8), [GEN] * len(PROMPT_LENS),
                                  seeds=list(range(len(PROMPT_LENS))))
        raw = {}
        for i, g in enumerate(gens):
            a = decode(g.meta_info["routed_experts"])
            assert a.shape == (PROMPT_LENS[i] + GEN - 1, L, K)
            assert (a[:, 0] == 0).all(), f"request {i}: dense layer 0 rows {a[:, 0].tolist()}"
            moe = a[:, 1:]
            assert ((moe >= 0) & (moe < E)).all() and (moe[..., 0] != moe[..., 1]).all()
            raw[i] = a
        ids = list(range(len(gens)))
        routing, mask, batch = sglang_rollout.routing_from_generations(dict(zip(ids, gens)),
                                                                       eng.moe)
        assert batch.mappings == ["absolute"] * len(ids)  # L = every hidden layer
        seqs = {i: torch.tensor(gens[i].prompt_ids + gens[i].token_ids) for i in ids}
        used, _ = h.replay(eng, seqs, {i: PROMPT_LENS[i] for i in ids}, routing, mask)
        per_layer_r3 = torch.zeros(2)
        per_layer_own = torch.zeros(2)
        rows = 0
        for i in ids:
            n = len(seqs[i]) - 1
            ref = torch.from_numpy(raw[i][:, 1:].astype(np.int64))
            r3 = used["R3"][i][:n].long()
            assert torch.equal(r3, ref), f"request {i}: replayed routing differs from SGLang's"
            per_layer_r3 += h.set_mismatch(r3, ref).sum(0)
            per_layer_own += h.set_mismatch(used["own"][i][:n], ref).sum(0)
            rows += n
        print(f"deepseek_v3: {rows} routed tokens; MoE layers 1, 2: own routing vs SGLang "
              f"{[f'{v:.2f}%' for v in (100 * per_layer_own / rows).tolist()]}, R3 "
              f"{[f'{v:.2f}%' for v in (100 * per_layer_r3 / rows).tolist()]}")
        assert per_layer_r3.tolist() == [0.0, 0.0]
        assert per_layer_own.sum() < 0.3 * rows * 2
        misaligned = ModelShape(E, K, (0, 2), L)  # a model shape whose dense layer is 1
        with pytest.raises(RoutingMismatchError, match=r"request 0 turn 0: token 0, layer 1 "
                                                       r"routes to experts .* but the model's "
                                                       r"layer 1 is dense"):
            sglang_sequences([gens[0].meta_info], [gens[0].seq_len], misaligned, num_layers=L)
    finally:
        eng.remove()


def test_field_missing_says_the_engine_flag(server, trainer):
    """Form 5: without routing SGLang omits the field silently; the adapter names the flag
    (here the request did not ask; a server without the flag omits it the same way)."""
    lay = layout(trainer)
    g = server.generate(prompts(5)[0], 3, return_routed_experts=False)
    assert "routed_experts" not in g.meta_info
    with pytest.raises(RoutingMismatchError,
                       match=r"request 0 turn 0: meta_info has no 'routed_experts' .*the engine "
                             r"was not started with --enable-return-routed-experts.*or the "
                             r"request was sent without return_routed_experts=True"):
        sglang_sequences([g.meta_info], [g.seq_len], lay, requests=[g.request])


def test_payload_refused_for_another_model(server, trainer):
    """The real payload given to layouts it does not belong to: a dense layer where SGLang
    routed (what SGLang's Qwen3-MoE, which ignores mlp_only_layers, sends for a checkpoint
    with a dense layer), and another top_k; both refused by name."""
    g = server.generate(prompts(6)[1], 4)
    dense1 = ModelShape(E, K, (0, 2), L)
    with pytest.raises(RoutingMismatchError, match=r"request 0 turn 0: token 0, layer 1 routes "
                                                   r"to experts .* but the model's layer 1 is "
                                                   r"dense"):
        sglang_sequences([g.meta_info], [g.seq_len], dense1, num_layers=L)
    with pytest.raises(RoutingMismatchError, match=r"do not fit the expected"):
        sglang_sequences([g.meta_info], [g.seq_len], ModelShape(E, 4, (0, 1, 2), L))


# ----------------------------------------------------------------------------- route injection
def random_routes(n: int, seed: int) -> np.ndarray:
    """[n, L, K] distinct experts per token and layer."""
    g = np.random.default_rng(seed)
    return np.stack([np.stack([g.permutation(E)[:K] for _ in range(L)]) for _ in range(n)])


def test_inject_own_routes_changes_nothing(server):
    """Result 1: a greedy request that injects the routes SGLang chose itself (prompt and
    generated positions) gets the same tokens, log-probs and routes, bit for bit. (Its
    routes give it its own radix-cache namespace, so it is computed afresh, as the plain
    request was; SGLang's seeded sampling is not repeatable on its CPU engine, hence
    greedy.)"""
    for i, p in enumerate(h.prompts(21, MODEL["vocab_size"], [9, 13, 17])):
        plain = server.generate(p, GEN, temperature=0.0)
        own = decode(plain.meta_info["routed_experts"])
        assert own.shape[0] == len(p) + GEN - 1
        same = server.generate(p, GEN, temperature=0.0,
                               custom_params=inject.request_args(own, num_experts=E))
        assert same.token_ids == plain.token_ids
        assert same.logprobs == plain.logprobs  # exactly
        assert np.array_equal(decode(same.meta_info["routed_experts"]), own)
        assert same.meta_info["cached_tokens"] == 0


def test_inject_differing_routes_replay_exactly(server, trainer):
    """Result 2: 10% of each request's rows (prompt and generated positions) take other
    experts: SGLang returns exactly the injected routes at every position and layer, and the
    training model replaying them (R3) agrees with SGLang's log-probs as closely as for
    requests without injection."""
    ps = prompts(22)
    plain = server.generate_batch(ps, [GEN] * len(ps))
    g = np.random.default_rng(22)
    alts = []
    for c in plain:
        a = decode(c.meta_info["routed_experts"]).astype(np.int64)
        n = a.shape[0]
        for t in set(g.choice(n, max(1, n // 10), replace=False).tolist()) | {n - 1}:
            for lid in range(L):
                while True:
                    new = g.permutation(E)[:K]
                    if set(new) != set(a[t, lid]):
                        break
                a[t, lid] = new
        alts.append(a)
    inj = server.generate_batch(ps, [GEN] * len(ps), custom_params=[
        inject.request_args(a, num_experts=E) for a in alts])
    for i, (a, c) in enumerate(zip(alts, inj)):
        got = decode(c.meta_info["routed_experts"])
        assert np.array_equal(got, a), f"request {i}"
        assert inject.check_returned(a, got, shape=QWEN) == a.shape[0]
    ids = list(range(len(ps)))
    res = {}
    for name, gens in (("plain", plain), ("injected", inj)):
        routing, mask, _ = sglang_rollout.routing_from_generations(dict(zip(ids, gens)),
                                                                   trainer.moe)
        seqs = {i: torch.tensor(gens[i].prompt_ids + gens[i].token_ids) for i in ids}
        used, lp = h.replay(trainer, seqs, {i: len(ps[i]) for i in ids}, routing, mask)
        res[name] = metrics.compare(used, lp, routing,
                                    {i: torch.tensor(gens[i].logprobs) for i in ids}, ids,
                                    infer_mask=mask)
        print(f"{name}: routing mismatch own {res[name]['own']['routing_mismatch']:.4f}, k3 KL "
              f"own {res[name]['own']['kl_k3_mean']:.3e}, R3 {res[name]['R3']['kl_k3_mean']:.3e}"
              f", R3 max|dlogprob| {res[name]['R3']['abs_dlogprob_max']:.4f}")
    r3_plain, r3_inj = res["plain"]["R3"], res["injected"]["R3"]
    assert r3_inj["routing_mismatch"] == 0.0
    assert r3_inj["abs_dlogprob_max"] < 0.1
    assert r3_inj["kl_k3_mean"] < 3 * r3_plain["kl_k3_mean"] + 1e-6
    assert res["injected"]["own"]["routing_mismatch"] > res["plain"]["own"]["routing_mismatch"]


def test_inject_bad_requests_refused_alone(server):
    """Bad routes are refused per request (HTTP 400 naming the problem) in the server
    process; a good request sent at the same time is unaffected."""
    import concurrent.futures

    p = prompts(23)[2]  # 12 tokens; with GEN=8, positions 0..18 are run
    good = random_routes(len(p) + GEN - 1, 23)
    args = inject.request_args(good, num_experts=E)
    ref = server.generate(p, GEN, temperature=0.0, custom_params=args)
    r = random_routes(4, 24)
    dup = r.copy()
    dup[2, 1] = [5, 5]
    bad = [
        (inject.request_args(random_routes(2, 25)[:, :2], num_experts=E), r"L=2"),
        (inject.request_args(r[:, :, :1], num_experts=E), r"K=1 experts per token, the model "
                                                          r"has top_k=2"),
        (inject.request_args(np.full((2, L, K), E), num_experts=E),
         rf"expert {E}, out of range for num_experts={E}"),
        (inject.request_args(dup, start=3, num_experts=E),
         r"token 5, MoE layer 1 repeats an expert \[5, 5\]"),
        (inject.request_args(r, start=16, num_experts=E), r"4 token rows, more than the "
                                                          r"request's 3"),
        ({inject.ROUTES_KEY: "A" * (MAX_PAYLOAD + 4)}, rf"more than the limit of "
                                                       rf"{MAX_PAYLOAD} bytes"),
        ({inject.ROUTES_KEY: "@@@@"}, r"not valid base64"),
        ({inject.START_KEY: 3}, r"replay_ops_routes_start was given without "
                                r"replay_ops_routes"),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(bad) + 1) as ex:
        ok = ex.submit(server.generate, p, GEN, temperature=0.0, custom_params=args)
        futs = [ex.submit(server.generate, p, GEN, temperature=0.0, custom_params=x)
                for x, _ in bad]
        for f, (_, msg) in zip(futs, bad):
            with pytest.raises(HttpError, match=msg) as e:
                f.result()
            assert e.value.status == 400
        out = ok.result()
    assert out.token_ids == ref.token_ids
    assert np.array_equal(decode(out.meta_info["routed_experts"]), good)


def test_inject_radix_cache_keeps_routes_apart(server):
    """The radix cache shares KV by token ids; a request with routes gets its own namespace
    (a digest of its routes in `extra_key`): the same prompt without routes never reuses KV
    computed with them, and the same routes again reuse all of it."""
    p = h.prompts(25, MODEL["vocab_size"], [40])[0]
    alt = random_routes(40, 26)
    args = inject.request_args(alt, num_experts=E)
    r1 = server.generate(p, 4, temperature=0.0, custom_params=args)
    r2 = server.generate(p, 4, temperature=0.0)
    r3 = server.generate(p, 4, temperature=0.0, custom_params=args)
    r4 = server.generate(p, 4, temperature=0.0)
    a1, a2, a3, a4 = (decode(r.meta_info["routed_experts"]) for r in (r1, r2, r3, r4))
    assert [r.meta_info["cached_tokens"] for r in (r1, r2)] == [0, 0]
    assert r3.meta_info["cached_tokens"] >= 39 and r4.meta_info["cached_tokens"] >= 39
    assert np.array_equal(a1[:40], alt) and np.array_equal(a3, a1)
    assert (a2[:40] != alt).any(-1).any(-1).sum() > 20
    assert np.array_equal(a4, a2) and r4.token_ids == r2.token_ids


def test_inject_survives_retraction(server):
    """A request streaming its tokens is retracted after its third token
    (/pause_generation, mode "retract", then /continue_generation: its KV is freed and it is
    prefilled again, prompt and generated tokens). Its routes at every position, the
    re-prefilled ones included, come back exactly as injected (miles #3307: without them the
    re-prefill's routes replace the ones the tokens were generated with)."""
    import json
    import urllib.request

    p = h.prompts(27, MODEL["vocab_size"], [20])[0]
    G = 24
    alt = random_routes(20 + G - 1, 27)
    sp = server.sampling(G, 1.0, 3)
    sp["custom_params"] = inject.request_args(alt, num_experts=E)
    body = {"input_ids": p, "sampling_params": sp, "return_logprob": True,
            "return_routed_experts": True, "stream": True}
    req = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    last, chunks = None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            last = json.loads(line[5:])
            chunks += 1
            if chunks == 3:
                assert server.post("/pause_generation", {"mode": "retract"})["status"] == "ok"
                assert server.post("/continue_generation", {})["status"] == "ok"
    meta = last["meta_info"]
    assert meta["num_retractions"] >= 1 and meta["completion_tokens"] == G
    got = decode(meta["routed_experts"])
    assert np.array_equal(got, alt)
    assert inject.check_returned(alt, got, shape=QWEN) == 20 + G - 1
