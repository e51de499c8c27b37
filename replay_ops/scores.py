"""Score functions: the one table that names them, numbers them and defines their math.

Every layer of the package takes a score function's id from `TABLE`:

* the ops check `score_func` against it (`get`),
* the torch backend and the `replay_mask` fallback use its `forward` and `vjp`,
* the Triton kernels compare the `SCORE` constexpr with `SOFTMAX.id`, `SIGMOID.id`, ...,
* the C++/CUDA kernels take the ids from `csrc/include/replay_score_funcs.h`, which is
  generated from this table (`make score-header`, i.e. `c_header()`) and checked against it
  by the test suite.

Each consumer branches on every id explicitly and ends in an error, so a function added
here and missed somewhere fails loudly instead of computing another function.

Math, in the compute dtype (fp32, or fp64 for fp64 logits):

    softmax       forward: softmax over the last dimension      (not element-wise)
    sigmoid       forward: 1 / (1 + exp(-x))                    f'(x) = f (1 - f)
    sqrtsoftplus  forward: sqrt(softplus(x)), softplus linear   f'(x) = sigmoid(x) / (2 f),
                  above 20 as in torch.nn.functional.softplus;  1 / (2 f) above 20,
                  0 where softplus underflows                   e^(x/2) / 2 below -40,
                                                                and 0 where f = 0
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

# Threshold above which softplus(x) is x (torch.nn.functional.softplus's default).
SOFTPLUS_THRESHOLD = 20.0
# Below this, the sqrt-softplus gradient is e^(x/2) / 2 (the Triton kernels' _SQRTSP_LOW).
SQRTSP_LOW = -40.0
# Added to the sum of the element-wise scores before normalising (Megatron-Core's 1e-20).
NORM_EPS = 1e-20


@dataclasses.dataclass(frozen=True)
class ScoreFunc:
    """One score function.

    `forward(x)`: the scores of logits `x` [..., n] (a row-wise softmax, or element-wise).
    `vjp(x, y, g)`: the gradient with respect to `x` given `y = forward(x)` and the
    gradient `g` of `y` (over the last dimension for a row-wise function).
    """

    name: str
    id: int
    elementwise: bool
    forward: Callable[[torch.Tensor], torch.Tensor]
    vjp: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _softmax_vjp(x, y, g):
    return y * (g - (g * y).sum(dim=-1, keepdim=True))


def _sigmoid_vjp(x, y, g):
    return g * y * (1 - y)


def _sqrt_softplus(x):
    sp = F.softplus(x, threshold=SOFTPLUS_THRESHOLD)
    pos = sp > 0
    return torch.where(pos, torch.where(pos, sp, 1.0).sqrt(), 0.0)


def _sqrt_softplus_vjp(x, y, g):
    # sigmoid(x) / (2 y). Below SQRTSP_LOW, softplus(x) = e^x and sigmoid(x) = e^x to within
    # a relative e^x (< 4.3e-18, under fp64's epsilon), so the slope is e^(x/2) / 2: computed
    # so, because torch.sigmoid flushes its subnormal results to 0 (from x below about -87.3
    # in fp32), which made the gradient 0 where the true one is still ~1e-20.
    slope = torch.where(x > SOFTPLUS_THRESHOLD, 1.0, torch.sigmoid(x))
    d = torch.where(x < SQRTSP_LOW, 0.5 * torch.exp(0.5 * x),
                    slope / (2 * torch.where(y > 0, y, 1.0)))
    return torch.where(y > 0, g * d, 0.0)


SOFTMAX = ScoreFunc("softmax", 0, False, lambda x: torch.softmax(x, dim=-1), _softmax_vjp)
SIGMOID = ScoreFunc("sigmoid", 1, True, torch.sigmoid, _sigmoid_vjp)
SQRTSOFTPLUS = ScoreFunc("sqrtsoftplus", 2, True, _sqrt_softplus, _sqrt_softplus_vjp)

TABLE: dict[str, ScoreFunc] = {f.name: f for f in (SOFTMAX, SIGMOID, SQRTSOFTPLUS)}
NAMES = tuple(TABLE)


def get(name: str, op: str = "gate") -> ScoreFunc:
    """The score function called `name`; a clear error for any other value."""
    sf = TABLE.get(name) if isinstance(name, str) else None
    if sf is None:
        raise ValueError(
            f"replay_ops.{op}: unknown score_func={name!r}; expected one of {NAMES}"
        )
    return sf


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Gate math runs in fp32, or in fp64 for fp64 logits."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def c_header() -> str:
    """csrc/include/replay_score_funcs.h: the ids of TABLE for the C++ and CUDA kernels."""
    lines = [
        "// Generated from replay_ops/scores.py by `make score-header`;",
        "// do not edit. tests/test_scores.py checks that it matches the table.",
        "#pragma once",
        "",
        "namespace replay_math {",
        "",
        "enum ScoreFunc : int {",
    ]
    for f in TABLE.values():
        lines.append(f"  k{f.name.capitalize()} = {f.id},")
    lines += [
        "};",
        "",
        f"constexpr int kNumScoreFuncs = {len(TABLE)};",
        "",
        "// The name of a score function id (nullptr for an unknown id).",
        "inline const char* score_func_name(int id) {",
        "  switch (id) {",
    ]
    for f in TABLE.values():
        lines.append(f'    case {f.id}: return "{f.name}";')
    lines += ["    default: return nullptr;", "  }", "}", "", "}  // namespace replay_math", ""]
    return "\n".join(lines)

