"""The route-injection hooks in vLLM 0.32 (installed by `register()` when
REPLAY_OPS_VLLM_INJECT=1; see the package docstring for what each does and why there).

Each hook wraps one vLLM function or method and calls it unchanged; a request without
routes, and every step in which no scheduled request has any, takes exactly vLLM's own path.
"""
from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch

from ...router_replay import inject
from ...router_replay.shape import ModelShape
from . import ENV

# under vLLM's logger, so that its handler shows these lines with the engine's own
log = logging.getLogger("vllm.plugins.replay_ops")
_INSTALLED = False
_LOCK = threading.Lock()
WIRE_KEY = inject.ROUTES_KEY


class InjectionUnsupported(RuntimeError):
    """The engine runs in a way the injection hooks cannot serve (named in the message)."""


def install() -> None:
    """Wrap vLLM's request entry, block hashing, model runner and routers (once per process)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _install_frontend()
        _install_block_hash()
        _install_model_runner()
        _INSTALLED = True
    log.info("replay_ops: route injection is on (%s=1)", ENV)


# ----------------------------------------------------------------------------- the model
def moe_layer_ids(hf_config, num_layers: int) -> list[int]:
    """The MoE layers of a model, as vLLM's model code builds them from its config: Qwen2/3-
    MoE skip `mlp_only_layers` and keep every `decoder_sparse_step`-th layer; DeepSeek-V2/V3
    style configs keep layers from `first_k_dense_replace` on, every `moe_layer_freq`-th;
    other MoE models (Mixtral, OLMoE, ...) route in every layer. The worker checks this
    against the loaded model's MoE layers at start-up."""
    if hasattr(hf_config, "mlp_only_layers") or hasattr(hf_config, "decoder_sparse_step"):
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
    if hasattr(hf_config, "first_k_dense_replace"):
        k = int(hf_config.first_k_dense_replace or 0)
        freq = int(getattr(hf_config, "moe_layer_freq", 1) or 1)
        return [i for i in range(num_layers) if i >= k and i % freq == 0]
    return list(range(num_layers))


def model_shape(model_config) -> ModelShape:
    """The served model's shape: experts, top-k, MoE layer ids and layer count."""
    L = model_config.get_total_num_hidden_layers()
    return ModelShape(int(model_config.get_num_experts()),
                      int(model_config.get_num_experts_per_tok()),
                      tuple(moe_layer_ids(model_config.hf_text_config, L)), int(L))


def check_engine(vllm_config) -> None:
    """Refuse (InjectionUnsupported) an engine configuration the hooks cannot serve."""
    pc = vllm_config.parallel_config
    problems = []
    if not vllm_config.use_v2_model_runner:
        problems.append("Model Runner V2 is off (route injection hooks it; set "
                        "VLLM_USE_V2_MODEL_RUNNER=1)")
    if not vllm_config.model_config.enforce_eager:
        problems.append("enforce_eager is off (torch.compile and CUDA graphs would freeze the "
                        "per-step routing; start vLLM with --enforce-eager)")
    for name in ("pipeline_parallel_size", "data_parallel_size",
                 "prefill_context_parallel_size", "decode_context_parallel_size"):
        if int(getattr(pc, name, 1) or 1) > 1:
            problems.append(f"{name}={getattr(pc, name)} (route injection serves one pipeline "
                            f"stage and one data-parallel rank without context parallelism)")
    if problems:
        raise InjectionUnsupported(f"replay_ops route injection ({ENV}=1) cannot run with this "
                                   f"engine: " + "; ".join(problems))


# ----------------------------------------------------------------------------- front end
def _install_frontend() -> None:
    from vllm.v1.engine import input_processor as ip

    cls = ip.InputProcessor
    orig = cls.process_inputs
    if getattr(orig, "_replay_ops", False):
        return

    @functools.wraps(orig)
    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        req = orig(self, request_id, prompt, params, *args, **kwargs)
        sp = req.sampling_params
        extra = sp.extra_args if sp is not None else None
        if not extra or (WIRE_KEY not in extra and inject.START_KEY not in extra):
            return req
        _check_request(self, req, extra)
        return req

    process_inputs._replay_ops = True
    cls.process_inputs = process_inputs


def _check_request(processor, req, extra: dict) -> None:
    """Check a request's routes (raising vLLM's validation error, HTTP 400) and put them in
    `extra_args` in checked form."""
    from vllm.exceptions import VLLMValidationError

    who = f"request {req.request_id}"
    try:
        if WIRE_KEY not in extra:
            raise inject.InjectionError(f"{who}: {inject.START_KEY} was given without "
                                        f"{WIRE_KEY}")
        if inject.is_wire(extra[WIRE_KEY]):
            raise inject.InjectionError(f"{who}: {WIRE_KEY} holds routes in the engine's "
                                        f"internal form; send the .npy or codec payload")
        check_engine(processor.vllm_config)
        shape = _shape_of(processor)
        sp = req.sampling_params
        prompt_len = len(req.prompt_token_ids) if req.prompt_token_ids is not None else \
            int(req.prompt_embeds.shape[0])
        seq_limit = prompt_len + int(sp.max_tokens) - 1
        routes = inject.parse(extra[WIRE_KEY], extra.get(inject.START_KEY, 0), shape=shape,
                              seq_limit=seq_limit, who=who)
    except (inject.InjectionError, InjectionUnsupported, ValueError) as e:
        raise VLLMValidationError(str(e), parameter=WIRE_KEY) from None
    extra = dict(extra)
    extra.pop(inject.START_KEY, None)
    extra[WIRE_KEY] = routes.to_wire()
    req.sampling_params.extra_args = extra


def _shape_of(processor) -> ModelShape:
    shape = getattr(processor, "_replay_ops_shape", None)
    if shape is None:
        shape = model_shape(processor.model_config)
        processor._replay_ops_shape = shape
    return shape


# ----------------------------------------------------------------------------- engine core
def routes_of_request(request) -> inject.InjectedRoutes | None:
    """The checked routes a vLLM request carries (cached on the request), or None."""
    cached = request.__dict__.get("_replay_ops_routes", False)
    if cached is not False:
        return cached
    sp = getattr(request, "sampling_params", None)
    extra = getattr(sp, "extra_args", None) or {}
    wire = extra.get(WIRE_KEY)
    routes = inject.InjectedRoutes.from_wire(wire) if inject.is_wire(wire) else None
    request._replay_ops_routes = routes
    return routes


def _install_block_hash() -> None:
    from vllm.v1.core import block_pool, kv_cache_utils

    orig = kv_cache_utils.generate_block_hash_extra_keys
    if getattr(orig, "_replay_ops", False):
        return

    @functools.wraps(orig)
    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        keys, mm_idx = orig(request, start_token_idx, end_token_idx, start_mm_idx)
        routes = routes_of_request(request)
        if routes is None:
            return keys, mm_idx
        key = routes.block_key(start_token_idx, end_token_idx)
        if key is None:
            return keys, mm_idx
        return tuple(keys or ()) + (("replay_ops_routes", key),), mm_idx

    generate_block_hash_extra_keys._replay_ops = True
    kv_cache_utils.generate_block_hash_extra_keys = generate_block_hash_extra_keys
    # block_pool imported the name for KV-cache events: they report the same keys
    if getattr(block_pool, "generate_block_hash_extra_keys", None) is orig:
        block_pool.generate_block_hash_extra_keys = generate_block_hash_extra_keys


# ----------------------------------------------------------------------------- worker
@dataclass
class ForcedStep:
    """One step's forced rows: `rows` [m] (token rows of the step's batch), `ids` [m, L_moe,
    K] (int32), both on the model's device; `column` maps an absolute MoE layer id to its
    column in `ids`; `num_tokens` the step's token rows."""

    rows: torch.Tensor
    ids: torch.Tensor
    column: dict
    num_tokens: int


class WorkerState:
    """Per model runner: the routes of the requests it holds, and the current step's."""

    def __init__(self, layer_ids: list[int]) -> None:
        self.layer_ids = list(layer_ids)
        self.column = {lid: c for c, lid in enumerate(layer_ids)}
        self.routes: dict[str, inject.InjectedRoutes] = {}
        self.step: ForcedStep | None = None
        self.forced_tokens = 0
        self.steps_with_routes = 0

    def build_step(self, input_batch, device) -> None:
        self.step = None
        if not self.routes:
            return
        qsl = input_batch.query_start_loc_np
        nct = input_batch.num_computed_tokens_np
        rows, ids = [], []
        for b, rid in enumerate(input_batch.req_ids):
            r = self.routes.get(rid)
            if r is None:
                continue
            q0, q1, p0 = int(qsl[b]), int(qsl[b + 1]), int(nct[b])
            a, e = max(p0, r.start), min(p0 + q1 - q0, r.end)
            if a >= e:
                continue
            rows.append(np.arange(q0 + a - p0, q0 + e - p0, dtype=np.int64))
            ids.append(r.ids[a - r.start:e - r.start])
        if not rows:
            return
        rows_np = np.concatenate(rows)
        ids_np = np.concatenate(ids).astype(np.int32)
        num_tokens = int(input_batch.num_tokens)
        if int(rows_np.max()) >= num_tokens:  # pragma: no cover - vLLM's batch invariant
            raise InjectionUnsupported(f"replay_ops: forced row {int(rows_np.max())} beyond the "
                                       f"step's {num_tokens} tokens")
        self.step = ForcedStep(torch.from_numpy(rows_np).to(device),
                               torch.from_numpy(ids_np).to(device), self.column, num_tokens)
        self.forced_tokens += len(rows_np)
        self.steps_with_routes += 1


def _install_model_runner() -> None:
    from vllm.v1.worker.gpu import model_runner as mr

    cls = mr.GPUModelRunner
    if getattr(cls.load_model, "_replay_ops", False):
        return
    orig_load, orig_add = cls.load_model, cls.add_requests
    orig_finish, orig_prepare = cls.finish_requests, cls.prepare_inputs
    orig_execute, orig_reload = cls.execute_model, cls.reload_weights

    @functools.wraps(orig_load)
    def load_model(self, *args, **kwargs):
        out = orig_load(self, *args, **kwargs)
        check_engine(self.vllm_config)
        self._replay_ops = WorkerState(bind_routers(self.get_model(), self.vllm_config))
        return out

    @functools.wraps(orig_reload)
    def reload_weights(self, *args, **kwargs):
        out = orig_reload(self, *args, **kwargs)
        bind_routers(self.get_model(), self.vllm_config)  # routers rebuilt by a reload
        return out

    @functools.wraps(orig_add)
    def add_requests(self, scheduler_output):
        out = orig_add(self, scheduler_output)
        state = getattr(self, "_replay_ops", None)
        if state is not None:
            for new in scheduler_output.scheduled_new_reqs:
                sp = new.sampling_params
                wire = (sp.extra_args or {}).get(WIRE_KEY) if sp is not None else None
                if wire is None:
                    state.routes.pop(new.req_id, None)
                    continue
                if not inject.is_wire(wire):
                    log.error("replay_ops: request %s reached the worker with unchecked routes "
                              "(the front end's hook is not active); they are not applied",
                              new.req_id)
                    continue
                routes = inject.InjectedRoutes.from_wire(wire)
                if list(routes.moe_layer_ids) != state.layer_ids:
                    log.error("replay_ops: request %s carries routes for MoE layers %s, the "
                              "model's are %s; they are not applied", new.req_id,
                              list(routes.moe_layer_ids), state.layer_ids)
                    continue
                state.routes[new.req_id] = routes
        return out

    @functools.wraps(orig_finish)
    def finish_requests(self, scheduler_output):
        out = orig_finish(self, scheduler_output)
        state = getattr(self, "_replay_ops", None)
        if state is not None and state.routes:
            # a preempted request comes back as a new request with its sampling params
            for rid in scheduler_output.finished_req_ids | set(
                    scheduler_output.preempted_req_ids or ()):
                state.routes.pop(rid, None)
        return out

    @functools.wraps(orig_prepare)
    def prepare_inputs(self, *args, **kwargs):
        input_batch = orig_prepare(self, *args, **kwargs)
        state = getattr(self, "_replay_ops", None)
        if state is not None:
            state.build_step(input_batch, self.device)
        return input_batch

    @functools.wraps(orig_execute)
    def execute_model(self, *args, **kwargs):
        state = getattr(self, "_replay_ops", None)
        if state is None:
            return orig_execute(self, *args, **kwargs)
        state.step = None  # a dummy run prepares no inputs: nothing is forced
        _ACTIVE.state = state
        try:
            return orig_execute(self, *args, **kwargs)
        finally:
            state.step = None
            _ACTIVE.state = None

    for fn in (load_model, reload_weights, add_requests, finish_requests, prepare_inputs,
               execute_model):
        fn._replay_ops = True
    cls.load_model, cls.reload_weights, cls.add_requests = load_model, reload_weights, add_requests
    cls.finish_requests, cls.prepare_inputs = finish_requests, prepare_inputs
    cls.execute_model = execute_model


class _Active(threading.local):
    state: WorkerState | None = None


_ACTIVE = _Active()


# ----------------------------------------------------------------------------- routers
def bind_routers(model: torch.nn.Module, vllm_config) -> list[int]:
    """Wrap every MoE router of `model` so that forced rows take the injected experts;
    returns the MoE layer ids (checked against the config's rule). Refuses a model whose
    routing the hooks cannot reach (InjectionUnsupported)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCaptureSource,
    )

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, RoutedExpertsCaptureSource) and not isinstance(module, MoERunner):
            raise InjectionUnsupported(f"replay_ops route injection: {name} "
                                       f"({type(module).__name__}) routes inside its own "
                                       f"kernel; injected routes cannot reach it")
        if not isinstance(module, MoERunner):
            continue
        if module.is_monolithic:
            raise InjectionUnsupported(f"replay_ops route injection: {name} runs a monolithic "
                                       f"MoE kernel that routes inside the kernel; injected "
                                       f"routes cannot reach it")
        lid = int(module.layer_id)
        if lid in found:
            raise InjectionUnsupported(f"replay_ops route injection: two MoE layers with layer "
                                       f"id {lid} ({found[lid][0]}, {name})")
        weights_fn = forced_weights_fn(module.router, name)
        found[lid] = (name, module.router, weights_fn)
    if not found:
        raise InjectionUnsupported("replay_ops route injection: the model has no MoE layer")
    ids = sorted(found)
    want = model_shape(vllm_config.model_config).moe_layer_ids
    if tuple(ids) != tuple(want):
        raise InjectionUnsupported(
            f"replay_ops route injection: the model's MoE layers are {ids}, but its config "
            f"says {list(want)} (replay_ops.integrations.vllm._hooks.moe_layer_ids); "
            f"requests' routes would land in the wrong layers")
    for lid, (name, router, weights_fn) in found.items():
        _wrap_router(router, lid, weights_fn)
    return ids


def _wrap_router(router, layer_id: int, weights_fn) -> None:
    orig = router._compute_routing
    if getattr(orig, "_replay_ops", False):
        orig = orig._replay_ops_orig

    def _compute_routing(hidden_states, router_logits, indices_type, *, input_ids=None):
        topk_weights, topk_ids = orig(hidden_states, router_logits, indices_type,
                                      input_ids=input_ids)
        state = _ACTIVE.state
        step = state.step if state is not None else None
        if step is None:
            return topk_weights, topk_ids
        if router_logits.shape[0] < step.num_tokens:
            raise InjectionUnsupported(
                f"replay_ops route injection: MoE layer {layer_id} sees "
                f"{router_logits.shape[0]} token rows, the step has {step.num_tokens} "
                f"(sequence parallelism or another token split is not supported)")
        forced = step.ids[:, step.column[layer_id]]
        w = weights_fn(router_logits.index_select(0, step.rows), forced.long())
        topk_ids = topk_ids.index_put((step.rows,), forced.to(topk_ids.dtype))
        topk_weights = topk_weights.index_put((step.rows,), w.to(topk_weights.dtype))
        return topk_weights, topk_ids

    _compute_routing._replay_ops = True
    _compute_routing._replay_ops_orig = orig
    router._compute_routing = _compute_routing


def forced_weights_fn(router, name: str = "router"):
    """The gate weights of forced rows, `fn(logits [m, E], ids [m, K]) -> [m, K]`: the
    router's own formula evaluated at the given ids (so forcing the router's own choice
    reproduces its weights bit for bit on vLLM's CPU router), which is replay_ops' gate
    semantics (`replay_ops.reference.gate_weights`): softmax over the K selected logits when
    the router renormalises, else the softmax over all experts at the ids; sigmoid scores
    at the ids, divided by their sum when renormalising; times routed_scaling_factor. An
    expert-score correction bias steers selection only and does not enter the weights.
    Refuses a router whose weights it cannot reproduce."""
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    kind = type(router).__name__
    sf = getattr(router, "scoring_func", "softmax")
    renorm = bool(getattr(router, "renormalize", True))
    scale = float(getattr(router, "routed_scaling_factor", 1.0) or 1.0)

    def refuse(why: str):
        raise InjectionUnsupported(f"replay_ops route injection: {name} uses {kind} with "
                                   f"{why}; its gate weights cannot be recomputed at injected "
                                   f"ids")

    if int(getattr(router, "num_fused_shared_experts", 0) or 0):
        refuse("fused shared experts")
    if getattr(router, "_hash_indices_table", None) is not None:
        refuse("hash routing")
    if getattr(router, "custom_routing_function", None) is not None:
        refuse("a custom routing function")
    if isinstance(router, cpu_router.CPURouter):
        if router.use_grouped_topk:
            if sf not in ("softmax", "sigmoid"):
                refuse(f"scoring_func={sf!r}")
            return functools.partial(_grouped_weights, sf=sf, renorm=renorm, scale=scale)
        if sf != "softmax":
            refuse(f"scoring_func={sf!r}")
        return functools.partial(_cpu_softmax_weights, renorm=renorm)
    if kind not in ("FusedTopKRouter", "GroupedTopKRouter", "FusedTopKBiasRouter"):
        refuse("a routing scheme the plugin does not know")
    if sf not in ("softmax", "sigmoid"):
        refuse(f"scoring_func={sf!r}")
    return functools.partial(_gate_weights, sf=sf, renorm=renorm, scale=scale)


def _cpu_softmax_weights(logits, ids, *, renorm: bool):
    # vLLM 0.32 cpu_router._softmax_topk at given ids, in the logits' dtype as it computes
    g = logits.gather(1, ids)
    if renorm:
        w = torch.softmax(g, dim=-1)
    else:
        w = (g - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    return w.to(torch.float32)


def _grouped_weights(logits, ids, *, sf: str, renorm: bool, scale: float):
    # vLLM 0.32 cpu_router._grouped_topk's weights at given ids (fp32 scores; the bias
    # steers selection only)
    x = logits.float()
    scores = torch.softmax(x, dim=-1) if sf == "softmax" else x.sigmoid()
    w = scores.gather(1, ids)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        w = w * scale
    return w


def _gate_weights(logits, ids, *, sf: str, renorm: bool, scale: float):
    # replay_ops' gate op in fp32 (validate=False: the ids were checked on arrival)
    from ... import gate

    return gate(logits.float(), ids.to(torch.int32), score_func=sf, normalize=renorm,
                scaling_factor=scale, validate=False).weights
