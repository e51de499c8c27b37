"""The MoE families the Hugging Face integration knows, and `register_family` to add one.

A family is one `transformers` architecture (a `config.model_type`): the class name of its
MoE block, how its router computes its logits (`logits`) and selects (`selection`, a
`replay_ops.Selection`), how it scores, and the shared experts it adds. `SUPPORTED`
maps each model type to its `ArchSpec`; `register_family` adds to it (or replaces an
entry with `replace=True`), the way transformers' `ExpertsInterface.register` adds an
experts function, so a model type this package does not ship is patched without editing
it:

    from replay_ops.integrations import hf

    hf.register_family("flex_olmo", block_class="FlexOlmoSparseMoeBlock",
                       score_func="softmax", normalize=lambda gate: gate.norm_topk_prob,
                       logits=hf.linear_logits, selection=hf.top_k_of_scores)
    patch = hf.patch_model(flex_olmo_model, "R3")

Under replay (REPLAY_FORWARD, R3 and R2) a patched block computes the router's logits only
(`logits(gate, x)`: the router's linear, and its bias where it has one, as the router module
computes them) and hands the family's selection rule (`selection(gate)`) to
`replay_ops.gate`: the rows without a route get the model's own choice inside the gate
kernel, so no top-k, sort or softmax of every row runs. The router module's whole forward
(its own top-k) runs in RECORD, with replay disabled, and when the caller asks for the
own-routing comparison (`ReplayPatch.own_routing`).

The block must look like the shipped ones: `block.gate(x)` returns `(logits, weights,
indices)` and `block.experts` holds fused `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`
weights (`patch.find_moe_blocks` checks this when the model is patched).

Per architecture (transformers 5.x module code):

| model_type  | block                  | scores  | normalize     | scaling               | shared  |
|-------------|------------------------|---------|---------------|-----------------------|---------|
| mixtral     | MixtralSparseMoeBlock  | softmax | always        | 1                     | none    |
| qwen2_moe   | Qwen2MoeSparseMoeBlock | softmax | norm_topk_prob| 1                     | gated   |
| qwen3_moe   | Qwen3MoeSparseMoeBlock | softmax | norm_topk_prob| 1                     | none    |
| olmoe       | OlmoeSparseMoeBlock    | softmax | norm_topk_prob| 1                     | none    |
| deepseek_v3 | DeepseekV3MoE          | sigmoid | norm_topk_prob| routed_scaling_factor | MLP     |

("gated": Qwen2-MoE's shared expert is scaled by sigmoid(shared_expert_gate(x)).)

DeepSeek-V3 selects with `sigmoid(logits) + e_score_correction_bias` restricted to the
`topk_group` best of `n_group` groups; the gate weights are the *unbiased* sigmoid scores.
Under replay the recorded indices are used as they are, so the bias and the groups affect
nothing; they only matter for RECORD and for rows with no route, which the gate selects
with the family's `selection` (`replay_ops.Selection.deepseek_v3`: the bias, the groups,
the sum of a group's top 2), as the router does.

Mixtral and DeepSeek-V3 keep their gate weights in fp32 (the unpatched models do the
same), the others cast them to the model dtype, as the unpatched models do.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F

from replay_ops import scores
from replay_ops._deprecated import deprecated_function, warn
from replay_ops.options import Selection
from replay_ops.router_replay.config import FALLBACKS

__all__ = [
    "SUPPORTED",
    "ArchSpec",
    "SelectionTopK",
    "UnsupportedModelError",
    "native_topk",
    "own_topk",
    "linear_logits",
    "register_family",
    "softmax_topk",
    "supported_architectures",
    "top_k_of_scores",
    "unregister_family",
]


class UnsupportedModelError(ValueError):
    """The model is not one of the architectures this integration supports."""


# ----------------------------------------------------------------------------- own top-k
# Each function reproduces the unpatched router's selection op by op (so RECORD stores what
# the unpatched model would pick); tests compare it with the router module's own output.


def softmax_topk(gate: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """`topk(softmax(logits in fp32), gate.top_k)` indices: the selection of Mixtral,
    Qwen2/3-MoE, OLMoE (and the default of `register_family` for softmax families)."""
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    return torch.topk(probs, gate.top_k, dim=-1)[1]


_softmax_topk = softmax_topk  # the name it had


def _deepseek_v3_topk(gate: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    E, G = gate.num_experts, gate.num_group
    scores_ = logits.sigmoid()
    scores_for_choice = scores_ + gate.e_score_correction_bias
    group_scores = scores_for_choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(scores_for_choice, k=gate.top_k, dim=-1, sorted=False)[1]


# ----------------------------------------------------------------------------- logits only
# What a patched block computes of the router under replay: the logits exactly as the router
# module computes them (the same call on the same tensors, so bitwise the same), and the
# router's selection rule as a value for the gate.


def linear_logits(gate: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, gate.weight, gate.bias)` (no bias where the router has none): the router
    logits of Mixtral, Qwen2/3-MoE, OLMoE (and the default of `register_family`)."""
    return F.linear(x, gate.weight, getattr(gate, "bias", None))


def _deepseek_v3_logits(gate: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # DeepseekV3TopkRouter.forward: the linear in fp32, whatever the model dtype
    return F.linear(x.type(torch.float32), gate.weight.type(torch.float32))


def top_k_of_scores(gate: torch.nn.Module) -> Selection:
    """`replay_ops.Selection()`: the top-k of the scores (the selection of Mixtral, Qwen2/3-MoE,
    OLMoE; the default of `register_family` for softmax families)."""
    return _TOP_K


_TOP_K = Selection()


def _deepseek_v3_selection(gate: torch.nn.Module) -> Selection:
    return Selection.deepseek_v3(expert_bias=gate.e_score_correction_bias,
                                 n_group=int(gate.num_group), topk_group=int(gate.topk_group))


# ----------------------------------------------------------------------------- shared experts


def _qwen2_moe_shared(block, x_flat, hidden_states, routed):
    shared = block.shared_expert(x_flat)
    shared = F.sigmoid(block.shared_expert_gate(x_flat)) * shared
    return routed + shared


def _deepseek_v3_shared(block, x_flat, hidden_states, routed):
    return routed.view(*hidden_states.shape) + block.shared_experts(hidden_states)


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """How one architecture's MoE block routes (see the module docstring's table)."""

    model_type: str
    block_class: str
    score_func: str
    normalize: Callable[[torch.nn.Module], bool]  # of the router module
    scaling_factor: Callable[[torch.nn.Module], float]
    weights_fp32: bool  # gate weights stay fp32 in the unpatched model
    topk: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    # add_shared(block, x [T, H], hidden_states (the block's input), routed [T, H]) -> out
    add_shared: Callable | None = None
    jitter: bool = False  # Mixtral's router_jitter_noise in training mode
    fallback: str = "gate"  # RouterReplayConfig.fallback that matches the model's own selection
    # logits(gate, x [T, H]) -> [T, E]: the router's logits alone, as its module computes them
    logits: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None
    # selection(gate) -> replay_ops.Selection: the router's own top-k rule, for the gate.
    # None (a family registered without it): replay runs the router module whole, as before
    selection: Callable[[torch.nn.Module], Selection] | None = None

    @property
    def logits_only(self) -> bool:
        """Whether replay computes the router's logits only (the family declares both its
        logits function and its selection rule)."""
        return self.logits is not None and self.selection is not None


# The per-gate values are module-level functions or `_Constant`s, never lambdas, so that a
# family (and a patched model holding one) pickles.


def _norm_attr(gate) -> bool:
    return bool(gate.norm_topk_prob)


def _routed_scaling(gate) -> float:
    return float(gate.routed_scaling_factor)


@dataclasses.dataclass(frozen=True)
class _Constant:
    """A per-gate value that does not depend on the gate (`register_family`'s constants)."""

    value: object

    def __call__(self, gate: torch.nn.Module):
        return self.value


_ALWAYS = _Constant(True)
_ONE = _Constant(1.0)


@dataclasses.dataclass(frozen=True)
class SelectionTopK:
    """`topk(gate, logits) -> [T, K]` of a family registered with a selection rule and no
    top-k function: the gate's own selection of every row (`padding="select"` on empty
    slots), which equals the router's on tie-free inputs."""

    selection: Callable[[torch.nn.Module], Selection]
    score_func: str

    def __call__(self, gate: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
        import replay_ops

        empty = torch.full((logits.shape[0], int(gate.top_k)), -1, dtype=torch.int32,
                           device=logits.device)
        plan = replay_ops.gate(logits.detach(), empty, score_func=self.score_func,
                               padding="select", selection=self.selection(gate),
                               validate=False)
        return plan.expert_indices.long()


SUPPORTED: dict[str, ArchSpec] = {
    "mixtral": ArchSpec(
        "mixtral", "MixtralSparseMoeBlock", "softmax", _ALWAYS, _ONE,
        weights_fp32=True, topk=softmax_topk, jitter=True,
        logits=linear_logits, selection=top_k_of_scores,
    ),
    "qwen2_moe": ArchSpec(
        "qwen2_moe", "Qwen2MoeSparseMoeBlock", "softmax", _norm_attr, _ONE,
        weights_fp32=False, topk=softmax_topk, add_shared=_qwen2_moe_shared,
        logits=linear_logits, selection=top_k_of_scores,
    ),
    "qwen3_moe": ArchSpec(
        "qwen3_moe", "Qwen3MoeSparseMoeBlock", "softmax", _norm_attr, _ONE,
        weights_fp32=False, topk=softmax_topk,
        logits=linear_logits, selection=top_k_of_scores,
    ),
    "olmoe": ArchSpec(
        "olmoe", "OlmoeSparseMoeBlock", "softmax", _norm_attr, _ONE,
        weights_fp32=False, topk=softmax_topk,
        logits=linear_logits, selection=top_k_of_scores,
    ),
    "deepseek_v3": ArchSpec(
        "deepseek_v3", "DeepseekV3MoE", "sigmoid", _norm_attr, _routed_scaling,
        weights_fp32=True, topk=_deepseek_v3_topk, add_shared=_deepseek_v3_shared,
        logits=_deepseek_v3_logits, selection=_deepseek_v3_selection,
    ),
}
_SHIPPED = frozenset(SUPPORTED)


def supported_architectures() -> list[str]:
    return sorted(SUPPORTED)


def spec_for(model_type: str) -> ArchSpec:
    """The registered family of `model_type`; UnsupportedModelError naming the known ones."""
    spec = SUPPORTED.get(model_type)
    if spec is None:
        raise UnsupportedModelError(
            f"replay_ops.integrations.hf: model_type={model_type!r} is not supported; "
            f"supported architectures: {', '.join(supported_architectures())} (add one with "
            f"replay_ops.integrations.hf.register_family)"
        )
    return spec


def own_topk(model_type: str, gate: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The model's own routing: the unpatched router's top-k indices [T, K] for router
    logits [T, E]."""
    return spec_for(model_type).topk(gate, logits)


# "native" names the C++/CUDA backend
native_topk = deprecated_function(own_topk, "replay_ops.integrations.hf.native_topk",
                                  "replay_ops.integrations.hf.own_topk",
                                  " (the model's own routing)")


# ----------------------------------------------------------------------------- registration


def _bad(arg: str, value, want: str) -> ValueError:
    return ValueError(f"replay_ops.integrations.hf.register_family: {arg}={value!r}; {want}")


def _of_gate(arg: str, value, kind: type, check) -> Callable[[torch.nn.Module], object]:
    """A constant (checked now) or a callable of the router module (checked at patch time
    by the forward's own use)."""
    if callable(value) and not isinstance(value, (bool, int, float)):
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise _bad(arg, value, "expected a bool or a callable of the router module")
        return _Constant(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not check(value):
        raise _bad(arg, value, "expected a finite number > 0 or a callable of the router "
                               "module")
    return _Constant(float(value))


def register_family(
    model_type: str,
    *,
    block_class: str | type,
    score_func: str = "softmax",
    topk: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
    normalize: bool | Callable[[torch.nn.Module], bool] = False,
    scaling_factor: float | Callable[[torch.nn.Module], float] = 1.0,
    weights_fp32: bool = False,
    add_shared: Callable | None = None,
    jitter: bool = False,
    fallback: str = "gate",
    replace: bool = False,
    logits: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
    selection: Selection | Callable[[torch.nn.Module], Selection] | None = None,
) -> ArchSpec:
    """Teach the integration a `transformers` MoE architecture (`config.model_type`).

    `block_class`: the MoE block's class (or its name), found in the model by class name.
    `score_func`: one of `replay_ops.scores.NAMES` ("softmax", "sigmoid", ...), what the
    router's gate weights are computed from. `topk(gate, logits) -> [T, K]` reproduces the
    router's own selection (default for "softmax": `softmax_topk`; required otherwise).
    `normalize` / `scaling_factor`: a constant or a function of the router module
    (`block.gate`), as the router's code has them. `weights_fp32`: the router keeps its gate
    weights in fp32 (else they are cast to the logits' dtype). `add_shared(block, x,
    hidden_states, routed) -> out`: shared experts added to the routed output. `jitter`:
    Mixtral-style `block.jitter_noise` in training mode. `fallback`: the
    `RouterReplayConfig.fallback` that reproduces the model's own selection on rows with no
    route ("topk_fn" where it is not a plain top-k of the scores; with `selection` the gate
    selects those rows itself, so "gate" is right). `replace=True` replaces a registered
    family (a shipped one included). Returns the `ArchSpec` registered.

    What replay computes of the router: `logits(gate, x) -> [T, E]`, the router's logits
    exactly as its module computes them (default `linear_logits`: `F.linear(x, gate.weight,
    gate.bias)`), and `selection`, the router's own top-k rule as a `replay_ops.Selection`
    (or a function of the router module returning one, e.g. for a bias buffer; default for
    "softmax" without `topk`: `top_k_of_scores`, the plain top-k). With both, a replayed
    block runs no top-k of its own: the gate selects the rows without a route. A family
    registered with `topk` and no `selection` (the old form) still works, with a
    DeprecationWarning: its replayed blocks run the router module whole, as before. With
    `selection` and no `topk`, the own top-k (RECORD's recompute, `fallback="topk_fn"`) is
    the gate's selection (`SelectionTopK`)."""
    if not isinstance(model_type, str) or not model_type:
        raise _bad("model_type", model_type, "expected a non-empty str (a config.model_type)")
    if model_type in SUPPORTED and not replace:
        raise ValueError(
            f"replay_ops.integrations.hf.register_family: model_type={model_type!r} is "
            f"already registered (block {SUPPORTED[model_type].block_class}); pass "
            f"replace=True to replace it")
    if isinstance(block_class, type):
        if not issubclass(block_class, torch.nn.Module):
            raise _bad("block_class", block_class, "expected a torch.nn.Module subclass or "
                                                   "its class name")
        block_class = block_class.__name__
    if not isinstance(block_class, str) or not block_class.isidentifier():
        raise _bad("block_class", block_class, "expected a torch.nn.Module subclass or its "
                                               "class name")
    if score_func not in scores.NAMES:
        raise _bad("score_func", score_func, f"expected one of {scores.NAMES}")
    if topk is not None and not callable(topk):
        raise _bad("topk", topk, "expected a callable topk(gate, logits) -> indices [T, K]")
    if logits is None:
        logits = linear_logits
    elif not callable(logits):
        raise _bad("logits", logits, "expected a callable logits(gate, x) -> router logits "
                                     "[T, E]")
    if isinstance(selection, Selection):
        selection = _Constant(selection)
    elif selection is not None and not callable(selection):
        raise _bad("selection", selection, "expected a replay_ops.Selection or a callable "
                                           "selection(gate) -> Selection")
    if selection is None and topk is None:
        if score_func != "softmax":
            raise _bad("selection", selection,
                       f"score_func={score_func!r} needs the router's own selection rule: "
                       f"selection=replay_ops.Selection(...) (or selection(gate) -> Selection)")
        selection = top_k_of_scores
    if topk is None:
        topk = softmax_topk if selection is top_k_of_scores else SelectionTopK(selection,
                                                                                score_func)
    elif selection is None:
        warn(f"replay_ops.integrations.hf.register_family({model_type!r}, topk=...) without "
             f"selection= is deprecated: its replayed blocks run the router module whole (a "
             f"top-k of every row, every forward); pass selection=replay_ops.Selection(...), "
             f"the router's rule, and the gate selects the rows without a route itself")
    norm = _of_gate("normalize", normalize, bool, None)
    scale = _of_gate("scaling_factor", scaling_factor, float,
                     lambda v: math.isfinite(v) and v > 0)
    for arg, value in (("weights_fp32", weights_fp32), ("jitter", jitter),
                       ("replace", replace)):
        if not isinstance(value, bool):
            raise _bad(arg, value, "expected a bool")
    if add_shared is not None and not callable(add_shared):
        raise _bad("add_shared", add_shared, "expected None or a callable "
                                             "add_shared(block, x, hidden_states, routed)")
    if fallback not in FALLBACKS:
        raise _bad("fallback", fallback, f"expected one of {FALLBACKS}")
    spec = ArchSpec(model_type, block_class, score_func, norm, scale, weights_fp32=weights_fp32,
                    topk=topk, add_shared=add_shared, jitter=jitter, fallback=fallback,
                    logits=logits, selection=selection)
    SUPPORTED[model_type] = spec
    return spec


def unregister_family(model_type: str) -> ArchSpec:
    """Remove a family added by `register_family` (the shipped ones stay); returns it."""
    if model_type in _SHIPPED:
        raise ValueError(
            f"replay_ops.integrations.hf.unregister_family: model_type={model_type!r} ships "
            f"with the package; replace it with register_family(..., replace=True) instead")
    if model_type not in SUPPORTED:
        raise ValueError(
            f"replay_ops.integrations.hf.unregister_family: model_type={model_type!r} is not "
            f"registered; registered: {', '.join(supported_architectures())}")
    return SUPPORTED.pop(model_type)
