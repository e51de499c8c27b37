"""The SGLang launcher without an engine (fast): which SGLang is used, the CPU hook (the
stand-in `sgl_kernel` and the allocator hook), the server's command line. The engine itself:
tests/test_sglang_engine.py."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

import replay_ops
from replay_ops.demo import sglang_engine

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's rules")


@CPU_ONLY
def test_missing_cpu_sglang_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.delenv("REPLAY_OPS_SGLANG_PYTHON", raising=False)
    monkeypatch.setenv("REPLAY_OPS_SGLANG_VENV", str(tmp_path / "none"))
    with pytest.raises(sglang_engine.SglangUnavailable,
                       match=r"no SGLang for this CPU machine in .*none; run `make "
                             r"install-sglang`"):
        sglang_engine.find_sglang(install=False)


def test_cpu_runtime_environment_and_command_line(tmp_path):
    rt = sglang_engine.SglangRuntime("python", cpu=True, source="test")
    env = rt.env()
    # the shim alone, then the engine path: replay_ops and its engine plugins (inert)
    shim, plugins = env["PYTHONPATH"].split(os.pathsep)
    assert shim == sglang_engine.SHIM_DIR and env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert os.path.realpath(os.path.join(plugins, "replay_ops")) == os.path.dirname(
        os.path.realpath(replay_ops.__file__))
    (info,) = [d for d in os.listdir(plugins) if d.endswith(".dist-info")]
    with open(os.path.join(plugins, info, "entry_points.txt")) as f:
        assert "replay_ops.integrations" in f.read()
    gpu = sglang_engine.SglangRuntime("python", cpu=False, source="test").env()
    assert gpu.get("PYTHONPATH") == os.environ.get("PYTHONPATH")  # untouched
    assert "SGLANG_USE_CPU_ENGINE" not in gpu or os.environ.get("SGLANG_USE_CPU_ENGINE")
    srv = sglang_engine.SglangServer(str(tmp_path), rt)
    a = srv.args
    assert a[a.index("--host") + 1] == "127.0.0.1" and "--enable-return-routed-experts" in a
    for flag in ("--disable-cuda-graph", "--sleep-on-idle"):
        assert flag in a
    assert a[a.index("--attention-backend") + 1] == "torch_native"
    assert a[a.index("--max-total-tokens") + 1] == "16384"
    plain = sglang_engine.SglangServer(str(tmp_path), rt, routed_experts=False).args
    assert "--enable-return-routed-experts" not in plain


def _stand_in():
    """The stand-in module, loaded from its file (never importable as `sgl_kernel` here)."""
    import importlib.util

    path = os.path.join(sglang_engine.SHIM_DIR, "sgl_kernel", "__init__.py")
    spec = importlib.util.spec_from_file_location("replay_ops_test_sgl_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stand_in_assign_req_to_token_pool_matches_a_loop():
    k = _stand_in()
    g = torch.Generator().manual_seed(0)
    pool = torch.full((5, 32), -7, dtype=torch.int32)
    rows = torch.tensor([3, 0, 4])
    start = torch.tensor([2, 0, 10])
    end = torch.tensor([6, 3, 10 + 7])
    out = torch.randint(0, 1000, (4 + 3 + 7,), generator=g, dtype=torch.int64)
    want = pool.clone()
    p = 0
    for r, s, e in zip(rows.tolist(), start.tolist(), end.tolist()):
        for t in range(s, e):
            want[r, t] = int(out[p])
            p += 1
    k.assign_req_to_token_pool_cpu(rows, pool, start, end, out, pool.shape[1])
    assert torch.equal(pool, want)
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.copy_all_layer_kv_cache_cpu"):
        k.copy_all_layer_kv_cache_cpu(None, None, None, None)
    assert not hasattr(k, "silu_and_mul")  # missing: SGLang's own fallback runs


def test_hook_gives_the_host_buffer_a_plain_cpu_allocator(tmp_path):
    """The start-up hook patches `sglang.srt.mem_cache.pool_host.common` when it is imported
    (a stand-in package here), and does nothing without SGLANG_USE_CPU_ENGINE=1."""
    pkg = tmp_path / "sglang" / "srt" / "mem_cache" / "pool_host"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "sglang", tmp_path / "sglang" / "srt",
              tmp_path / "sglang" / "srt" / "mem_cache", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "common.py").write_text(
        "from collections import defaultdict\n"
        "def pinned(*a, **k):\n    raise RuntimeError('Found no NVIDIA driver')\n"
        "ALLOC_MEMORY_FUNCS = defaultdict(lambda: pinned)\n")
    code = ("import torch\nfrom sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS\n"
            "b = ALLOC_MEMORY_FUNCS['cpu']((2, 3), dtype=torch.int32, device='cpu', "
            "pin_memory=True, allocator=None)\n"
            "print(tuple(b.shape), b.dtype, int(b.abs().sum()), b.is_pinned())\n")
    env = dict(os.environ, PYTHONPATH=f"{sglang_engine.SHIM_DIR}:{tmp_path}",
               SGLANG_USE_CPU_ENGINE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["(2,", "3)", "torch.int32", "0", "False"], out.stderr[-2000:]
    env.pop("SGLANG_USE_CPU_ENGINE")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "Found no NVIDIA driver" in out.stderr


def test_deepseek_checkpoint_config_fields():
    from replay_ops.testing import tiny

    cfg = tiny.tiny_config("deepseek_v3", num_layers=2)
    sglang_engine.sglang_config(cfg)
    assert (cfg.moe_layer_freq, cfg.topk_method, cfg.scoring_func) == (1, "noaux_tc", "sigmoid")
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 1.0
    q = types.SimpleNamespace(model_type="qwen3_moe")
    sglang_engine.sglang_config(q)
    assert vars(q) == {"model_type": "qwen3_moe"}
