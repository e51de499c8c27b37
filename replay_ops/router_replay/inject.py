"""Route injection: a request carries the routes its MoE layers must take for a range of its
positions, and the rollout engine uses exactly those experts for those tokens.

    from replay_ops.router_replay import inject

    args = inject.request_args(routes, start=p0, num_experts=E)   # routes [n, L, K]
    # vLLM: SamplingParams(extra_args=args), or {"vllm_xargs": args} in an OpenAI request
    # SGLang: the same entries in the request's sampling params (docs/router_replay.md)
    inject.check_returned(routes, returned_routed_experts, start=p0, shape=model_shape)

This module is the part every engine shares: the request format, its checks (run by the
engine's plugin before the request is admitted), the form the engine keeps the routes in,
and the client's check that the engine used them. The engines' plugins are
`replay_ops.integrations.vllm` and `replay_ops.integrations.sglang`; docs/router_replay.md
("Injecting routes into the engine") describes both.

## The request

* `replay_ops_routes`: the routes `[n, L, K]` for positions `start .. start+n-1` of the
  request's sequence (prompt then generated tokens), as
  - base64 text of an `.npy` array (what vLLM returns as `routed_experts`: uint8 up to 256
    experts, uint16 above; any integer dtype is taken), or
  - base64 text of a replay_ops codec blob (`router_replay.codec.encode`), or
  - in process, the array itself (numpy or torch) or the raw `.npy` / codec bytes.
  L is the model's MoE layer count (one column per MoE layer, in order) or its hidden layer
  count (absolute layer ids, as vLLM and SGLang return them; the dense layers' columns are
  ignored and must hold 0 or -1). K is the model's top_k.
* `replay_ops_routes_start`: the first position (default 0).

Refused, with the request and the position named (`InjectionError`):

* a payload that is not one of the forms above, or larger than `max_bytes`
  (`REPLAY_OPS_INJECT_MAX_BYTES`, default 64 MiB of payload);
* a shape other than `[n >= 1, L_moe or L_all, top_k]`;
* an expert id outside `0 .. num_experts-1` (-1 included: a token without a route is left
  out of the range, not marked), an expert twice in a token's layer, a route in a dense
  layer's column;
* positions beyond the sequence: `start + n > prompt_len + max_tokens - 1` (the last token
  is never run through the model, so it has no route), or a start below 0.

The engine keeps the checked routes as `InjectedRoutes` (int16 `[n, L_moe, K]`, int32 above
32767 experts) and sends them between its processes in `to_wire()` form.
"""
from __future__ import annotations

import base64
import hashlib
import io
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .adapters.batch import RoutingMismatchError, decode_b64, to_moe
from .shape import ModelShape, describe_bad_route, first_bad_route

def switch_on(env: str) -> bool:
    """An engine plugin's switch: True when the environment variable `env` is 1, False when
    it is 0 or unset; any other value is refused, naming it."""
    v = os.environ.get(env, "")
    if v in ("", "0"):
        return False
    if v == "1":
        return True
    raise ValueError(f"{env}={v!r}: expected 1 (route injection on) or 0/unset (off)")


ROUTES_KEY = "replay_ops_routes"
START_KEY = "replay_ops_routes_start"
WIRE_VERSION = 1
MAX_BYTES_ENV = "REPLAY_OPS_INJECT_MAX_BYTES"
DEFAULT_MAX_BYTES = 64 << 20
FORMATS = ("npy", "codec")
NPY_MAGIC = b"\x93NUMPY"


class InjectionError(ValueError):
    """A request's injected routes are refused (the message names the request, the position
    and the value)."""


class InjectionIgnoredError(RuntimeError):
    """The routes an engine returned differ from the ones injected: the engine did not apply
    them (its plugin is not active, or the request's routes were dropped on the way)."""


def max_bytes_default() -> int:
    """`REPLAY_OPS_INJECT_MAX_BYTES` (an integer number of bytes), else 64 MiB."""
    raw = os.environ.get(MAX_BYTES_ENV)
    if raw is None or raw == "":
        return DEFAULT_MAX_BYTES
    try:
        v = int(raw)
    except ValueError:
        v = -1
    if v < 1:
        raise ValueError(f"{MAX_BYTES_ENV}={raw!r}: expected a positive integer number of bytes")
    return v


def wire_dtype(num_experts: int) -> np.dtype:
    return np.dtype("<i2") if num_experts <= np.iinfo(np.int16).max else np.dtype("<i4")


@dataclass(frozen=True)
class InjectedRoutes:
    """Checked routes of one request: `ids [n, L_moe, K]` for positions `start .. start+n-1`,
    one column per MoE layer (`moe_layer_ids`, absolute layer ids)."""

    start: int
    ids: np.ndarray
    moe_layer_ids: tuple[int, ...]

    @property
    def n(self) -> int:
        return int(self.ids.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.n

    def to_wire(self) -> dict:
        """A plain dict (ints, lists, bytes) that the engines' inter-process messages carry."""
        a = np.ascontiguousarray(self.ids)
        return {"v": WIRE_VERSION, "start": int(self.start), "shape": list(a.shape),
                "dtype": a.dtype.str, "layers": list(self.moe_layer_ids), "ids": a.tobytes()}

    @classmethod
    def from_wire(cls, d: Any) -> "InjectedRoutes":
        if not is_wire(d):
            raise InjectionError(f"not the checked form of injected routes (got "
                                 f"{type(d).__name__}); the engine's plugin checks a request's "
                                 f"routes when it arrives")
        ids = np.frombuffer(d["ids"], dtype=np.dtype(d["dtype"])).reshape(d["shape"])
        return cls(int(d["start"]), ids, tuple(int(i) for i in d["layers"]))

    def block_key(self, begin: int, end: int) -> str | None:
        """A digest of the routes forced at positions `begin .. end-1` (None when the range
        holds none): what a KV-cache block computed with them is keyed by, besides its
        tokens, so that it is never shared with one computed with other routes."""
        a, b = max(begin, self.start), min(end, self.end)
        if a >= b:
            return None
        h = hashlib.sha256()
        h.update(f"replay_ops_routes:{a}:{b}:{self.ids.dtype.str}:{self.ids.shape[1:]}:"
                 f"{self.moe_layer_ids}:".encode())
        h.update(np.ascontiguousarray(self.ids[a - self.start:b - self.start]).tobytes())
        return h.hexdigest()

    def rows_for(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of `positions` are forced, as a bool mask; their rows' indices into `ids`)."""
        sel = (positions >= self.start) & (positions < self.end)
        return sel, positions[sel] - self.start


def is_wire(d: Any) -> bool:
    return isinstance(d, dict) and d.get("v") == WIRE_VERSION and "ids" in d


# ----------------------------------------------------------------------------- client side
def request_args(routes, *, start: int = 0, num_experts: int, fmt: str = "npy",
                 order: str = "keep") -> dict:
    """The request entries that inject `routes` [n, L, K] at positions `start ..`:
    `{"replay_ops_routes": <base64 text>, "replay_ops_routes_start": start}`, for vLLM's
    `SamplingParams.extra_args` / `vllm_xargs` or SGLang's `custom_params`. `fmt`: "npy"
    (an `.npy` of vLLM's own dtype: uint8 up to 256 experts, uint16 above; int16 when the
    routes hold -1) or "codec" (a replay_ops codec blob, `order` "keep" or "set")."""
    if fmt not in FORMATS:
        raise ValueError(f"inject.request_args: fmt must be one of {FORMATS}, got {fmt!r}")
    a = routes.detach().cpu().numpy() if isinstance(routes, torch.Tensor) else np.asarray(routes)
    if a.ndim != 3 or a.dtype.kind not in "iu":
        raise InjectionError(f"inject.request_args: routes must be an integer array [n, L, K], "
                             f"got {a.dtype} of shape {a.shape}")
    if fmt == "npy":
        lo = int(a.min()) if a.size else 0
        hi = int(a.max()) if a.size else 0
        if lo >= 0 and hi < 256 and num_experts <= 256:
            a = a.astype(np.uint8)
        elif lo >= 0 and hi < 65536 and num_experts > 256:
            a = a.astype(np.uint16)
        else:
            a = a.astype(np.int16 if num_experts <= 32767 else np.int32)
        buf = io.BytesIO()
        np.save(buf, a, allow_pickle=False)
        raw = buf.getvalue()
    else:
        from . import codec

        raw = codec.encode(a.astype(np.int64), num_experts=num_experts, order=order)
    return {ROUTES_KEY: base64.b64encode(raw).decode("ascii"), START_KEY: int(start)}


def check_returned(routes, returned, *, shape: ModelShape, start: int = 0,
                   returned_start: int = 0, order: str = "keep", who: str = "request") -> int:
    """Check that an engine used the injected `routes` ([n, L, K], positions `start ..`):
    `returned` is the routing the engine sent back for the request (rows for positions
    `returned_start ..`: vLLM's `routed_experts` array or its base64 text, SGLang's
    decoded array), `shape` the model's. Every injected position the engine returned a row
    for must hold exactly the injected experts in every MoE layer, in the injected order
    (`order="set"`: the same sets, for routes sent as a codec blob in "set" order).
    Returns the number of positions checked; raises `InjectionIgnoredError` naming the
    first position and layer that differ, or when no injected position came back."""
    if order not in ("keep", "set"):
        raise ValueError(f"inject.check_returned: order must be 'keep' or 'set', got {order!r}")
    if returned is None:
        raise InjectionIgnoredError(f"{who}: the engine returned no routes, so the injected "
                                    f"ones cannot be checked (start the engine with routed-"
                                    f"experts return enabled)")
    if isinstance(returned, (str, bytes, bytearray, memoryview)):
        from .adapters.vllm import decode_vllm

        returned = decode_vllm(returned, who=f"{who}: returned routes")
    inj = _moe_columns(routes, shape, f"{who}: injected routes")
    ret = _moe_columns(returned, shape, f"{who}: returned routes", check_values=False)
    a = max(start, returned_start)
    b = min(start + inj.shape[0], returned_start + ret.shape[0])
    if a >= b:
        raise InjectionIgnoredError(
            f"{who}: the engine returned routes for positions {returned_start}.."
            f"{returned_start + ret.shape[0] - 1}, none of the injected positions {start}.."
            f"{start + inj.shape[0] - 1}")
    x = inj[a - start:b - start]
    y = ret[a - returned_start:b - returned_start]
    if order == "set":
        x, y = np.sort(x, -1), np.sort(y, -1)
    diff = (x != y).any(-1)
    if diff.any():
        t, c = (int(v) for v in np.argwhere(diff)[0])
        rows = int(diff.any(1).sum())
        raise InjectionIgnoredError(
            f"{who}: position {a + t}, MoE layer {shape.moe_layer_ids[c]}: the engine routed to "
            f"experts {ret[a - returned_start + t, c].tolist()}, the injected routes say "
            f"{inj[a - start + t, c].tolist()} ({rows} of {b - a} injected positions differ); "
            f"the engine did not apply the injected routes: is its replay_ops plugin active "
            f"(REPLAY_OPS_VLLM_INJECT=1 / REPLAY_OPS_SGLANG_INJECT=1)?")
    return b - a


def _moe_columns(x, shape: ModelShape, who: str, check_values: bool = True) -> np.ndarray:
    t = torch.from_numpy(np.array(x)) if isinstance(x, np.ndarray) else x
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(np.asarray(t))
    if t.dim() != 3 or t.shape[2] != shape.top_k:
        raise InjectionError(f"{who}: routes must be [n, L, K={shape.top_k}], got shape "
                             f"{tuple(t.shape)}")
    if check_values:
        try:
            out, _ = to_moe(shape, t.cpu(), who)
        except RoutingMismatchError as e:
            raise InjectionError(str(e)) from None
        return out.numpy().astype(np.int64)
    mapping = shape.mapping_for(t.shape[1], who, error=InjectionError)
    return t.cpu()[:, shape.columns(mapping), :].to(torch.int64).numpy()


# ----------------------------------------------------------------------------- engine side
def parse(payload, start, *, shape: ModelShape, seq_limit: int, max_bytes: int | None = None,
          who: str = "request") -> InjectedRoutes:
    """Check a request's `replay_ops_routes` payload and start against the model (`shape`)
    and the request (`seq_limit`: prompt_len + max_tokens - 1, the positions that are run
    through the model); returns the `InjectedRoutes` the engine keeps. Raises
    `InjectionError` (see the module docstring for what is refused)."""
    if max_bytes is None:
        max_bytes = max_bytes_default()
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
        raise InjectionError(f"{who}: {START_KEY} must be an integer position, got "
                             f"{type(start).__name__} {start!r}")
    start = int(start)
    if start < 0:
        raise InjectionError(f"{who}: {START_KEY}={start} is negative")
    if start >= seq_limit:
        raise InjectionError(f"{who}: {START_KEY}={start} is beyond the sequence: positions "
                             f"0..{seq_limit - 1} are run through the model (prompt_len + "
                             f"max_tokens - 1 = {seq_limit}; the last token has no route)")
    a = _decode_payload(payload, shape, seq_limit - start, max_bytes, who)
    if a.dim() != 3:
        raise InjectionError(f"{who}: {ROUTES_KEY} must be [n, L, K], got shape {tuple(a.shape)}")
    n, L, K = a.shape
    if n == 0:
        raise InjectionError(f"{who}: {ROUTES_KEY} holds no rows (shape {tuple(a.shape)})")
    if start + n > seq_limit:
        raise InjectionError(
            f"{who}: routes for positions {start}..{start + n - 1} reach beyond the sequence: "
            f"positions 0..{seq_limit - 1} are run through the model (prompt_len + max_tokens "
            f"- 1 = {seq_limit}; the last token has no route)")
    if K != shape.top_k:
        raise InjectionError(f"{who}: routes have K={K} experts per token, the model has "
                             f"top_k={shape.top_k} (shape {tuple(a.shape)})")
    try:
        moe, _ = to_moe(shape, a, who)
    except RoutingMismatchError as e:
        bad = first_bad_route(_mapped(a, shape), shape.num_experts)
        if bad is not None:  # name the sequence position, not the row
            msg = f"{who}: {describe_bad_route(bad, shape.num_experts, shape.moe_layer_ids, start)}"
        else:
            msg = f"{e} (token 0 is position {start})" if start else str(e)
        raise InjectionError(msg) from None
    missing = (moe < 0).any(-1)
    if bool(missing.any()):
        t, c = (int(v) for v in missing.nonzero()[0])
        raise InjectionError(
            f"{who}: position {start + t}, MoE layer {shape.moe_layer_ids[c]} has no route "
            f"({moe[t, c].tolist()}); every injected token needs K experts in every MoE layer "
            f"(leave tokens without routes out of the range start..start+n-1)")
    ids = moe.numpy().astype(wire_dtype(shape.num_experts))
    return InjectedRoutes(start, ids, tuple(shape.moe_layer_ids))


def _mapped(a: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    mapping = shape.mapping_for(a.shape[1], "routes", error=InjectionError)
    return a[:, shape.columns(mapping), :].to(torch.int64)


def _decode_payload(payload, shape: ModelShape, max_rows: int, max_bytes: int,
                    who: str) -> torch.Tensor:
    what = f"{who}: {ROUTES_KEY}"
    if isinstance(payload, torch.Tensor):
        payload = payload.detach().cpu().numpy()
    if isinstance(payload, np.ndarray):
        if payload.nbytes > max_bytes:
            raise InjectionError(f"{what}: {payload.nbytes} bytes, more than the limit of "
                                 f"{max_bytes} ({MAX_BYTES_ENV})")
        if payload.dtype.kind not in "iu":
            raise InjectionError(f"{what}: must hold integer expert ids, got {payload.dtype}")
        if payload.ndim == 3 and payload.shape[0] > max_rows:
            raise InjectionError(f"{what}: {payload.shape[0]} rows, more than the {max_rows} "
                                 f"positions left in the sequence")
        return _signed(payload)
    text = None
    if isinstance(payload, str):
        if len(payload) > max_bytes:
            raise InjectionError(f"{what}: {len(payload)} characters of base64, more than the "
                                 f"limit of {max_bytes} bytes ({MAX_BYTES_ENV})")
        text = payload
    elif isinstance(payload, (bytes, bytearray, memoryview)):
        raw = bytes(payload)
        if len(raw) > max_bytes:
            raise InjectionError(f"{what}: {len(raw)} bytes, more than the limit of "
                                 f"{max_bytes} ({MAX_BYTES_ENV})")
        if raw.startswith(NPY_MAGIC):
            text = base64.b64encode(raw)  # the .npy reader's one entry (header checked first)
        elif not raw.startswith(_codec_magic()):
            text = raw
    else:
        raise InjectionError(f"{what}: expected base64 text of an .npy array or a codec "
                             f"blob (or, in process, an integer array), got "
                             f"{type(payload).__name__}")
    if text is not None:
        try:
            head = base64.b64decode(text[:12], validate=True)
        except (ValueError, TypeError):
            head = b""
        if head.startswith(NPY_MAGIC):
            from .adapters.vllm import decode_vllm

            try:
                return _signed(decode_vllm(text, who=what, max_rows=max_rows))
            except RoutingMismatchError as e:
                raise InjectionError(str(e)) from None
        try:
            raw = decode_b64(text, what, "base64 text of an .npy array or a codec blob")
        except RoutingMismatchError as e:
            raise InjectionError(str(e)) from None
    if raw.startswith(_codec_magic()):
        from . import codec

        try:
            inf = codec.info(raw)
        except Exception as e:  # noqa: BLE001 - CodecError and friends name the byte
            raise InjectionError(f"{what}: a corrupt codec blob: {e}") from None
        if inf.num_experts != shape.num_experts:
            raise InjectionError(f"{what}: the codec blob was encoded for num_experts="
                                 f"{inf.num_experts}; the model has {shape.num_experts}")
        if inf.has_token_ids:
            raise InjectionError(f"{what}: the codec blob was encoded with token_ids; "
                                 f"injected routes are encoded without them")
        if inf.num_tokens > max_rows:
            raise InjectionError(f"{what}: {inf.num_tokens} rows, more than the {max_rows} "
                                 f"positions left in the sequence")
        try:
            return codec.decode(raw, max_tokens=max_rows).to(torch.int64)
        except Exception as e:  # noqa: BLE001
            raise InjectionError(f"{what}: a corrupt codec blob: {e}") from None
    raise InjectionError(f"{what}: the decoded {len(raw)} bytes are neither an .npy array nor "
                         f"a replay_ops codec blob (they start with {raw[:8]!r})")


def _signed(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == np.uint64 and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise InjectionError(f"{ROUTES_KEY}: an expert id {int(a.max())} is out of range")
    return torch.from_numpy(a.astype(np.int64))


def _codec_magic() -> bytes:
    from .codec.format import MAGIC

    return MAGIC
