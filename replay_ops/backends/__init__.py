"""Backend registry and selection.

Three backends implement the ten kernels of the contract in `protocol.py`:

    native   the C++ CPU kernels and, in a CUDA build, the CUDA kernels (replay_ops._C)
    triton   the Triton kernels (CUDA; CPU tensors only under TRITON_INTERPRET=1)
    torch    vectorised eager PyTorch, on any device

Every op call asks `select(op, device_type, shape, dtype, requested)`. It walks an order
of backends and returns the first one that is available for the device and `supports`
the call (for example the CUDA gate kernels take E <= kMaxExperts; larger problems go
to the next backend; a gate call whose features a backend lacks, `OpShape.features`, such
as the in-kernel selection of flagged rows, goes on too). Orders:

    cuda: native -> triton -> torch
    cpu:  native -> torch           (triton only when asked for, under TRITON_INTERPRET=1,
                                     then torch)

A backend that is present but broken (the native extension built for another torch or
missing a CUDA library, or without a kernel image for the GPU) is passed over by automatic
selection with a RuntimeWarning, once per process and reason, that gives the reason and
names the backend used instead; forcing it raises with the same reason. A backend that is
merely absent (not built, Triton not installed) is passed over quietly.

Force a backend with the `backend=` argument of the Python API, or for the whole process
with the environment variable `REPLAY_OPS_BACKEND` (read at each call; the argument
wins). A forced backend that is not available for the device is an error; one that is
available but does not support a call's sizes hands the call to the backends after it in
the device's order, and `backends(op=..., ...)` says which one runs and why.

`replay_ops.backends()` (this module is callable) reports the whole picture.
"""
from __future__ import annotations

import importlib
import os
import sys
import types
import warnings

import torch

from .protocol import OPS, BackendContractError, OpShape, Support, check_contract

__all__ = ["ENV_VAR", "MODULES", "AUTO_ORDER", "OpShape", "Support", "BackendContractError",
           "load", "available", "select", "explain", "requested_backend", "backends"]

ENV_VAR = "REPLAY_OPS_BACKEND"
ALIASES = {"reference": "torch", "eager": "torch"}
MODULES = {
    "native": "replay_ops.backends.native",
    "triton": "replay_ops.backends.triton",
    "torch": "replay_ops.backends.torch",
}
AUTO_ORDER = {"cuda": ("native", "triton", "torch"), "cpu": ("native", "torch")}

_loaded: dict[str, types.ModuleType | None] = {}
_errors: dict[str, str] = {}
_loud_errors: set[str] = set()  # backends whose import failed for a fault, not an absence
_warned: set[tuple[str, str, str]] = set()


def load(name: str) -> types.ModuleType | None:
    """The backend module `name`, or None when it cannot be imported (the reason is kept
    for `backends()`). A module that imports but breaks the contract raises."""
    if name not in _loaded:
        try:
            mod = importlib.import_module(MODULES[name])
        except Exception as e:  # the extension was not built, triton is missing, ...
            _loaded[name] = None
            _errors[name] = f"{type(e).__name__}: {e}"
            if not isinstance(e, ModuleNotFoundError):
                _loud_errors.add(name)
            return None
        check_contract(mod)
        _loaded[name] = mod
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


def available(name: str, device_type: str) -> Support:
    """Whether backend `name` can run on `device_type` tensors at all (and why not)."""
    mod = load(name)
    if mod is None:
        return Support(False, _errors.get(name, "not importable"), name in _loud_errors)
    return mod.available(device_type)


def _warn_passed_over(skipped: dict[str, Support], chosen: str, device_type: str) -> None:
    for cand, verdict in skipped.items():
        key = (cand, device_type, verdict.reason)
        if verdict.loud and key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"replay_ops: the {cand} backend cannot run on {device_type} tensors: "
                f"{verdict.reason} -- using the {chosen} backend instead (this warning is "
                f"given once)", RuntimeWarning, stacklevel=4)


def _order(device_type: str, name: str) -> tuple[str, ...]:
    order = AUTO_ORDER.get(device_type, ("torch",))
    if name == "auto":
        return order
    if name not in order:  # Triton on CPU tensors: the torch backend serves what it cannot
        return (name,) if name == "torch" else (name, "torch")
    return (name,) + order[order.index(name) + 1:]


def explain(op: str, device_type: str, shape: OpShape, dtype: torch.dtype,
            requested: str | None = None) -> tuple[str, dict[str, str]]:
    """(the backend that runs `op` for these sizes, {backend passed over: why})."""
    if op not in OPS:
        raise ValueError(f"replay_ops: unknown op {op!r}; expected one of {OPS}")
    name = requested_backend(requested)
    if name != "auto":
        avail = available(name, device_type)
        if not avail:
            raise RuntimeError(
                f"replay_ops: backend {name!r} was requested but is not usable for "
                f"{device_type} tensors: {avail.reason}"
            )
    skipped: dict[str, str] = {}
    verdicts: dict[str, Support] = {}
    for cand in _order(device_type, name):
        verdict = available(cand, device_type)
        if verdict:
            verdict = load(cand).supports(op, device_type, shape, dtype)
        if verdict:
            _warn_passed_over(verdicts, cand, device_type)
            return cand, skipped
        skipped[cand] = verdict.reason
        verdicts[cand] = verdict
    raise RuntimeError(
        f"replay_ops: no backend serves {op} for {device_type} tensors of {shape} "
        f"{dtype}: {skipped}"
    )


def select(op: str, device_type: str, shape: OpShape, dtype: torch.dtype,
           requested: str | None = None) -> types.ModuleType:
    """The backend module that runs `op` (see the module docstring for the rules)."""
    return load(explain(op, device_type, shape, dtype, requested)[0])


def backends(op: str | None = None, device: str = "cpu", shape: tuple | None = None,
             dtype: torch.dtype = torch.float32, requested: str | None = None) -> dict:
    """Which backend serves each device, and why the others do not.

    With `op` (one of the ten kernels) and `shape` (T, E, K[, H]) it also reports, under
    "call", the backend that runs that call on `device` and why each backend before it
    was passed over (e.g. the CUDA gate's limit on E)."""
    info: dict = {"requested": requested_backend(requested), "active": {}, "backends": {},
                  "why": {}}
    for dev in ("cpu", "cuda"):
        name = info["requested"]
        try:
            if name != "auto" and not available(name, dev):
                raise RuntimeError(available(name, dev).reason)
            active = next((c for c in _order(dev, name) if available(c, dev)), None)
            info["active"][dev] = active
        except RuntimeError as e:
            info["active"][dev] = f"error: backend {name!r} is not usable: {e}"
        info["why"][dev] = {c: available(c, dev).reason for c in MODULES
                            if not available(c, dev)}
    for name in MODULES:
        mod = load(name)
        row = {dev: bool(available(name, dev)) for dev in ("cpu", "cuda")}
        if mod is None:
            row["reason"] = _errors.get(name)
        else:
            row.update(getattr(mod, "describe", lambda: {})())
        info["backends"][name] = row
    if op is not None:
        runs, skipped = explain(op, device, OpShape(*shape), dtype, requested)
        info["call"] = {"op": op, "device": device, "shape": tuple(shape), "runs": runs,
                        "passed_over": skipped}
    return info


class _CallableModule(types.ModuleType):
    """`replay_ops.backends()` reports; `replay_ops.backends.select` etc. are the registry."""

    def __call__(self, *args, **kwargs) -> dict:
        return backends(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
