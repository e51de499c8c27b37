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
  `replay_ops.gate` on the live logits at the recorded (or, for RECORD, the router's own
  selected) experts;
* `moe_router_fusion=True`: every call goes through `replay_ops.gate` (Megatron's fused
  path would return the fused top-k *before* consulting replay, silently skipping it);
* otherwise `super().routing()` runs: with replay off the router is Megatron's.

Replay actions are compared by value, so Megatron-Core's `RouterReplayAction` and the
copy that verl's router replay patch installs are both recognised; any other value set
as `router_replay_action` raises `ReplayRoutingError` (never Megatron's own routing in
silence).
The router reads `score_function` and `topk` from its own attributes at every call, as
Megatron's routing does, and the other flags from `config`.

verl's replay mask (`set_target_indices(idx, replay_mask=mask)`, stored as
`target_replay_mask` and pushed on `replay_backward_mask_list` beside the index FIFO):
rows where the mask is False take Megatron's own selection and their recorded values
are not read (a zero placeholder row stays unread); REPLAY_BACKWARD pops both FIFOs
together and raises if their lengths differ.

A router given no target under REPLAY_FORWARD or REPLAY_BACKWARD raises, unless it is an
MTP router (`is_mtp_layer`: passed by megatron-core >= 0.17, set by `replay_spec` on the
routers below an MTP block spec and by `install` on the routers below an MTP module).
verl sets the global action on every router but gives targets only to decoder routers,
and the recording has no MTP columns, so an MTP router without a target takes
Megatron's own selection (through the fused gate), as Megatron does under verl's
patch; an MTP router that is given a target replays it. A decoder router is never
routed with its own top-k in place of a missing target.

Rows that have no usable route (a -1 slot, a repeated expert such as a zero-filled
padding row) follow an explicit padding policy so that every row routes to
exactly K distinct experts with non-zero weights (`routing_map.sum() == T*K` holds by
construction, with no host read): "topk" (Megatron's own selection for those rows,
the default), "spread" (K distinct experts spread evenly over the expert-parallel ranks),
or "error".

The fast path: one `replay_ops.gate_dense` call writes Megatron's `probs [T, E]` and bool
`routing_map [T, E]` directly, with per-row flags (a -1 slot, an id out of range, a
repeated expert, replay mask False), the "spread" padding and the underflow guard (a
routed weight of exactly 0 raised to the dtype's smallest normal value) inside the kernel,
and the dispatch plan of the same routing for the plan dispatcher. The router reads the
flags once when it must (validate=True, or padding="error"), and not at all otherwise.
Rows that take Megatron's own selection (replay mask False, and the "topk" padding) get
it inside the same gate launch, from their logits rows (`megatron_selection`: score
function, pre-softmax, rounding, expert bias, group-limited top-k): the forward is one
launch with or without a replay mask, and no top-k of the replayed rows runs. This
holds where the backend that runs the gate selects inside its kernel (the native CPU and
CUDA kernels, the Triton kernels, the torch backend: `gate_selects_in_kernel`); where it
does not (a backend past its limits: the native CUDA kernels hand a selecting call with K
above MAX_TOPK to another backend), the router computes Megatron's own top-k before the
gate (the rows the mask excludes, and the "topk" padding rows when nothing is read) or
after the flag read on the flagged rows only, rather than move the call. `own_topk`
(Megatron's own top-k, op for op) serves the model's own routing only: RECORD, an MTP
router given no target, `moe_router_fusion=True` without replay, and the masked rows of
padding="spread".
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import warnings
from typing import Optional

import torch

import replay_ops
from replay_ops import scores as scores_table
from replay_ops._deprecated import deprecated_function
from replay_ops._validate import signed_routing
from replay_ops.errors import RoutingError
from replay_ops.options import GateOptions, Selection
from replay_ops.plan import (
    ROW_EMPTY_SLOT,
    ROW_OUT_OF_RANGE,
    ROW_REPEAT,
    DenseRouting,
    RoutingPlan,
    spread_rows,
)

from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

__all__ = [
    "PADDING_POLICIES",
    "ReplayOptions",
    "ReplayRoutingError",
    "ReplayTokenOrderWarning",
    "ReplayTopKRouter",
    "UnsupportedConfigError",
    "check_config",
    "gate_semantics",
    "megatron_selection",
    "replay_action",
    "replay_router",
    "spread_experts",
]

PADDING_POLICIES = ("topk", "spread", "error")
TOKEN_ORDERS = ("warn", "error", "sequence_first")
MASKED_ROWS = ("replay", "padding")
# Set on a target tensor whose rows are known to be in the router's token order
# (set_replay_routing marks the [T, K] views it passes to set_target_indices).
SEQUENCE_FIRST_MARK = "_replay_ops_sequence_first"
# megatron-core >= 0.17 builds routers with `is_mtp_layer=`; 0.16 does not know it.
_BASE_TAKES_MTP = "is_mtp_layer" in inspect.signature(TopKRouter.__init__).parameters
SCORE_FUNCTIONS = scores_table.NAMES  # the score functions replay_ops.gate implements


class UnsupportedConfigError(ValueError):
    """A TransformerConfig combination the replay router does not support (named flag)."""


class ReplayRoutingError(RoutingError, RuntimeError):
    """Replay data that cannot be used as given (missing, mis-shaped, a bad row)."""


class ReplayTokenOrderWarning(UserWarning):
    """Replay rows for an unpacked micro-batch (B > 1) whose token order cannot be checked:
    Megatron's router reads tokens sequence-first ([S, B] flattened)."""


_ORDER_WARNED = False


@dataclasses.dataclass(frozen=True)
class ReplayOptions:
    """Options of the replay router (not TransformerConfig fields).

    padding: what a row without a usable route does (replay_mask False, a -1 slot, a
        repeated expert, e.g. a zero-filled padding row): "topk" = Megatron's own
        selection for that row (expert bias and group limits included); "spread" = K
        distinct experts spread evenly over the EP ranks (deterministic, rotated per
        layer); "error" = raise, naming the layer and the row (one host read per call).
    validate: check that every recorded id is in -1..E-1 and raise otherwise (one host
        read per call of the row flags the gate kernel writes, shared with the padding
        rows that "error" needs; "topk" rows are selected inside the gate kernel and need
        no read). With False, "topk" and "spread" read nothing
        from the device (CUDA-graph safe); an out-of-range id then makes its row a padding
        row. At most one host read per call whatever the options.
    backend: replay_ops backend for the gate (None = automatic).
    plan_dispatch: MoE layers built by `replay_spec` or converted by `install` permute with
        the router's plan (`PlanAlltoAllTokenDispatcher`) wherever that applies (the
        all-to-all dispatcher, dropless; see dispatcher.py); False keeps Megatron's
        dispatcher everywhere.
    token_order: an unpacked micro-batch (B > 1) replays rows whose order cannot be read
        from them: Megatron's router flattens its tokens [S, B] sequence-first (row
        s*B + b), and rows flattened [B, S] batch-first replay other tokens' routes.
        "warn" (default) = a `ReplayTokenOrderWarning` once per process, naming the order;
        "error" = raise `ReplayRoutingError` (strict); "sequence_first" = the caller states
        that its rows are sequence-first (no warning). Rows given by `set_replay_routing`
        (which reorders `batch_first` input itself) are never warned about.
    masked_rows: what the rows that Megatron's `padding_mask` marks (True = padding) do:
        "replay" (default) = replay their recorded route like any other row; "padding" =
        treat them as padding rows, routed by the `padding` policy whatever their recorded
        values (with padding="spread": K distinct experts spread over the EP ranks, instead
        of a client's placeholder route such as SkyRL's 0..K-1 or ms-swift's zeros, which
        all land on the first experts of one rank).
    agreement: under REPLAY_FORWARD and REPLAY_BACKWARD, the gate also writes, in the same
        launch, whether each row's replayed set of experts is the set Megatron's own
        selection picks from the current logits, and the log of the router's probability
        mass on the replayed set (`replay_ops.gate_dense(return_agreement=True)`): the
        router keeps them as `last_agreement` (bool [T]) and `last_set_logprob` (float32
        [T], differentiable), and `agreement_fraction()` gives the fraction of replayed rows
        that agree. Rows that take Megatron's own selection (replay mask False, padding
        rows) agree by construction and are not counted by `agreement_fraction`.
    """

    padding: str = "topk"
    validate: bool = True
    backend: Optional[str] = None
    plan_dispatch: bool = True
    token_order: str = "warn"
    masked_rows: str = "replay"
    agreement: bool = False

    def __post_init__(self):
        if self.padding not in PADDING_POLICIES:
            raise ValueError(f"ReplayOptions: unknown padding={self.padding!r}; expected one of "
                             f"{PADDING_POLICIES}")
        if self.token_order not in TOKEN_ORDERS:
            raise ValueError(f"ReplayOptions: unknown token_order={self.token_order!r}; "
                             f"expected one of {TOKEN_ORDERS}")
        if self.masked_rows not in MASKED_ROWS:
            raise ValueError(f"ReplayOptions: unknown masked_rows={self.masked_rows!r}; "
                             f"expected one of {MASKED_ROWS}")


# ----------------------------------------------------------------------------- config
def gate_semantics(config, score_function: str | None = None, topk: int | None = None, *,
                   expert_bias: torch.Tensor | None = None, **more) -> GateOptions:
    """The `replay_ops.GateOptions` equal to Megatron's routing for `config`: the weights
    (softmax + moe_router_pre_softmax=False -> softmax over the K selected logits,
    normalize=True; pre-softmax -> softmax over all E gathered, normalize=False; sigmoid
    (and sqrtsoftplus) -> divided by the sum when K > 1; times
    moe_router_topk_scaling_factor) and the selection (`megatron_selection`: the rule the
    gate kernel applies to the rows that take Megatron's own choice).

    `score_function` and `topk` default to the config's; a router passes its own
    attributes (`router.score_function`, `router.topk`), which Megatron's routing reads and
    which may be changed after the router is built, and its `expert_bias`. `more`: other
    options (padding, ep_size, return_agreement, ...)."""
    sf = config.moe_router_score_function if score_function is None else score_function
    k = config.moe_router_topk if topk is None else topk
    if sf == "softmax":
        normalize = not bool(config.moe_router_pre_softmax)
    else:
        normalize = k > 1
    scale = config.moe_router_topk_scaling_factor
    return GateOptions(score_func=sf, normalize=normalize,
                       scaling_factor=float(scale) if scale else 1.0,
                       selection=megatron_selection(config, sf, expert_bias), **more)


def megatron_selection(config, score_function: str | None = None,
                       expert_bias: torch.Tensor | None = None) -> Selection:
    """Megatron-Core's own top-k (`topk_routing_with_score_function`) for `config` as a
    `replay_ops.Selection`: softmax selects on the raw logits, or with
    moe_router_pre_softmax on the fp32 softmax rounded to the logits dtype; sigmoid and
    sqrtsoftplus on the fp32 scores rounded to the logits dtype plus `expert_bias`; with
    moe_router_group_topk, group-limited top-k over moe_router_num_groups groups (a group
    scores the sum of its top K // group_topk). The same rule as `ReplayTopKRouter.own_topk`,
    with the tie rule of docs/ops.md (the lower expert id first)."""
    sf = config.moe_router_score_function if score_function is None else score_function
    gtopk = int(config.moe_router_group_topk or 0)
    groups = int(config.moe_router_num_groups or 0) if gtopk else 0
    if sf == "softmax":
        on_logits = not config.moe_router_pre_softmax
        return Selection(source="logits" if on_logits else "scores", round_scores=not on_logits,
                         num_groups=groups, group_topk=gtopk)
    return Selection(source="scores", round_scores=True, expert_bias=expert_bias,
                     num_groups=groups, group_topk=gtopk)


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
    for own in ("sinkhorn", "quantile_balancing"):
        if replay_on and own in _routing_types(config):
            raise UnsupportedConfigError(
                f"{where}: moe_router_load_balancing_type={own!r} cannot be combined with "
                f"moe_enable_routing_replay=True or moe_router_fusion=True: {own} routing "
                f"selects experts by its own algorithm, which the replay router does not "
                f"run, so RECORD would store other experts than the model routes to (use "
                f"'aux_loss', 'seq_aux_loss', 'global_aux_loss' or 'none')")
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


# ----------------------------------------------------------------------------- actions
_ACTIONS = {a.value: a for a in RouterReplayAction}


def replay_action(router_replay, where: str = "ReplayTopKRouter") -> RouterReplayAction | None:
    """The replay action set on `router_replay`, as Megatron-Core's `RouterReplayAction`.

    Actions are compared by value, so the enum of any `RouterReplay` that follows
    Megatron's API is recognised: Megatron-Core's own, and the copy that verl's router
    replay patch installs (`verl.utils.megatron.router_replay_patch.RouterReplayAction`,
    whose members are not Megatron's objects but carry the same names and values). None
    means no action. Anything else raises `ReplayRoutingError`: a router that does not
    recognise an action must never fall back to its own routing in silence."""
    a = getattr(router_replay, "router_replay_action", None) if router_replay is not None else None
    if a is None or isinstance(a, RouterReplayAction):
        return a
    if isinstance(a, enum.Enum):
        known = _ACTIONS.get(a.value)
        if known is not None and known.name == a.name:
            return known
    raise ReplayRoutingError(
        f"{where}: router_replay.router_replay_action={a!r} (type "
        f"{type(a).__module__}.{type(a).__qualname__}) is not a replay action this router "
        f"recognises; expected a RouterReplayAction member with one of the values "
        f"{sorted(_ACTIONS)} (Megatron-Core's enum, or verl's copy of it). Refusing to route "
        f"with its own top-k in its place")


# ----------------------------------------------------------------------------- padding rows
def spread_experts(num_tokens: int, num_experts: int, top_k: int, ep_size: int,
                   offset: int = 0, device=None) -> torch.Tensor:
    """int64 [T, K]: the K distinct experts of every row under padding="spread", the
    formula the gate kernel applies to each padding row by itself (no scan over the rows):
    row t takes the K consecutive values i = offset + t*K + k + W(c) (mod E), rotated per
    cycle c = t*K // E by W(c) = ((c * 2654435769) mod 2^32) * E // 2^32, and value i is
    expert (i mod ep) * (E/ep) + (i div ep). Consecutive values go to consecutive ranks, so
    a row's slots sit on min(K, ep) ranks; a run of padding rows covers every expert once
    per cycle (never piling onto expert 0 or rank 0), and the rotation keeps periodic
    padding rows (one per packed sequence) from repeating the same experts. Computed on
    the device with no host read (replay_ops.reference.spread_expert is the oracle)."""
    E, K = num_experts, top_k
    if ep_size < 1 or E % ep_size:
        raise ValueError(f"spread_experts: ep_size={ep_size} must divide num_experts={E}")
    return spread_rows(num_tokens, E, K, ep_size, offset, device)


# ----------------------------------------------------------------------------- backends
_SELECTS: dict = {}


@torch._dynamo.assume_constant_result
def gate_selects_in_kernel(device_type: str, num_tokens: int, num_experts: int, top_k: int,
                           dtype: torch.dtype, backend: str | None = None) -> bool:
    """True when the backend that runs the plain dense gate for these sizes also selects
    the flagged rows inside its kernel (`OpShape.features` SELECT): the native CPU and CUDA
    kernels, the Triton kernels and the torch backend do, within their limits. Where the
    backend of the plain gate would hand a selecting call to another one, the router keeps
    Megatron's own top-k before the gate instead (two launches, the plain gate's kernels).
    Decided once per device, sizes and dtype (a constant under torch.compile)."""
    key = (device_type, num_tokens, num_experts, top_k, dtype, backend)
    hit = _SELECTS.get(key)
    if hit is None:
        from replay_ops.api import selects_in_kernel

        hit = _SELECTS[key] = selects_in_kernel("gate_dense", device_type, num_tokens,
                                                num_experts, top_k, dtype, backend)
    return hit


# ----------------------------------------------------------------------------- the router
class ReplayTopKRouter(TopKRouter):
    """Megatron's TopKRouter, with replay_ops' fused gate under replay and with
    `moe_router_fusion=True`. See the module docstring. Build it through the MoE spec
    (`replay_spec(spec)` or `MoESubmodules(router=replay_router(...))`) or convert built
    routers with `install(model)`."""

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False,
                 options: ReplayOptions | None = None):
        check_config(config)
        if _BASE_TAKES_MTP:  # megatron-core >= 0.17 tells the router it is an MTP router
            super().__init__(config=config, pg_collection=pg_collection,
                             is_mtp_layer=is_mtp_layer)
        else:
            super().__init__(config=config, pg_collection=pg_collection)
        self.is_mtp_layer = bool(is_mtp_layer)
        self.replay_options = options if options is not None else ReplayOptions()
        self.last_plan: RoutingPlan | None = None
        self._last_routing_map: torch.Tensor | None = None
        # with ReplayOptions(agreement=True), after a replayed call (else None)
        self.last_agreement: torch.Tensor | None = None
        self.last_set_logprob: torch.Tensor | None = None
        self._last_replayed: torch.Tensor | None = None

    # ---------------------------------------------------------------- helpers
    @property
    def ep_size(self) -> int:
        return int(getattr(self.config, "expert_model_parallel_size", 1) or 1)

    def _where(self) -> str:
        return f"ReplayTopKRouter(layer {self.layer_number})"

    def own_topk(self, logits: torch.Tensor) -> torch.Tensor:
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

    native_topk = deprecated_function(own_topk, "ReplayTopKRouter.native_topk",
                                      "ReplayTopKRouter.own_topk")

    def _replay_mask(self, mask, T: int, action, device) -> torch.Tensor | None:
        """verl's per-token replay mask ([T], or any shape with T elements; bool, or integers
        read as `!= 0` as verl does) as bool [T] on `device`: True = replay the recorded row,
        False = Megatron's own selection for that row."""
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor):
            raise ReplayRoutingError(f"{self._where()}: {action.name}: the replay mask is "
                                     f"{type(mask).__name__}, not a tensor")
        if mask.is_floating_point() or mask.is_complex():
            raise ReplayRoutingError(f"{self._where()}: {action.name}: the replay mask must be "
                                     f"bool (or integer 0/1), got {mask.dtype}")
        if mask.numel() != T:
            raise ReplayRoutingError(
                f"{self._where()}: {action.name}: the replay mask has shape "
                f"{tuple(mask.shape)} ({mask.numel()} elements) but this call routes T={T} "
                f"tokens; the mask does not line up with the tokens")
        mask = mask.reshape(T).to(device=device)
        return mask if mask.dtype == torch.bool else mask != 0

    def _check_target(self, target, T: int, K: int, action) -> torch.Tensor:
        """The recorded [T, K] ids as a signed integer tensor; a clear error otherwise."""
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
        return target

    def _gate(self, logits, idx, *, mask=None, fallback=None, padding="empty",
              agreement: bool = False) -> DenseRouting:
        """replay_ops.gate_dense with Megatron's semantics for this router (weights and own
        selection, `gate_semantics`): the dense probs and routing map, the row flags, the
        plan; one launch, no host read."""
        opts = gate_semantics(
            self.config, self.score_function, self.topk, expert_bias=self.expert_bias,
            padding=padding, ep_size=self.ep_size,
            spread_offset=((self.layer_number or 1) - 1) * self.topk, underflow_guard=True,
            return_agreement=agreement)
        return replay_ops.gate_dense(logits, idx, replay_mask=mask, fallback=fallback,
                                     validate=False, backend=self.replay_options.backend,
                                     options=opts)

    def _check_token_order(self, target, seq_length: int, bsz: int, action) -> None:
        """An unpacked micro-batch (B > 1): the rows' order cannot be read from them; warn
        once or raise (token_order), naming Megatron's order."""
        global _ORDER_WARNED
        order = self.replay_options.token_order
        if bsz <= 1 or order == "sequence_first" or getattr(target, SEQUENCE_FIRST_MARK, False):
            return
        msg = (f"{self._where()}: {action.name}: token order: the target indices route an "
               f"unpacked micro-batch of B={bsz} sequences of S={seq_length} tokens. "
               f"Megatron's router reads its tokens sequence-first ([S, B] flattened, row "
               f"s*B + b); rows flattened batch-first ([B, S], row b*S + s) replay other "
               f"tokens' routes with no error. Give sequence-first rows (set_replay_routing("
               f"..., batch_first=True) reorders a [B, S, L, K] tensor), or pack the "
               f"micro-batch (B = 1), and say ReplayOptions(token_order='sequence_first') "
               f"when the rows are sequence-first")
        if order == "error":
            raise ReplayRoutingError(msg)
        if not _ORDER_WARNED:
            _ORDER_WARNED = True
            warnings.warn(msg, ReplayTokenOrderWarning, stacklevel=3)

    def _replay(self, target, logits: torch.Tensor, action, mask=None,
                pad_rows=None) -> DenseRouting:
        """The dense routing of recorded [T, K] ids: rows the replay mask excludes take
        Megatron's own selection (verl's semantics; their recorded values are not read),
        rows without a usable route follow the padding policy, every row K distinct experts.

        One gate launch: Megatron's own selection of the rows that take it (replay mask
        False, and the "topk" padding's flagged rows) is computed inside the gate kernel
        from their logits rows (`megatron_selection`), with no top-k of the other rows and
        no host read. Only padding="spread" with a replay mask computes the own top-k
        first (its masked rows take the own selection, its flagged rows the spread). At
        most one host read, of the row flags the gate wrote, and only with validate or
        padding="error"."""
        T, E = logits.shape
        K = self.topk
        idx = self._check_target(target, T, K, action).to(device=logits.device)
        keep = self._replay_mask(mask, T, action, logits.device)
        opts = self.replay_options
        if pad_rows is not None and opts.masked_rows == "padding":
            # the rows padding_mask marks become padding rows (a -1 slot): the padding policy
            # routes them, their recorded placeholder is not read
            idx = torch.where(pad_rows.to(idx.device)[:, None], idx.new_full((), -1), idx)
        read = opts.validate or opts.padding == "error"
        in_kernel = gate_selects_in_kernel(logits.device.type, T, E, K, logits.dtype,
                                           opts.backend)
        fallback = None
        if opts.padding == "spread":
            padding = "spread"
            if keep is not None:
                with torch.no_grad():
                    fallback = self.own_topk(logits.detach())
        elif in_kernel:  # "topk", and "error" (whose flagged rows raise below; masked rows select)
            padding = "select"
        else:  # a backend without the in-kernel selection: Megatron's own top-k first
            if keep is not None or (opts.padding == "topk" and not read):
                with torch.no_grad():
                    fallback = self.own_topk(logits.detach())
            padding = "fallback" if opts.padding == "topk" and fallback is not None else "empty"
        out = self._gate(logits, idx, mask=keep, fallback=fallback, padding=padding,
                         agreement=opts.agreement)
        if not read:
            return out
        flags = out.row_flags.numpy(force=True)  # the one host read
        bad_bits = ROW_EMPTY_SLOT | ROW_OUT_OF_RANGE | ROW_REPEAT  # a masked row is not bad
        if opts.validate and (flags & ROW_OUT_OF_RANGE).any():
            self._raise_out_of_range(idx if keep is None else
                                     torch.where(keep[:, None], idx, -1), E, action)
        bad = (flags & bad_bits) != 0
        if opts.padding == "error" and bad.any():
            t = int(bad.argmax())
            raise ReplayRoutingError(
                f"{self._where()}: {action.name}: row {t} has no usable route "
                f"{idx[t].tolist()} (a -1 slot or a repeated expert) and padding='error'; "
                f"{int(bad.sum())} of {T} rows are like this")
        if padding == "empty" and opts.padding == "topk" and bad.any():
            # (no in-kernel selection) Megatron's own selection on the flagged rows only,
            # then the gate again
            rows = torch.from_numpy(bad.nonzero()[0]).to(logits.device)
            fixed = idx.to(torch.int64)  # a copy for int16/int32 targets; cloned below else
            fixed = fixed.clone() if fixed is idx else fixed
            with torch.no_grad():
                fixed[rows] = self.own_topk(logits.detach()[rows])
            out = self._gate(logits, fixed, agreement=opts.agreement)
        return out

    def _raise_out_of_range(self, idx: torch.Tensor, num_experts: int, action) -> None:
        from .data import LayoutError, check_expert_range

        try:
            check_expert_range(idx, num_experts,
                               who=f"{self._where()}: {action.name} target indices")
        except LayoutError as e:
            raise ReplayRoutingError(str(e)) from None
        raise AssertionError("an out-of-range id was flagged but not found")  # unreachable

    def _chunk_note(self) -> str:
        """With virtual pipeline stages: which of this pipeline rank's model chunks holds the
        router (for the missing-target errors: a client that sets targets for one chunk
        only leaves the others without)."""
        vpp = getattr(self.config, "virtual_pipeline_model_parallel_size", None)
        if not vpp or self.layer_number is None or self.is_mtp_layer:
            return ""
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        for vp in range(vpp):
            off = get_transformer_layer_offset(self.config, vp_stage=vp)
            if off < self.layer_number <= off + get_num_layers_to_build(self.config, vp_stage=vp):
                return (f" (virtual pipeline chunk {vp} of {vpp} on this pipeline rank: every "
                        f"chunk's routers need their own targets, set for that chunk's layers)")
        return f" (virtual pipeline size {vpp})"

    def _replay_target(self, rr, action):
        """(target indices, verl's replay mask or None) for a replay action, taken from
        Megatron's or verl's RouterReplay with its FIFO discipline; None when this router
        routes with its own selection: an MTP router that was given no target (see the module
        docstring)."""
        masks = getattr(rr, "replay_backward_mask_list", None)  # verl's RouterReplay only
        if action == RouterReplayAction.REPLAY_FORWARD:
            if rr.target_topk_idx is None:
                if self.is_mtp_layer:
                    return None
                raise ReplayRoutingError(
                    f"{self._where()}{self._chunk_note()}: REPLAY_FORWARD but no target "
                    f"indices were set (router_replay.set_target_indices / "
                    f"set_replay_routing); replay would silently run on the router's own routing")
            return rr.target_topk_idx, getattr(rr, "target_replay_mask", None)
        if masks is not None and len(masks) != len(rr.replay_backward_list):
            raise ReplayRoutingError(
                f"{self._where()}: REPLAY_BACKWARD: the backward replay list holds "
                f"{len(rr.replay_backward_list)} entries but the replay-mask list holds "
                f"{len(masks)}; the two FIFOs drifted apart (an entry was taken from one "
                f"without the other), so the recompute cannot tell which mask is its own")
        if not rr.replay_backward_list:
            if self.is_mtp_layer:
                return None
            raise ReplayRoutingError(
                f"{self._where()}{self._chunk_note()}: REPLAY_BACKWARD but the backward "
                f"replay list is empty: the recompute has no matching set_target_indices")
        target = rr.replay_backward_list.pop(0)
        return target, (masks.pop(0) if masks is not None else None)

    def _route(self, logits: torch.Tensor, action, pad_rows=None,
               shape=(0, 1)) -> DenseRouting:
        rr = self.router_replay
        replay = None
        if action == RouterReplayAction.RECORD:
            with torch.no_grad():
                idx = self.own_topk(logits.detach())
            rr.record_indices(idx)  # Megatron's own method (static buffer where it has one)
            return self._gate(logits, idx)
        if action is not None:
            replay = self._replay_target(rr, action)
        if replay is not None:
            self._check_token_order(replay[0], shape[0], shape[1], action)
            return self._replay(replay[0], logits, action, mask=replay[1], pad_rows=pad_rows)
        # moe_router_fusion=True without a replay action, or an MTP router given no target:
        # Megatron's own selection, through the fused gate
        with torch.no_grad():
            idx = self.own_topk(logits.detach())
        return self._gate(logits, idx)

    # ---------------------------------------------------------------- routing
    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """TopKRouter.routing with the probs and routing map from replay_ops.gate when a
        replay action is set or moe_router_fusion=True; everything else as Megatron."""
        action = replay_action(self.router_replay, self._where())
        if action is None and not self.config.moe_router_fusion:
            self.last_plan = None
            self.last_agreement = self.last_set_logprob = self._last_replayed = None
            return super().routing(logits, padding_mask=padding_mask)

        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)

        logits = self.apply_z_loss(logits, padding_mask=padding_mask)

        # Megatron's probs and routing map from the gate kernel itself. A routed weight that
        # underflowed to exactly 0 (fp16, or a far-off logit) would be lost by the flex
        # dispatcher's torch.topk over probs: the kernel raises it to the smallest normal
        # value of the dtype (its gradient passes through, as Megatron's would).
        dense = self._route(logits, action, pad_rows=padding_mask, shape=(seq_length, bsz))
        probs, routing_map, plan = dense.probs, dense.routing_map, dense.plan
        self.last_agreement, self.last_set_logprob = dense.agreement, dense.set_logprob
        self._last_replayed = None if dense.agreement is None else dense.row_flags == 0

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

        # Megatron-Core's own routing passes the flattened [T] mask here, which does not
        # broadcast against the [T, E] map (and masks the wrong entries when T == E): the
        # mask of each token is its row, [T, 1].
        self._apply_expert_bias(
            routing_map, padding_mask=None if padding_mask is None else padding_mask[:, None])

        # The plan dispatcher may use the plan only while it describes this routing map.
        self.last_plan = None if dropped else plan
        self._last_routing_map = None if dropped else routing_map
        return probs, routing_map

    def agreement_fraction(self) -> float | None:
        """The fraction of the rows replayed by the latest call (recorded route used: no
        flag) whose replayed set equals Megatron's own selection from the current logits;
        None without ReplayOptions(agreement=True), or when the latest call replayed no row.
        One host read."""
        if self.last_agreement is None or self._last_replayed is None:
            return None
        n = int(self._last_replayed.sum())
        if n == 0:
            return None
        return int((self.last_agreement & self._last_replayed).sum()) / n

    def plan_for(self, routing_map: torch.Tensor) -> RoutingPlan | None:
        """The RoutingPlan behind `routing_map` if it is this router's latest output and no
        token was dropped after the gate; else None. Its `weights` are None: the probs are
        dense, and the dispatcher's experts apply them."""
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
