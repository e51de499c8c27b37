"""The vLLM launcher without an engine (fast): which vLLM is used, the CPU start-up hook, and
a server that does not start. The engine itself: tests/test_vllm_engine.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import replay_ops
from replay_ops.demo import vllm_engine

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's rules")


@CPU_ONLY
def test_missing_cpu_vllm_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.delenv("REPLAY_OPS_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("REPLAY_OPS_VLLM_VENV", str(tmp_path / "none"))
    with pytest.raises(vllm_engine.VllmUnavailable, match=r"no vLLM for this CPU machine in "
                                                          r".*none; run `make install-vllm`"):
        vllm_engine.find_vllm(install=False)
    # a half-made environment (no ready mark) is not taken for a finished one
    (tmp_path / "half" / "bin").mkdir(parents=True)
    (tmp_path / "half" / "bin" / "python").write_text("")
    assert not vllm_engine.cpu_vllm_ready(str(tmp_path / "half"))


def test_cpu_runtime_environment_holds_the_hook_only_for_vllm():
    rt = vllm_engine.VllmRuntime("python", cpu=True, source="test")
    env = rt.env()
    # the shim alone, then the engine path: replay_ops and its engine plugins (inert)
    shim, plugins = env["PYTHONPATH"].split(os.pathsep)
    assert shim == vllm_engine.SHIM_DIR and env["TRITON_INTERPRET"] == "1"
    assert os.path.realpath(os.path.join(plugins, "replay_ops")) == os.path.dirname(
        os.path.realpath(replay_ops.__file__))
    (info,) = [d for d in os.listdir(plugins) if d.endswith(".dist-info")]
    with open(os.path.join(plugins, info, "entry_points.txt")) as f:
        assert "replay_ops.integrations" in f.read()
    assert os.path.isfile(os.path.join(vllm_engine.SHIM_DIR, "sitecustomize.py"))
    gpu = vllm_engine.VllmRuntime("python", cpu=False, source="test").env()
    assert gpu.get("PYTHONPATH") == os.environ.get("PYTHONPATH")  # untouched
    assert "sitecustomize" not in sys.modules or vllm_engine.SHIM_DIR not in str(
        getattr(sys.modules["sitecustomize"], "__file__", ""))  # never in this process


def test_start_up_hook_registers_an_inactive_cpu_backend():
    pytest.importorskip("triton")
    code = ("import triton.backends as b; c = b.backends.get('cpu'); "
            "print(c is not None, c is not None and c.driver.is_active())")
    env = dict(os.environ, PYTHONPATH=vllm_engine.SHIM_DIR, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["True", "False"], out.stderr[-2000:]
    env.pop("TRITON_INTERPRET")  # without the interpreter the hook does nothing
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split()[0] == "False", out.stderr[-2000:]


def test_a_server_that_exits_while_starting_is_reported_with_its_log(tmp_path):
    fake = tmp_path / "fakepy"
    fake.write_text("#!/bin/sh\necho 'engine: cannot start (test)'\nexit 3\n")
    fake.chmod(0o755)
    rt = vllm_engine.VllmRuntime(str(fake), cpu=False, source="test")
    srv = vllm_engine.VllmServer(str(tmp_path), rt, start_timeout=60)
    assert "--enforce-eager" not in srv.args and "--enable-return-routed-experts" in srv.args
    assert srv.args[srv.args.index("--host") + 1] == "127.0.0.1"
    with pytest.raises(vllm_engine.VllmUnavailable,
                       match=r"(?s)exited with code 3 while starting.*cannot start \(test\)"):
        srv.start()
    cpu = vllm_engine.VllmServer(str(tmp_path), vllm_engine.VllmRuntime("p", True, "t"))
    assert "--enforce-eager" in cpu.args  # compiled MoE layers return zero routing on a CPU
