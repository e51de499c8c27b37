"""Route injection's engine-neutral part (replay_ops.router_replay.inject) and the parts of
the vLLM plugin that run without vLLM: the request format and its refusals, the checked form
the engines keep, the prefix-cache key, the client's check of what came back, the model's MoE
layers from its config, the forced gate weights against the reference, and the mapping of a
step's rows to positions. The plugin inside a real vLLM: tests/test_vllm_engine.py."""
from __future__ import annotations

import base64
import importlib.metadata
import io
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from replay_ops import reference
from replay_ops.router_replay import ModelShape, codec, inject
from replay_ops.router_replay.inject import InjectedRoutes, InjectionError, InjectionIgnoredError

ROOT = Path(__file__).resolve().parents[1]
# 16 experts, top-2, layers 0 and 2 MoE, layer 1 dense (as the Qwen3-MoE in the engine tests)
SHAPE = ModelShape(16, 2, (0, 2), 3)


def routes(n, seed=0, E=16, L=3, K=2, dense=(1,)):
    """[n, L, K] distinct experts per token and layer; dense columns 0 (what vLLM sends)."""
    g = np.random.default_rng(seed)
    a = np.stack([np.stack([g.permutation(E)[:K] for _ in range(L)]) for _ in range(n)])
    a[:, list(dense)] = 0
    return a


def npy_b64(a) -> str:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


# ----------------------------------------------------------------------------- the request
@pytest.mark.parametrize("fmt", inject.FORMATS)
@pytest.mark.parametrize("layers", ["all", "moe"])
def test_request_round_trip(fmt, layers):
    a = routes(7, seed=1)
    src = a if layers == "all" else a[:, [0, 2]]
    args = inject.request_args(src, start=5, num_experts=16, fmt=fmt)
    assert set(args) == {inject.ROUTES_KEY, inject.START_KEY} and args[inject.START_KEY] == 5
    r = inject.parse(args[inject.ROUTES_KEY], 5, shape=SHAPE, seq_limit=12)
    assert (r.start, r.n, r.end, r.moe_layer_ids) == (5, 7, 12, (0, 2))
    assert r.ids.dtype == np.int16 and np.array_equal(r.ids, a[:, [0, 2]])
    w = r.to_wire()
    assert isinstance(w["ids"], bytes) and inject.is_wire(w)
    back = InjectedRoutes.from_wire(w)
    assert back.start == 5 and np.array_equal(back.ids, r.ids) and back.moe_layer_ids == (0, 2)


def test_request_npy_dtype_is_vllms():
    """The .npy payload takes vLLM's own dtype: uint8 up to 256 experts, uint16 above."""
    def dtype_of(args):
        raw = base64.b64decode(args[inject.ROUTES_KEY])
        return np.load(io.BytesIO(raw)).dtype

    small = routes(3)
    assert dtype_of(inject.request_args(small, num_experts=16)) == np.uint8
    big = routes(3, E=300, L=2, dense=())
    assert dtype_of(inject.request_args(big, num_experts=300)) == np.uint16
    r = inject.parse(inject.request_args(big, num_experts=300)[inject.ROUTES_KEY], 0,
                     shape=ModelShape(300, 2, (0, 1)), seq_limit=3)
    assert np.array_equal(r.ids, big)


def test_in_process_forms_and_vllm_returned_payload():
    """An array or tensor in process, raw .npy / codec bytes, and vLLM's own returned
    payload (base64 .npy of uint8 over every hidden layer) all give the same routes."""
    a = routes(4, seed=2)
    want = a[:, [0, 2]]
    blob = codec.encode(want, num_experts=16)
    buf = io.BytesIO()
    np.save(buf, a.astype(np.uint8), allow_pickle=False)
    for payload in (a, torch.from_numpy(a), a.astype(np.uint8), buf.getvalue(), blob,
                    base64.b64encode(blob), npy_b64(a.astype(np.uint8))):
        r = inject.parse(payload, 1, shape=SHAPE, seq_limit=5)
        assert np.array_equal(r.ids, want), type(payload)


def test_codec_set_order_and_check():
    a = routes(6, seed=3)[:, [0, 2]]
    args = inject.request_args(a, num_experts=16, fmt="codec", order="set")
    r = inject.parse(args[inject.ROUTES_KEY], 0, shape=SHAPE, seq_limit=6)
    assert np.array_equal(r.ids, np.sort(a, -1))
    returned = np.zeros((6, 3, 2), np.uint8)
    returned[:, [0, 2]] = r.ids
    assert inject.check_returned(a, returned, shape=SHAPE, order="set") == 6
    if (np.sort(a, -1) != a).any():
        with pytest.raises(InjectionIgnoredError):
            inject.check_returned(a, returned, shape=SHAPE)


BAD = [
    # (payload, start, seq_limit, message)
    (routes(3)[:, :, :1], 0, 9, r"K=1 experts per token, the model has top_k=2"),
    (routes(3, L=4, dense=()), 0, 9, r"L=4 .* 2 MoE layers .* 3 hidden layers"),
    (np.full((2, 2, 2), 16), 0, 9, r"token 0, MoE layer 0 .* expert 16, out of range for "
                                   r"num_experts=16"),
    (np.array([[[3, 3], [1, 2]]]), 4, 9, r"token 4, MoE layer 0 repeats an expert \[3, 3\]"),
    (np.array([[[3, 4], [-1, -1]]]), 2, 9, r"position 2, MoE layer 2 has no route"),
    (routes(2, dense=()), 3, 9, r"layer 1 routes to experts .* model's layer 1 is dense.*"
                                r"\(token 0 is position 3\)"),
    (routes(2), -1, 9, r"replay_ops_routes_start=-1 is negative"),
    (routes(2), 9, 9, r"replay_ops_routes_start=9 is beyond the sequence: positions 0..8"),
    (routes(5), 5, 9, r"5 rows, more than the 4 positions left in the sequence"),
    (npy_b64(routes(5)), 5, 9, r"shape \(5, 3, 2\), 5 token rows, more than the request's 4"),
    (np.zeros((0, 3, 2), np.uint8), 0, 9, r"holds no rows"),
    (routes(2), True, 9, r"replay_ops_routes_start must be an integer position, got bool"),
    (routes(2), "3", 9, r"must be an integer position, got str"),
    (routes(2).astype(np.float32), 0, 9, r"must hold integer expert ids, got float32"),
    ("not base64!", 0, 9, r"not valid base64"),
    (base64.b64encode(b"hello world!").decode(), 0, 9, r"neither an .npy array nor a "
                                                       r"replay_ops codec blob"),
    ({"a": 1}, 0, 9, r"expected base64 text .* got dict"),
    (base64.b64encode(codec.encode(np.zeros((2, 2, 2), np.int64) + [[0, 1]],
                                   num_experts=8)).decode(), 0, 9,
     r"encoded for num_experts=8; the model has 16"),
    (codec.encode(routes(3)[:, [0, 2]], num_experts=16, token_ids=np.arange(3)), 0, 9,
     r"encoded with token_ids"),
    (codec.encode(routes(3)[:, [0, 2]], num_experts=16)[:-3], 0, 9, r"corrupt codec blob"),
]


@pytest.mark.parametrize("payload,start,limit,msg", BAD, ids=[str(i) for i in range(len(BAD))])
def test_refused_with_the_position(payload, start, limit, msg):
    with pytest.raises(InjectionError, match=msg):
        inject.parse(payload, start, shape=SHAPE, seq_limit=limit, who="request 7")


def test_payload_too_large(monkeypatch):
    a = routes(40)
    text = npy_b64(a)
    for payload in (text, base64.b64decode(text), a):
        with pytest.raises(InjectionError, match=r"more than the limit of 100 "):
            inject.parse(payload, 0, shape=SHAPE, seq_limit=50, max_bytes=100)
    monkeypatch.setenv(inject.MAX_BYTES_ENV, "100")
    with pytest.raises(InjectionError, match="REPLAY_OPS_INJECT_MAX_BYTES"):
        inject.parse(text, 0, shape=SHAPE, seq_limit=50)
    monkeypatch.setenv(inject.MAX_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match="REPLAY_OPS_INJECT_MAX_BYTES='lots'"):
        inject.parse(text, 0, shape=SHAPE, seq_limit=50)
    monkeypatch.setenv(inject.MAX_BYTES_ENV, str(len(text)))
    assert inject.parse(text, 0, shape=SHAPE, seq_limit=50).n == 40


def test_wire_refuses_other_forms():
    with pytest.raises(InjectionError, match="not the checked form"):
        InjectedRoutes.from_wire("abc")
    assert not inject.is_wire({"v": 2, "ids": b""}) and not inject.is_wire(None)


# ----------------------------------------------------------------------------- cache keys
def test_block_key_covers_exactly_the_forced_rows():
    a = routes(10, seed=4)[:, [0, 2]].astype(np.int16)
    r = InjectedRoutes(8, a, (0, 2))  # positions 8..17
    assert r.block_key(0, 8) is None and r.block_key(18, 40) is None
    k = r.block_key(0, 16)
    assert k == InjectedRoutes(8, a.copy(), (0, 2)).block_key(0, 16)  # same routes, same key
    b = a.copy()
    b[9, 0] = [b[9, 0, 1], b[9, 0, 0]]  # a change after the block: the block's key stays
    assert InjectedRoutes(8, b, (0, 2)).block_key(0, 16) == k
    b[7, 1] = (b[7, 1] + 1) % 16 if b[7, 1, 0] + 1 != b[7, 1, 1] else b[7, 1] + 2
    assert InjectedRoutes(8, b, (0, 2)).block_key(0, 16) != k  # position 15 changed
    assert InjectedRoutes(9, a[1:], (0, 2)).block_key(0, 16) != k  # position 8 not forced
    sel, rows = r.rows_for(np.arange(6, 20))
    assert sel.tolist() == [False] * 2 + [True] * 10 + [False] * 2
    assert rows.tolist() == list(range(10))


# ----------------------------------------------------------------------------- the check
def test_check_returned_names_the_first_differing_position():
    a = routes(6, seed=5)
    ret = np.concatenate([routes(4, seed=6), a, routes(2, seed=7)]).astype(np.uint8)
    assert inject.check_returned(a, ret, shape=SHAPE, start=4) == 6
    assert inject.check_returned(a[:, [0, 2]], npy_b64(ret), shape=SHAPE, start=4) == 6
    # rows returned from position 3 on (vLLM's routed_experts_prompt_start=3)
    assert inject.check_returned(a, ret[3:], shape=SHAPE, start=4, returned_start=3) == 6
    # the request ended after position 6: the positions returned are checked
    assert inject.check_returned(a, ret[:7], shape=SHAPE, start=4) == 3
    bad = ret.copy()
    bad[7, 2] = [9, 10] if list(bad[7, 2]) != [9, 10] else [10, 11]
    with pytest.raises(InjectionIgnoredError,
                       match=r"request 3: position 7, MoE layer 2: the engine routed to experts "
                             r"\[\d+, \d+\], the injected routes say \[\d+, \d+\] \(1 of 6 "
                             r"injected positions differ\).*REPLAY_OPS_VLLM_INJECT=1"):
        inject.check_returned(a, bad, shape=SHAPE, start=4, who="request 3")
    with pytest.raises(InjectionIgnoredError, match=r"none of the injected positions 4..9"):
        inject.check_returned(a, ret[:4], shape=SHAPE, start=4)
    with pytest.raises(InjectionIgnoredError, match="returned no routes"):
        inject.check_returned(a, None, shape=SHAPE)
    with pytest.raises(InjectionError, match="K=2"):
        inject.check_returned(a[:, :, :1], ret, shape=SHAPE)


# ----------------------------------------------------------------------------- the plugin
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_plugin_is_inert_without_its_variable(engine):
    """register() with its variable unset (or 0) does nothing, not even import the engine
    or the hooks; another value is refused."""
    var = f"REPLAY_OPS_{engine.upper()}_INJECT"
    hooks = f"replay_ops.integrations.{engine}._hooks"
    code = (f"import sys, os; os.environ.pop({var!r}, None)\n"
            f"from replay_ops.integrations import {engine} as p\n"
            f"p.register()\n"
            f"assert {engine!r} not in sys.modules and {hooks!r} not in sys.modules\n"
            f"os.environ[{var!r}] = '0'; p.register()\n"
            f"assert {hooks!r} not in sys.modules\n"
            f"os.environ[{var!r}] = 'yes'\n"
            f"try:\n    p.register()\nexcept ValueError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=str(ROOT), timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"{var}='yes': expected 1" in r.stdout


def test_entry_points_declared_once(tmp_path):
    """setup.py declares the plugins' entry points that the CPU engines' path folder
    declares, and that folder's metadata is what importlib reads."""
    from replay_ops.demo.engine_server import ENGINE_PLUGINS, engine_path
    from replay_ops.integrations import sglang, vllm

    want = ((vllm.ENTRY_POINT_GROUP, vllm.ENTRY_POINT),
            (sglang.ENTRY_POINT_GROUP, sglang.ENTRY_POINT))
    assert ENGINE_PLUGINS == want
    setup = (ROOT / "setup.py").read_text()
    for group, ep in want:
        assert f'"{group}": ["{ep}"]' in setup
    folder = engine_path(str(tmp_path))
    assert engine_path(str(tmp_path)) == folder  # made once, then reused
    (info,) = [p for p in os.listdir(folder) if p.endswith(".dist-info")]
    dist = importlib.metadata.PathDistribution(Path(folder) / info)
    assert sorted((e.group, f"{e.name} = {e.value}") for e in dist.entry_points) == \
        sorted(want)
    import replay_ops

    assert os.path.realpath(os.path.join(folder, "replay_ops")) == \
        os.path.realpath(os.path.dirname(replay_ops.__file__))


def test_moe_layer_ids_from_config():
    from replay_ops.integrations.vllm._hooks import moe_layer_ids

    ns = types.SimpleNamespace
    assert moe_layer_ids(ns(mlp_only_layers=[1], decoder_sparse_step=1), 4) == [0, 2, 3]
    assert moe_layer_ids(ns(mlp_only_layers=[], decoder_sparse_step=2), 6) == [1, 3, 5]
    assert moe_layer_ids(ns(first_k_dense_replace=1, moe_layer_freq=1), 4) == [1, 2, 3]
    assert moe_layer_ids(ns(first_k_dense_replace=0, moe_layer_freq=2), 5) == [0, 2, 4]
    assert moe_layer_ids(ns(num_local_experts=8), 3) == [0, 1, 2]


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forced_weights_follow_the_gate_semantics(renorm, dtype):
    """The forced rows' gate weights: the router's formula at the given ids equals replay_ops'
    gate semantics (the reference), up to the logits dtype's rounding; forcing the router's
    own top-k choice reproduces its weights bit for bit (vLLM 0.32's CPU softmax router)."""
    from replay_ops.integrations.vllm._hooks import (_cpu_softmax_weights, _gate_weights,
                                                     _grouped_weights)

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(9, 16, generator=g) * 2).to(dtype)
    ids = torch.stack([torch.randperm(16, generator=g)[:3] for _ in range(9)])
    ref = reference.gate_weights(logits.double(), ids, "softmax", renorm, 1.0).float()
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    out = _cpu_softmax_weights(logits, ids, renorm=renorm)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    # the router's own choice (vLLM's _softmax_topk, as it computes it)
    vals, own = torch.topk(logits, 3, dim=-1, sorted=False)
    if renorm:
        own_w = torch.softmax(vals, dim=-1).float()
    else:
        own_w = (vals - torch.logsumexp(logits, dim=-1, keepdim=True)).exp().float()
    assert torch.equal(_cpu_softmax_weights(logits, own, renorm=renorm), own_w)
    for sf in ("softmax", "sigmoid"):
        ref = reference.gate_weights(logits.double(), ids, sf, renorm, 2.5).float()
        torch.testing.assert_close(_grouped_weights(logits, ids, sf=sf, renorm=renorm,
                                                    scale=2.5), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(_gate_weights(logits, ids, sf=sf, renorm=renorm, scale=2.5),
                                   ref, atol=tol, rtol=tol)


def test_step_rows_follow_positions():
    """A step's forced rows are found by position (num_computed_tokens + i), the rows vLLM's
    routed-experts capture records: a chunked prefill, a decode step and a request without
    routes in one batch."""
    from replay_ops.integrations.vllm._hooks import WorkerState

    st = WorkerState([0, 2])
    a = np.arange(2 * 10 * 2 * 2).reshape(20, 2, 2).astype(np.int16)  # positions 5..24
    st.routes["r0"] = InjectedRoutes(5, a, (0, 2))
    st.routes["r2"] = InjectedRoutes(0, a[:3], (0, 2))  # positions 0..2
    batch = types.SimpleNamespace(
        req_ids=["r0", "r1", "r2"],
        # r0: a prefill chunk of positions 0..7; r1: 4 rows, no routes; r2: decode at 30
        query_start_loc_np=np.array([0, 8, 12, 13]),
        num_computed_tokens_np=np.array([0, 0, 30]),
        num_tokens=13)
    st.build_step(batch, torch.device("cpu"))
    s = st.step
    assert s.rows.tolist() == [5, 6, 7] and torch.equal(s.ids, torch.from_numpy(a[:3]).int())
    assert st.forced_tokens == 3 and st.steps_with_routes == 1
    batch.num_computed_tokens_np = np.array([8, 0, 1])  # the next chunk; r2 at position 1
    batch.query_start_loc_np = np.array([0, 8, 12, 13])
    st.build_step(batch, torch.device("cpu"))
    assert st.step.rows.tolist() == list(range(8)) + [12]
    assert torch.equal(st.step.ids, torch.from_numpy(np.concatenate([a[3:11], a[1:2]])).int())
    st.routes.clear()
    st.build_step(batch, torch.device("cpu"))
    assert st.step is None


# ----------------------------------------------------------------------------- SGLang's plugin
def test_sglang_wire_text_and_model_rule():
    from replay_ops.integrations.sglang import _hooks

    a = routes(5, seed=8, dense=())
    r = InjectedRoutes(3, a.astype(np.int16), (0, 1, 2))
    text = _hooks.wire_text(r)
    assert _hooks.is_wire_text(text) and "\n" not in text and "[" not in text  # a JSON scalar
    back = _hooks.from_wire_text(text)
    assert back.start == 3 and np.array_equal(back.ids, r.ids) and back.moe_layer_ids == (0, 1, 2)
    ns = types.SimpleNamespace
    # SGLang 0.5.23's Qwen2/3-MoE route in every layer, whatever mlp_only_layers says
    qwen = ns(num_experts=16, num_experts_per_tok=2, num_hidden_layers=3, mlp_only_layers=[1],
              decoder_sparse_step=1)
    assert _hooks.model_shape(qwen) == ModelShape(16, 2, (0, 1, 2), 3)
    ds = ns(n_routed_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
            first_k_dense_replace=1, moe_layer_freq=1)
    assert _hooks.model_shape(ds) == ModelShape(8, 2, (1, 2, 3), 4)
    with pytest.raises(_hooks.InjectionUnsupported, match="names no expert count"):
        _hooks.model_shape(ns(num_experts_per_tok=2, num_hidden_layers=2))


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("renorm", [True, False])
def test_sglang_forced_weights(sf, renorm):
    """SGLang's forced weights are the gate semantics (the reference), and forcing the torch
    router's own choice reproduces its weights bit for bit."""
    from replay_ops.integrations.sglang._hooks import forced_weights

    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(7, 16, generator=g) * 2).to(torch.bfloat16)
    cfg = types.SimpleNamespace(scoring_func=sf, renormalize=renorm, correction_bias=None,
                                apply_routed_scaling_factor_on_output=True,
                                routed_scaling_factor=2.5)
    ids = torch.stack([torch.randperm(16, generator=g)[:3] for _ in range(7)])
    ref = reference.gate_weights(logits.double(), ids, sf, renorm, 2.5).float()
    torch.testing.assert_close(forced_weights(logits, ids, cfg), ref, atol=1e-6, rtol=1e-6)
    # SGLang's fused_topk_torch_native (no bias), then the scale it folds in after routing
    scores = {"softmax": lambda x: x.softmax(-1), "sigmoid": torch.sigmoid,
              "sqrtsoftplus": lambda x: torch.nn.functional.softplus(x).sqrt()}[sf]
    own_w, own = torch.topk(scores(logits.float()), 3, dim=-1)
    if renorm:
        own_w = own_w / (own_w.sum(dim=-1, keepdim=True, dtype=torch.float32) + 1e-20)
    own_w = own_w * 2.5
    assert torch.equal(forced_weights(logits, own, cfg), own_w)


def test_sglang_step_rows_follow_positions():
    """A forward's forced rows from the batch's lengths: an extend (one request with a
    cached prefix, one without routes) and a decode, checked against `positions`."""
    from replay_ops.integrations.sglang import _hooks

    a = np.arange(30 * 3 * 2).reshape(30, 3, 2).astype(np.int16)
    r = InjectedRoutes(4, a, (0, 1, 2))  # positions 4..33
    _hooks._ROUTES.clear()
    _hooks._ROUTES["x"] = r
    mode = types.SimpleNamespace
    extend = mode(is_idle=lambda: False, is_extend=lambda: True, is_decode=lambda: False)
    fb = types.SimpleNamespace(
        forward_mode=extend, rids=["y", "x"], extend_prefix_lens_cpu=[0, 2],
        extend_seq_lens_cpu=[3, 5], positions=torch.tensor([0, 1, 2, 2, 3, 4, 5, 6]))
    step = _hooks.build_step(fb, {0: 0, 1: 1, 2: 2})
    assert step.rows.tolist() == [5, 6, 7] and torch.equal(step.ids, torch.from_numpy(a[:3]).int())
    decode = mode(is_idle=lambda: False, is_extend=lambda: False, is_decode=lambda: True)
    fb = types.SimpleNamespace(forward_mode=decode, rids=["x", "y"], seq_lens_cpu=[34, 9],
                               positions=torch.tensor([33, 8]))
    step = _hooks.build_step(fb, {0: 0, 1: 1, 2: 2})
    assert step.rows.tolist() == [0] and torch.equal(step.ids, torch.from_numpy(a[29:30]).int())
    fb.positions = torch.tensor([32, 8])  # lengths and positions disagree: refused
    with pytest.raises(_hooks.InjectionUnsupported, match="positions are not the ones"):
        _hooks.build_step(fb, {0: 0, 1: 1, 2: 2})
    _hooks._ROUTES.clear()


# ----------------------------------------------------------------------------- the demo's part
def test_demo_other_routes_and_refusals():
    from replay_ops.demo import DemoConfig, injection, run

    a = routes(20, seed=9)
    b, n = injection.other_routes(a, (0, 2), 16, 0.1, np.random.default_rng(0))
    changed = (np.sort(b[:, [0, 2]], -1) != np.sort(a[:, [0, 2]], -1)).any(-1)
    assert n == 3 and changed.all(1).sum() == 3 and changed[-1].all()  # 2 + the last row
    assert (b[:, 1] == a[:, 1]).all()  # the dense layer's column is left alone
    assert all(len(set(r)) == 2 for r in b[:, [0, 2]].reshape(-1, 2).tolist())
    for engine in ("builtin", "sglang"):
        cfg = DemoConfig.from_size("tiny", engine=engine, inject=True, out="/nonexistent/x")
        with pytest.raises(ValueError, match="--inject and --resume"):
            run(cfg)


def test_demo_report_lines():
    from replay_ops.demo.report import injection_lines, resume_lines

    s = {"model": {"moe_layer_ids": [0, 1]},
         "injection": {"requests": 2, "own_routes": {"tokens_equal": 2, "logprobs_equal": 2,
                                                      "routes_equal": 2, "max_abs_dlogprob": 0.0,
                                                      "requests": 2},
                       "batch_rerun_without_routes": {"tokens_equal": 2, "logprobs_equal": 1},
                       "other_routes": {"rows_changed": 3, "rows": 30, "positions_checked": 30},
                       "r3_plain": {"kl_k3_mean": 1e-5, "abs_dlogprob_max": 0.01},
                       "r3_other_routes": {"kl_k3_mean": 2e-5, "abs_dlogprob_max": 0.02},
                       "throughput": {"tokens": 40, "runs": 2, "off_tok_s": 10.0,
                                      "on_tok_s": 9.0, "overhead_pct": 11.1}},
         "resume": {"resumed_requests": 2, "learning_rate": 0.003, "prefix_rows": 10,
                    "without_injection": {"prefix_routes_differ_per_layer": [0.1, 0.2],
                                          "prefix_routes_differ": 0.15,
                                          "training_r3": {"prefix_routes_replayed_differ": 0.15,
                                                          "resumed_tokens_kl_k3_mean": 1e-5}},
                    "with_injection": {"prefix_routes_differ_per_layer": [0.0, 0.0],
                                       "prefix_routes_differ": 0.0,
                                       "training_r3": {"prefix_routes_replayed_differ": 0.0,
                                                       "resumed_tokens_kl_k3_mean": 1e-5}}}}
    text = "\n".join(injection_lines(s) + resume_lines(s))
    assert "tokens equal 2/2" in text and "at all 30 positions" in text
    assert "(+11.1% time)" in text
    assert "      1 |     20.00% |      0.00%" in text and "  all |     15.00% |      0.00%" in text


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_plugin_switch(engine, monkeypatch):
    """Each engine plugin is inert unless its variable is 1, and refuses any other value by
    name (installing replay_ops must not change an engine, and a typo must not be read as
    off)."""
    import importlib

    mod = importlib.import_module(f"replay_ops.integrations.{engine}")
    monkeypatch.delenv(mod.ENV, raising=False)
    assert mod.active() is False
    monkeypatch.setenv(mod.ENV, "0")
    assert mod.active() is False
    monkeypatch.setenv(mod.ENV, "1")
    assert mod.active() is True
    monkeypatch.setenv(mod.ENV, "yes")
    with pytest.raises(ValueError, match=f"{mod.ENV}='yes'"):
        mod.active()
