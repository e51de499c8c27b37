"""Backend registry and selection.

A backend is a module that defines `NAME`, `available(device_type) -> bool` and the six
kernels `gate_fwd`, `gate_bwd`, `permute_fwd`, `permute_bwd`, `unpermute_fwd`,
`unpermute_bwd` (signatures in `_torch_backend.py`). The registered ops call
`select(device, requested)` and then the backend's kernel.

Selection, first available wins:

    cuda: native -> triton -> torch
    cpu:  native -> torch           (triton only when asked for, under TRITON_INTERPRET=1)

Force one with the `backend=` argument of the Python API, or for the whole process with
the environment variable `REPLAY_OPS_BACKEND` (read at each call). The argument wins.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

ENV_VAR = "REPLAY_OPS_BACKEND"
ALIASES = {"reference": "torch", "eager": "torch"}
MODULES = {
    "native": "replay_ops._native_backend",
    "triton": "replay_ops._triton_backend",
    "torch": "replay_ops._torch_backend",
}
AUTO_ORDER = {"cuda": ("native", "triton", "torch"), "cpu": ("native", "torch")}

_loaded: dict[str, ModuleType | None] = {}
_errors: dict[str, str] = {}


def _load(name: str) -> ModuleType | None:
    if name not in _loaded:
        try:
            _loaded[name] = importlib.import_module(MODULES[name])
        except Exception as e:  # missing extension, triton not installed, ...
            _loaded[name] = None
            _errors[name] = f"{type(e).__name__}: {e}"
    return _loaded[name]


def _canonical(requested: str | None) -> str:
    name = (requested or "auto").strip().lower()
    name = ALIASES.get(name, name)
    if name != "auto" and name not in MODULES:
        raise ValueError(
            f"replay_ops: unknown backend {requested!r}; expected 'auto' or one of "
            f"{sorted(MODULES) + sorted(ALIASES)}"
        )
    return name


def requested_backend(arg: str | None = None) -> str:
    """The backend asked for: the argument, else $REPLAY_OPS_BACKEND, else 'auto'."""
    if arg is not None and arg != "auto":
        return _canonical(arg)
    return _canonical(os.environ.get(ENV_VAR) or "auto")


def _reason(name: str, device_type: str) -> str:
    if _load(name) is None:
        return _errors.get(name, "not importable")
    return f"not available for {device_type} tensors"


def select(device_type: str, requested: str | None = None) -> ModuleType:
    name = requested_backend(requested)
    if name != "auto":
        mod = _load(name)
        if mod is None or not mod.available(device_type):
            hint = ""
            if name == "triton" and device_type == "cpu":
                hint = " (Triton runs on CPU tensors only under TRITON_INTERPRET=1)"
            raise RuntimeError(
                f"replay_ops: backend {name!r} was requested but is not usable for "
                f"{device_type} tensors: {_reason(name, device_type)}{hint}"
            )
        return mod
    for cand in AUTO_ORDER.get(device_type, ("torch",)):
        mod = _load(cand)
        if mod is not None and mod.available(device_type):
            return mod
    return _load("torch")


def backends() -> dict:
    """Which backend serves each device now, and why the others do not."""
    info: dict = {"requested": requested_backend(None), "active": {}, "backends": {}}
    for dev in ("cpu", "cuda"):
        try:
            info["active"][dev] = select(dev).NAME
        except RuntimeError as e:
            info["active"][dev] = f"error: {e}"
    for name in MODULES:
        mod = _load(name)
        info["backends"][name] = {
            dev: (mod is not None and bool(mod.available(dev))) for dev in ("cpu", "cuda")
        }
        if mod is None:
            info["backends"][name]["reason"] = _errors.get(name)
        elif hasattr(mod, "cpu_isa"):
            try:
                info["backends"][name]["cpu_isa"] = mod.cpu_isa()
            except ValueError as e:  # a bad REPLAY_OPS_CPU_ISA: report it, the ops raise it
                info["backends"][name]["cpu_isa"] = f"error: {e}"
    return info
