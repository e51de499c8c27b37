"""Route injection into vLLM: a plugin that makes the engine's MoE layers take the experts a
request carries for a range of its positions (prefill and decode), and route every other
token as usual.

Installed with replay_ops as vLLM's `vllm.general_plugins` entry point `replay_ops_inject`
(setup.py), which vLLM loads in every process it starts. It does nothing unless the engine's
environment has `REPLAY_OPS_VLLM_INJECT=1`: installing replay_ops alone changes nothing in
vLLM. Active, it hooks three places (read from vLLM 0.32's source; nothing is copied):

* the request's entry (`InputProcessor.process_inputs`, in the front-end process, for
  `LLM.generate` and the OpenAI server alike): a request whose `SamplingParams.extra_args`
  (the server's `vllm_xargs`) holds `replay_ops_routes` is checked
  (`replay_ops.router_replay.inject.parse`) and refused with a `VLLMValidationError` (HTTP
  400) naming the problem, before it reaches the engine; its routes then travel in checked
  form (`InjectedRoutes.to_wire`) in place of the payload;
* the prefix cache's block hash (`generate_block_hash_extra_keys`, in the engine core): a
  block holding forced positions is keyed by a digest of their routes too, so it is shared
  only with requests that force the same routes there; the routed-experts store, keyed by
  the block hash, returns those routes for it;
* Model Runner V2 (in the worker): the routes of each scheduled request are kept by
  request (re-sent by the scheduler after a preemption), mapped each step to the step's
  token rows by position (`num_computed_tokens + i`, the rows vLLM's own routed-experts
  capture records), so chunked prefill, preemption and recompute force the same routes;
  every MoE router's `_compute_routing` then replaces the forced rows' expert ids, and
  their gate weights are recomputed from the current router logits at those ids (the
  router's own formula and dtype: see `_hooks.forced_weights_fn`). vLLM's capture, which
  runs after, records the forced ids, so the returned `routed_experts` show them.

Limits (each refused loudly at start-up or per request, never silently ignored): Model
Runner V2 only; `enforce_eager` (torch.compile and CUDA graphs would freeze the per-step
routing); no pipeline, data, prefill- or decode-context parallelism; modular MoE kernels
whose router is one of vLLM's built-in routers (not monolithic kernels, custom routing
functions, fused shared experts, hash or zero-expert routing); a model whose MoE layers the
plugin can tell from its config (checked against the loaded model at start-up).
"""
from __future__ import annotations

ENV = "REPLAY_OPS_VLLM_INJECT"
ENTRY_POINT = "replay_ops_inject = replay_ops.integrations.vllm:register"
ENTRY_POINT_GROUP = "vllm.general_plugins"


def active() -> bool:
    """True when the engine's environment turns route injection on (`REPLAY_OPS_VLLM_INJECT`
    is 1); any value other than 0/1/unset is refused."""
    from ...router_replay.inject import switch_on

    return switch_on(ENV)


def register() -> None:
    """vLLM's plugin entry point (every vLLM process calls it once). Inert unless
    `REPLAY_OPS_VLLM_INJECT=1`."""
    if not active():
        return
    from . import _hooks

    _hooks.install()
