"""The gate ops' options as one frozen value, from the API through the ops to the backends.

`GateOptions` carries what decides a gate's arithmetic and its plan: the score function and
its normalisation and scale, the plan's row alignment, how a padding row is routed, the
model's own selection rule (`Selection`), whether the agreement outputs are written, and the
dense gate's padding policy. The registered ops (`torch.ops.replay.gate`, `.gate_dense` and
their backward ops) take flat arguments, since a custom op's schema cannot hold a Python
object; the lists below are the one place that says which options each op takes
(`GATE_OPTIONS`, `DENSE_OPTIONS`) and which flat schema arguments they become, in the
schema's order (`GATE_FIELDS`, `DENSE_FIELDS`, `BACKWARD_FIELDS`: a `Selection` becomes the
six `SELECTION_FIELDS`, its bias an optional Tensor argument), and `flat`/`from_flat` are
the one place that converts. The backends receive the value.

Per-call switches that are not options of the arithmetic (`replay_mask`, `fallback`,
`validate`, `backend`) stay arguments of their own.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

SELECTION_SOURCES = ("scores", "logits")


@dataclass(frozen=True, eq=False)
class Selection:
    """The model's own top-k rule, as a value: which K experts the model's router picks from
    a row of logits. The gates use it for the rows without a usable route (computed inside
    the kernel from the logits row, see docs/ops.md "The model's own selection") and for
    `return_agreement`. It never changes a weight: bias and groups act on selection only.

    For row t, with x its logits and the call's `score_func`:

    * `source="scores"` (default): u_j = the score of expert j, in fp32 (fp64 for fp64
      logits): softmax over all E, sigmoid(x_j) or sqrt(softplus(x_j)).
      `source="logits"`: u_j = x_j (Megatron-Core's softmax router without pre-softmax;
      plain top-k picks the same set, group-limited top-k does not). Softmax only.
    * `round_scores`: u_j is rounded to the logits dtype first (Megatron-Core's
      `.type_as(logits)` of the sigmoid scores and of the pre-softmax probabilities).
    * `expert_bias` (float [E], on the logits' device): v_j = u_j + expert_bias[j], in the
      compute dtype (DeepSeek-V3's `e_score_correction_bias`, Megatron's `expert_bias`).
      Otherwise v_j = u_j.
    * `num_groups` > 0 and `group_topk` > 0: group-limited top-k. The E experts form
      `num_groups` equal slices; a group's score is the sum of its `n` largest v (summed
      largest first), with n = `group_score_topn`, or K // group_topk when it is 0
      (Megatron-Core; transformers' DeepSeek-V3 takes n = 2); the `group_topk` best groups
      are kept, and the K experts are taken from the kept groups only.
    * The K experts are the K largest v (of the kept groups), in descending order of v.
      **Tie rule**: among equal values the lower expert id (group id) comes first; NaN
      counts as larger than every number (as in torch.topk and torch.sort).
    * Without bias, rounding or groups, v is an increasing function of the logit (softmax,
      sigmoid and sqrt-softplus all increase), so v = x is ranked (`ranks_logits`): no score
      is computed, and two different logits whose scores round to the same float keep the
      logits' order (where `torch.topk` of the rounded scores has a tie).

    `torch.topk` documents no order among equal values, so the routers of Megatron-Core and
    transformers agree with this rule wherever the scores have no ties (the tests compare
    them on tie-free inputs).

    The value is frozen. Two selections are equal when their fields are equal and they hold
    the same bias tensor object (a bias is a buffer the trainer updates in place: its identity
    is what the value names)."""

    source: str = "scores"
    expert_bias: torch.Tensor | None = None
    round_scores: bool = False
    num_groups: int = 0
    group_topk: int = 0
    group_score_topn: int = 0

    def __post_init__(self):
        if self.source not in SELECTION_SOURCES:
            raise ValueError(f"replay_ops.Selection: source must be one of {SELECTION_SOURCES}, "
                             f"got source={self.source!r}")
        for name in ("num_groups", "group_topk", "group_score_topn"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"replay_ops.Selection: {name} must be an integer >= 0, got "
                                 f"{name}={v!r}")
        if (self.num_groups > 0) != (self.group_topk > 0):
            raise ValueError(f"replay_ops.Selection: group-limited selection needs both "
                             f"num_groups and group_topk (> 0), got num_groups="
                             f"{self.num_groups}, group_topk={self.group_topk}")
        if self.group_score_topn and not self.grouped:
            raise ValueError(f"replay_ops.Selection: group_score_topn={self.group_score_topn} "
                             f"needs num_groups and group_topk")
        if self.group_topk > self.num_groups:
            raise ValueError(f"replay_ops.Selection: group_topk={self.group_topk} is larger "
                             f"than num_groups={self.num_groups}")
        if not isinstance(self.round_scores, bool):
            raise TypeError(f"replay_ops.Selection: round_scores must be a bool, got "
                            f"{self.round_scores!r}")
        b = self.expert_bias
        if b is not None and not isinstance(b, torch.Tensor):
            raise TypeError(f"replay_ops.Selection: expert_bias must be a float tensor [E] or "
                            f"None, got {type(b).__name__}")

    @property
    def grouped(self) -> bool:
        return self.num_groups > 0 and self.group_topk > 0

    @property
    def ranks_logits(self) -> bool:
        """True when the values ranked are the logits themselves: no bias, and the logits
        source, or the scores without rounding or groups (every score function increases
        with the logit, so the scores rank as the logits do)."""
        return self.expert_bias is None and (
            self.source == "logits" or (not self.round_scores and not self.grouped))

    def group_topn(self, top_k: int) -> int:
        """n of the group score: group_score_topn, or K // group_topk (Megatron-Core)."""
        return self.group_score_topn or top_k // max(self.group_topk, 1)

    def __eq__(self, other):
        if not isinstance(other, Selection):
            return NotImplemented
        return (self._scalars() == other._scalars()
                and self.expert_bias is other.expert_bias)

    def __hash__(self):
        return hash((self._scalars(), id(self.expert_bias)))

    def _scalars(self):
        return (self.source, self.round_scores, self.num_groups, self.group_topk,
                self.group_score_topn)

    # ------------------------------------------------------------------ named rules
    @classmethod
    def megatron(cls, *, score_function: str = "softmax", pre_softmax: bool = False,
                 num_groups: int | None = None, group_topk: int | None = None,
                 expert_bias: torch.Tensor | None = None) -> "Selection":
        """Megatron-Core's `topk_routing_with_score_function` (0.16): `moe_router_score_function`,
        `moe_router_pre_softmax`, `moe_router_num_groups`, `moe_router_group_topk` and the
        router's `expert_bias` (sigmoid only, as Megatron's config requires). Softmax without
        pre-softmax selects on the raw logits; with it, and for sigmoid, on the scores rounded
        to the logits dtype; groups apply when group_topk is set; the group score is the sum
        of the top K // group_topk scores."""
        if score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"replay_ops.Selection.megatron: score_function must be 'softmax' "
                             f"or 'sigmoid' (Megatron-Core 0.16), got {score_function!r}")
        if expert_bias is not None and score_function != "sigmoid":
            raise ValueError("replay_ops.Selection.megatron: Megatron-Core applies expert_bias "
                             "with the sigmoid score function only "
                             f"(moe_router_enable_expert_bias), got score_function="
                             f"{score_function!r}")
        grouped = bool(group_topk)
        if grouped and not num_groups:
            raise ValueError(f"replay_ops.Selection.megatron: group_topk={group_topk} needs "
                             f"num_groups, got num_groups={num_groups!r}")
        on_logits = score_function == "softmax" and not pre_softmax
        return cls(source="logits" if on_logits else "scores", expert_bias=expert_bias,
                   round_scores=not on_logits,
                   num_groups=int(num_groups) if grouped else 0,
                   group_topk=int(group_topk) if grouped else 0)

    @classmethod
    def deepseek_v3(cls, *, expert_bias: torch.Tensor | None, n_group: int,
                    topk_group: int) -> "Selection":
        """transformers' `DeepseekV3TopkRouter` (also GLM-4-MoE's router): sigmoid scores of
        fp32 logits, plus `e_score_correction_bias`; a group's score is the sum of its top 2;
        `topk_group` of `n_group` groups kept. (Mixtral, Qwen2/3-MoE and OLMoE take the top-k
        of the fp32 softmax: `Selection()`.)"""
        if n_group <= 1:
            return cls(expert_bias=expert_bias)
        return cls(expert_bias=expert_bias, num_groups=int(n_group), group_topk=int(topk_group),
                   group_score_topn=2)


DEFAULT_SELECTION = Selection()

# The flat schema arguments of a Selection, in order: (schema name, Selection attribute).
_SELECTION_FLAT = (("selection_source", "source"), ("expert_bias", "expert_bias"),
                   ("round_scores", "round_scores"), ("num_groups", "num_groups"),
                   ("group_topk", "group_topk"), ("group_score_topn", "group_score_topn"))
SELECTION_FIELDS = tuple(name for name, _ in _SELECTION_FLAT)

# The options each op takes (GateOptions fields), in the schema's order.
GATE_OPTIONS = ("score_func", "normalize", "scaling_factor", "align", "padding", "selection",
                "return_agreement", "weights_dtype")
DENSE_OPTIONS = ("score_func", "normalize", "scaling_factor", "padding", "ep_size",
                 "spread_offset", "underflow_guard", "align", "with_plan", "selection",
                 "return_agreement")
BACKWARD_OPTIONS = ("score_func", "normalize", "scaling_factor")


def flat_fields(options: tuple[str, ...]) -> tuple[str, ...]:
    """The schema arguments of a list of options ("selection" becomes SELECTION_FIELDS)."""
    out: list[str] = []
    for o in options:
        out += SELECTION_FIELDS if o == "selection" else (o,)
    return tuple(out)


# The flat arguments of each schema, in the schema's order (tests/test_options.py holds the
# registered schemas to these lists).
GATE_FIELDS = flat_fields(GATE_OPTIONS)
DENSE_FIELDS = flat_fields(DENSE_OPTIONS)
BACKWARD_FIELDS = flat_fields(BACKWARD_OPTIONS)

# The conversions the API always made (align, score_func and padding pass unchanged, so that
# the ops' checks refuse a wrong type or value by name instead of it being rounded).
_COERCE = {"normalize": bool, "scaling_factor": float, "ep_size": int, "spread_offset": int,
           "underflow_guard": bool, "with_plan": bool, "return_agreement": bool,
           "round_scores": bool}


def _same(x):
    return x


@dataclass(frozen=True)
class GateOptions:
    """The options of `replay_ops.gate` (GATE_OPTIONS) and `replay_ops.gate_dense` (all);
    see docs/ops.md. Their values are checked by the ops, once, with the argument named."""
    score_func: str = "softmax"
    normalize: bool = True
    scaling_factor: float = 1.0
    align: int = 1
    # how a padding row is routed: "empty" (either gate), "select" (either gate: the model's
    # own selection), "spread" and "fallback" (the dense gate only)
    padding: str = "empty"
    # the model's own top-k rule (rows without a usable route, and the agreement outputs);
    # None gives DEFAULT_SELECTION (a default argument holding an object is one that
    # torch.compile cannot trace on every torch this package supports)
    selection: Selection | None = None
    # write plan.agreement and plan.set_logprob
    return_agreement: bool = False
    # the gate's weights dtype (the sparse gate only): None, the logits' dtype; or their
    # compute dtype (torch.float32 for half and bfloat16 logits), the weights unrounded
    weights_dtype: torch.dtype | None = None
    # the dense gate only
    ep_size: int = 1
    spread_offset: int = 0
    underflow_guard: bool = False
    with_plan: bool = True

    def __post_init__(self):
        if self.selection is None:
            object.__setattr__(self, "selection", DEFAULT_SELECTION)

    def flat(self, fields: tuple[str, ...]) -> tuple:
        """The values of the flat schema arguments `fields`, in their order, as the op schema
        types them."""
        sel = dict(_SELECTION_FLAT)
        out = []
        for f in fields:
            v = getattr(self.selection, sel[f]) if f in sel else getattr(self, f)
            out.append(_COERCE.get(f, _same)(v))
        return tuple(out)

    @classmethod
    def from_flat(cls, fields: tuple[str, ...], values) -> "GateOptions":
        """The value an op receives as flat arguments (the fields it lacks at defaults)."""
        given = dict(zip(fields, values, strict=True))
        sel = {attr: given.pop(name) for name, attr in _SELECTION_FLAT if name in given}
        if sel:
            given["selection"] = Selection(**sel)
        return cls(**given)

    @classmethod
    def megatron(cls, *, score_function: str = "softmax", pre_softmax: bool = False,
                 num_groups: int | None = None, group_topk: int | None = None,
                 scaling_factor: float | None = None, expert_bias: torch.Tensor | None = None,
                 **more) -> "GateOptions":
        """The options of Megatron-Core's router (TransformerConfig's
        `moe_router_score_function`, `moe_router_pre_softmax`, `moe_router_num_groups`,
        `moe_router_group_topk`, `moe_router_topk_scaling_factor`, and the router's
        `expert_bias`): its weights (softmax over the selection, or over all E with
        pre-softmax; sigmoid divided by the sum) and its selection (`Selection.megatron`).
        `more`: other options (align, padding, return_agreement, ...)."""
        sel = Selection.megatron(score_function=score_function, pre_softmax=pre_softmax,
                                 num_groups=num_groups, group_topk=group_topk,
                                 expert_bias=expert_bias)
        normalize = not pre_softmax if score_function == "softmax" else True
        return cls(score_func=score_function, normalize=normalize,
                   scaling_factor=float(scaling_factor) if scaling_factor else 1.0,
                   selection=sel, **more)


DEFAULTS = GateOptions()
_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(GateOptions))


def resolve(options: GateOptions | None, who: str, fields: tuple[str, ...],
            **keywords) -> GateOptions:
    """The options of a call that takes them as keywords or as `options=`: the keywords
    alone, or `options` alone. `replay_ops.gate` and `gate_dense` refuse `options=` with any
    option keyword given explicitly (even at its default value) before they get here; this
    refuses a keyword that differs from its default beside `options` (for callers that
    cannot tell an explicit keyword). `fields`: the options the op takes (GATE_OPTIONS or
    DENSE_OPTIONS)."""
    if options is None:
        return GateOptions(**keywords)
    if not isinstance(options, GateOptions):
        raise TypeError(f"{who}: options must be a replay_ops.GateOptions, got "
                        f"{type(options).__name__}")
    given = [k for k, v in keywords.items()
             if v != getattr(DEFAULTS, k) and not (k == "selection" and v is None)]
    if given:
        raise ValueError(f"{who}: pass the options either as keywords or as options=, not both "
                         f"(got options= and {', '.join(f'{k}={keywords[k]!r}' for k in given)})")
    unused = [f for f in _OPTION_NAMES
              if f not in fields and getattr(options, f) != getattr(DEFAULTS, f)]
    if unused:
        owner = "gate" if set(unused) <= set(GATE_OPTIONS) else "gate_dense"
        raise ValueError(f"{who}: options set {', '.join(unused)}, which {who} does not take "
                         f"(they belong to replay_ops.{owner})")
    return options


def options_one_way(who: str, fields: tuple[str, ...]):
    """A decorator: the call refuses `options=` together with any option keyword of
    `fields`, whatever the keyword's value. An explicit `normalize=True` beside
    `options=GateOptions(normalize=False)` must not be dropped because it equals the
    default (nor the value's field because a keyword was given): the ValueError names the
    keywords. (A wrapper, since inside the function a keyword at its default cannot be told
    from an absent one; `inspect.signature` shows the wrapped function's.)"""
    def deco(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if kwargs.get("options") is not None:
                both = [k for k in fields if k in kwargs]
                if both:
                    raise ValueError(
                        f"{who}: pass the options either as keywords or as options=, not both "
                        f"(got options= and {', '.join(f'{k}={kwargs[k]!r}' for k in both)}); "
                        f"to change one option of a GateOptions value, pass "
                        f"options=dataclasses.replace(options, {both[0]}=...)")
            return fn(*args, **kwargs)
        return call
    return deco
