"""`RouterReplay`: the routing of every MoE layer of one model, recorded or replayed.

One object per model, no module-level state: two models in one process never share
routing. A MoE layer calls

    plan = replay.route(layer_id, logits, topk_fn=..., score_func=..., normalize=...)
    if plan is None:            # disabled, or no action set: the layer's native path
        ...

Layers are identified by their absolute layer id (the index in the model's list of
decoder layers). `moe_layer_ids` lists the MoE ones in ascending order; dense layers are
absent. A routing tensor `[T, L, K]` is indexed either by MoE ordinal (L = number of MoE
layers) or by absolute layer id (L = number of hidden layers, dense rows ignored);
`set_routing` says which one it used in `.layer_mapping`.
"""
from __future__ import annotations

import collections
import os
from typing import Callable, Sequence

import torch

from ..plan import RoutingPlan
from .config import ConfigError, ReplayAction, ReplayMode, RouterReplayConfig, check_combination

LAYER_MAPPINGS = ("auto", "absolute", "moe")


class RouterReplayError(RuntimeError):
    """Routing that cannot be replayed as asked (missing, mis-shaped, out of order)."""


class RouterReplay:
    def __init__(
        self,
        config: RouterReplayConfig | None = None,
        *,
        num_experts: int,
        top_k: int,
        moe_layer_ids: Sequence[int],
        num_hidden_layers: int | None = None,
    ) -> None:
        config = config if config is not None else RouterReplayConfig()
        if not isinstance(config, RouterReplayConfig):
            raise TypeError(
                f"RouterReplay: config must be a RouterReplayConfig, got {type(config).__name__}"
            )
        check_combination(config)
        self.config = config
        self.mode = config.replay_mode
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(
                f"RouterReplay: num_experts must be an integer >= 1, got {num_experts!r}")
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(
                f"RouterReplay: top_k must be an integer in 1..num_experts={num_experts}, "
                f"got {top_k!r}"
            )
        ids = [int(i) for i in moe_layer_ids]
        if not ids:
            raise ValueError("RouterReplay: moe_layer_ids is empty; a model with no MoE layer "
                             "has nothing to replay")
        if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(
                f"RouterReplay: moe_layer_ids must be distinct non-negative layer ids, got {ids}"
            )
        if ids != sorted(ids):
            raise ValueError(
                f"RouterReplay: moe_layer_ids must be ascending (the model's layer order), "
                f"got {ids}"
            )
        if num_hidden_layers is None:
            num_hidden_layers = ids[-1] + 1
        if num_hidden_layers <= ids[-1]:
            raise ValueError(
                f"RouterReplay: num_hidden_layers={num_hidden_layers} but moe_layer_ids "
                f"contains layer {ids[-1]}"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.moe_layer_ids: list[int] = ids
        self.num_hidden_layers = int(num_hidden_layers)
        self._ordinal = {lid: n for n, lid in enumerate(ids)}
        self._action: ReplayAction | None = None
        self.clear()
        if self.enabled and config.replay_file is not None:
            self.load(config.replay_file)

    # ------------------------------------------------------------------ state
    @property
    def enabled(self) -> bool:
        return self.mode is not ReplayMode.DISABLED

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def action(self) -> ReplayAction | None:
        return self._action

    def set_action(self, action: ReplayAction | str | None) -> None:
        """Set what the next `route` calls do; None means native routing."""
        action = ReplayAction.parse(action)
        if action is not None and not self.enabled:
            raise ConfigError(
                f"RouterReplay.set_action({action.name}): router replay is disabled "
                f"(mode=disabled); build it with mode=R2 or R3"
            )
        self._action = action

    def clear(self) -> None:
        """Forget recordings, the routing to replay and the recompute queues."""
        self._records: dict[int, list[torch.Tensor]] = {lid: [] for lid in self.moe_layer_ids}
        self._queues: dict[int, collections.deque] = {
            lid: collections.deque() for lid in self.moe_layer_ids
        }
        self._routing: torch.Tensor | None = None
        self._routing_cols: dict[int, int] = {}
        self._replay_mask: torch.Tensor | None = None
        self.layer_mapping: str | None = None
        self.routing_source: str | None = None
        self._calls = collections.Counter()

    def clear_queues(self) -> None:
        for q in self._queues.values():
            q.clear()

    def queue_depth(self, layer_id: int) -> int:
        return len(self._queues[self._check_layer(layer_id, "queue_depth")])

    def calls(self, layer_id: int) -> int:
        """How many times `route` served this layer with replay or record since the
        last `reset_calls()` (to assert that no layer bypassed the replay)."""
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
        tokens) of int16/int32/int64, -1 = empty slot. L is the number of MoE layers
        (`layer_index="moe"`) or of all hidden layers (`"absolute"`); `"auto"` picks by L.
        The tensor is kept as is: each layer replays a `[T, K]` view of it.

        `replay_mask` [T] bool: False rows fall back to native top-k. When None, tokens
        whose slots are empty (-1) in every MoE layer get False; a token that is empty in
        some MoE layers but not in others is an error.
        """
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
        if indices.dtype == torch.uint8:
            raise TypeError(
                "RouterReplay.set_routing: indices are uint8; decode them with "
                "replay_ops.router_replay.files (255 is the empty-slot sentinel there)"
            )
        if indices.dtype not in (torch.int16, torch.int32, torch.int64):
            raise TypeError(
                f"RouterReplay.set_routing: indices must be int16/int32/int64, got {indices.dtype}"
            )
        T, L, K = indices.shape
        if K != self.top_k:
            raise ValueError(
                f"RouterReplay.set_routing: indices have K={K} slots per token but the model "
                f"has top_k={self.top_k} (shape {tuple(indices.shape)})"
            )
        mapping = self.resolve_layer_mapping(L, layer_index, where="set_routing")
        if mapping == "moe":
            cols = {lid: n for n, lid in enumerate(self.moe_layer_ids)}
        else:
            cols = {lid: lid for lid in self.moe_layer_ids}
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
        self._routing = indices
        self._routing_cols = cols
        self._replay_mask = replay_mask
        self.layer_mapping = mapping
        self.routing_source = "set_routing"

    def resolve_layer_mapping(self, L: int, layer_index: str = "auto", *, where: str = "") -> str:
        """"moe" or "absolute" for a routing tensor with L layers; raises if L fits neither."""
        if layer_index not in LAYER_MAPPINGS:
            raise ValueError(
                f"RouterReplay.{where}: unknown layer_index={layer_index!r}; expected one of "
                f"{LAYER_MAPPINGS}"
            )
        n_moe, n_all = self.num_moe_layers, self.num_hidden_layers
        if layer_index == "moe" or (layer_index == "auto" and L == n_moe):
            if L != n_moe:
                raise ValueError(
                    f"RouterReplay.{where}: layer_index='moe' needs L={n_moe} (MoE layers "
                    f"{self.moe_layer_ids}), got L={L}"
                )
            return "moe"
        if layer_index == "absolute" or (layer_index == "auto" and L == n_all):
            if L != n_all:
                raise ValueError(
                    f"RouterReplay.{where}: layer_index='absolute' needs L=num_hidden_layers="
                    f"{n_all}, got L={L}"
                )
            return "absolute"
        raise ValueError(
            f"RouterReplay.{where}: the routing has L={L} layers, but this model has "
            f"{n_moe} MoE layers (ids {self.moe_layer_ids}) and {n_all} hidden layers; "
            f"L must be one of them"
        )

    def _derive_mask(self, indices: torch.Tensor, cols: dict[int, int]) -> torch.Tensor:
        sel = torch.tensor(sorted(set(cols.values())), device=indices.device)
        empty = (indices.index_select(1, sel) < 0).all(dim=2)  # [T, L_moe]
        all_empty = empty.all(dim=1)
        partial = empty.any(dim=1) & ~all_empty
        if bool(partial.any()):
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
        topk_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        score_func: str = "softmax",
        normalize: bool = True,
        scaling_factor: float = 1.0,
        align: int = 1,
        backend: str | None = None,
    ) -> RoutingPlan | None:
        """The routing plan of MoE layer `layer_id` for router `logits` [T, E], or None
        when replay is disabled or no action is set (the layer runs its own path)."""
        if not self.enabled or self._action is None:
            return None
        from .. import gate  # late: replay_ops/__init__ imports this package lazily

        self._check_layer(layer_id, "route")
        if logits.dim() != 2 or logits.shape[1] != self.num_experts:
            raise ValueError(
                f"RouterReplay.route: layer {layer_id}: logits must be [T, E={self.num_experts}], "
                f"got shape {tuple(logits.shape)}"
            )
        T = logits.shape[0]
        opts = dict(score_func=score_func, normalize=normalize, scaling_factor=scaling_factor,
                    align=align, validate=self.config.validate, backend=backend)
        action = self._action
        if action is ReplayAction.RECORD:
            if topk_fn is None:
                raise ValueError(
                    f"RouterReplay.route: layer {layer_id}: RECORD needs topk_fn, the layer's "
                    f"native top-k selection"
                )
            with torch.no_grad():
                idx = topk_fn(logits.detach())
            idx = self._check_native(layer_id, idx, T)
            plan = gate(logits, idx, **opts)
            self._records[layer_id].append(plan.expert_indices.detach())
        elif action is ReplayAction.REPLAY_FORWARD:
            if self._routing is None and self.mode is ReplayMode.R2 and self._has_records():
                self._use_recorded()
            if self._routing is not None and self._routing.device != logits.device:
                self._move_routing(logits.device)  # once per routing, not once per layer
            idx = self.routing_for(layer_id)
            if idx.shape[0] != T:
                raise RouterReplayError(
                    f"RouterReplay.route: layer {layer_id}: the routing to replay has "
                    f"{idx.shape[0]} tokens but the logits have T={T} tokens (source: "
                    f"{self.routing_source}, mapping: {self.layer_mapping}); the batch and its "
                    f"routing do not line up"
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
            plan = gate(logits, idx, replay_mask=mask, **opts)
            if self.config.recompute and torch.is_grad_enabled():
                q = self._queues[layer_id]
                if len(q) >= self.config.max_queue:
                    raise RouterReplayError(
                        f"RouterReplay.route: layer {layer_id}: {len(q)} replayed forwards are "
                        f"waiting for REPLAY_BACKWARD (max_queue={self.config.max_queue}); "
                        f"without activation recompute set recompute=False, or call "
                        f"clear_queues() after each step"
                    )
                q.append(plan.expert_indices.detach())
        elif action is ReplayAction.REPLAY_BACKWARD:
            q = self._queues[layer_id]
            if not q:
                raise RouterReplayError(
                    f"RouterReplay.route: layer {layer_id}: REPLAY_BACKWARD but the layer's "
                    f"queue is empty: the recompute has no matching REPLAY_FORWARD (forwards "
                    f"are queued only when grad is enabled and recompute=True)"
                )
            idx = q.popleft()
            if idx.shape[0] != T:
                raise RouterReplayError(
                    f"RouterReplay.route: layer {layer_id}: REPLAY_BACKWARD pops {idx.shape[0]} "
                    f"tokens but the recomputed logits have T={T} tokens; recompute order "
                    f"differs from the forward order"
                )
            plan = gate(logits, idx.to(logits.device), **opts)
        else:  # pragma: no cover - set_action only accepts ReplayAction
            raise RouterReplayError(f"RouterReplay.route: unknown action {action!r}")
        self._calls[layer_id] += 1
        return plan

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
        several RECORD forwards are concatenated along T in call order."""
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
        return torch.stack(per_layer, dim=1).to(torch.int32)

    def _use_recorded(self) -> None:
        """R2: replay what RECORD stored, if no routing was set explicitly."""
        rec = self.recorded()
        self._routing = rec
        self._routing_cols = {lid: n for n, lid in enumerate(self.moe_layer_ids)}
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
            num_experts=self.num_experts,
            top_k=self.top_k,
            moe_layer_ids=list(self.moe_layer_ids),
            num_hidden_layers=self.num_hidden_layers,
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
        self.set_routing(rf.indices(start, stop), None, layer_index=rf.meta.layer_index)
        self.routing_source = f"file:{os.fspath(path)}"
        self.routing_file = rf
        return rf

    def __repr__(self) -> str:
        return (
            f"RouterReplay(mode={self.mode.value}, action="
            f"{self._action.name if self._action else None}, num_experts={self.num_experts}, "
            f"top_k={self.top_k}, moe_layer_ids={self.moe_layer_ids}, "
            f"num_hidden_layers={self.num_hidden_layers}, layer_mapping={self.layer_mapping})"
        )
