"""`ModelShape`: the expert and layer shape of the model whose routing is recorded or
replayed, and the check of routing values against it.

One type serves every part of the replay system: `RouterReplay`, the record files
(`RecordMeta.shape`), the rollout adapters, a checked `ReplayBatch` (the shape it was
checked against), the Hugging Face integration (`MoEBlocks.shape`) and Megatron-Core
(`ModelShape.from_megatron(config)`).

Layers are identified by their absolute layer id (the index in the model's list of decoder
layers); `moe_layer_ids` lists the MoE ones in ascending order. A routing tensor
`[tokens, L, K]` is indexed either by MoE ordinal (`L == num_moe_layers`, mapping "moe") or
by absolute layer id (`L == num_hidden_layers`, mapping "absolute"; dense rows ignored).
"""
from __future__ import annotations

import ast
import dataclasses
from typing import Sequence

from .._validate import BadRoute, first_bad_route  # noqa: F401  (the one value check)

# How a routing tensor's layer columns are indexed (`layer_index=`): "moe" (one column per
# MoE layer, in order), "absolute" (one per layer id, dense ones ignored), or "auto" (chosen
# by the number of columns). The one list of the choices; MAPPINGS are the resolved ones.
LAYER_INDEX = ("auto", "moe", "absolute")
MAPPINGS = LAYER_INDEX[1:]


def resolve_mapping(L: int, n_moe: int, n_abs: int, who: str, layer_index: str = "auto", *,
                    error: type[Exception] = ValueError, moe_need: str | None = None,
                    abs_need: str | None = None, neither: str | None = None) -> str:
    """"moe" or "absolute": how a routing tensor with L layer columns is indexed, for a
    model with `n_moe` MoE layers and `n_abs` layers. `layer_index` "auto" picks by L;
    "moe"/"absolute" insist. An unknown `layer_index` raises ValueError; an L that does not
    fit raises `error`, worded by the caller: `moe_need`/`abs_need` say what L must be,
    `neither` what the model has (each has a plain default)."""
    if layer_index not in LAYER_INDEX:
        raise ValueError(f"{who}: unknown layer_index={layer_index!r}; expected one of "
                         f"{LAYER_INDEX}")
    if layer_index == "moe" or (layer_index == "auto" and L == n_moe):
        if L != n_moe:
            raise error(f"{who}: layer_index='moe' needs {moe_need or f'L={n_moe}'}, got L={L}")
        return "moe"
    if layer_index == "absolute" or (layer_index == "auto" and L == n_abs):
        if L != n_abs:
            raise error(f"{who}: layer_index='absolute' needs {abs_need or f'L={n_abs}'}, "
                        f"got L={L}")
        return "absolute"
    raise error(f"{who}: " + (neither or f"routing has L={L} layer columns, but the model has "
                                         f"{n_moe} MoE layers and {n_abs} layers; L must be "
                                         f"one of them"))


@dataclasses.dataclass(frozen=True)
class ModelShape:
    num_experts: int
    top_k: int
    moe_layer_ids: tuple[int, ...]
    num_hidden_layers: int | None = None  # default: the last MoE layer id + 1

    def __post_init__(self) -> None:
        E, K = self.num_experts, self.top_k
        if isinstance(E, bool) or not isinstance(E, int) or E < 1:
            raise ValueError(f"{self._who()}: num_experts must be an integer >= 1, got {E!r}")
        if isinstance(K, bool) or not isinstance(K, int) or not 1 <= K <= E:
            raise ValueError(f"{self._who()}: top_k must be an integer in 1..num_experts={E}, "
                             f"got {K!r}")
        ids = tuple(int(i) for i in self.moe_layer_ids)
        if not ids:
            raise ValueError(f"{self._who()}: moe_layer_ids is empty; a model with no MoE "
                             f"layer has nothing to replay")
        if ids[0] < 0 or len(set(ids)) != len(ids) or list(ids) != sorted(ids):
            raise ValueError(f"{self._who()}: moe_layer_ids must be ascending distinct "
                             f"non-negative layer ids (the model's layer order), got {list(ids)}")
        n = ids[-1] + 1 if self.num_hidden_layers is None else int(self.num_hidden_layers)
        if n <= ids[-1]:
            raise ValueError(f"{self._who()}: num_hidden_layers={n} but moe_layer_ids "
                             f"contains layer {ids[-1]}")
        object.__setattr__(self, "moe_layer_ids", ids)
        object.__setattr__(self, "num_hidden_layers", n)

    def _who(self) -> str:
        return type(self).__name__

    @classmethod
    def of(cls, obj) -> "ModelShape":
        """The shape of anything that has one (`.shape`), or carries the four fields."""
        shape = getattr(obj, "shape", None)
        if isinstance(shape, ModelShape):
            return shape
        return cls(obj.num_experts, obj.top_k, tuple(obj.moe_layer_ids), obj.num_hidden_layers)

    @classmethod
    def from_megatron(cls, config, *, include_mtp: bool = False) -> ModelShape:
        """The shape of a Megatron-Core model, from its `TransformerConfig`: `num_moe_experts`,
        `moe_router_topk`, and the MoE layers of `num_layers` by `moe_layer_freq` (an int N:
        layers 0, N, 2N, ...; or a 0/1 list, one entry per layer, e.g. `[0]*3 + [1]*58`
        for three dense layers first; or that list as Megatron's command line writes it,
        the text "([0]*3+[1]*58)"), the pattern Megatron's decoder block spec builds.

        Layer ids are absolute and 0-based: Megatron's layer number n is layer id n - 1
        (pipeline stages share one numbering). MTP layers restart their layer numbers at 1,
        so they are counted only with `include_mtp=True`: MTP layer j (0-based, in the MTP
        block's order) is then the MoE layer with id `num_layers + j`, after every decoder
        layer, and `num_hidden_layers` is `num_layers + mtp_num_layers`."""
        who = "ModelShape.from_megatron"
        n = config.num_layers
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{who}: num_layers must be an integer, got {n!r}")
        if n < 1:
            raise ValueError(f"{who}: num_layers must be >= 1, got {n}")
        if getattr(config, "num_moe_experts", None) is None:
            raise ValueError(f"{who}: num_moe_experts is None: the config has no MoE layer, "
                             f"so there is no routing to replay")
        pattern = megatron_moe_pattern(getattr(config, "moe_layer_freq", 1), n, who)
        ids = [i for i, p in enumerate(pattern) if p]
        n_mtp = int(getattr(config, "mtp_num_layers", None) or 0) if include_mtp else 0
        ids += [n + j for j in range(n_mtp)]
        try:
            return cls(int(config.num_moe_experts), int(config.moe_router_topk), tuple(ids),
                       n + n_mtp)
        except ValueError as e:
            raise ValueError(f"{who}: {e}") from None

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    def differences(self, other: ModelShape, mine: str = "this", theirs: str = "other"
                    ) -> list[str]:
        """What differs between two shapes, one entry per field, each naming both values
        (`mine`, `theirs`: the words for each side); empty when they are equal."""
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                a, b = (list(v) if isinstance(v, tuple) else v for v in (a, b))
                out.append(f"{f.name}: {mine} {a}, {theirs} {b}")
        return out

    def mapping_for(self, L: int, who: str, layer_index: str = "auto",
                    error: type[Exception] = ValueError) -> str:
        """"moe" or "absolute" for a routing tensor with L layers (`resolve_mapping`)."""
        n_moe, n_all = self.num_moe_layers, self.num_hidden_layers
        ids = list(self.moe_layer_ids)
        return resolve_mapping(
            L, n_moe, n_all, who, layer_index, error=error,
            moe_need=f"L={n_moe} (MoE layers {ids})",
            abs_need=f"L=num_hidden_layers={n_all}",
            neither=f"routing has L={L} layers, but the model has {n_moe} MoE layers (ids "
                    f"{ids}) and {n_all} hidden layers; L must be one of them")

    def columns(self, mapping: str) -> list[int]:
        """The column of each MoE layer (in moe_layer_ids order) in a routing tensor."""
        return list(range(self.num_moe_layers)) if mapping == "moe" else list(self.moe_layer_ids)

    def layer_ids(self, mapping: str) -> list[int]:
        """The absolute layer id of each column of a routing tensor."""
        return list(self.moe_layer_ids) if mapping == "moe" else list(range(self.num_hidden_layers))


def megatron_moe_pattern(freq, num_layers: int, who: str = "megatron_moe_pattern") -> list[int]:
    """Megatron's per-layer MoE pattern (1 = MoE, 0 = dense) of `num_layers` layers from
    `moe_layer_freq`: an int N (every N-th layer from the first), a 0/1 list of one entry per
    layer, or the command line's text of such a list (a list literal, or lists joined by
    `+` and repeated by `*`, as in "([0]*3+[1]*58)"; nothing else is evaluated)."""
    if isinstance(freq, str):
        freq = _pattern_text(freq, who)
    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)):
        raise TypeError(f"{who}: moe_layer_freq={freq!r} is not an int or a 0/1 list")
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"{who}: moe_layer_freq={freq} must be >= 1")
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    pattern = list(freq)
    if any(isinstance(p, bool) or p not in (0, 1) for p in pattern):
        raise ValueError(f"{who}: moe_layer_freq must hold only 0 (dense) and 1 (MoE), got "
                         f"{pattern}")
    if len(pattern) != num_layers:
        raise ValueError(f"{who}: moe_layer_freq has {len(pattern)} entries but "
                         f"num_layers={num_layers}")
    return [int(p) for p in pattern]


def _pattern_text(text: str, who: str) -> list:
    """The list that Megatron's command line builds from a pattern's text: list literals of
    ints, `+` and `* int`, in parentheses or not; anything else is refused."""
    def value(node):
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            a, b = value(node.left), value(node.right)
            if isinstance(a, list) and isinstance(b, list):
                return a + b
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            a, b = value(node.left), value(node.right)
            if isinstance(a, list) and type(b) is int and 0 <= b and len(a) * b <= 1 << 20:
                return a * b
        raise ValueError(f"{who}: moe_layer_freq={text!r} is not a pattern of 0/1 lists "
                         f"joined by + and repeated by * (such as \"([0]*3+[1]*58)\")")

    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        tree = None
    out = value(tree.body) if tree is not None else None
    if not isinstance(out, list):
        raise ValueError(f"{who}: moe_layer_freq={text!r} is not a list pattern such as "
                         f"\"([0]*3+[1]*58)\"")
    return out


def describe_bad_route(bad: BadRoute, num_experts: int, layer_ids: Sequence[int],
                       token_offset: int = 0) -> str:
    """The standard words for a bad route: token, layer id, slot and value."""
    lid, t = layer_ids[bad.layer], bad.token + token_offset
    if bad.kind == "range":
        return (f"token {t}, MoE layer {lid} (slot {bad.slot}) routes to expert {bad.value}, "
                f"out of range for num_experts={num_experts} (valid 0..{num_experts - 1}, "
                f"-1 = no route)")
    return (f"token {t}, MoE layer {lid} repeats an expert {bad.row} (expert {bad.value} at "
            f"slot {bad.slot}); zero-filled or duplicated rows are not routes (mark missing "
            f"routes with -1)")
