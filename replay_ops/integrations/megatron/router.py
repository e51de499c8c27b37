"""`ReplayTopKRouter`: Megatron-Core's `TopKRouter` with the replay gate of replay_ops.

Why a `TopKRouter` subclass overriding `routing()` (and not a router written from
scratch for the `MoESubmodules.router` slot): `TopKRouter.routing()` does more than top-k.
It applies the z-loss, the aux losses (switch, sequence and global, computed from the full
logits), token dropping and capacity, and it counts tokens per expert for the expert-bias
update. A subclass keeps every one of those by calling the same methods in the same order,
keeps `gating()` (the router GEMM, `moe_router_dtype`, input jitter), the parameters and
their names (checkpoints load unchanged), and the `router_replay` object that Megatron
creates with `moe_enable_routing_replay=True`, so code that drives Megatron's
`RouterReplay` API (verl, SkyRL, AReaL: `set_target_indices`, `record_indices`,
`RouterReplay.set_global_router_replay_action`, the REPLAY_BACKWARD FIFO, static record
buffers) works unchanged. Only the step that turns logits into `(probs, routing_map)`
changes, and only when there is something to change:

* a replay action is set (RECORD, REPLAY_FORWARD, REPLAY_BACKWARD): the weights come from
  `replay_ops.gate` on the live logits at the recorded (or, for RECORD, natively
  selected) experts;
* `moe_router_fusion=True`: every call goes through `replay_ops.gate` (Megatron's fused
  path would return the fused top-k *before* consulting replay, silently skipping it);
* otherwise `super().routing()` runs: with replay off the router is Megatron's.

Rows that have no usable route (replay_mask False, a -1 slot, a repeated expert such as a
zero-filled padding row) follow an explicit padding policy so that every row routes to
exactly K distinct experts with non-zero weights (`routing_map.sum() == T*K` holds by
construction, with no host read): "topk" (Megatron's own selection for those rows,
the default), "spread" (K distinct experts spread evenly over the expert-parallel ranks),
or "error".
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

import replay_ops
from replay_ops import scores as scores_table
from replay_ops._validate import signed_routing
from replay_ops.plan import RoutingPlan

from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

__all__ = [
    "PADDING_POLICIES",
    "ReplayOptions",
    "ReplayRoutingError",
    "ReplayTopKRouter",
    "UnsupportedConfigError",
    "check_config",
    "gate_semantics",
    "install",
    "replay_router",
    "replay_spec",
    "spread_experts",
]

PADDING_POLICIES = ("topk", "spread", "error")
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")


class UnsupportedConfigError(ValueError):
    """A TransformerConfig combination the replay router does not support (named flag)."""


class ReplayRoutingError(RuntimeError):
    """Replay data that cannot be used as given (missing, mis-shaped, a bad row)."""


@dataclasses.dataclass(frozen=True)
class ReplayOptions:
    """Options of the replay router (not TransformerConfig fields).

    padding: what a row without a usable route does (replay_mask False, a -1 slot, a
        repeated expert, e.g. a zero-filled padding row): "topk" = Megatron's native
        selection for that row (expert bias and group limits included); "spread" = K
        distinct experts spread evenly over the EP ranks (deterministic, rotated per
        layer); "error" = raise, naming the layer and the row (one host read per call).
    validate: check that every recorded id is in -1..E-1 and raise otherwise (one host
        read per call, shared with the padding rows that "error" and "topk" read). With
        False, "topk" and "spread" read nothing from the device (CUDA-graph safe); an
        out-of-range id then makes its row a padding row. At most one host read per call
        whatever the options.
    backend: replay_ops backend for the gate (None = automatic).
    """

    padding: str = "topk"
    validate: bool = True
    backend: Optional[str] = None

    def __post_init__(self):
        if self.padding not in PADDING_POLICIES:
            raise ValueError(f"ReplayOptions: unknown padding={self.padding!r}; expected one of "
                             f"{PADDING_POLICIES}")


# ----------------------------------------------------------------------------- config
def gate_semantics(config) -> dict:
    """The replay_ops.gate arguments equal to Megatron's routing for `config`:
    softmax + moe_router_pre_softmax=False -> softmax over the K selected logits
    (normalize=True); pre-softmax -> softmax over all E gathered (normalize=False); sigmoid
    (and sqrtsoftplus) -> divided by the sum when K > 1; times
    moe_router_topk_scaling_factor."""
    sf = config.moe_router_score_function
    if sf == "softmax":
        normalize = not bool(config.moe_router_pre_softmax)
    else:
        normalize = config.moe_router_topk > 1
    scale = config.moe_router_topk_scaling_factor
    return dict(score_func=sf, normalize=normalize,
                scaling_factor=float(scale) if scale else 1.0)


def _routing_types(config) -> list:
    t = config.moe_router_load_balancing_type
    return list(t) if isinstance(t, (list, tuple)) else [t]


def check_config(config, *, where: str = "ReplayTopKRouter") -> None:
    """Raise UnsupportedConfigError, naming the flag, for a combination the replay router
    cannot serve. Called when the router is built (and by `install`)."""
    sf = config.moe_router_score_function
    if sf not in SCORE_FUNCTIONS:
        raise UnsupportedConfigError(
            f"{where}: moe_router_score_function={sf!r} is not supported; replay_ops.gate "
            f"implements {SCORE_FUNCTIONS}")
    replay_on = bool(config.moe_enable_routing_replay) or bool(config.moe_router_fusion)
    if replay_on and "sinkhorn" in _routing_types(config):
        raise UnsupportedConfigError(
            f"{where}: moe_router_load_balancing_type='sinkhorn' cannot be combined with "
            f"moe_enable_routing_replay=True or moe_router_fusion=True: sinkhorn routing has "
            f"no top-k to replay (use 'aux_loss', 'seq_aux_loss', 'global_aux_loss' or 'none')")
    scale = config.moe_router_topk_scaling_factor
    if scale is not None and scale != 0 and not scale > 0:
        raise UnsupportedConfigError(
            f"{where}: moe_router_topk_scaling_factor={scale!r} must be positive (routed "
            f"weights must stay non-zero and positive for the flex dispatcher)")
    if config.moe_router_fusion:
        aux = [t for t in _routing_types(config) if t in ("aux_loss", "seq_aux_loss",
                                                           "global_aux_loss")]
        coeff = config.moe_aux_loss_coeff
        has_coeff = any(c > 0 for c in coeff) if isinstance(coeff, (list, tuple)) else coeff > 0
        te_ok = getattr(moe_utils, "HAVE_TE", False) and \
            getattr(moe_utils, "fused_moe_aux_loss", None) is not None and \
            getattr(moe_utils, "fused_compute_score_for_moe_aux_loss", None) is not None
        if aux and has_coeff and not te_ok:
            raise UnsupportedConfigError(
                f"{where}: moe_router_fusion=True with moe_router_load_balancing_type={aux} and "
                f"moe_aux_loss_coeff={coeff} needs TransformerEngine's fused aux-loss kernels "
                f"(TE >= 2.7), which are not installed; the replay gate itself needs no "
                f"TransformerEngine. Set moe_router_fusion=False (the replay router still uses "
                f"the fused replay_ops gate under replay) or install TransformerEngine")
    if config.moe_router_group_topk:
        groups = config.moe_router_num_groups
        if not groups or config.num_moe_experts % groups:
            raise UnsupportedConfigError(
                f"{where}: moe_router_group_topk={config.moe_router_group_topk} needs "
                f"moe_router_num_groups dividing num_moe_experts={config.num_moe_experts}, got "
                f"{groups!r}")


# ----------------------------------------------------------------------------- padding rows
def spread_experts(bad_rows: torch.Tensor, num_experts: int, top_k: int, ep_size: int,
                   offset: int = 0) -> torch.Tensor:
    """int64 [T, K]: for padding rows, K distinct experts spread evenly over the EP ranks.

    The j-th padding row (j counts only rows where `bad_rows` is True) takes the K
    consecutive values i = offset + j*K + k (mod E), and value i maps to expert
    (i mod ep) * (E/ep) + (i div ep): consecutive values go to consecutive ranks, so
    padding rows cycle over every rank and every expert, never piling onto expert 0 or
    rank 0. Computed on the device with no host read (other rows get arbitrary values)."""
    E, K = num_experts, top_k
    if ep_size < 1 or E % ep_size:
        raise ValueError(f"spread_experts: ep_size={ep_size} must divide num_experts={E}")
    local = E // ep_size
    j = torch.cumsum(bad_rows.to(torch.int64), 0) - 1
    i = (offset + j[:, None] * K + torch.arange(K, device=bad_rows.device)) % E
    return (i % ep_size) * local + torch.div(i, ep_size, rounding_mode="floor")


def _bad_rows(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """bool [T]: a -1 (or out-of-range) slot, or a repeated expert in the row."""
    bad = ((idx < 0) | (idx >= num_experts)).any(dim=1)
    if idx.shape[1] > 1:
        s = idx.sort(dim=1).values
        bad = bad | (s[:, 1:] == s[:, :-1]).any(dim=1)
    return bad


# ----------------------------------------------------------------------------- the router
class ReplayTopKRouter(TopKRouter):
    """Megatron's TopKRouter, with replay_ops' fused gate under replay and with
    `moe_router_fusion=True`. See the module docstring. Build it through the MoE spec
    (`replay_spec(spec)` or `MoESubmodules(router=replay_router(...))`) or convert built
    routers with `install(model)`."""

    def __init__(self, config, pg_collection=None, options: ReplayOptions | None = None):
        check_config(config)
        super().__init__(config=config, pg_collection=pg_collection)
        self.replay_options = options if options is not None else ReplayOptions()
        self.last_plan: RoutingPlan | None = None
        self._last_routing_map: torch.Tensor | None = None

    # ---------------------------------------------------------------- helpers
    @property
    def ep_size(self) -> int:
        return int(getattr(self.config, "expert_model_parallel_size", 1) or 1)

    def _where(self) -> str:
        return f"ReplayTopKRouter(layer {self.layer_number})"

    def native_topk(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [T, K]: Megatron's own selection for `logits` [T, E], op for op as
        `topk_routing_with_score_function` does it (pre-softmax, sigmoid plus expert
        bias, group-limited top-k), so RECORD stores what Megatron would store."""
        cfg = self.config
        T, E = logits.shape
        sf = self.score_function
        if sf == "softmax":
            scores = (torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
                      if cfg.moe_router_pre_softmax else logits)
        else:
            if sf == "sigmoid":
                scores = torch.sigmoid(logits.float()).type_as(logits)
            else:
                scores = scores_table.SQRTSOFTPLUS.forward(logits.float()).type_as(logits)
            if self.expert_bias is not None:
                scores = scores + self.expert_bias
        if cfg.moe_router_group_topk:
            _, idx = moe_utils.group_limited_topk(
                scores=scores, topk=self.topk, num_tokens=T, num_experts=E,
                num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk)
        else:
            _, idx = torch.topk(scores, k=self.topk, dim=1)
        return idx

    def _replay_indices(self, target, logits: torch.Tensor, action) -> torch.Tensor:
        """Recorded [T, K] ids -> ids with K distinct valid experts in every row, by the
        padding policy."""
        T, E = logits.shape
        K = self.topk
        if not isinstance(target, torch.Tensor):
            raise ReplayRoutingError(f"{self._where()}: {action.name}: the target indices are "
                                     f"{type(target).__name__}, not a tensor")
        try:  # any integer dtype; unsigned and int8 are widened to a signed copy
            target, _ = signed_routing(target, f"{self._where()}: {action.name}",
                                       "target indices")
        except (TypeError, ValueError) as e:
            raise ReplayRoutingError(str(e)) from None
        if target.dim() != 2 or tuple(target.shape) != (T, K):
            raise ReplayRoutingError(
                f"{self._where()}: {action.name}: the target indices have shape "
                f"{tuple(target.shape)} but this call routes T={T} tokens with top-k K={K}; "
                f"the routing does not line up with the tokens (check the packing, CP and SP "
                f"splits and the micro-batch)")
        idx = target.to(device=logits.device)
        opts = self.replay_options
        bad = _bad_rows(idx, E)
        # At most one host read per call: the range check (validate) and the padding rows
        # the policy needs on the host ('error', or 'topk' with validate) share it.
        out_of_range = ((idx < -1) | (idx >= E)).any().view(1) if opts.validate else None
        host_rows = opts.padding == "error" or (opts.padding == "topk" and opts.validate)
        if host_rows:
            # T row flags, then T+1 copies of the range flag: the rows' count, which
            # nonzero reads anyway, exceeds T exactly when an id is out of range.
            flags = bad if out_of_range is None else torch.cat([bad, out_of_range.expand(T + 1)])
            rows = flags.nonzero().flatten()  # the one host read
            if rows.numel() > T:
                self._raise_out_of_range(idx, E, action)
        elif out_of_range is not None and bool(out_of_range):  # the one host read
            self._raise_out_of_range(idx, E, action)
        if opts.padding == "error":
            if rows.numel():
                t = int(rows[0])
                raise ReplayRoutingError(
                    f"{self._where()}: {action.name}: row {t} has no usable route "
                    f"{idx[t].tolist()} (a -1 slot or a repeated expert) and padding='error'; "
                    f"{rows.numel()} of {T} rows are like this")
            return idx.long()
        if opts.padding == "topk":
            if host_rows:  # run the native top-k on the padding rows only
                out = idx.long()
                if rows.numel():
                    out = out.clone()
                    with torch.no_grad():
                        out[rows] = self.native_topk(logits.detach()[rows])
                return out
            with torch.no_grad():  # no host read: native top-k of every row, kept where bad
                fill = self.native_topk(logits.detach())
        else:
            offset = ((self.layer_number or 1) - 1) * K
            fill = spread_experts(bad, E, K, self.ep_size, offset)
        return torch.where(bad[:, None], fill, idx.long())

    def _raise_out_of_range(self, idx: torch.Tensor, num_experts: int, action) -> None:
        from .data import LayoutError, check_expert_range

        try:
            check_expert_range(idx, num_experts,
                               who=f"{self._where()}: {action.name} target indices")
        except LayoutError as e:
            raise ReplayRoutingError(str(e)) from None
        raise AssertionError("an out-of-range id was flagged but not found")  # unreachable

    def _plan(self, logits: torch.Tensor) -> RoutingPlan:
        rr = self.router_replay
        action = rr.router_replay_action if rr is not None else None
        if action == RouterReplayAction.RECORD:
            with torch.no_grad():
                idx = self.native_topk(logits.detach())
            rr.record_indices(idx)  # Megatron's own method (static buffer where it has one)
        elif action == RouterReplayAction.REPLAY_FORWARD:
            if rr.target_topk_idx is None:
                raise ReplayRoutingError(
                    f"{self._where()}: REPLAY_FORWARD but no target indices were set "
                    f"(router_replay.set_target_indices / set_replay_routing); replay would "
                    f"silently run on native routing")
            idx = self._replay_indices(rr.target_topk_idx, logits, action)
        elif action == RouterReplayAction.REPLAY_BACKWARD:
            if not rr.replay_backward_list:
                raise ReplayRoutingError(
                    f"{self._where()}: REPLAY_BACKWARD but the backward replay list is empty: "
                    f"the recompute has no matching set_target_indices")
            idx = self._replay_indices(rr.replay_backward_list.pop(0), logits, action)
        else:  # moe_router_fusion=True without a replay action: native selection, fused gate
            with torch.no_grad():
                idx = self.native_topk(logits.detach())
        sem = gate_semantics(self.config)
        return replay_ops.gate(logits, idx, validate=False, backend=self.replay_options.backend,
                               **sem)

    # ---------------------------------------------------------------- routing
    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """TopKRouter.routing with the probs and routing map from replay_ops.gate when a
        replay action is set or moe_router_fusion=True; everything else as Megatron."""
        rr = self.router_replay
        action = rr.router_replay_action if rr is not None else None
        if action is None and not self.config.moe_router_fusion:
            self.last_plan = None
            return super().routing(logits, padding_mask=padding_mask)

        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)

        logits = self.apply_z_loss(logits, padding_mask=padding_mask)

        plan = self._plan(logits)
        # A routed weight that underflowed to exactly 0 (fp16, or a far-off logit) would be
        # lost by the flex dispatcher's torch.topk over probs: raise it to the smallest
        # normal value of the dtype. Every slot is a valid expert here (the padding policy
        # filled the rest), so this is done on the [T, K] weights, before the dense layout.
        w = plan.weights
        plan = plan._replace(weights=torch.where(w == 0, torch.finfo(w.dtype).tiny, w))
        probs, routing_map = plan.to_dense()

        dropped = False
        if self.config.moe_expert_capacity_factor is not None:
            probs, routing_map = moe_utils.apply_router_token_dropping(
                probs,
                routing_map,
                router_topk=self.topk,
                capacity_factor=self.config.moe_expert_capacity_factor,
                drop_policy=self.config.moe_token_drop_policy,
                pad_to_capacity=self.config.moe_pad_expert_input_to_capacity,
            )
            dropped = True

        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            routing_map_for_aux_loss, scores_for_aux_loss = (
                moe_utils.compute_routing_scores_for_aux_loss(
                    logits, self.topk, self.score_function,
                    fused=self.config.moe_router_fusion, padding_mask=padding_mask))
            probs = self._apply_aux_loss(probs, scores_for_aux_loss, routing_map_for_aux_loss,
                                         with_padding_mask=padding_mask is not None)
            probs = self._apply_seq_aux_loss(probs, scores_for_aux_loss,
                                             routing_map_for_aux_loss, seq_length, bsz,
                                             with_padding_mask=padding_mask is not None)
            probs = self._apply_global_aux_loss(probs, scores_for_aux_loss,
                                                routing_map_for_aux_loss,
                                                with_padding_mask=padding_mask is not None)

        self._apply_expert_bias(routing_map, padding_mask=padding_mask)

        # The plan dispatcher may use the plan only while it describes this routing map.
        self.last_plan = None if dropped else plan
        self._last_routing_map = None if dropped else routing_map
        return probs, routing_map

    def plan_for(self, routing_map: torch.Tensor) -> RoutingPlan | None:
        """The RoutingPlan behind `routing_map` if it is this router's latest output and no
        token was dropped after the gate; else None."""
        if self.last_plan is not None and routing_map is self._last_routing_map:
            return self.last_plan
        return None


def replay_router(options: ReplayOptions | None = None, **kwargs):
    """A router builder for `MoESubmodules(router=...)` with the given options
    (`replay_router(padding="spread")`)."""
    if options is None:
        options = ReplayOptions(**kwargs)
    elif kwargs:
        options = dataclasses.replace(options, **kwargs)
    if options == ReplayOptions():
        return ReplayTopKRouter
    return functools.partial(ReplayTopKRouter, options=options)


def replay_spec(spec, options: ReplayOptions | None = None, **kwargs):
    """Set the router of every MoE layer in a Megatron spec (a layer spec, a decoder
    block spec, an MTP block spec, or lists of them) to the replay router. The spec is
    changed in place and returned. Raises if the spec has no MoE layer."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    builder = replay_router(options, **kwargs)
    found = []
    seen = set()

    def walk(obj):
        if obj is None or id(obj) in seen or isinstance(obj, (str, int, float, bool, type)):
            return
        seen.add(id(obj))
        if isinstance(obj, MoESubmodules):
            router = obj.router
            if router is not TopKRouter and not _is_replay_builder(router):
                raise UnsupportedConfigError(
                    f"replay_spec: an MoE spec uses router {router!r}; only Megatron's "
                    f"TopKRouter is replaced (a custom router would lose its own routing)")
            obj.router = builder
            found.append(obj)
            return
        if isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o)
            return
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))
            return
        sub = getattr(obj, "submodules", None)
        if sub is not None:
            walk(sub)

    walk(spec)
    if not found:
        raise UnsupportedConfigError("replay_spec: the spec has no MoE layer (no MoESubmodules)")
    return spec


def _is_replay_builder(b) -> bool:
    return b is ReplayTopKRouter or (isinstance(b, functools.partial) and b.func is ReplayTopKRouter)


def install(model, options: ReplayOptions | None = None, **kwargs) -> list:
    """Turn every Megatron `TopKRouter` of an already built model (a module or a list of
    virtual-pipeline chunks) into a `ReplayTopKRouter`, in place: same parameters, buffers
    and `router_replay` object. Returns the routers. Raises on a router subclass that is
    not Megatron's own (its routing would be lost) and on unsupported configs."""
    if options is None:
        options = ReplayOptions(**kwargs)
    elif kwargs:
        options = dataclasses.replace(options, **kwargs)
    chunks = model if isinstance(model, (list, tuple)) else [model]
    routers = []
    for chunk in chunks:
        for name, m in chunk.named_modules():
            if isinstance(m, ReplayTopKRouter):
                m.replay_options = options
                routers.append(m)
            elif type(m) is TopKRouter:
                check_config(m.config, where=f"install({name})")
                m.__class__ = ReplayTopKRouter
                m.replay_options = options
                m.last_plan = None
                m._last_routing_map = None
                routers.append(m)
            elif isinstance(m, TopKRouter):
                raise UnsupportedConfigError(
                    f"install: {name} is a {type(m).__name__}, a TopKRouter subclass that is not "
                    f"Megatron's own; replacing it would drop its routing")
    if not routers:
        raise UnsupportedConfigError("install: the model has no TopKRouter (no MoE layer)")
    return routers
