"""`ModelShape`: the expert and layer shape of the model whose routing is recorded or
replayed, and the check of routing values against it.

One type serves every part of the replay system: `RouterReplay`, the record files
(`RecordMeta.shape`), the rollout adapters and the Hugging Face
integration (`MoEBlocks.shape`).

Layers are identified by their absolute layer id (the index in the model's list of decoder
layers); `moe_layer_ids` lists the MoE ones in ascending order. A routing tensor
`[tokens, L, K]` is indexed either by MoE ordinal (`L == num_moe_layers`, mapping "moe") or
by absolute layer id (`L == num_hidden_layers`, mapping "absolute"; dense rows ignored).
"""
from __future__ import annotations

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

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

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
