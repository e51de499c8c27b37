"""The backend registry: the typed contract, selection by `supports`, and what
`replay_ops.backends()` reports."""
from __future__ import annotations

import sys
import types

import pytest
import torch

import replay_ops
from replay_ops import backends as rb
from replay_ops.backends.protocol import OPS, REQUIRED, BackendContractError, OpShape, Support


def test_backends_module_is_callable_and_reports():
    info = replay_ops.backends()
    assert set(info) >= {"requested", "active", "backends", "why"}
    assert info["backends"]["torch"]["cpu"] is True
    assert info["active"]["cpu"] in ("native", "torch")


def test_every_registered_module_fulfils_the_contract():
    for name in rb.MODULES:
        mod = rb.load(name)
        if mod is None:
            continue
        for member in REQUIRED:
            assert hasattr(mod, member), (name, member)
        assert isinstance(mod.available("cpu"), Support)


def test_a_module_without_a_kernel_fails_loudly_when_it_loads(monkeypatch):
    """A backend module that imports but lacks a kernel is a programming error: the registry
    raises naming what is missing, instead of reporting it as unavailable."""
    fake = types.ModuleType("replay_ops_fake_backend")
    fake.NAME = "fake"
    fake.available = lambda device_type: Support(True)
    fake.supports = lambda *a: Support(True)
    for op in OPS:
        if op != "unpermute_bwd":
            setattr(fake, op, lambda *a: None)
    monkeypatch.setitem(sys.modules, "replay_ops_fake_backend", fake)
    monkeypatch.setitem(rb.MODULES, "fake", "replay_ops_fake_backend")
    monkeypatch.delitem(rb._loaded, "fake", raising=False)
    with pytest.raises(BackendContractError, match=r"missing \['unpermute_bwd'\]"):
        rb.load("fake")
    monkeypatch.delitem(rb._loaded, "fake", raising=False)


def test_selection_asks_supports_and_reports_why(monkeypatch):
    """On CUDA, a gate over more experts than the CUDA kernels hold goes to the next backend
    in the order, and `backends(op=..., shape=...)` says which one runs and why. (The
    availability of CUDA is simulated: the decision is the registry's, not a kernel's.)"""
    native = rb.load("native")
    if native is None:
        pytest.skip("the native extension is not built")
    monkeypatch.setattr(native, "available", lambda d: Support(True))
    triton_mod = rb.load("triton")
    if triton_mod is not None:
        monkeypatch.setattr(triton_mod, "available", lambda d: Support(True))
    E = native.MAX_EXPERTS
    runs, skipped = rb.explain("gate_fwd", "cuda", OpShape(8, E, 2), torch.float32)
    assert runs == "native" and skipped == {}
    runs, skipped = rb.explain("gate_fwd", "cuda", OpShape(8, E + 1, 2), torch.float32)
    assert runs == ("triton" if triton_mod is not None else "torch")
    assert f"E={E + 1} experts is above the CUDA gate kernels' limit kMaxExperts={E}" in \
        skipped["native"]
    runs, skipped = rb.explain("gate_bwd", "cuda", OpShape(8, 64, native.MAX_TOPK + 1),
                               torch.float32)
    assert runs != "native" and "kMaxTopK" in skipped["native"]
    # an explicitly requested backend that cannot take the sizes hands the call on
    runs, _ = rb.explain("gate_fwd", "cuda", OpShape(8, E + 1, 2), torch.float32, "native")
    assert runs != "native"
    info = replay_ops.backends(op="gate_fwd", device="cuda", shape=(8, E + 1, 2))
    assert info["call"]["runs"] == runs and "native" in info["call"]["passed_over"]
    # the limits come from the extension, not from a copy in Python
    from replay_ops import _C

    assert (native.MAX_EXPERTS, native.MAX_TOPK) == (_C.MAX_EXPERTS, _C.MAX_TOPK)


def test_triton_gate_above_its_top_k_falls_through(monkeypatch):
    """K above the Triton gate's limit (its per-row sums take 1024 slots at most): the
    triton backend says why in `supports`, selection goes on to torch, and the launchers
    refuse it with a clear error instead of a CompilationError."""
    triton_mod = rb.load("triton")
    if triton_mod is None:
        pytest.skip("triton is not importable")
    from replay_ops.triton_kernels import gate as G

    native = rb.load("native")
    if native is not None:
        monkeypatch.setattr(native, "available", lambda d: Support(True))
    monkeypatch.setattr(triton_mod, "available", lambda d: Support(True))
    K = G.MAX_TOPK
    assert K == 1024
    for op in ("gate_fwd", "gate_bwd"):
        assert triton_mod.supports(op, "cuda", OpShape(8, 2048, K), torch.float32)
        why = triton_mod.supports(op, "cuda", OpShape(8, 2048, K + 1), torch.float32)
        assert not why and "K=1025 slots is above the Triton gate kernels' limit of 1024" \
            in why.reason
        runs, skipped = rb.explain(op, "cuda", OpShape(8, 2048, K + 1), torch.float32)
        assert runs == "torch" and "limit of 1024" in skipped["triton"]
    # permute and unpermute have no limit on K
    assert triton_mod.supports("unpermute_bwd", "cuda", OpShape(8, 2048, 4096, 64),
                               torch.float32)
    with pytest.raises(ValueError, match="K=1025 slots per token is above the Triton gate's "
                                         "limit of 1024"):
        G.gate_config(T=4, K=K + 1, E=2048, align=1)
    with pytest.raises(ValueError, match="limit of 1024"):
        G.gate_bwd_config(T=4, K=K + 1, E=2048)


def test_unavailable_requested_backend_is_an_error():
    if rb.available("native", "cuda"):
        pytest.skip("the native CUDA kernels are available here")
    with pytest.raises(RuntimeError, match="backend 'native' was requested but is not usable "
                                           "for cuda tensors"):
        rb.explain("gate_fwd", "cuda", OpShape(1, 4, 2), torch.float32, "native")


def test_native_without_a_kernel_image_falls_back(monkeypatch):
    """A CUDA build that has no kernel image for the GPU (sm_75 with an 8.0/9.0 arch list,
    or Blackwell without PTX) must not claim CUDA: the probe's answer makes the registry
    pick Triton (then torch) and say why. The GPU is simulated: the probe is replaced."""
    native = rb.load("native")
    if native is None:
        pytest.skip("the native extension is not built")
    monkeypatch.setattr(native, "WITH_CUDA", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "Tesla T4")
    calls = []

    def probe(d):
        calls.append(d)
        return "" if d == 0 else "no kernel image is available for execution on the device"

    monkeypatch.setattr(native, "probe_kernel_image", probe)
    monkeypatch.setattr(native, "_image_problems", None)
    verdict = native.available("cuda")
    assert not verdict and "no kernel image for cuda:1 (Tesla T4, sm_75)" in verdict.reason
    assert "TORCH_CUDA_ARCH_LIST naming 7.5 or ending in +PTX" in verdict.reason
    native.available("cuda")
    assert calls == [0, 1]  # probed once per device, then remembered
    info = replay_ops.backends()
    assert info["active"]["cuda"] in ("triton", "torch")
    assert "no kernel image" in info["why"]["cuda"]["native"]
    runs, skipped = rb.explain("gate_fwd", "cuda", OpShape(8, 16, 2), torch.float32)
    assert runs != "native" and "no kernel image" in skipped["native"]
    monkeypatch.setattr(native, "_image_problems", None)


def test_a_triton_below_the_supported_floor_is_refused(monkeypatch):
    """The Triton backend names both versions when the installed Triton is older than the
    floor, which is the one pyproject.toml declares and the Makefile tests (TRITON_FLOOR)."""
    import re
    from pathlib import Path

    import triton

    from replay_ops.backends import triton as T

    root = Path(__file__).resolve().parents[1]
    declared = re.search(r'^triton\s*=\s*">=([\d.]+)"', (root / "pyproject.toml").read_text(),
                         re.M).group(1)
    assert tuple(int(x) for x in declared.split(".")) == T.MIN_TRITON
    floor = re.search(r"^TRITON_FLOOR \?= ([\d.]+)", (root / "Makefile").read_text(), re.M)
    assert floor.group(1).startswith(declared + ".")
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    for device in ("cpu", "cuda"):
        s = T.available(device)
        assert not s.ok and "Triton 3.5.1 is older than 3.6" in s.reason, s
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert T._triton_too_old() is None
