"""Route injection into SGLang: a plugin that makes the engine's MoE layers take the experts a
request carries for a range of its positions (prefill and decode), and route every other
token as usual.

Installed with replay_ops as SGLang's general plugin `replay_ops_inject` (entry point group
`sglang.srt.plugins`, setup.py), which SGLang loads in its server and scheduler processes.
It does nothing unless the engine's environment has `REPLAY_OPS_SGLANG_INJECT=1`: installing
replay_ops alone changes nothing in SGLang. Active, it registers hooks with SGLang's own
`HookRegistry` (read from SGLang 0.5.23's source; nothing is copied):

* the request's entry (`TokenizerManager._create_tokenized_object`, in the server process,
  for `/generate` and the OpenAI endpoints alike): a request whose sampling params'
  `custom_params` hold `replay_ops_routes` is checked
  (`replay_ops.router_replay.inject.parse`) and refused with a ValueError (HTTP 400) naming
  the problem; its routes then travel in checked, JSON-safe form, and its `extra_key` (the
  radix cache's namespace) gains a digest of them, so that its KV is shared only with
  requests that force the same routes (or none, when the request has none);
* the request (`Req.__init__`, in the scheduler): its routes are kept with it, by position,
  so a request that is retracted and prefilled again (memory pressure, or
  `/pause_generation` with mode "retract") forces the same routes again;
* each forward (`ModelRunner.forward`): the step's token rows are mapped to (request,
  position) from the batch (`rids`, the extend prefix and lengths, or the decode lengths),
  checked against the batch's `positions`;
* the routing (`layers.moe.topk._post_process_topk_ids`, which every MoE layer's
  `select_experts` calls before the routed-experts capture): the forced rows take the
  injected ids, and their gate weights are recomputed from the current router logits at
  those ids; the capture, which runs inside, records the forced ids, so the returned
  `routed_experts` show them.

Limits (refused at start-up, or per request): CUDA graphs off (`--disable-cuda-graph`: a
replayed graph would not see the step's routes); no speculative decoding, data-parallel
attention or expert-parallel all-to-all; routers without fused shared experts, custom
routing functions or hash routing; a model whose MoE layers the plugin can tell from its
config (checked against the loaded model at start-up).
"""
from __future__ import annotations

ENV = "REPLAY_OPS_SGLANG_INJECT"
ENTRY_POINT = "replay_ops_inject = replay_ops.integrations.sglang:register"
ENTRY_POINT_GROUP = "sglang.srt.plugins"


def active() -> bool:
    """True when the engine's environment turns route injection on (`REPLAY_OPS_SGLANG_INJECT`
    is 1); any value other than 0/1/unset is refused."""
    from ...router_replay.inject import switch_on

    return switch_on(ENV)


def register() -> None:
    """SGLang's plugin entry point (its server and scheduler processes call it once).
    Inert unless `REPLAY_OPS_SGLANG_INJECT=1`."""
    if not active():
        return
    from . import _hooks

    _hooks.install()
