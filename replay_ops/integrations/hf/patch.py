"""Patching a Hugging Face `transformers` MoE model: find its MoE blocks, install the one
patched forward (`block.patched_forward`) on each, and undo it.

    from replay_ops.integrations import hf
    from replay_ops.router_replay import ReplayAction

    patch = hf.patch_model(model, "R3")          # or a RouterReplayConfig / RouterReplay
    patch.replay.set_routing(rollout_routing)    # [T, L, K] from the inference engine
    patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
    out = model(input_ids)                       # every MoE block replays that routing
    patch.remove()                               # (or hf.unpatch_model(model))

Each supported MoE block (see `SUPPORTED`) gets an instance-level `forward` that

1. calls the block's router module (`block.gate`), which gives the router logits exactly
   as the unpatched model computes them (and keeps `output_router_logits` working). Under
   replay (REPLAY_FORWARD) the router computes its logits only (the family's `logits`,
   through `block.router_forward`): no top-k, sort or softmax of every row; its whole
   forward (its own top-k) runs in RECORD, with no action, and with `own_routing=True`;
2. asks the replay object for a plan: `replay.route(layer_id, logits, topk_fn=<the block's
   own selection>, selection=<the family's rule>, score_func=..., normalize=...,
   scaling_factor=...)`: the gate selects the rows without a route (replay mask False)
   itself, from the logits row it reads, with the family's rule;
3. runs the experts, through the experts module's own call (so its hooks run), with the
   implementation the model's config names (`config._experts_implementation`,
   transformers' `ExpertsInterface`) and the replayed routing: for "grouped_mm",
   `replay_ops.permute` -> two grouped GEMMs over the plan's expert offsets ->
   `replay_ops.unpermute` (fp32 accumulation in the recorded column order); for any other
   implementation, that function itself given the replayed indices and weights (see
   `replay_ops.integrations.hf.block`);
4. adds the shared experts where the architecture has them.

Routing agreement: with `patch_model(..., return_agreement=True)` (or `patch.return_agreement
= True`) each replayed forward also keeps, per MoE layer, whether the routing used is the
set the model's own rule picks from the current logits and the log-probability of that set
(`patch.agreement()`: layer id -> `LayerAgreement(agreement, set_logprob)`, from the gate).
The own-routing comparison: with `own_routing=True` a replayed block also runs the router
module whole and keeps its choice (`patch.last_own_routing()`).

The router module and the experts module get an instance-level forward too
(`block.router_forward`, `block.experts_forward`): called
as the unpatched block calls it, it is the class's own; the replayed block hands it the
plan. Both forwards go inside accelerate's hooks when the module has them already
(`from_pretrained(..., device_map=...)`: the hooks call `module._old_forward`, which the
patch replaces, and `remove()` restores); hooks added after patching wrap them. So an
offloaded patched model loads its expert weights where the unpatched one does, and forward
hooks and pre-hooks on the experts run in every mode.

When the replay object returns no plan (mode "disabled", or no action set) the block runs
its original forward, so a patched model in disabled mode is the unpatched model.

The families (architectures) and how each routes: `replay_ops.integrations.hf.families`
(`SUPPORTED`, `register_family`). The block forward: `replay_ops.integrations.hf.block`.

Activation recompute (`model.gradient_checkpointing_enable()`): a block that runs while
autograd is executing a backward pass is a recompute, so a REPLAY_FORWARD action is served
as REPLAY_BACKWARD for that call (`route(..., action=REPLAY_BACKWARD)`: it pops the layer's
queue, and the replay object's own action is left alone), and a RECORD action gates with
the model's own choice again without recording it twice. Turn this off with
`patch_model(..., auto_recompute=False)` and set the action yourself. Non-reentrant and
reentrant checkpoints both queue their forward (the reentrant one runs it without grad
inside its autograd Function, whose node then holds the queue entry: see
`RouterReplay`'s recompute queue in docs/router_replay.md).

Auxiliary loss: with `output_router_logits=True` the architecture's load-balancing loss
counts the experts each token was sent to (the replayed routing), not a top-k of the
logits taken again (`replay_ops.integrations.hf.aux_loss`).

Pickling: a patched model pickles (and `torch.save`s whole, deep-copies) into a patched
model; the patch keeps its blocks, family (by model type), `auto_recompute` and the
replay's config and shape, not the replay state (`ReplayPatch.__getstate__`).

Host syncs: none in a MoE block forward with the "grouped_mm" experts (the permuted buffer
has the plan's static `max_rows` rows and the grouped GEMM takes the offsets on the device),
so a CUDA graph can capture the replayed forward. Where transformers' `_can_use_grouped_mm`
rule sends the grouped GEMM to its fallback op (`transformers::grouped_mm_fallback`), that
op reads the offsets once per GEMM, as it does unpatched; "eager" reads what its loop
needs, as unpatched. The routing's values are checked once, when it is set, loaded or
recorded (`RouterReplayConfig.validate`: one read there), not in the layers.

torch.compile: `torch.compile(model, fullgraph=True)` traces a patched model (every
architecture above, the "grouped_mm" experts) in R3 replay, R2 RECORD and R2 replay with
no graph break, and a new routing set between steps does not recompile (the routing is a
graph input). What the trace reads of the replay object is Python state guarded by Dynamo
(the action, the mode): changing the action compiles once per action. Three things are
left out of a compiled forward, since an int read there would recompile every call:
`RouterReplay.calls` (it counts eager `route` calls), the recompute queue, and the
recompute check itself. A compiled forward's activation recompute is part of the
compiled backward (AOTAutograd's saved or recomputed graph, from the forward's own
inputs), which never calls `route` again; so compile the checkpointed layer (or the
model), not a region inside a checkpoint. R2: `set_action(REPLAY_FORWARD)` takes the
recording as the routing before the layers run, and `set_action(RECORD)` after a replay
starts the next recording, so the layers only read tensors.

CUDA graphs: `patch.replay.use_static_buffer(max_tokens, device)` keeps the routing in
preallocated buffers that `set_routing` copies into, so a graph captured around a
replayed forward reads each step's routing (see `RouterReplay.use_static_buffer`).
"""
from __future__ import annotations

import dataclasses
import re
import types
import warnings
import weakref

import torch

from replay_ops.router_replay import (
    ModelShape,
    RouterReplay,
    RouterReplayConfig,
)

from ..._deprecated import deprecated_names, deprecated_property
from . import aux_loss
from .block import (
    LayerAgreement,
    experts_forward,
    installed_forward,
    is_installed,
    patched_forward,
    router_forward,
)
from .families import (
    SUPPORTED,
    ArchSpec,
    UnsupportedModelError,
    spec_for,
    supported_architectures,
)

__all__ = [
    "MoEBlocks",
    "ReplayPatch",
    "find_moe_blocks",
    "make_router_replay",
    "patch_model",
    "unpatch_model",
]


# ------------------------------------------------------------------- the MoE blocks

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclasses.dataclass
class MoEBlocks:
    """Where the MoE blocks of a model are and how they route."""

    model_type: str
    spec: ArchSpec
    shape: ModelShape  # experts, top-k, MoE layer ids, hidden layers
    blocks: dict[int, torch.nn.Module]  # absolute layer id -> MoE block
    score_func: str
    normalize: bool
    scaling_factor: float

    num_experts = property(lambda self: self.shape.num_experts)
    top_k = property(lambda self: self.shape.top_k)
    moe_layer_ids = property(lambda self: list(self.shape.moe_layer_ids))
    num_hidden_layers = property(lambda self: self.shape.num_hidden_layers)

    # A registered family pickles by its model type, as a class pickles by its name: it is
    # code, found again with `spec_for` where the model is loaded (a family registered with
    # register_family must be registered there too). An unregistered spec pickles as it is.
    def __getstate__(self):
        state = dict(self.__dict__)
        if SUPPORTED.get(self.model_type) is self.spec:
            state["spec"] = self.model_type
        return state

    def __setstate__(self, state):
        if isinstance(state["spec"], str):
            state = dict(state, spec=spec_for(state["spec"]))
        self.__dict__.update(state)


def find_moe_blocks(model: torch.nn.Module) -> MoEBlocks:
    """Find the MoE blocks of a supported `transformers` model (dense layers are skipped;
    a layer id is the index in the model's list of decoder layers)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"replay_ops.integrations.hf: {type(model).__name__} has no config.model_type; "
            f"expected a transformers model, one of: {', '.join(supported_architectures())}"
        )
    spec = spec_for(model_type)
    blocks: dict[int, torch.nn.Module] = {}
    for name, mod in model.named_modules():
        if type(mod).__name__ != spec.block_class:
            continue
        m = _LAYER_RE.search(name + ".")
        if m is None:
            raise UnsupportedModelError(
                f"replay_ops.integrations.hf: cannot tell the layer id of MoE block {name!r} "
                f"(expected a name like 'model.layers.<i>.mlp')"
            )
        lid = int(m.group(1))
        if lid in blocks:
            raise UnsupportedModelError(
                f"replay_ops.integrations.hf: layer {lid} has two MoE blocks ({name!r})"
            )
        _check_block(name, mod)
        blocks[lid] = mod
    if not blocks:
        raise UnsupportedModelError(
            f"replay_ops.integrations.hf: {type(model).__name__} (model_type={model_type!r}) "
            f"has no {spec.block_class} module; nothing to route"
        )
    ids = sorted(blocks)
    first = blocks[ids[0]]
    E, K = int(first.gate.num_experts), int(first.gate.top_k)
    for lid in ids:
        g = blocks[lid].gate
        if (int(g.num_experts), int(g.top_k)) != (E, K):
            raise UnsupportedModelError(
                f"replay_ops.integrations.hf: layer {lid} routes {g.num_experts} experts top-"
                f"{g.top_k}, layer {ids[0]} routes {E} top-{K}; one RouterReplay needs the same "
                f"E and K in every MoE layer"
            )
    n_layers = int(getattr(config, "num_hidden_layers", ids[-1] + 1))
    return MoEBlocks(
        model_type=model_type,
        spec=spec,
        shape=ModelShape(E, K, tuple(ids), n_layers),
        blocks=blocks,
        score_func=spec.score_func,
        normalize=spec.normalize(first.gate),
        scaling_factor=spec.scaling_factor(first.gate),
    )


def _accelerate_wrapped(module: torch.nn.Module) -> bool:
    """accelerate's hooks (`add_hook_to_module`: offload, device_map) replace the instance
    forward with a wrapper that calls `module._old_forward` between the hook's pre- and
    post-forward."""
    d = module.__dict__
    return "_hf_hook" in d and "_old_forward" in d


def _install(module: torch.nn.Module, fn) -> None:
    """Make `fn(module, ...)` the module's forward: its instance forward, or, under
    accelerate's hooks, the forward their wrapper calls (so the hooks still run around it,
    and a wrapper installed later wraps it the same way)."""
    d = module.__dict__
    if _accelerate_wrapped(module):
        if not is_installed(d["_old_forward"], fn):
            d["_replay_ops_old_forward"] = d["_old_forward"]
        d["_old_forward"] = installed_forward(module, fn)
    else:
        d["forward"] = installed_forward(module, fn)


def _uninstall(module: torch.nn.Module, fn) -> bool:
    """Undo `_install`; False where the forward was wrapped after patching by something
    other than accelerate (the wrapper is left in place)."""
    d = module.__dict__
    old = d.pop("_replay_ops_old_forward", None)
    if is_installed(d.get("forward"), fn):
        del d["forward"]
        return True
    if is_installed(d.get("_old_forward"), fn):  # accelerate's wrapper around the patch
        d["_old_forward"] = old if old is not None else types.MethodType(type(module).forward,
                                                                          module)
        return True
    return "forward" not in d


def _check_patchable(lid: int, block: torch.nn.Module) -> None:
    """Refuse a block that patching would silently get wrong."""
    ep_state = getattr(block, "_replay_ops_ep", None)
    if ep_state is not None and ep_state.sharded:
        raise UnsupportedModelError(
            f"replay_ops.integrations.hf.patch_model: layer {lid}'s experts were sharded for "
            f"expert parallelism (this rank holds experts {ep_state.local_experts.start}.."
            f"{ep_state.local_experts.stop - 1} of {int(block.gate.num_experts)}); a patch "
            f"without them would run the wrong experts. Load the model again to patch it "
            f"differently")
    for what, module in (("MoE block", block), ("experts module", block.experts),
                         ("router module", block.gate)):
        if "forward" in module.__dict__ and not _accelerate_wrapped(module):
            raise UnsupportedModelError(
                f"replay_ops.integrations.hf.patch_model: layer {lid}'s {what} already has a "
                f"forward of its own instance ({module.__dict__['forward']!r}); patching "
                f"would bypass it and removing the patch would drop it. Patch the model "
                f"before installing such a wrapper (it then wraps the patched forward), or "
                f"use module hooks (register_forward_pre_hook / register_forward_hook), which "
                f"run in every mode. accelerate's hooks (device_map, offload) are kept: the "
                f"patched forward runs inside them")


def _check_block(name: str, block: torch.nn.Module) -> None:
    experts = getattr(block, "experts", None)
    gate = getattr(block, "gate", None)
    if experts is None or gate is None:
        raise UnsupportedModelError(
            f"replay_ops.integrations.hf: MoE block {name!r} has no .gate/.experts modules"
        )
    for attr in ("gate_up_proj", "down_proj"):
        if not isinstance(getattr(experts, attr, None), torch.Tensor):
            raise UnsupportedModelError(
                f"replay_ops.integrations.hf: {name}.experts has no fused {attr} tensor "
                f"(expected [E, 2I, H] / [E, H, I] expert weights)"
            )
    layout = {
        "is_transposed": False, "has_bias": False, "has_gate": True,
        "is_concatenated": True, "has_post_expert_norm": False,
    }
    for attr, want in layout.items():
        got = getattr(experts, attr, want)
        if bool(got) != want:
            raise UnsupportedModelError(
                f"replay_ops.integrations.hf: {name}.experts has {attr}={got}; only the "
                f"layout {layout} is supported"
            )


def make_router_replay(
    model: torch.nn.Module, config: RouterReplayConfig | str | None = None
) -> RouterReplay:
    """A RouterReplay sized for `model` (experts, top-k, MoE layer ids). A mode string
    builds a RouterReplayConfig with the architecture's fallback."""
    lay = find_moe_blocks(model)
    if config is None or isinstance(config, str):
        config = RouterReplayConfig(mode=config or "disabled", fallback=lay.spec.fallback)
    return RouterReplay(config, shape=lay.shape)


# ----------------------------------------------------------------------------- the patch


class ReplayPatch:
    """The handle `patch_model` returns: `.replay` (the RouterReplay), `.moe` (the
    model's MoE blocks, `MoEBlocks`), `.last_routing()`, `.remove()`; also a context
    manager that removes the patch."""

    def __init__(self, model, moe: MoEBlocks, replay: RouterReplay, auto_recompute: bool,
                 return_agreement: bool = False, own_routing: bool = False):
        self.model = model
        self.moe = moe
        self.replay = replay
        self.auto_recompute = auto_recompute
        # per replayed forward: each layer's agreement with the model's own rule (gate)
        self.return_agreement = bool(return_agreement)
        # the own-routing comparison: replayed blocks also run the router module whole
        self.own_routing = bool(own_routing)
        # every key present from the start: a compiled forward then only replaces values
        # (a new key would change the dict's keys, which torch.compile guards on)
        self._last: dict[int, torch.Tensor | None] = dict.fromkeys(moe.moe_layer_ids)
        self._agreement: dict[int, LayerAgreement | None] = dict.fromkeys(moe.moe_layer_ids)
        self._own: dict[int, torch.Tensor | None] = dict.fromkeys(moe.moe_layer_ids)
        self.active = False
        self._aux_release = None  # undoes aux_loss.acquire (also when collected unremoved)

    # Pickling (pickle, torch.save of the whole model, copy.deepcopy) keeps the patch: the
    # model, its MoE blocks and family, auto_recompute, and the RouterReplay's config and
    # shape. Not the replay state (the routing set, recordings, recompute queues, the
    # action, static buffers, the last routing): the loaded patch has a new RouterReplay
    # built from that config, as patch_model builds one (a replay_file it names is loaded
    # again), with no action set.
    def __getstate__(self):
        for lid, block in self.moe.blocks.items():
            if block.__dict__.get("_replay_ops_ep") is not None:
                raise TypeError(
                    f"replay_ops.integrations.hf: cannot pickle an expert-parallel patch "
                    f"(layer {lid} runs its experts over a process group, which does not "
                    f"pickle); save the model's state_dict instead")
        return {"model": self.model, "moe": self.moe, "config": self.replay.config,
                "auto_recompute": self.auto_recompute, "active": self.active,
                "return_agreement": self.return_agreement, "own_routing": self.own_routing}

    def __setstate__(self, state):
        self.__init__(state["model"], state["moe"],
                      RouterReplay(state["config"], shape=state["moe"].shape),
                      state["auto_recompute"], state.get("return_agreement", False),
                      state.get("own_routing", False))
        self.active = state["active"]
        if self.active:
            self._acquire_aux_loss()

    def _acquire_aux_loss(self) -> None:
        """Count the routing used in the architecture's auxiliary loss (`aux_loss`) while
        this patch is active."""
        first = self.moe.blocks[self.moe.moe_layer_ids[0]]
        module = type(first).__module__  # the architecture's modeling module
        if aux_loss.acquire(module):
            self._aux_release = weakref.finalize(self, aux_loss.release, module)

    layout = deprecated_property("moe", "ReplayPatch.layout")

    @property
    def moe_layer_ids(self) -> list[int]:
        return list(self.moe.moe_layer_ids)

    def last_routing(self) -> torch.Tensor:
        """int32 [T, L_moe, K]: the indices every MoE layer used in its latest routed
        forward (RECORD or REPLAY_FORWARD; recomputes are not counted)."""
        missing = [lid for lid in self.moe.moe_layer_ids if self._last[lid] is None]
        if missing:
            raise RuntimeError(
                f"ReplayPatch.last_routing: MoE layers {missing} have not routed through "
                f"replay_ops yet (replay disabled, or no action set)"
            )
        per = [self._last[lid] for lid in self.moe.moe_layer_ids]
        T = {lid: t.shape[0] for lid, t in zip(self.moe.moe_layer_ids, per)}
        if len(set(T.values())) != 1:
            raise RuntimeError(
                f"ReplayPatch.last_routing: layers saw different token counts {T}"
            )
        return torch.stack(per, dim=1)

    def agreement(self) -> dict[int, LayerAgreement]:
        """Layer id -> `LayerAgreement(agreement bool [T], set_logprob float32 [T])` of
        every MoE layer's latest replayed forward (REPLAY_FORWARD with `return_agreement`;
        recomputes are not counted): whether the routing used is the set of experts the
        model's own selection rule picks from the current logits, and the log of the
        router's probability mass on it (differentiable). Computed by the gate from the
        logits row it reads; no top-k runs."""
        missing = [lid for lid in self.moe.moe_layer_ids if self._agreement[lid] is None]
        if missing:
            raise RuntimeError(
                f"ReplayPatch.agreement: MoE layers {missing} have no agreement yet (set "
                f"patch.return_agreement = True, or patch_model(..., return_agreement=True), "
                f"and run a REPLAY_FORWARD forward)")
        return {lid: self._agreement[lid] for lid in self.moe.moe_layer_ids}

    def last_own_routing(self) -> torch.Tensor:
        """int64 [T, L_moe, K]: what every MoE layer's router module chose itself in its
        latest replayed forward with `own_routing=True` (the own-routing comparison; compare
        with `last_routing()`)."""
        missing = [lid for lid in self.moe.moe_layer_ids if self._own[lid] is None]
        if missing:
            raise RuntimeError(
                f"ReplayPatch.last_own_routing: MoE layers {missing} have not run their own "
                f"routing under replay (set patch.own_routing = True, or patch_model(..., "
                f"own_routing=True))")
        return torch.stack([self._own[lid] for lid in self.moe.moe_layer_ids], dim=1)

    def remove(self) -> None:
        """Restore every block's and experts module's original forward (inside accelerate's
        hooks where they were added, before or after patching)."""
        if not self.active:
            return
        for lid, block in self.moe.blocks.items():
            if not _uninstall(block, patched_forward):
                # wrapped after patching by something else: left as it is
                warnings.warn(f"replay_ops.integrations.hf: layer {lid}'s forward was wrapped "
                              f"after patching ({block.__dict__['forward']!r}); the wrapper is "
                              f"left in place and the patched forward inside it now runs the "
                              f"original forward", stacklevel=2)
            block.__dict__.pop("_replay_ops_layer", None)
            ep_state = block.__dict__.get("_replay_ops_ep")
            if ep_state is not None and not ep_state.sharded:
                del block.__dict__["_replay_ops_ep"]  # all experts are still here
            # sharded experts keep the patched experts forward: it refuses the original
            # block's call, which would run the wrong experts; any other runs its class's
            # own forward when called without a plan, so one wrapped later can stay
            if not block.experts.__dict__.get("_replay_ops_sharded", False):
                _uninstall(block.experts, experts_forward)
            _uninstall(block.gate, router_forward)
        if self._aux_release is not None:
            self._aux_release()
            self._aux_release = None
        if getattr(self.model, "_replay_ops_patch", None) is self:
            del self.model._replay_ops_patch
        self.active = False

    def __enter__(self) -> "ReplayPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        lay = self.moe
        return (
            f"ReplayPatch(model_type={lay.model_type}, moe_layer_ids={lay.moe_layer_ids}, "
            f"num_experts={lay.num_experts}, top_k={lay.top_k}, active={self.active}, "
            f"replay={self.replay!r})"
        )


def patch_model(
    model: torch.nn.Module,
    replay: RouterReplay | RouterReplayConfig | str | None = None,
    *,
    auto_recompute: bool = True,
    ep_group=None,
    return_agreement: bool = False,
    own_routing: bool = False,
) -> ReplayPatch:
    """Route every MoE block of `model` through replay_ops under `replay` (a RouterReplay
    built for this model, a RouterReplayConfig, a mode string "disabled"/"R2"/"R3", or None
    for disabled). Returns a `ReplayPatch`; undo with `.remove()` or `unpatch_model`.
    With `ep_group` (a torch.distributed group) the experts are sharded over the group:
    see `replay_ops.integrations.hf.ep.enable_expert_parallel`. `return_agreement=True`:
    each replayed forward keeps every layer's agreement with the model's own selection
    (`ReplayPatch.agreement()`). `own_routing=True`: replayed blocks also run the router
    module whole, for the own-routing comparison (`ReplayPatch.last_own_routing()`)."""
    if getattr(model, "_replay_ops_patch", None) is not None:
        raise RuntimeError(
            "replay_ops.integrations.hf.patch_model: the model is already patched; call "
            "unpatch_model(model) first"
        )
    lay = find_moe_blocks(model)
    for lid, block in lay.blocks.items():
        _check_patchable(lid, block)
    if not isinstance(replay, RouterReplay):
        replay = make_router_replay(model, replay)
    else:
        if replay.shape != lay.shape:
            fields = lambda m: (m.num_experts, m.top_k, list(m.moe_layer_ids),  # noqa: E731
                                m.num_hidden_layers)
            raise ValueError(
                f"replay_ops.integrations.hf.patch_model: the RouterReplay was built for "
                f"(num_experts, top_k, moe_layer_ids, num_hidden_layers)="
                f"{fields(replay.shape)}, but the model has {fields(lay.shape)}"
            )
    patch = ReplayPatch(model, lay, replay, auto_recompute, return_agreement, own_routing)
    for lid, block in lay.blocks.items():
        block._replay_ops_layer = (patch, lid)
        _install(block, patched_forward)
        _install(block.experts, experts_forward)
        _install(block.gate, router_forward)
    model._replay_ops_patch = patch
    patch.active = True
    patch._acquire_aux_loss()
    if ep_group is not None:
        from .ep import enable_expert_parallel

        enable_expert_parallel(patch, ep_group)
    return patch


def unpatch_model(model: torch.nn.Module) -> None:
    """Undo `patch_model` (no-op for a model that is not patched)."""
    patch = getattr(model, "_replay_ops_patch", None)
    if patch is not None:
        patch.remove()


# Renamed, kept for one release (they warn; the package re-exports them): "layout" now
# names data layouts only.
RENAMED = {"MoELayout": ("MoEBlocks", MoEBlocks),
           "moe_layout": ("find_moe_blocks", find_moe_blocks)}
__getattr__ = deprecated_names(__name__, RENAMED)
