"""The forward of a Hugging Face MoE block under replay_ops: `patched_forward`, the one
forward every patched block runs, on one device (`patch.patch_model`) and under expert
parallelism (`ep.enable_expert_parallel`). This module imports neither of them.

    routing = route_block(patch, lid, block, hidden_states)   # router + replay plan
    out = block_forward(block, routing, spec, run_experts)    # experts + shared experts

`run_experts(experts, x, plan)` is the part that differs: `plan_experts` on one device,
dispatch -> `rows_experts` -> combine under expert parallelism (the block's
`_replay_ops_ep` state, an `ExpertsRunner`).

The experts always run through the experts module's own call, `block.experts(hidden_states,
top_k_index, top_k_weights)`, as the unpatched block calls it (`call_experts`), so that
everything hooked on the module runs around them: accelerate's offload hooks (which load
the weights before the forward and offload them after), forward pre-hooks and forward
hooks (which may change the inputs or the output). `patch_model` installs `experts_forward`
as the module's forward (inside accelerate's wrapper when there is one); called as the
unpatched block calls it, it is the class's own forward. The replayed block passes it the
replayed routing and, where replay_ops computes the experts itself (the grouped_mm plan
path, expert parallelism), the plan as the keyword `replay_ops_plan`: the hooks see
`top_k_index` = `plan.expert_indices` (int32, -1 on an empty slot) and `top_k_weights` =
`plan.weights` there, and the output is the routed `[T, H]` as unpatched. A pre-hook that
replaces the routing arguments is obeyed: the forward then runs the config's
implementation on them (one device; under expert parallelism it raises, since the
exchange is planned from the plan).

The experts run through the implementation the model's config names
(`config._experts_implementation`, looked up in transformers' `ExpertsInterface` exactly as
the unpatched experts module looks it up):

* "grouped_mm" (transformers' own `grouped_mm_experts_forward`): a grouped GEMM over the
  plan. `replay_ops.permute` fills `plan.max_rows` expert-major rows (static, so no host
  read), `plan.expert_offsets[1:]` (int32 cumulative ends, padding rows of `align > 1`
  included) are the group ends, the up and down projections are two grouped GEMMs, and
  `replay_ops.unpermute` sums the `K` rows of each token back (fp32, recorded column
  order). The sort, histogram, offsets and inverse permutation of transformers' function
  are the plan's; the grouped GEMM is transformers' own dispatcher (`_grouped_mm`), so
  where `torch.nn.functional.grouped_mm` cannot run (its `_can_use_grouped_mm` rule: dtype,
  device, torch version) the same fallback runs (`transformers::grouped_mm_fallback`, which
  reads the offsets once on the host, as it does for the unpatched model).
* any other name ("eager", "batched_mm", a function registered with
  `ExpertsInterface.register`): that very function, called as the unpatched block calls it,
  `fn(experts, x, top_k_index, top_k_weights)`, with the replayed indices (int64, as the
  router gives them) and the replayed gate weights. Empty slots (index -1, weight 0) are
  passed as expert 0 with weight 0, which adds an exact zero unless expert 0's output for
  that token is not finite. Host syncs are then the implementation's own (eager reads the
  experts hit).

Rows past the used ones (`plan.max_rows - expert_offsets[E]`) are zero in the permuted
buffer; the grouped GEMM does not compute them, and `unpermute` (forward) and `permute`'s
backward read only the rows the plan's slots point to, so whatever the GEMM leaves there is
never read. Padding rows inside a segment (`align > 1`) are zero inputs: with no expert
bias an expert maps them to zero, and nothing reads them either.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Protocol

import torch

import replay_ops
from replay_ops._deprecated import deprecated_property
from replay_ops.plan import RoutingPlan
from replay_ops.router_replay import ReplayAction

from .aux_loss import mark_routed

__all__ = [
    "BlockRouting",
    "ExpertsRunner",
    "GROUPED_MM",
    "LOGITS_KWARG",
    "LayerAgreement",
    "PLAN_KWARG",
    "block_forward",
    "call_experts",
    "experts_forward",
    "experts_function",
    "grouped_mlp",
    "own_routing_plan",
    "patched_forward",
    "plan_experts",
    "route_block",
    "router_forward",
    "routing_agreement",
    "rows_experts",
]

GROUPED_MM = "grouped_mm"
# experts_forward's keyword: (plan, run_experts[, x]); x: the hidden states plan.rows holds
PLAN_KWARG = "replay_ops_plan"
LOGITS_KWARG = "replay_ops_logits"  # router_forward's keyword: the family's logits function


# ----------------------------------------------------------------------------- routing


def _in_backward() -> bool:
    if torch.compiler.is_compiling():
        return False
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


@dataclasses.dataclass
class BlockRouting:
    """What `route_block` found for one MoE block forward."""

    hidden_states: torch.Tensor  # the block's input (after Mixtral's router jitter)
    x: torch.Tensor  # [T, H]
    logits: torch.Tensor  # [T, E], fp32 where the architecture keeps gate weights in fp32
    # the model's own routing: the router's gate weights and indices (None where replay
    # computed the logits only)
    own_weights: torch.Tensor | None
    own_indices: torch.Tensor | None
    plan: RoutingPlan | None  # None: the replay object chose the model's own routing
    recompute: bool  # an activation recompute (its routing is not reported again)
    # with ReplayPatch.return_agreement, in a replayed forward (else None)
    agreement: "LayerAgreement | None" = None

    # deprecated names of own_weights / own_indices ("native" names the C++/CUDA backend)
    native_weights = deprecated_property("own_weights", "BlockRouting.native_weights")
    native_indices = deprecated_property("own_indices", "BlockRouting.native_indices")


def _needs_own_routing(patch, action, spec) -> bool:
    """Whether the router module's whole forward (its own top-k) runs: RECORD, no action
    (the model's own routing), the own-routing comparison (`patch.own_routing`), and a
    family that declares no logits function and selection rule. Replay (REPLAY_FORWARD
    and its recompute) otherwise computes the logits only."""
    return (action is None or action is ReplayAction.RECORD or patch.own_routing
            or not spec.logits_only)


def route_block(patch, lid: int, block: torch.nn.Module,
                hidden_states: torch.Tensor, permute: bool = False) -> BlockRouting:
    """Run the block's router and ask the replay object for the plan: RECORD, REPLAY_FORWARD,
    and (inside a backward pass, with auto_recompute) the recompute of either. `patch` is a
    `replay_ops.integrations.hf.ReplayPatch` (its `.replay`, `.moe.spec`,
    `.auto_recompute`, `.own_routing`, `.return_agreement`).

    Under replay the router module is called for its logits only (`LOGITS_KWARG`: the
    family's `logits` function, inside the module's own call so that its hooks run and
    transformers' `router_logits` output still collects them), and the family's selection
    rule goes to the gate, which selects the rows without a route itself. The router's
    whole forward runs where its own choice is needed (`_needs_own_routing`).

    `permute`: the gate also writes the expert-major rows of the tokens (`plan.rows`, the
    input of the grouped GEMMs of `plan_experts`), in the same op, forward and backward."""
    replay = patch.replay
    spec = patch.moe.spec
    if spec.jitter and block.training and block.jitter_noise > 0:
        hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
            1.0 - block.jitter_noise, 1.0 + block.jitter_noise
        )
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    gate = block.gate
    action = replay.action if replay.enabled else None
    if _needs_own_routing(patch, action, spec):
        logits, own_w, own_idx = gate(x)
    else:
        logits, own_w, own_idx = gate(x, **{LOGITS_KWARG: spec.logits})
    router_logits = logits  # the tensor transformers' `router_logits` output collects
    weights_dtype = _weights_dtype(spec, logits)
    if spec.weights_fp32 and weights_dtype is None:
        logits = logits.float()

    def topk_fn(lg: torch.Tensor) -> torch.Tensor:
        if own_idx is not None and lg.shape == logits.shape and \
                lg.data_ptr() == logits.data_ptr():
            return own_idx  # the router's own output for these very logits
        return spec.topk(gate, lg)

    # the gate's options, as one value from here to the kernel
    opts = replay_ops.GateOptions(
        score_func=spec.score_func, normalize=spec.normalize(gate),
        scaling_factor=spec.scaling_factor(gate), weights_dtype=weights_dtype,
        **({} if spec.selection is None else {"selection": spec.selection(gate)}))
    # DeepSeek-V3 normalizes its sigmoid weights even for top-1: w = s / (s + 1e-20), then
    # the scaling. replay_ops.gate, as Megatron-Core, leaves a row with one slot as it is;
    # gate unnormalized and unscaled, then apply the model's own formula (below).
    top1_norm = spec.score_func == "sigmoid" and opts.normalize and int(gate.top_k) == 1
    if top1_norm:
        scaling = opts.scaling_factor
        opts = dataclasses.replace(opts, normalize=False, scaling_factor=1.0)
    recompute = patch.auto_recompute and action in (
        ReplayAction.REPLAY_FORWARD, ReplayAction.RECORD) and _in_backward()
    agreement = None
    if action is None:
        plan = None
    elif recompute and action is ReplayAction.RECORD:
        # Recompute of a recorded forward: same inputs, same own choice; gate with it but
        # do not record it a second time.
        with torch.no_grad():
            idx = topk_fn(logits.detach())
        plan = replay_ops.gate(logits, idx, validate=False, options=opts,
                               hidden=x if permute else None)
    elif recompute:
        # the recompute of a replayed forward pops the layer's queue; the replay object's
        # own action stays REPLAY_FORWARD (other layers may still run forwards)
        plan = replay.route(lid, logits, action=ReplayAction.REPLAY_BACKWARD, topk_fn=topk_fn,
                            options=opts, hidden=x if permute else None)
    else:
        if patch.return_agreement:  # from the gate that makes the plan
            opts = dataclasses.replace(opts, return_agreement=True)
        plan = replay.route(lid, logits, action=action, topk_fn=topk_fn, options=opts,
                            hidden=x if permute else None)
        if patch.return_agreement:
            agreement = routing_agreement(logits, plan, opts)
    if top1_norm and plan is not None:
        w = plan.weights
        plan = plan._replace(weights=(w / (w + 1e-20)) * scaling)
    if plan is not None:  # the auxiliary loss counts the experts the tokens are sent to
        mark_routed(router_logits, plan.expert_indices)
    return BlockRouting(hidden_states, x, logits, own_w, own_idx, plan, recompute, agreement)


class LayerAgreement(NamedTuple):
    """One MoE layer's routing agreement in a patched forward (`ReplayPatch.agreement`).

    `agreement`: bool [T], the set of experts the row was routed to equals the set the
    model's own selection rule picks from the current logits (slot order ignored; a row
    the gate selected itself agrees). `set_logprob`: float32 [T], the log of the router's
    probability mass on that set, differentiable to the router (see docs/ops.md,
    "Agreement and the replayed set's log-probability")."""

    agreement: torch.Tensor
    set_logprob: torch.Tensor


def routing_agreement(logits: torch.Tensor, plan: RoutingPlan,
                      opts: replay_ops.GateOptions) -> LayerAgreement:
    """The agreement of the routing `plan` used with the model's own selection
    (`opts.selection`), from the gate: the plan's own outputs when the gate that made it
    gave them (RouterReplay.route with return_agreement), else one more gate call over the
    indices used, with `return_agreement`."""
    if plan.agreement is None:
        plan = replay_ops.gate(logits, plan.expert_indices, validate=False,
                               options=dataclasses.replace(opts, return_agreement=True))
    return LayerAgreement(plan.agreement, plan.set_logprob)


def _weights_dtype(spec, logits: torch.Tensor) -> torch.dtype | None:
    """The gate's weights_dtype in a family that keeps its gate weights in fp32
    (`weights_fp32`: `softmax(logits, dtype=torch.float)`): from half and bfloat16 logits
    the gate writes its fp32 weights unrounded itself, with no cast of the logits or of
    their gradient (its math is fp32 either way); None otherwise (fp64 logits are cast)."""
    if spec.weights_fp32 and logits.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return None


def own_routing_plan(r: BlockRouting, block: torch.nn.Module, spec) -> RoutingPlan:
    """A plan of the model's own routing: the router's own indices and gate weights, as
    the unpatched block uses them."""
    plan = replay_ops.gate(r.logits, r.own_indices, validate=False,
                           score_func=spec.score_func, normalize=spec.normalize(block.gate),
                           scaling_factor=spec.scaling_factor(block.gate),
                           weights_dtype=_weights_dtype(spec, r.logits))
    return plan._replace(weights=r.own_weights.to(plan.weights.dtype))


class ExpertsRunner(Protocol):
    """What a block's `_replay_ops_ep` state provides to `patched_forward` (see
    `ep.EPState`): the experts over a plan, and the failure report that keeps every rank
    of a group from waiting on one that raised."""

    def run_experts(self, experts: torch.nn.Module, x: torch.Tensor,
                    plan: RoutingPlan) -> torch.Tensor: ...

    def report_failure(self, exc: BaseException): ...


def patched_forward(block: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward of every patched MoE block (installed per instance by `patch_model`).

    On one device, with replay disabled or no action set, it is the block's own forward.
    Otherwise the router runs, the replay object gives the plan (`route_block`) and the
    experts run over it: `plan_experts` here, or, when the block is expert parallel
    (`block._replay_ops_ep`, an `ExpertsRunner`), dispatch -> this rank's experts ->
    combine, which runs on every call (the group exchanges rows even with replay off; the
    plan is then the model's own routing) and turns a routing error into one every rank
    raises."""
    layer = block.__dict__.get("_replay_ops_layer")
    if layer is None:  # removed, but called through a wrapper installed after patching
        return type(block).forward(block, hidden_states)  # sharded experts raise there
    patch, lid = layer
    runner: ExpertsRunner | None = block.__dict__.get("_replay_ops_ep")
    replay = patch.replay
    if runner is None and (not replay.enabled or replay.action is None):
        return type(block).forward(block, hidden_states)
    spec = patch.moe.spec
    try:
        # one device, grouped_mm: the gate writes the experts' input rows too
        r = route_block(patch, lid, block, hidden_states,
                        permute=runner is None and experts_function(block.experts) == GROUPED_MM)
        plan = r.plan if r.plan is not None else own_routing_plan(r, block, spec)
    except Exception as exc:
        if runner is None:
            raise
        runner.report_failure(exc)  # every rank raises, none waits in the exchange
        raise
    if r.plan is not None and not r.recompute:
        patch._last[lid] = plan.expert_indices
        if r.agreement is not None:
            patch._agreement[lid] = r.agreement
        if r.own_indices is not None and patch.own_routing:
            patch._own[lid] = r.own_indices
    if plan is not r.plan:
        r = dataclasses.replace(r, plan=plan)
    return block_forward(block, r, spec, None if runner is None else runner.run_experts)


def block_forward(block: torch.nn.Module, r: BlockRouting, spec,
                  run_experts: Callable[[torch.nn.Module, torch.Tensor, RoutingPlan],
                                        torch.Tensor] | None = None) -> torch.Tensor:
    """The routed block's output: the experts over `r.plan` (`call_experts`, through the
    experts module's own call; `run_experts` None or `plan_experts`: on one device) plus
    the shared experts where the architecture (`spec`, a `families.ArchSpec`) has them, in
    the block's input shape."""
    routed = call_experts(block.experts, r.x, r.plan, run_experts)
    out = routed if spec.add_shared is None else spec.add_shared(block, r.x, r.hidden_states,
                                                                 routed)
    return out.reshape(r.hidden_states.shape)


def installed_forward(module: torch.nn.Module, fn: Callable) -> Callable:
    """The instance forward `patch_model` installs: `fn` bound to `module` (a
    `functools.partial`, which pickles by reference, unlike a bound method of a
    function the module's class does not have)."""
    return functools.partial(fn, module)


def is_installed(fwd, fn: Callable) -> bool:
    return isinstance(fwd, functools.partial) and fwd.func is fn


# ----------------------------------------------------------------------------- the experts call


def _dense_routing(idx: torch.Tensor, weights: torch.Tensor):
    """Index and weights as the unpatched router gives them (int64, no -1): an empty slot
    (-1) becomes expert 0 with weight 0, which adds an exact zero."""
    valid = idx >= 0
    return torch.where(valid, idx, 0).long(), torch.where(valid, weights, 0)


def call_experts(experts: torch.nn.Module, x: torch.Tensor, plan: RoutingPlan,
                 run_experts: Callable | None = None) -> torch.Tensor:
    """`sum_k w[t,k] * MLP_{e[t,k]}(x[t])` over `plan`, through the experts module's own call
    (`experts(...)`: its hooks run, module docstring). On one device (`run_experts` None
    or `plan_experts`) with an implementation other than grouped_mm, the module is called
    exactly as the unpatched block calls it, with the replayed indices and weights; with
    grouped_mm, or under expert parallelism (`run_experts`, an `ExpertsRunner`'s), the plan
    goes along (`PLAN_KWARG`) and `experts_forward` runs `run_experts` over it."""
    if run_experts is None or run_experts is plan_experts:
        if experts_function(experts) != GROUPED_MM:
            idx, weights = _dense_routing(plan.expert_indices, plan.weights)
            return experts(x, idx, weights)
        run_experts = plan_experts
    return experts(x, plan.expert_indices, plan.weights,
                   **{PLAN_KWARG: (plan, run_experts, x)})


def _sharded_error(experts: torch.nn.Module) -> RuntimeError:
    return RuntimeError(
        "replay_ops.integrations.hf.ep: this experts module holds only this rank's experts "
        f"(shape {tuple(experts.gate_up_proj.shape)}, sharded by enable_expert_parallel); it "
        "runs only through the expert-parallel patched forward, not the original one")


def experts_forward(experts: torch.nn.Module, hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args,
                    **kwargs) -> torch.Tensor:
    """The forward `patch_model` installs on each MoE block's experts module (module
    docstring). Without `PLAN_KWARG` it is the class's own forward (the experts
    implementation the config names); a module whose weights expert parallelism sharded
    refuses that. With `PLAN_KWARG=(plan, run_experts)` it returns `run_experts(experts,
    hidden_states, plan)`, unless a pre-hook replaced the routing arguments, which are
    then run as given."""
    job = kwargs.pop(PLAN_KWARG, None)
    sharded = experts.__dict__.get("_replay_ops_sharded", False)
    if job is None:
        if sharded:
            raise _sharded_error(experts)
        return type(experts).forward(experts, hidden_states, top_k_index, top_k_weights,
                                     *args, **kwargs)
    plan, run_experts = job[:2]
    if plan.rows is not None and (len(job) < 3 or hidden_states is not job[2]):
        plan = plan._replace(rows=None)  # a hook replaced the hidden states: permute them
    if top_k_index is not plan.expert_indices or top_k_weights is not plan.weights:
        # a hook gave other routing arguments (or moved them to another device) than the
        # plan's: the plan does not describe them, run them as the unpatched module would
        if run_experts is not plan_experts:
            raise RuntimeError(
                "replay_ops.integrations.hf: a hook of the experts module replaced its "
                "routing arguments (top_k_index, top_k_weights); under expert parallelism "
                "the exchange is planned from the replayed routing, so the experts cannot "
                "run other routing. Change the routing before the block (set_routing), not "
                "in a hook")
        idx, weights = _dense_routing(top_k_index, top_k_weights)
        return type(experts).forward(experts, hidden_states, idx, weights, *args, **kwargs)
    return run_experts(experts, hidden_states, plan)


def router_forward(gate: torch.nn.Module, hidden_states: torch.Tensor, *args,
                   **kwargs):
    """The forward `patch_model` installs on each MoE block's router module (`block.gate`).
    Without `LOGITS_KWARG` it is the class's own forward (logits, gate weights, indices).
    With `LOGITS_KWARG=logits_fn` (a replayed block) it returns `(logits_fn(gate,
    hidden_states), None, None)`: the router's logits only, no top-k; its hooks still run
    around it (transformers' `router_logits` output records index 0)."""
    logits_fn = kwargs.pop(LOGITS_KWARG, None)
    if logits_fn is None:
        return type(gate).forward(gate, hidden_states, *args, **kwargs)
    return logits_fn(gate, hidden_states), None, None


# ----------------------------------------------------------------------------- experts


def _moe_module():
    from transformers.integrations import moe

    return moe


def _eager_forward(experts: torch.nn.Module) -> Callable:
    """The experts class's own forward (what `use_experts_implementation` wraps)."""
    fwd = type(experts).forward
    return getattr(fwd, "__wrapped__", fwd)


def experts_function(experts: torch.nn.Module) -> Callable | str:
    """The experts implementation the unpatched module would run: `GROUPED_MM` for
    transformers' own grouped_mm function (run over the plan by `grouped_mlp`), else the
    function itself (`fn(experts, hidden_states, top_k_index, top_k_weights)`). Looked up
    as `use_experts_implementation` looks it up: `config._experts_implementation` in
    `ALL_EXPERTS_FUNCTIONS`, "eager" or None being the class's own forward; an unknown
    name raises transformers' KeyError."""
    eager = _eager_forward(experts)
    config = getattr(experts, "config", None)
    name = getattr(config, "_experts_implementation", None) if config is not None else None
    if name is None or name == "eager":
        return eager
    moe = _moe_module()
    fn = moe.ALL_EXPERTS_FUNCTIONS.get_interface(name, eager)
    if fn is getattr(moe, "grouped_mm_experts_forward", None):
        return GROUPED_MM
    return fn


def _grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """rows [M, K] @ weight[g] [K, N] per group (offs: int32 cumulative ends), through
    transformers' own dispatcher: `F.grouped_mm` where its `_can_use_grouped_mm` allows,
    else its `transformers::grouped_mm_fallback` op."""
    fn = getattr(_moe_module(), "_grouped_mm", None)
    if fn is None:
        raise RuntimeError(
            "replay_ops.integrations.hf: this transformers has no "
            "transformers.integrations.moe._grouped_mm, which its grouped_mm experts "
            "implementation uses; set config._experts_implementation to 'eager' or "
            "'batched_mm', or install transformers >= 5.0 with grouped_mm experts")
    return fn(rows, weight, offs)


def grouped_mlp(experts: torch.nn.Module, rows: torch.Tensor, offs: torch.Tensor,
                gate_up: torch.Tensor | None = None,
                down: torch.Tensor | None = None) -> torch.Tensor:
    """Expert MLPs over expert-major rows: rows up to offs[0] go through expert 0 of
    `gate_up`/`down` (default: the module's `[E, 2I, H]` / `[E, H, I]` weights), rows
    offs[g-1]:offs[g] through expert g; rows past offs[-1] are not computed (their output
    is whatever the GEMM leaves; callers never read it). Two grouped GEMMs and the module's
    own gate activation (`_apply_gate`)."""
    gate_up = experts.gate_up_proj if gate_up is None else gate_up
    down = experts.down_proj if down is None else down
    h = _grouped_mm(rows, gate_up.transpose(-2, -1), offs)
    apply_gate = getattr(experts, "_apply_gate", None)
    if apply_gate is not None:
        h = apply_gate(h)
    else:
        g, u = h.chunk(2, dim=-1)
        h = experts.act_fn(g) * u
    return _grouped_mm(h, down.transpose(-2, -1), offs)


def plan_experts(experts: torch.nn.Module, x: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """sum_k w[t,k] * MLP_{e[t,k]}(x[t]) on one device, through the experts implementation
    the config names (module docstring), reading the module's weights as they are (the
    patched block calls it inside the module's own call, `call_experts`, so that hooks
    that load them have run). No host read on the grouped_mm path."""
    fn = experts_function(experts)
    if fn == GROUPED_MM:
        rows = plan.rows  # written by the gate (route_block's `permute`) from this very x
        if rows is None:
            rows = replay_ops.permute(x, plan, plan.max_rows, validate=False)
        y = grouped_mlp(experts, rows, plan.expert_offsets[1:])
        # y has plan.max_rows rows: unpermute reads only those the slots point to.
        return replay_ops.unpermute(y, plan, validate=False)
    idx, weights = _dense_routing(plan.expert_indices, plan.weights)
    return fn(experts, x, idx, weights)


def rows_experts(experts: torch.nn.Module, rows: torch.Tensor, local_plan: RoutingPlan,
                 local_experts: range, sharded: bool) -> torch.Tensor:
    """MLP_{e(r)}(rows[r]) for the expert-major rows an expert-parallel dispatch delivered
    (`local_plan`: K = 1, one slot per row, experts numbered 0.. within `local_experts`).
    `sharded`: the module holds only the local experts' weights. Through the experts
    implementation the config names: grouped_mm over `local_plan.expert_offsets[1:]`, any
    other one called with each row's expert (top-1, weight 1: exact; 0 on padding rows)."""
    fn = experts_function(experts)
    if fn == GROUPED_MM:
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if not sharded:
            gate_up = gate_up[local_experts.start:local_experts.stop]
            down = down[local_experts.start:local_experts.stop]
        return grouped_mlp(experts, rows, local_plan.expert_offsets[1:], gate_up, down)
    # Row r holds the local plan's slot sorted_slots[r] (-1: a padding row): its expert is
    # that slot's; padding rows (zero inputs) get weight 0.
    slots = local_plan.sorted_slots[: rows.shape[0]]
    valid = slots >= 0
    idx = local_plan.expert_indices.reshape(-1)[slots.clamp_min(0).long()].long()
    if not sharded:
        idx = idx + local_experts.start
    weights = valid.to(rows.dtype)
    return fn(experts, rows, idx[:, None], weights[:, None])
