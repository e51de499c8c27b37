"""`RouterReplay`: the routing of every MoE layer of one model, recorded or replayed.

One object per model, no module-level state: two models in one process never share
routing. A MoE layer calls

    plan = replay.route(layer_id, logits, topk_fn=..., score_func=..., normalize=...)
    if plan is None:            # disabled, or no action set: the layer's own path
        ...

`route` does what its action says (`action=`, or the object's current action, see
`set_action`): RECORD, REPLAY_FORWARD or REPLAY_BACKWARD, each in its own method.

Layers are identified by their absolute layer id (the index in the model's list of
decoder layers); the model's shape is a `ModelShape`. A routing tensor `[T, L, K]` is
indexed either by MoE ordinal (L = number of MoE layers) or by absolute layer id (L =
number of hidden layers, dense rows ignored); `set_routing` says which one it used in
`.layer_mapping`.

Checks of the routing's values (expert ids in range, no expert twice in a token's layer)
run once, when the routing is set, loaded or taken from a recording, with
`config.validate` (one host sync); the MoE layers then gate without a host sync. A
`ReplayBatch` checked against this model's shape (the rollout adapters give one) is not
scanned again.

The parts: this module holds the state machine (actions, R2 steps), the layer call and
the recordings; `store.py` the routing to replay (its checks, the static buffers);
`recompute.py` the recompute queue of activation checkpointing; record files are read
and written through `files.py` (`RoutingFile.batch`, `write_routing`).
"""
from __future__ import annotations

import collections
import dataclasses
import os
from typing import Callable, Sequence

import torch

from ..options import DEFAULT_SELECTION, GATE_OPTIONS, GateOptions, options_one_way, resolve
from ..plan import RoutingPlan
from .adapters.batch import INDEX_DTYPE, ReplayBatch, _mark_checked
from .config import ConfigError, ReplayAction, ReplayMode, RouterReplayConfig, check_combination
from .recompute import RecomputeQueues
from .shape import LAYER_INDEX, ModelShape
from .store import RouterReplayError, RoutingStore, describe_source

LAYER_MAPPINGS = LAYER_INDEX  # the choices of layer_index=
_describe_source = describe_source  # (its former name here)

__all__ = ["LAYER_MAPPINGS", "RouterReplay", "RouterReplayError"]


class RouterReplay:
    def __init__(
        self,
        config: RouterReplayConfig | None = None,
        *,
        num_experts: int | None = None,
        top_k: int | None = None,
        moe_layer_ids: Sequence[int] | None = None,
        num_hidden_layers: int | None = None,
        shape: ModelShape | None = None,
    ) -> None:
        config = config if config is not None else RouterReplayConfig()
        if not isinstance(config, RouterReplayConfig):
            raise TypeError(
                f"RouterReplay: config must be a RouterReplayConfig, got {type(config).__name__}"
            )
        check_combination(config)
        self.config = config
        if shape is None:
            try:
                shape = ModelShape(num_experts, top_k, tuple(moe_layer_ids or ()),
                                   num_hidden_layers)
            except ValueError as e:
                raise ValueError(f"RouterReplay: {e}") from None
        self.shape = shape
        self._ordinal = {lid: n for n, lid in enumerate(shape.moe_layer_ids)}
        self._store = RoutingStore(shape)
        self._action: ReplayAction | None = None
        self.step = 0  # recordings started (R2): a new RECORD after a replay starts the next
        self.clear()
        self.clear_agreement()
        if self.enabled and config.replay_file is not None:
            self.load(config.replay_file)

    # ------------------------------------------------------------------ state
    mode = property(lambda self: self.config.mode)
    num_experts = property(lambda self: self.shape.num_experts)
    top_k = property(lambda self: self.shape.top_k)
    moe_layer_ids = property(lambda self: list(self.shape.moe_layer_ids))
    num_hidden_layers = property(lambda self: self.shape.num_hidden_layers)
    num_moe_layers = property(lambda self: self.shape.num_moe_layers)

    @property
    def enabled(self) -> bool:
        return self.mode is not ReplayMode.DISABLED

    @property
    def action(self) -> ReplayAction | None:
        return self._action

    def set_action(self, action: ReplayAction | str | None) -> None:
        """Set what the next `route` calls do by default; None means the model's own routing.

        R2: REPLAY_FORWARD after RECORD forwards takes the recording as the routing to
        replay here, before the layers run (where a recording cannot be used, e.g. layers
        recorded unevenly, the first layer that replays raises). The layers then only read
        tensors, so a compiled model has no graph break for it."""
        self._action = self._enabled_action(action, "set_action")
        if (self._action is ReplayAction.RECORD and self.mode is ReplayMode.R2
                and self._replayed):
            self._start_new_recording()  # (as the first RECORD route would)
        if (self._action is ReplayAction.REPLAY_FORWARD and self.mode is ReplayMode.R2
                and self._store.routing is None and self._has_records()):
            try:
                self._use_recorded()
            except RouterReplayError:
                pass  # raised again, with the layer, by the first REPLAY_FORWARD route

    def _enabled_action(self, action, where: str) -> ReplayAction | None:
        action = ReplayAction.parse(action)
        if action is not None and not self.enabled:
            raise ConfigError(
                f"RouterReplay.{where}({action.name}): router replay is disabled "
                f"(mode=disabled); build it with mode=R2 or R3"
            )
        return action

    def clear(self) -> None:
        """Forget recordings, the routing to replay and the recompute queues."""
        self._records: dict[int, list[torch.Tensor]] = {lid: [] for lid in self.moe_layer_ids}
        self._queues = RecomputeQueues(self.moe_layer_ids)
        self._store.forget()
        self._calls = collections.Counter()
        self._replayed = False  # a REPLAY_FORWARD ran since the recording started

    def clear_agreement(self) -> None:
        """Forget the agreement counts of `agreement()` (`clear()` keeps them: they measure
        a run of many steps, each of which sets its routing anew)."""
        # layer id -> (replayed tokens whose set agrees, replayed tokens): 0-dim int64
        # tensors on the logits' device, summed without a host read
        self._agreement: dict[int, list[torch.Tensor]] = {}

    def clear_queues(self) -> None:
        self._queues.clear()

    def queue_depth(self, layer_id: int) -> int:
        """Entries waiting for a recompute (entries whose forward's graph is gone are not
        counted: they can never be recomputed)."""
        return self._queues.depth(self._check_layer(layer_id, "queue_depth"))

    def calls(self, layer_id: int) -> int:
        """How many times `route` served this layer with replay or record since the
        last `reset_calls()` (to assert that no layer bypassed the replay). Eager calls
        only: a torch.compile'd forward does not count (an int read there would be a
        guard that recompiles every call); check a model eagerly once."""
        return self._calls[layer_id]

    def reset_calls(self) -> None:
        self._calls = collections.Counter()

    def check_all_layers_routed(self, expected: int | None = None) -> None:
        """Raise if some MoE layer was not routed through `route` (e.g. a fused router
        path that bypasses replay), or routed a different number of times."""
        counts = {lid: self._calls[lid] for lid in self.moe_layer_ids}
        target = expected if expected is not None else max(counts.values())
        bad = {lid: c for lid, c in counts.items() if c != target or c == 0}
        if bad:
            raise RouterReplayError(
                f"RouterReplay: MoE layers {sorted(bad)} were routed {sorted(set(bad.values()))} "
                f"times through RouterReplay.route, expected {max(target, 1)} (per-layer "
                f"calls: {counts}); a layer that bypasses route() silently ignores the replay"
            )

    def _check_layer(self, layer_id: int, where: str) -> int:
        if layer_id not in self._ordinal:
            raise RouterReplayError(
                f"RouterReplay.{where}: layer_id={layer_id} is not a MoE layer of this model "
                f"(moe_layer_ids={self.moe_layer_ids}); layer ids are absolute layer indices"
            )
        return layer_id

    # ------------------------------------------------------------------ routing in
    def set_routing(
        self,
        indices: torch.Tensor | ReplayBatch,
        replay_mask: torch.Tensor | None = None,
        layer_index: str = "auto",
    ) -> None:
        """Routing to replay: a `ReplayBatch` (with its own mask and layer mapping), or
        `indices` [T, L, K] (or [B, S, L, K], flattened to B*S tokens), -1 = empty slot.

        A `ReplayBatch` checked against this model's shape (`ReplayBatch.check`; the
        rollout adapters and `RoutingFile.batch` give checked batches) is taken as it is:
        no scan, no mapping decided again. One checked against another shape is refused,
        naming what differs; an unchecked one is checked here like a tensor.

        For a tensor, L is the number of MoE layers (`layer_index="moe"`) or of all hidden
        layers (`"absolute"`); `"auto"` picks by L. An int16/int32/int64 tensor is kept as
        is: each layer replays a `[T, K]` view of it. int8 and unsigned tensors
        (uint8/16/32/64) are widened to a signed copy first, and their values are always
        checked, `validate` or not: an unsigned type cannot hold -1, so each of its values,
        its maximum included, is an expert id, refused when >= num_experts.

        `replay_mask` [T] bool: False rows fall back to the model's own top-k. When None,
        tokens whose slots are empty (-1) in every MoE layer get False; a token that is
        empty in some MoE layers but not in others is an error. With `config.validate` the
        values of the replayed rows are checked here, once (expert ids in range, no
        repeats), and a row an explicit mask marks True must be routed in every MoE layer
        (a row with every slot -1 in a MoE layer would get no expert there, a MoE output
        of 0: one more host read).
        """
        if isinstance(indices, ReplayBatch):
            if replay_mask is not None or layer_index != "auto":
                raise ValueError("RouterReplay.set_routing: a ReplayBatch carries its own "
                                 "replay_mask and layer_index; pass the batch alone")
            self._set_batch(indices, "set_routing")
            return
        self._set_routing(indices, replay_mask, layer_index, "set_routing")

    def _set_routing(self, indices, replay_mask, layer_index: str, source: str) -> None:
        self._require_enabled()
        self._store.set(indices, replay_mask, layer_index, source, self.config.validate)

    def _set_batch(self, batch: ReplayBatch, source: str) -> None:
        self._require_enabled()
        if batch.checked_for(self.shape):
            self._store.set_checked(batch, source)
            return
        other = batch.checked_shape
        if other is not None:
            raise RouterReplayError(
                "RouterReplay.set_routing: the batch was checked against another model shape: "
                + "; ".join(other.differences(self.shape, "batch", "model"))
                + ". Its columns are those layers' routes, not this model's")
        self._store.set(batch.indices, batch.replay_mask, batch.layer_index, source,
                        self.config.validate)

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise ConfigError(
                "RouterReplay.set_routing: router replay is disabled (mode=disabled)"
            )

    # ------------------------------------------------------------------ static buffers
    def use_static_buffer(self, max_tokens: int, device: torch.device | str | None = None
                          ) -> None:
        """Keep the routing to replay in preallocated buffers from now on: int32
        [max_tokens, L_moe, K] indices and a bool [max_tokens] replay mask, on `device`
        (the model's; default CPU). `set_routing`, `load` and R2's recording then copy into
        them instead of rebinding a tensor, so the layers read the same addresses every
        step and a CUDA graph captured around a replayed forward sees each step's routing.
        The mask is always passed to the gate (True where a row has a route), so the
        replayed forward runs the same kernels, with the same shapes, whatever the routing:
        no host read and no allocation that depends on it. A routing with more than
        `max_tokens` tokens is refused; one with fewer uses the first rows."""
        max_tokens = int(max_tokens)
        if max_tokens <= 0:
            raise ValueError(f"RouterReplay.use_static_buffer: max_tokens must be > 0, got "
                             f"{max_tokens}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        self._store.use_static_buffer(max_tokens, device)

    @property
    def static_capacity(self) -> int | None:
        """max_tokens of `use_static_buffer`, or None (the routing tensor is rebound)."""
        static = self._store.static
        return None if static is None else static[0].shape[0]

    # ------------------------------------------------------------------ the routing set
    @property
    def layer_mapping(self) -> str | None:
        """How the routing set indexes its layer columns ("moe" or "absolute"), or None."""
        return self._store.mapping

    @property
    def routing_source(self) -> str | None:
        """Where the routing set came from: "set_routing", "recorded", "file:<path>"."""
        return self._store.source

    @property
    def replay_mask(self) -> torch.Tensor | None:
        """bool [T]: the rows replayed (False: the fallback selection). None when every row
        is replayed (set explicitly, or derived from routing where no row is all -1)."""
        return self._store.mask

    def routing_for(self, layer_id: int) -> torch.Tensor:
        """The [T, K] view of the routing that `layer_id` replays (no copy)."""
        self._check_layer(layer_id, "routing_for")
        if self._store.routing is None:
            raise RouterReplayError(self._no_routing_message(layer_id))
        return self._store.layer_view(layer_id)

    def resolve_layer_mapping(self, L: int, layer_index: str = "auto", *, where: str = "") -> str:
        """"moe" or "absolute" for a routing tensor with L layers; raises if L fits neither."""
        return self.shape.mapping_for(L, f"RouterReplay.{where}", layer_index)

    def _no_routing_message(self, layer_id: int) -> str:
        hint = (
            "call set_routing() with the rollout's routed_experts (R3): the batch carried no "
            "routing" if self.mode is ReplayMode.R3
            else "record a forward first (RECORD), or call set_routing()/load()"
        )
        return (
            f"RouterReplay.route: layer {layer_id} is in REPLAY_FORWARD but no routing is set; "
            f"{hint}"
        )

    # ------------------------------------------------------------------ the layer call
    @options_one_way("RouterReplay.route", GATE_OPTIONS)
    def route(
        self,
        layer_id: int,
        logits: torch.Tensor,
        *,
        action: ReplayAction | str | None = None,
        topk_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        score_func: str = "softmax",
        normalize: bool = True,
        scaling_factor: float = 1.0,
        align: int = 1,
        padding: str | None = None,
        backend: str | None = None,
        selection=None,
        return_agreement: bool | None = None,
        options: GateOptions | None = None,
        hidden: torch.Tensor | None = None,
    ) -> RoutingPlan | None:
        """The routing plan of MoE layer `layer_id` for router `logits` [T, E], or None
        when replay is disabled or there is no action (the layer runs its own path).
        `action` overrides the object's current action for this call only (e.g. a
        recompute served as REPLAY_BACKWARD while the object stays in REPLAY_FORWARD).
        `selection` (a replay_ops.Selection): the layer's own top-k rule, which the gate
        applies, inside its kernel, to the rows without a route (replay mask False).
        The gate's options (score_func, normalize, scaling_factor, align, padding,
        selection, return_agreement) come as these keywords or as one
        `options=replay_ops.GateOptions`, never both (as `replay_ops.gate`).

        `padding` (default: `config.padding`): a replayed row with a -1 slot routes to its
        other experts ("empty") or takes the model's own selection in the gate ("select").
        Options whose padding is "empty" take `config.padding`.

        `return_agreement` (default: `config.agreement`): the plan also carries `agreement`
        and `set_logprob` (replay_ops.gate), and under REPLAY_FORWARD the replayed tokens
        are counted for `agreement()`.

        `hidden` [T, H] (the layer's hidden states): the plan also carries `rows`, the
        expert-major rows of `hidden` for it, written by the gate's op (replay_ops.gate's
        `hidden`)."""
        action = self._action if action is None else self._enabled_action(action, "route")
        if not self.enabled or action is None:
            return None
        self._check_layer(layer_id, "route")
        if logits.dim() != 2 or logits.shape[1] != self.num_experts:
            raise ValueError(
                f"RouterReplay.route: layer {layer_id}: logits must be [T, E={self.num_experts}], "
                f"got shape {tuple(logits.shape)}"
            )
        # The values were checked when the routing was set (config.validate): the gate
        # runs sync-free (an index outside [0, E) would be an empty slot).
        if options is None:
            opts = GateOptions(score_func=score_func, normalize=normalize,
                               scaling_factor=scaling_factor, align=align,
                               padding=self.config.padding if padding is None else padding,
                               return_agreement=self.config.agreement
                               if return_agreement is None else bool(return_agreement),
                               selection=DEFAULT_SELECTION if selection is None else selection)
        else:  # (a keyword beside options= was refused by the decorator)
            opts = resolve(options, "RouterReplay.route", GATE_OPTIONS)
            if self.config.agreement and not opts.return_agreement:
                opts = dataclasses.replace(opts, return_agreement=True)
            if opts.padding == "empty" and self.config.padding != "empty":
                opts = dataclasses.replace(opts, padding=self.config.padding)
        call = dict(validate=False, backend=backend, options=opts)
        if hidden is not None:
            call["hidden"] = hidden
        if action is ReplayAction.RECORD:
            plan = self._route_record(layer_id, logits, topk_fn, call)
        elif action is ReplayAction.REPLAY_FORWARD:
            plan = self._route_replay_forward(layer_id, logits, topk_fn, call)
        elif action is ReplayAction.REPLAY_BACKWARD:
            plan = self._route_replay_backward(layer_id, logits, call)
        else:  # pragma: no cover - ReplayAction.parse only returns these
            raise RouterReplayError(f"RouterReplay.route: unknown action {action!r}")
        if not _compiling():
            self._calls[layer_id] += 1
        return plan

    @staticmethod
    def _gate(logits, idx, **kw) -> RoutingPlan:
        import replay_ops  # late, and looked up at call time (replay_ops imports this)

        return replay_ops.gate(logits, idx, **kw)

    def _route_record(self, layer_id, logits, topk_fn, opts) -> RoutingPlan:
        """The layer's own top-k, gated and stored (checked when read out)."""
        if topk_fn is None:
            raise ValueError(
                f"RouterReplay.route: layer {layer_id}: RECORD needs topk_fn, the layer's "
                f"own top-k selection"
            )
        if self._replayed and self.mode is ReplayMode.R2:
            # R2: a replay ran since this recording started (of the recording itself, or of
            # routing set from slices of it, as micro-batches do); this RECORD starts the
            # next step, whose routing replaces it (a forgotten clear() must not replay the
            # old step).
            self._start_new_recording()
        elif self._store.source == "recorded":
            # taken from the recording by set_action(REPLAY_FORWARD) but not replayed yet:
            # the recording goes on, and the routing is taken again from all of it
            self._store.forget()
        with torch.no_grad():
            idx = self._check_own(layer_id, topk_fn(logits.detach()), logits.shape[0])
        self._records[layer_id].append(idx.detach())
        return self._gate(logits, idx, **opts)

    def _start_new_recording(self) -> None:
        for lid in self.moe_layer_ids:
            self._records[lid].clear()
        self._store.forget()
        self._replayed = False
        self.step += 1

    def _route_replay_forward(self, layer_id, logits, topk_fn, opts) -> RoutingPlan:
        """The routing set (or recorded) for this layer; fallback rows use the model's own
        top-k.
        With recompute=True the indices used go onto the layer's queue when a recompute can
        follow (grad enabled, or inside a reentrant checkpoint's forward)."""
        T = logits.shape[0]
        self._replayed = True
        if self._store.routing is None and self.mode is ReplayMode.R2 and self._has_records():
            self._use_recorded()
        store = self._store
        if store.routing is not None and store.routing.device != logits.device:
            if store.static is not None:
                raise RouterReplayError(
                    f"RouterReplay.route: layer {layer_id}: the static routing buffer is on "
                    f"{store.routing.device} but the logits are on {logits.device}; pass the "
                    f"model's device to use_static_buffer")
            store.move_to(logits.device)  # once per routing, not once per layer
        idx = self.routing_for(layer_id)
        if idx.shape[0] != T:
            raise RouterReplayError(
                f"RouterReplay.route: layer {layer_id}: the routing to replay has "
                f"{idx.shape[0]} tokens but the logits have T={T} tokens (source: "
                f"{describe_source(store.source)}, mapping: {store.mapping}); "
                f"the batch and its routing do not line up"
            )
        mask = replayed = store.mask
        if mask is not None and self.config.fallback == "topk_fn":
            if topk_fn is None:
                raise ValueError(
                    f"RouterReplay.route: layer {layer_id}: fallback='topk_fn' needs topk_fn"
                )
            with torch.no_grad():
                own = self._check_own(layer_id, topk_fn(logits.detach()), T)
            idx = torch.where(mask[:, None], idx.to(torch.int32), own.to(torch.int32))
            mask = None
        plan = self._gate(logits, idx, replay_mask=mask, **opts)
        if plan.agreement is not None and not _compiling():
            self._count_agreement(layer_id, plan.agreement, replayed)
        if not self.config.recompute or _compiling():
            return plan
        return self._queues.push(layer_id, plan, self.config.max_queue)

    def _count_agreement(self, layer_id: int, agreement: torch.Tensor,
                         replayed: torch.Tensor | None) -> None:
        """Add one forward's replayed tokens, and those whose set agrees, to the layer's
        counts (on the device: no host read)."""
        if replayed is not None:
            replayed = replayed.to(agreement.device)
            agree = (agreement & replayed).sum()
            n = replayed.sum()
        else:
            agree = agreement.sum()
            n = torch.tensor(agreement.numel(), device=agreement.device)
        acc = self._agreement.get(layer_id)
        if acc is None:
            self._agreement[layer_id] = [agree, n]
        else:
            acc[0] = acc[0] + agree
            acc[1] = acc[1] + n

    def agreement(self) -> dict[int, float]:
        """Per MoE layer (absolute layer id, in `moe_layer_ids` order): the fraction of the
        replayed tokens (replay mask True) of the REPLAY_FORWARD calls since the last
        `clear()` / `clear_agreement()` whose replayed set of experts equals the set the
        model's own selection picks from the current logits (`plan.agreement` of
        replay_ops.gate). Counted when the gate wrote the agreement: `config.agreement`,
        or `route(..., return_agreement=True)`, since the object was built or
        `clear_agreement()` (`clear()` keeps the counts). A layer with no counted replayed
        token is left out. One host read."""
        layers = [lid for lid in self.moe_layer_ids if lid in self._agreement]
        if not layers:
            return {}
        counts = torch.stack([torch.stack([c.cpu() for c in self._agreement[lid]])
                              for lid in layers]).tolist()
        return {lid: a / n for lid, (a, n) in zip(layers, counts) if n > 0}

    def _route_replay_backward(self, layer_id, logits, opts) -> RoutingPlan:
        """Activation recompute: the indices of the matching REPLAY_FORWARD, first in,
        first out."""
        idx = self._queues.pop(layer_id, logits.shape[0])
        return self._gate(logits, idx.to(logits.device), **opts)

    def _check_own(self, layer_id: int, idx, T: int) -> torch.Tensor:
        """The layer's own top-k (`topk_fn`'s result) checked: [T, K] integer indices."""
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape != (T, self.top_k):
            shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(
                f"RouterReplay.route: layer {layer_id}: topk_fn must return [T, K]=({T}, "
                f"{self.top_k}) indices, got {shape}"
            )
        if idx.is_floating_point():
            raise TypeError(
                f"RouterReplay.route: layer {layer_id}: topk_fn returned {idx.dtype}; "
                f"return the integer indices (torch.topk(...).indices)"
            )
        return idx
    # ------------------------------------------------------------------ recordings out
    def _has_records(self) -> bool:
        return any(self._records[lid] for lid in self.moe_layer_ids)

    def record_calls(self, layer_id: int) -> int:
        return len(self._records[self._check_layer(layer_id, "record_calls")])

    def recorded(self) -> torch.Tensor:
        """int32 [T, L_moe, K]: what RECORD stored, MoE layers in `moe_layer_ids` order;
        several RECORD forwards are concatenated along T in call order. With
        config.validate the values are checked (one host sync)."""
        return self._recording(self.config.validate).to(torch.int32)

    def _recording(self, check: bool) -> torch.Tensor:
        counts = {lid: len(self._records[lid]) for lid in self.moe_layer_ids}
        if not any(counts.values()):
            raise RouterReplayError(
                "RouterReplay.recorded: nothing was recorded (no RECORD forward)")
        if len(set(counts.values())) != 1:
            raise RouterReplayError(
                f"RouterReplay.recorded: MoE layers were recorded a different number of times "
                f"({counts}); a layer bypassed RouterReplay.route"
            )
        per_layer = [torch.cat(self._records[lid], dim=0) for lid in self.moe_layer_ids]
        lengths = {lid: t.shape[0] for lid, t in zip(self.moe_layer_ids, per_layer)}
        if len(set(lengths.values())) != 1:
            raise RouterReplayError(
                f"RouterReplay.recorded: MoE layers recorded different token counts {lengths}"
            )
        rec = torch.stack(per_layer, dim=1)
        if check:
            self._store.check_values(rec, None, "recorded")
        return rec

    def recorded_batch(self, cu_seqlens: torch.Tensor | Sequence[int] | None = None
                       ) -> ReplayBatch:
        """The recording (`recorded()`) as a `ReplayBatch` checked against this model's
        shape: THD `[T, L_moe, K]` int16 (int32 above 32767 experts), every row replayed,
        one sequence unless `cu_seqlens` gives the boundaries. Its values are scanned once
        here (whatever `config.validate` says: the mark promises it), and not again by a
        sink of the same shape (`set_routing`, Megatron's `set_replay_routing`)."""
        rec = self._recording(True)
        T = rec.shape[0]
        rec = rec.to(INDEX_DTYPE if self.num_experts <= torch.iinfo(INDEX_DTYPE).max
                     else torch.int32)
        cu = torch.tensor([0, T], dtype=torch.int64) if cu_seqlens is None else \
            torch.as_tensor(cu_seqlens).to(torch.int64).cpu()
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != T or \
                bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"RouterReplay.recorded_batch: cu_seqlens {cu.tolist()} must run "
                             f"from 0 to the {T} recorded tokens, never decreasing")
        batch = ReplayBatch(rec, torch.ones(T, dtype=torch.bool, device=rec.device), cu,
                            ["moe"] * (cu.numel() - 1), "moe")
        return _mark_checked(batch, self.shape)  # scanned by _recording just above

    def _use_recorded(self) -> None:
        """R2: replay what RECORD stored, if no routing was set explicitly."""
        self._store.set_recorded(self.recorded())

    def clear_records(self) -> None:
        for lid in self.moe_layer_ids:
            self._records[lid].clear()

    # ------------------------------------------------------------------ files
    def save(
        self,
        path: str | os.PathLike | None = None,
        *,
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
        model_name: str | None = None,
        append: bool = False,
    ) -> str:
        """Write `recorded()` to a record file (default: config.record_file), atomically.
        `append=True` adds the tokens as new sequences after those already in the file."""
        from . import files

        path = path if path is not None else self.config.record_file
        if path is None:
            raise ValueError("RouterReplay.save: no path given and config.record_file is not set")
        meta = files.RecordMeta(
            shape=self.shape,
            layer_index="moe",
            model_name=model_name if model_name is not None else (self.config.model_name or ""),
        )
        writer = files.append_routing if append else files.write_routing
        writer(path, self.recorded(), meta, cu_seqlens=cu_seqlens)
        return os.fspath(path)

    def load(
        self,
        path: str | os.PathLike | None = None,
        *,
        sequences: tuple[int, int] | None = None,
        verify: bool = True,
    ):
        """Load a record file and set it as the routing to replay. The file is read once
        into private memory (`files.open_routing`): its checksum is computed over that copy
        and the routing replayed is that copy, so a process that rewrites or truncates the
        file in place later changes nothing here. Raw int16 files are replayed as views of
        it, uint8 and codec files are decoded (to int16) for the tokens loaded.
        `sequences=(b0, b1)` loads only sequences b0..b1-1 (tokens
        cu_seqlens[b0]:cu_seqlens[b1]). The file's model shape is checked against this
        model (`RoutingFile.batch`), its values here, once (with `config.validate`).
        Returns the opened `RoutingFile`."""
        from . import files

        path = path if path is not None else self.config.replay_file
        if path is None:
            raise ValueError("RouterReplay.load: no path given and config.replay_file is not set")
        rf = files.open_routing(path, verify=verify)
        batch = rf.batch(self.shape, sequences=sequences, model_name=self.config.model_name,
                         check=False)
        # scanned here, with this object's words; the mask derived again (None when every
        # token is routed, so the layers run no fallback selection)
        self._set_routing(batch.indices, None, batch.layer_index, f"file:{os.fspath(path)}")
        self.routing_file = rf
        return rf

    def __repr__(self) -> str:
        return (
            f"RouterReplay(mode={self.mode.value}, action="
            f"{self._action.name if self._action else None}, num_experts={self.num_experts}, "
            f"top_k={self.top_k}, moe_layer_ids={self.moe_layer_ids}, "
            f"num_hidden_layers={self.num_hidden_layers}, layer_mapping={self.layer_mapping})"
        )


def _compiling() -> bool:
    """Inside a torch.compile trace: the per-call Python bookkeeping (the `calls` counts,
    the recompute queue) is left out, since an int read there would be a guard that
    recompiles on every call. A compiled forward's recompute runs in the compiled backward
    (AOTAutograd), from the graph's own inputs, and never calls `route` again."""
    return torch.compiler.is_compiling()
