"""The gate ops' options as one frozen value, from the API through the ops to the backends.

`GateOptions` carries what decides a gate's arithmetic and its plan: the score function and
its normalisation and scale, the plan's row alignment, and the dense gate's padding policy.
The registered ops (`torch.ops.replay.gate`, `.gate_dense` and their backward ops) take flat
arguments, since a custom op's schema cannot hold a Python object; the field lists below
are the one place that says which options each schema carries, in its order, and
`flat`/`from_flat` are the one place that converts. The backends receive the value.

Per-call switches that are not options of the arithmetic (`replay_mask`, `fallback`,
`validate`, `backend`) stay arguments of their own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The options in each op schema, in the schema's order (tests/test_ops_registration.py
# holds the registered schemas to these lists).
GATE_FIELDS = ("score_func", "normalize", "scaling_factor", "align")
DENSE_FIELDS = ("score_func", "normalize", "scaling_factor", "padding", "ep_size",
                "spread_offset", "underflow_guard", "align", "with_plan")
BACKWARD_FIELDS = ("score_func", "normalize", "scaling_factor")

# The conversions the API always made (align, score_func and padding pass unchanged, so that
# the ops' checks refuse a wrong type or value by name instead of it being rounded).
_COERCE = {"normalize": bool, "scaling_factor": float, "ep_size": int, "spread_offset": int,
           "underflow_guard": bool, "with_plan": bool}


def _same(x):
    return x


@dataclass(frozen=True)
class GateOptions:
    """The options of `replay_ops.gate` (the first four) and `replay_ops.gate_dense` (all);
    see docs/ops.md. Their values are checked by the ops, once, with the argument named."""
    score_func: str = "softmax"
    normalize: bool = True
    scaling_factor: float = 1.0
    align: int = 1
    # the dense gate only
    padding: str = "empty"
    ep_size: int = 1
    spread_offset: int = 0
    underflow_guard: bool = False
    with_plan: bool = True

    def flat(self, fields: tuple[str, ...]) -> tuple:
        """The values of `fields`, in their order, as the op schema types them."""
        return tuple(_COERCE.get(f, _same)(getattr(self, f)) for f in fields)

    @classmethod
    def from_flat(cls, fields: tuple[str, ...], values) -> "GateOptions":
        """The value an op receives as flat arguments (the fields it lacks at defaults)."""
        return cls(**dict(zip(fields, values, strict=True)))


DEFAULTS = GateOptions()


def resolve(options: GateOptions | None, who: str, fields: tuple[str, ...],
            **keywords) -> GateOptions:
    """The options of a call that takes them as keywords or as `options=`: the keywords
    alone, or `options` when no keyword differs from its default (both at once would leave
    one of them silently unused)."""
    if options is None:
        return GateOptions(**keywords)
    if not isinstance(options, GateOptions):
        raise TypeError(f"{who}: options must be a replay_ops.GateOptions, got "
                        f"{type(options).__name__}")
    given = [k for k, v in keywords.items() if v != getattr(DEFAULTS, k)]
    if given:
        raise ValueError(f"{who}: pass the options either as keywords or as options=, not both "
                         f"(got options= and {', '.join(f'{k}={keywords[k]!r}' for k in given)})")
    unused = [f.name for f in dataclasses.fields(GateOptions)
              if f.name not in fields and getattr(options, f.name) != getattr(DEFAULTS, f.name)]
    if unused:
        raise ValueError(f"{who}: options set {', '.join(unused)}, which {who} does not take "
                         f"(they belong to replay_ops.gate_dense)")
    return options
