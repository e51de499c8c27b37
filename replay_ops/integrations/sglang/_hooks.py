"""The route-injection hooks in SGLang 0.5.23, registered with SGLang's `HookRegistry` by
`register()` when REPLAY_OPS_SGLANG_INJECT=1 (see the package docstring for what each does).

Each hook calls SGLang's function unchanged; a request without routes, and every forward in
which no request has any, takes exactly SGLang's own path.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ...router_replay import inject
from ...router_replay.shape import ModelShape
from . import ENV

log = logging.getLogger("sglang.srt.plugins.replay_ops")
ROUTES_KEY = inject.ROUTES_KEY
EXTRA_KEY_TAG = "replay_ops_routes:"
_INSTALLED = False
_LOCK = threading.Lock()
# rid -> the routes of a live request (the Req holds them; gone with it)
_ROUTES: "weakref.WeakValueDictionary[str, inject.InjectedRoutes]" = weakref.WeakValueDictionary()


class InjectionUnsupported(RuntimeError):
    """The engine runs in a way the injection hooks cannot serve (named in the message)."""


def install() -> None:
    """Register the hooks with SGLang's HookRegistry (applied by its `load_plugins`)."""
    global _INSTALLED
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    with _LOCK:
        if _INSTALLED:
            return
        around = HookType.AROUND
        HookRegistry.register(
            "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object",
            _create_tokenized_object, around)
        HookRegistry.register("sglang.srt.managers.schedule_batch.Req.__init__",
                              _req_init, around)
        HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.load_model",
                              _load_model, around)
        HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.forward",
                              _forward, around)
        HookRegistry.register("sglang.srt.layers.moe.topk._post_process_topk_ids",
                              _post_process_topk_ids, around)
        _INSTALLED = True
    log.info("replay_ops: route injection is on (%s=1)", ENV)


# ----------------------------------------------------------------------------- the model
def moe_layer_ids(hf_config, num_layers: int) -> list[int]:
    """The MoE layers as SGLang 0.5.23's model code builds them from the config: DeepSeek-
    V2/V3 style configs keep layers from `first_k_dense_replace` on, every
    `moe_layer_freq`-th; every other MoE model routes in every layer (SGLang's Qwen2/3-MoE
    read neither `mlp_only_layers` nor `decoder_sparse_step`). The scheduler checks this
    against the loaded model's MoE layers at start-up."""
    if hasattr(hf_config, "first_k_dense_replace"):
        k = int(hf_config.first_k_dense_replace or 0)
        freq = int(getattr(hf_config, "moe_layer_freq", 1) or 1)
        return [i for i in range(num_layers) if i >= k and i % freq == 0]
    return list(range(num_layers))


def model_shape(hf_config) -> ModelShape:
    """The served model's shape: experts, top-k, MoE layer ids and layer count (the layer
    count SGLang's routed-experts capture uses: `num_hidden_layers`)."""
    E = next((getattr(hf_config, a) for a in ("num_experts", "n_routed_experts",
                                               "num_local_experts")
              if getattr(hf_config, a, None)), None)
    if not E:
        raise InjectionUnsupported("replay_ops route injection: the model's config names no "
                                   "expert count (num_experts / n_routed_experts / "
                                   "num_local_experts); it is not a MoE model")
    L = int(hf_config.num_hidden_layers)
    return ModelShape(int(E), int(hf_config.num_experts_per_tok),
                      tuple(moe_layer_ids(hf_config, L)), L)


# ----------------------------------------------------------------------------- front end
def wire_text(routes: inject.InjectedRoutes) -> str:
    """The checked routes as one JSON-safe string (SGLang's custom_params travel as JSON
    scalars): 'replay_ops_routes/1;start;n,L,K;dtype;layers;base64'."""
    import base64

    a = np.ascontiguousarray(routes.ids)
    return ";".join(["replay_ops_routes/1", str(routes.start), ",".join(map(str, a.shape)),
                     a.dtype.str, ",".join(map(str, routes.moe_layer_ids)),
                     base64.b64encode(a.tobytes()).decode("ascii")])


def from_wire_text(text: str) -> inject.InjectedRoutes:
    import base64

    tag, start, shape, dtype, layers, data = text.split(";")
    if tag != "replay_ops_routes/1":
        raise inject.InjectionError(f"not the checked form of injected routes ({tag!r})")
    ids = np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype)).reshape(
        [int(v) for v in shape.split(",")])
    return inject.InjectedRoutes(int(start), ids, tuple(int(v) for v in layers.split(",")))


def is_wire_text(v) -> bool:
    return isinstance(v, str) and v.startswith("replay_ops_routes/1;")


def _create_tokenized_object(original_fn, self, obj, *args, **kwargs):
    out = original_fn(self, obj, *args, **kwargs)
    sp = getattr(out, "sampling_params", None)
    cp = getattr(sp, "custom_params", None)
    if not cp or (ROUTES_KEY not in cp and inject.START_KEY not in cp):
        return out
    who = f"request {getattr(out, 'rid', None) or ''}".strip()
    if ROUTES_KEY not in cp:
        raise ValueError(f"{who}: {inject.START_KEY} was given without {ROUTES_KEY}")
    if is_wire_text(cp[ROUTES_KEY]):
        raise ValueError(f"{who}: {ROUTES_KEY} holds routes in the engine's internal form; "
                         f"send the .npy or codec payload")
    if out.input_ids is None:
        raise ValueError(f"{who}: injected routes need the request's token ids (input_ids)")
    shape = getattr(self, "_replay_ops_shape", None)
    if shape is None:
        shape = self._replay_ops_shape = model_shape(self.model_config.hf_text_config)
    max_new = sp.max_new_tokens if sp.max_new_tokens is not None else 128
    seq_limit = len(out.input_ids) + int(max_new) - 1
    try:
        routes = inject.parse(cp[ROUTES_KEY], cp.get(inject.START_KEY, 0), shape=shape,
                              seq_limit=seq_limit, who=who)
    except inject.InjectionError as e:
        raise ValueError(str(e)) from None
    cp = dict(cp)
    cp.pop(inject.START_KEY, None)
    text = wire_text(routes)
    cp[ROUTES_KEY] = text
    sp.custom_params = cp
    # the radix cache's namespace: KV computed with these routes is shared only with
    # requests that force the same ones
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    out.extra_key = f"{out.extra_key}|{EXTRA_KEY_TAG}{digest}" if out.extra_key else \
        f"{EXTRA_KEY_TAG}{digest}"
    return out


# ----------------------------------------------------------------------------- scheduler
def _req_init(original_fn, self, *args, **kwargs):
    original_fn(self, *args, **kwargs)
    cp = getattr(getattr(self, "sampling_params", None), "custom_params", None) or {}
    text = cp.get(ROUTES_KEY) if isinstance(cp, dict) else None
    if text is None:
        return
    if not is_wire_text(text):
        log.error("replay_ops: request %s reached the scheduler with unchecked routes (the "
                  "server's hook is not active); they are not applied", self.rid)
        return
    routes = from_wire_text(text)
    self._replay_ops_routes = routes  # the request keeps them (retraction included)
    _ROUTES[self.rid] = routes


def check_engine(model_runner) -> None:
    """Refuse (InjectionUnsupported) an engine configuration the hooks cannot serve."""
    from sglang.srt.layers.moe.topk import TopK

    problems = []
    args = model_runner.server_args
    try:
        from sglang.srt.arg_groups.overrides import resolving_view

        view = resolving_view(args)
    except Exception:  # noqa: BLE001 - an older layout: read the arguments as they are
        view = args

    def flag(name, default=None):
        try:
            return getattr(view, name)
        except Exception:  # noqa: BLE001
            return getattr(args, name, default)

    if str(model_runner.device) != "cpu" and not flag("disable_cuda_graph", False):
        problems.append("CUDA graphs are on (a replayed graph would not see the step's "
                        "routes; start SGLang with --disable-cuda-graph)")
    if flag("speculative_algorithm", None):
        problems.append(f"speculative decoding ({flag('speculative_algorithm')})")
    if flag("enable_dp_attention", False):
        problems.append("data-parallel attention")
    backend = str(flag("moe_a2a_backend", "none") or "none")
    if backend not in ("none", "MoeA2ABackend.NONE"):
        problems.append(f"the expert-parallel all-to-all backend {backend}")
    found = {}
    for name, m in model_runner.model.named_modules():
        if not isinstance(m, TopK):
            continue
        cfg = m.topk_config
        if not cfg.allow_routed_experts_capture:
            continue  # a draft model's router
        if cfg.num_shared_topk_slots:
            problems.append(f"{name}: fused shared experts")
        if cfg.custom_routing_function is not None:
            problems.append(f"{name}: a custom routing function")
        if cfg.scoring_func not in ("softmax", "sigmoid", "sqrtsoftplus"):
            problems.append(f"{name}: scoring_func={cfg.scoring_func!r}")
        found[int(m.layer_id)] = name
    shape = model_shape(model_runner.model_config.hf_text_config)
    if sorted(found) != list(shape.moe_layer_ids):
        problems.append(f"the model's MoE layers are {sorted(found)}, but its config says "
                        f"{list(shape.moe_layer_ids)} (replay_ops.integrations.sglang._hooks."
                        f"moe_layer_ids); requests' routes would land in the wrong layers")
    if problems:
        raise InjectionUnsupported(f"replay_ops route injection ({ENV}=1) cannot run with this "
                                   f"engine: " + "; ".join(problems))
    model_runner._replay_ops_layers = {lid: c for c, lid in enumerate(shape.moe_layer_ids)}


def _load_model(original_fn, self, *args, **kwargs):
    out = original_fn(self, *args, **kwargs)
    check_engine(self)
    return out


@dataclass
class ForcedStep:
    """One forward's forced rows: `rows` [m] (token rows), `ids` [m, L_moe, K] int32, on the
    model's device; `column` maps a MoE layer id to its column; `num_tokens` the rows."""

    rows: torch.Tensor
    ids: torch.Tensor
    column: dict
    num_tokens: int


class _Active(threading.local):
    step: ForcedStep | None = None


_ACTIVE = _Active()
STATS = {"forced_tokens": 0, "steps_with_routes": 0}


def token_positions(forward_batch) -> tuple[list, list] | None:
    """Per request of the batch (in batch order), its first token row and its positions
    (a range), from the batch's host-side lengths; None for a batch without tokens."""
    mode = forward_batch.forward_mode
    if mode.is_idle():
        return None
    if mode.is_extend():
        prefix = list(forward_batch.extend_prefix_lens_cpu)
        lens = list(forward_batch.extend_seq_lens_cpu)
    elif mode.is_decode():
        seq = forward_batch.seq_lens_cpu
        seq = seq.tolist() if hasattr(seq, "tolist") else list(seq)
        prefix = [int(s) - 1 for s in seq]
        lens = [1] * len(seq)
    else:
        raise InjectionUnsupported(f"replay_ops route injection: forward mode {mode} is not "
                                   f"supported")
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64).tolist()
    return starts, [range(int(p), int(p) + int(n)) for p, n in zip(prefix, lens)]


def build_step(forward_batch, column: dict) -> ForcedStep | None:
    rids = forward_batch.rids
    if not _ROUTES or not rids or not any(r in _ROUTES for r in rids):
        return None
    starts, ranges = token_positions(forward_batch)
    rows, ids, want = [], [], []
    for rid, t0, pos in zip(rids, starts, ranges):
        r = _ROUTES.get(rid)
        if r is None:
            continue
        a, e = max(pos.start, r.start), min(pos.stop, r.end)
        if a >= e:
            continue
        rows.append(np.arange(t0 + a - pos.start, t0 + e - pos.start, dtype=np.int64))
        ids.append(r.ids[a - r.start:e - r.start])
        want.append(np.arange(a, e, dtype=np.int64))
    if not rows:
        return None
    rows_np = np.concatenate(rows)
    positions = forward_batch.positions
    num_tokens = int(positions.shape[0])
    if int(rows_np.max()) >= num_tokens:
        raise InjectionUnsupported(f"replay_ops: forced row {int(rows_np.max())} beyond the "
                                   f"forward's {num_tokens} tokens")
    dev = positions.device
    rows_t = torch.from_numpy(rows_np).to(dev)
    if dev.type == "cpu":  # the lengths said where each position is: check (no sync on CPU)
        got = positions.index_select(0, rows_t).numpy()
        if not np.array_equal(got, np.concatenate(want)):
            raise InjectionUnsupported("replay_ops: the batch's positions are not the ones its "
                                       "lengths describe; the forced rows cannot be placed")
    STATS["forced_tokens"] += len(rows_np)
    STATS["steps_with_routes"] += 1
    return ForcedStep(rows_t, torch.from_numpy(np.concatenate(ids).astype(np.int32)).to(dev),
                      column, num_tokens)


def _forward(original_fn, self, forward_batch, *args, **kwargs):
    column = getattr(self, "_replay_ops_layers", None)
    if column is None:
        return original_fn(self, forward_batch, *args, **kwargs)
    _ACTIVE.step = build_step(forward_batch, column)
    try:
        return original_fn(self, forward_batch, *args, **kwargs)
    finally:
        _ACTIVE.step = None


# ----------------------------------------------------------------------------- routing
def _post_process_topk_ids(original_fn, *args, **kwargs):
    step = _ACTIVE.step
    if step is None:
        return original_fn(*args, **kwargs)
    if args:  # SGLang passes them by keyword; name any positional ones
        import inspect

        kwargs = dict(inspect.signature(original_fn).bind(*args, **kwargs).arguments)
    layer_id = kwargs["layer_id"]
    cfg = kwargs["topk_config"]
    col = step.column.get(layer_id) if cfg.allow_routed_experts_capture else None
    if col is None:
        return original_fn(**kwargs)
    logits = kwargs["router_logits"]
    topk_ids, topk_weights = kwargs["topk_ids"], kwargs["topk_weights"]
    if logits.shape[0] < step.num_tokens:
        raise InjectionUnsupported(f"replay_ops route injection: MoE layer {layer_id} sees "
                                   f"{logits.shape[0]} token rows, the forward has "
                                   f"{step.num_tokens}")
    forced = step.ids[:, col].long()
    w = forced_weights(logits.index_select(0, step.rows), forced, cfg)
    kwargs["topk_ids"] = topk_ids.index_put((step.rows,), forced.to(topk_ids.dtype))
    kwargs["topk_weights"] = topk_weights.index_put((step.rows,), w.to(topk_weights.dtype))
    return original_fn(**kwargs)


def forced_weights(logits: torch.Tensor, ids: torch.Tensor, cfg) -> torch.Tensor:
    """The forced rows' gate weights [m, K] from the current router logits at `ids`, as
    SGLang's torch router computes them for its own choice (`fused_topk_torch_native`):
    the scores (softmax over all experts, sigmoid or sqrt-softplus; in fp32, or in the
    logits' dtype when an expert-score bias steers the selection, which it does not enter)
    gathered at the ids, divided by their sum (+1e-20) when the router renormalises, times
    routed_scaling_factor when it is applied to the output. That is replay_ops' gate
    semantics (`replay_ops.reference.gate_weights`)."""
    sf = cfg.scoring_func
    x = logits if cfg.correction_bias is not None else logits.float()
    if sf == "softmax":
        s = x.softmax(dim=-1)
    elif sf == "sigmoid":
        s = x.sigmoid()
    else:
        s = torch.nn.functional.softplus(x).sqrt()
    w = s.gather(1, ids)
    if cfg.renormalize:
        w = w / (w.sum(dim=-1, keepdim=True, dtype=torch.float32) + 1e-20)
    if cfg.apply_routed_scaling_factor_on_output and cfg.routed_scaling_factor is not None:
        w = w * cfg.routed_scaling_factor
    return w
