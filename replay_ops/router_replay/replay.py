"""`RouterReplay`: the routing of every MoE layer of one model, recorded or replayed.

One object per model, no module-level state: two models in one process never share
routing. A MoE layer calls

    plan = replay.route(layer_id, logits, topk_fn=..., score_func=..., normalize=...)
    if plan is None:            # disabled, or no action set: the layer's native path
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
`config.validate` (one host sync); the MoE layers then gate without a host sync.
"""
from __future__ import annotations

import collections
import os
import weakref
from typing import Callable, Sequence

import torch

from ..plan import RoutingPlan
from .config import ConfigError, ReplayAction, ReplayMode, RouterReplayConfig, check_combination
from .._validate import UNSIGNED, signed_routing, unsigned_note
from .shape import LAYER_INDEX, ModelShape, describe_bad_route, first_bad_route

LAYER_MAPPINGS = LAYER_INDEX  # the choices of layer_index=


class RouterReplayError(RuntimeError):
    """Routing that cannot be replayed as asked (missing, mis-shaped, out of order)."""


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
        self._static: tuple[torch.Tensor, torch.Tensor] | None = None  # use_static_buffer
        self._action: ReplayAction | None = None
        self.step = 0  # recordings started (R2): a new RECORD after a replay starts the next
        self.clear()
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
        """Set what the next `route` calls do by default; None means native routing.

        R2: REPLAY_FORWARD after RECORD forwards takes the recording as the routing to
        replay here, before the layers run (where a recording cannot be used, e.g. layers
        recorded unevenly, the first layer that replays raises). The layers then only read
        tensors, so a compiled model has no graph break for it."""
        self._action = self._enabled_action(action, "set_action")
        if (self._action is ReplayAction.RECORD and self.mode is ReplayMode.R2
                and self._replayed):
            self._start_new_recording()  # (as the first RECORD route would)
        if (self._action is ReplayAction.REPLAY_FORWARD and self.mode is ReplayMode.R2
                and self._routing is None and self._has_records()):
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
        self._queues: dict[int, collections.deque] = {
            lid: collections.deque() for lid in self.moe_layer_ids
        }
        self._forget_routing()
        self._calls = collections.Counter()
        self._replayed = False  # a REPLAY_FORWARD ran since the recording started

    def _forget_routing(self) -> None:
        self._routing: torch.Tensor | None = None
        self._routing_cols: dict[int, int] = {}
        self._replay_mask: torch.Tensor | None = None
        self.layer_mapping: str | None = None
        self.routing_source: str | None = None

    def clear_queues(self) -> None:
        for q in self._queues.values():
            q.clear()

    def queue_depth(self, layer_id: int) -> int:
        """Entries waiting for a recompute (entries whose forward's graph is gone are not
        counted: they can never be recomputed)."""
        q = self._queues[self._check_layer(layer_id, "queue_depth")]
        _drop_dead(q)
        return len(q)

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
        indices: torch.Tensor,
        replay_mask: torch.Tensor | None = None,
        layer_index: str = "auto",
    ) -> None:
        """Routing to replay: `indices` [T, L, K] (or [B, S, L, K], flattened to B*S
        tokens), -1 = empty slot. L is the number of MoE layers (`layer_index="moe"`) or
        of all hidden layers (`"absolute"`); `"auto"` picks by L. An int16/int32/int64
        tensor is kept as is: each layer replays a `[T, K]` view of it. int8 and unsigned
        tensors (uint8/16/32/64) are widened to a signed copy first, and their values are
        always checked, `validate` or not: an unsigned type cannot hold -1, so each of its
        values, its maximum included, is an expert id, refused when >= num_experts.

        `replay_mask` [T] bool: False rows fall back to native top-k. When None, tokens
        whose slots are empty (-1) in every MoE layer get False; a token that is empty in
        some MoE layers but not in others is an error. With `config.validate` the values of
        the replayed rows are checked here, once (expert ids in range, no repeats).
        """
        self._set_routing(indices, replay_mask, layer_index, "set_routing")

    def _set_routing(self, indices, replay_mask, layer_index: str, source: str) -> None:
        if not self.enabled:
            raise ConfigError(
                "RouterReplay.set_routing: router replay is disabled (mode=disabled)"
            )
        if not isinstance(indices, torch.Tensor):
            raise TypeError(
                f"RouterReplay.set_routing: indices must be a torch.Tensor, got "
                f"{type(indices).__name__}"
            )
        if indices.dim() == 4:
            B, S = indices.shape[:2]
            indices = indices.reshape(B * S, *indices.shape[2:])
            if replay_mask is not None and replay_mask.dim() == 2:
                replay_mask = replay_mask.reshape(B * S)
        if indices.dim() != 3:
            raise ValueError(
                f"RouterReplay.set_routing: indices must be [T, L, K] or [B, S, L, K], got "
                f"shape {tuple(indices.shape)}"
            )
        indices, dtype = signed_routing(indices, "RouterReplay.set_routing", "indices")
        T, L, K = indices.shape
        if K != self.top_k:
            raise ValueError(
                f"RouterReplay.set_routing: indices have K={K} slots per token but the model "
                f"has top_k={self.top_k} (shape {tuple(indices.shape)})"
            )
        mapping = self.resolve_layer_mapping(L, layer_index, where="set_routing")
        cols = dict(zip(self.moe_layer_ids, self.shape.columns(mapping)))
        if replay_mask is not None:
            if replay_mask.dtype != torch.bool or tuple(replay_mask.shape) != (T,):
                raise ValueError(
                    f"RouterReplay.set_routing: replay_mask must be bool [T]=({T},), got "
                    f"{replay_mask.dtype} {tuple(replay_mask.shape)}"
                )
            if replay_mask.device != indices.device:
                replay_mask = replay_mask.to(indices.device)
        else:
            replay_mask = self._derive_mask(indices, cols)
        # unsigned routing is always checked: its type cannot hold -1, so a format's
        # stand-in for an empty slot (often the type's maximum) would otherwise pass
        self._check_values(indices[:, self.shape.columns(mapping), :], replay_mask, source,
                           dtype, force=dtype in UNSIGNED)
        if self._static is not None:
            self._copy_static(indices[:, self.shape.columns(mapping), :], replay_mask, source)
            return
        self._routing = indices
        self._routing_cols = cols
        self._replay_mask = replay_mask
        self.layer_mapping = mapping
        self.routing_source = source

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
        L, K = self.num_moe_layers, self.top_k
        self._static = (torch.full((max_tokens, L, K), -1, dtype=torch.int32, device=device),
                        torch.zeros(max_tokens, dtype=torch.bool, device=device))
        self._forget_routing()

    @property
    def static_capacity(self) -> int | None:
        """max_tokens of `use_static_buffer`, or None (the routing tensor is rebound)."""
        return None if self._static is None else self._static[0].shape[0]

    def _copy_static(self, moe_routing: torch.Tensor, mask: torch.Tensor | None,
                     source: str) -> None:
        buf, mbuf = self._static
        T = moe_routing.shape[0]
        if T > buf.shape[0]:
            raise RouterReplayError(
                f"RouterReplay.set_routing: indices have T={T} tokens but the static buffer "
                f"holds max_tokens={buf.shape[0]} (use_static_buffer); allocate a larger "
                f"one or split the batch")
        buf[:T].copy_(moe_routing)
        if mask is None:
            mbuf[:T].fill_(True)
        else:
            mbuf[:T].copy_(mask)
        self._routing = buf[:T]
        self._routing_cols = dict(zip(self.moe_layer_ids, range(self.num_moe_layers)))
        self._replay_mask = mbuf[:T]
        self.layer_mapping = "moe"
        self.routing_source = source

    def _check_values(self, moe_routing: torch.Tensor, mask, source: str,
                      dtype: torch.dtype | None = None, force: bool = False) -> None:
        """With config.validate (or `force`): the replayed rows of [T, L_moe, K] routing
        name experts in range, none twice in a token's layer (one host sync). `dtype`: the
        dtype the routing arrived in, for the message."""
        if not (self.config.validate or force):
            return
        bad = first_bad_route(moe_routing, self.num_experts, mask)
        if bad is not None:
            raise RouterReplayError(
                f"RouterReplay: the routing from {_describe_source(source)} cannot be "
                f"replayed: {describe_bad_route(bad, self.num_experts, self.moe_layer_ids)}"
                f"{unsigned_note(dtype, bad.value) if bad.kind == 'range' else ''}"
            )

    def resolve_layer_mapping(self, L: int, layer_index: str = "auto", *, where: str = "") -> str:
        """"moe" or "absolute" for a routing tensor with L layers; raises if L fits neither."""
        return self.shape.mapping_for(L, f"RouterReplay.{where}", layer_index)

    def _derive_mask(self, indices: torch.Tensor, cols: dict[int, int]) -> torch.Tensor:
        sel = torch.tensor(sorted(set(cols.values())), device=indices.device)
        empty = (indices.index_select(1, sel) < 0).all(dim=2)  # [T, L_moe]
        all_empty = empty.all(dim=1)
        partial = empty.any(dim=1) & ~all_empty
        # one host read for both flags
        any_partial, any_empty = torch.stack([partial.any(), all_empty.any()]).tolist()
        if not any_partial and not any_empty:
            # every row has a route: no mask, so the layers run no fallback selection
            return None
        if any_partial:
            t = int(partial.nonzero()[0, 0])
            layers = [self.moe_layer_ids[j] for j in empty[t].nonzero().flatten().tolist()]
            raise RouterReplayError(
                f"RouterReplay.set_routing: token {t} has no route (all slots -1) in MoE "
                f"layers {layers} but has routes in the other MoE layers; pass an explicit "
                f"replay_mask or fix the recording"
            )
        return ~all_empty

    def routing_for(self, layer_id: int) -> torch.Tensor:
        """The [T, K] view of the routing that `layer_id` replays (no copy)."""
        self._check_layer(layer_id, "routing_for")
        if self._routing is None:
            raise RouterReplayError(self._no_routing_message(layer_id))
        return self._routing[:, self._routing_cols[layer_id], :]

    def _move_routing(self, device: torch.device) -> None:
        """Move the routing buffer (and mask) to the model's device, keeping its layout,
        so that each layer's slice stays a view. Set the routing on the model's device
        to avoid this copy."""
        self._routing = self._routing.to(device)
        if self._replay_mask is not None:
            self._replay_mask = self._replay_mask.to(device)

    @property
    def replay_mask(self) -> torch.Tensor | None:
        """bool [T]: the rows replayed (False: the fallback selection). None when every row
        is replayed (set explicitly, or derived from routing where no row is all -1)."""
        return self._replay_mask

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
        backend: str | None = None,
        selection=None,
    ) -> RoutingPlan | None:
        """The routing plan of MoE layer `layer_id` for router `logits` [T, E], or None
        when replay is disabled or there is no action (the layer runs its own path).
        `action` overrides the object's current action for this call only (e.g. a
        recompute served as REPLAY_BACKWARD while the object stays in REPLAY_FORWARD).
        `selection` (a replay_ops.Selection): the layer's own top-k rule, which the gate
        applies, inside its kernel, to the rows without a route (replay mask False)."""
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
        opts = dict(score_func=score_func, normalize=normalize, scaling_factor=scaling_factor,
                    align=align, validate=False, backend=backend)
        if selection is not None:
            opts["selection"] = selection
        if action is ReplayAction.RECORD:
            plan = self._route_record(layer_id, logits, topk_fn, opts)
        elif action is ReplayAction.REPLAY_FORWARD:
            plan = self._route_replay_forward(layer_id, logits, topk_fn, opts)
        elif action is ReplayAction.REPLAY_BACKWARD:
            plan = self._route_replay_backward(layer_id, logits, opts)
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
        """The layer's native top-k, gated and stored (checked when read out)."""
        if topk_fn is None:
            raise ValueError(
                f"RouterReplay.route: layer {layer_id}: RECORD needs topk_fn, the layer's "
                f"native top-k selection"
            )
        if self._replayed and self.mode is ReplayMode.R2:
            # R2: a replay ran since this recording started (of the recording itself, or of
            # routing set from slices of it, as micro-batches do); this RECORD starts the
            # next step, whose routing replaces it (a forgotten clear() must not replay the
            # old step).
            self._start_new_recording()
        elif self.routing_source == "recorded":
            # taken from the recording by set_action(REPLAY_FORWARD) but not replayed yet:
            # the recording goes on, and the routing is taken again from all of it
            self._forget_routing()
        with torch.no_grad():
            idx = self._check_native(layer_id, topk_fn(logits.detach()), logits.shape[0])
        self._records[layer_id].append(idx.detach())
        return self._gate(logits, idx, **opts)

    def _start_new_recording(self) -> None:
        for lid in self.moe_layer_ids:
            self._records[lid].clear()
        self._forget_routing()
        self._replayed = False
        self.step += 1

    def _route_replay_forward(self, layer_id, logits, topk_fn, opts) -> RoutingPlan:
        """The routing set (or recorded) for this layer; fallback rows use native top-k.
        With grad enabled and recompute=True the indices used go onto the layer's queue."""
        T = logits.shape[0]
        self._replayed = True
        if self._routing is None and self.mode is ReplayMode.R2 and self._has_records():
            self._use_recorded()
        if self._routing is not None and self._routing.device != logits.device:
            if self._static is not None:
                raise RouterReplayError(
                    f"RouterReplay.route: layer {layer_id}: the static routing buffer is on "
                    f"{self._routing.device} but the logits are on {logits.device}; pass the "
                    f"model's device to use_static_buffer")
            self._move_routing(logits.device)  # once per routing, not once per layer
        idx = self.routing_for(layer_id)
        if idx.shape[0] != T:
            raise RouterReplayError(
                f"RouterReplay.route: layer {layer_id}: the routing to replay has "
                f"{idx.shape[0]} tokens but the logits have T={T} tokens (source: "
                f"{_describe_source(self.routing_source)}, mapping: {self.layer_mapping}); "
                f"the batch and its routing do not line up"
            )
        mask = self._replay_mask
        if mask is not None and self.config.fallback == "topk_fn":
            if topk_fn is None:
                raise ValueError(
                    f"RouterReplay.route: layer {layer_id}: fallback='topk_fn' needs topk_fn"
                )
            with torch.no_grad():
                native = self._check_native(layer_id, topk_fn(logits.detach()), T)
            idx = torch.where(mask[:, None], idx.to(torch.int32), native.to(torch.int32))
            mask = None
        plan = self._gate(logits, idx, replay_mask=mask, **opts)
        if self.config.recompute and torch.is_grad_enabled() and not _compiling():
            q = self._queues[layer_id]
            _drop_dead(q)
            if len(q) >= self.config.max_queue:
                raise RouterReplayError(
                    f"RouterReplay.route: layer {layer_id}: {len(q)} replayed forwards are "
                    f"waiting for REPLAY_BACKWARD (max_queue={self.config.max_queue}); "
                    f"without activation recompute set recompute=False, or call "
                    f"clear_queues() after each step"
                )
            entry = _QueueEntry(plan.expert_indices.detach())
            if plan.weights.requires_grad:
                plan = plan._replace(weights=_bind_to_graph(plan.weights, entry))
            q.append(entry)
        return plan

    def _route_replay_backward(self, layer_id, logits, opts) -> RoutingPlan:
        """Activation recompute: the indices of the matching REPLAY_FORWARD, first in,
        first out."""
        q = self._queues[layer_id]
        _drop_dead(q)
        if not q:
            raise RouterReplayError(
                f"RouterReplay.route: layer {layer_id}: REPLAY_BACKWARD but the layer's "
                f"queue is empty: the recompute has no matching REPLAY_FORWARD (forwards "
                f"are queued only when grad is enabled and recompute=True; reentrant "
                f"activation checkpointing, use_reentrant=True, runs the forward without "
                f"grad and is not supported: use use_reentrant=False)"
            )
        idx = q.popleft().indices
        if idx.shape[0] != logits.shape[0]:
            raise RouterReplayError(
                f"RouterReplay.route: layer {layer_id}: REPLAY_BACKWARD pops {idx.shape[0]} "
                f"tokens but the recomputed logits have T={logits.shape[0]} tokens; recompute "
                f"order differs from the forward order"
            )
        return self._gate(logits, idx.to(logits.device), **opts)

    def _check_native(self, layer_id: int, idx, T: int) -> torch.Tensor:
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
        self._check_values(rec, None, "recorded")
        return rec.to(torch.int32)

    def _use_recorded(self) -> None:
        """R2: replay what RECORD stored, if no routing was set explicitly."""
        rec = self.recorded()
        if self._static is not None:
            self._copy_static(rec, None, "recorded")
            return
        self._routing = rec
        self._routing_cols = dict(zip(self.moe_layer_ids, range(self.num_moe_layers)))
        self._replay_mask = None
        self.layer_mapping = "moe"
        self.routing_source = "recorded"

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
        rec = self.recorded()
        meta = files.RecordMeta(
            shape=self.shape,
            layer_index="moe",
            model_name=model_name if model_name is not None else (self.config.model_name or ""),
        )
        writer = files.append_routing if append else files.write_routing
        writer(path, rec, meta, cu_seqlens=cu_seqlens)
        return os.fspath(path)

    def load(
        self,
        path: str | os.PathLike | None = None,
        *,
        sequences: tuple[int, int] | None = None,
        verify: bool = True,
    ):
        """Load a record file and set it as the routing to replay. The file is
        memory-mapped: int16 files are replayed with no copy, uint8 files are decoded
        (to int16) for the tokens loaded. `sequences=(b0, b1)` loads only sequences
        b0..b1-1 (tokens cu_seqlens[b0]:cu_seqlens[b1]). The file's model shape is
        checked against this model. Returns the opened `RoutingFile`."""
        from . import files

        path = path if path is not None else self.config.replay_file
        if path is None:
            raise ValueError("RouterReplay.load: no path given and config.replay_file is not set")
        rf = files.open_routing(path, verify=verify)
        rf.check_model(
            num_experts=self.num_experts,
            top_k=self.top_k,
            moe_layer_ids=self.moe_layer_ids,
            num_hidden_layers=self.num_hidden_layers,
            model_name=self.config.model_name,
        )
        start, stop = 0, rf.num_tokens
        if sequences is not None:
            b0, b1 = (int(v) for v in sequences)
            if not 0 <= b0 <= b1 <= rf.num_sequences:
                raise IndexError(
                    f"RouterReplay.load: sequences=({b0}, {b1}) is outside the file's "
                    f"{rf.num_sequences} sequences ({os.fspath(path)!r})"
                )
            start, stop = int(rf.cu_seqlens_np[b0]), int(rf.cu_seqlens_np[b1])
        self._set_routing(rf.indices(start, stop), None, rf.meta.layer_index,
                          f"file:{os.fspath(path)}")
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


def _describe_source(source: str | None) -> str:
    if source is None:
        return "nowhere"
    if source.startswith("file:"):
        return f"the record file {source[5:]!r}"
    if source == "recorded":
        return "the recording (RECORD forwards of this RouterReplay)"
    return "set_routing()"


# ----------------------------------------------------------------------------- recompute queue
class _QueueEntry:
    """The indices a REPLAY_FORWARD used, waiting for its recompute. `alive` turns False
    when the autograd graph of that forward is freed (backpropagated, or dropped without a
    backward: a skipped step, an evaluation forward with grad enabled): such an entry can
    never be recomputed, and popping it would replay another batch's routing."""

    __slots__ = ("indices", "alive", "token_ref", "__weakref__")

    def __init__(self, indices: torch.Tensor):
        self.indices = indices
        self.alive = True
        self.token_ref = None  # set by _bind_to_graph; kept so that its callback fires


class _GraphToken:
    """Held by a node of the forward's graph; its deletion marks the queue entry dead."""

    __slots__ = ("__weakref__",)


class _Bind(torch.autograd.Function):
    """Identity on the gate weights whose node holds a token: the node lives exactly as
    long as the forward's graph."""

    @staticmethod
    def forward(ctx, weights, token):
        ctx.token = token
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _bind_to_graph(weights: torch.Tensor, entry: _QueueEntry) -> torch.Tensor:
    token = _GraphToken()
    entry_ref = weakref.ref(entry)

    def _freed(_ref, entry_ref=entry_ref):
        e = entry_ref()
        if e is not None:
            e.alive = False

    entry.token_ref = weakref.ref(token, _freed)
    return _Bind.apply(weights, token)


def _drop_dead(q: collections.deque) -> None:
    """Discard the entries whose forward's graph is gone, keeping the order of the rest."""
    if any(not e.alive for e in q):
        live = [e for e in q if e.alive]
        q.clear()
        q.extend(live)
