"""The score-function table (replay_ops/scores.py) is the one source of names and ids: the
C++ header is generated from it, every backend branches on every entry, and an unknown
name is an error everywhere."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import replay_ops
from replay_ops import reference as ref
from replay_ops import scores
from replay_ops.options import GateOptions

from _helpers import backend_params, make_indices, make_logits

ROOT = Path(__file__).resolve().parents[1]


def test_cpp_header_is_generated_from_the_table():
    header = (ROOT / "csrc" / "include" / "replay_score_funcs.h").read_text()
    assert header == scores.c_header(), (
        "csrc/include/replay_score_funcs.h is stale: run `make score-header`")
    for f in scores.TABLE.values():
        assert f"k{f.name.capitalize()} = {f.id}," in header


def test_table_ids_are_distinct_and_dense():
    ids = sorted(f.id for f in scores.TABLE.values())
    assert ids == list(range(len(scores.TABLE)))
    assert scores.NAMES == tuple(scores.TABLE)


@pytest.mark.parametrize("name", scores.NAMES)
def test_forward_and_vjp_match_autograd(name):
    """Each entry's vjp is the gradient of its forward (checked by autograd in fp64)."""
    sf = scores.TABLE[name]
    x = torch.tensor([[-30.0, -2.0, 0.0, 0.5, 3.0, 25.0]], dtype=torch.float64,
                     requires_grad=True)
    y = sf.forward(x)
    g = torch.linspace(-1, 1, 6, dtype=torch.float64)[None]
    (want,) = torch.autograd.grad(y, x, g)
    got = sf.vjp(x.detach(), y.detach(), g)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    # and the forward agrees with the oracle's own scores
    torch.testing.assert_close(y.detach(), ref.scores(x.detach(), name), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sqrt_softplus_gradient_far_below_zero(dtype):
    """Far below zero the slope sigmoid(x) is subnormal in fp32 (torch.sigmoid flushes it
    to 0 there) while the gradient, ~e^(x/2) / 2, is still a normal number: the vjp gives
    it to 1e-5 in fp32 and to 1e-14 in fp64, checked against the fp64 autograd of the
    oracle. Where softplus itself
    underflows (fp32, x below about -103.3) the score and its gradient are 0."""
    sf = scores.SQRTSOFTPLUS
    xs = [-19.99, -20.01, -25.0, -30.0, -39.9, -40.1, -60.0, -87.0, -88.5, -95.0, -100.0,
          -103.0]
    x = torch.tensor(xs, dtype=dtype)
    y = sf.forward(x)
    g = torch.linspace(0.5, 2.0, len(xs), dtype=dtype)
    got = sf.vjp(x, y, g)
    x64 = x.double().requires_grad_(True)
    (want,) = torch.autograd.grad(ref.sqrt_softplus(x64), x64, g.double())
    assert (got != 0).all(), got
    # fp64: within a few ulp on both sides of the switch to e^(x/2) / 2 (at -40)
    rtol = 1e-5 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=0)
    if dtype == torch.float32:
        x = torch.tensor([-104.0, -120.0])
        y = sf.forward(x)
        assert (y == 0).all() and (sf.vjp(x, y, torch.ones(2)) == 0).all()


def test_unknown_name_is_an_error_in_every_layer():
    with pytest.raises(ValueError, match=r"unknown score_func='relu'; expected one of "):
        scores.get("relu")
    with pytest.raises(ValueError, match="unknown score_func='relu'"):
        replay_ops.gate(torch.zeros(2, 3), torch.zeros(2, 1, dtype=torch.int32),
                        replay_mask=torch.zeros(2, dtype=torch.bool), score_func="relu")


@pytest.mark.parametrize("dev_backend", backend_params())
def test_every_backend_refuses_an_unknown_name(dev_backend):
    """A kernel called directly (past the ops' checks) with a name outside the table fails
    loudly instead of computing another function."""
    device, backend = dev_backend
    from replay_ops import backends

    mod = backends.load(backend)
    logits = make_logits(3, 4, device=device)
    idx = make_indices(3, 4, 2, device=device)
    with pytest.raises(ValueError, match="unknown score_func='relu'"):
        mod.gate_fwd(logits, idx, None, GateOptions(score_func="relu"))
    plan = replay_ops.gate(logits, idx, backend=backend)
    with pytest.raises(ValueError, match="unknown score_func='relu'"):
        mod.gate_bwd(torch.ones_like(plan.weights), logits, plan.expert_indices,
                     GateOptions(score_func="relu"))


def test_native_kernels_refuse_an_unknown_id():
    """The C++ ops take the id; an id outside the table is refused before any kernel runs."""
    from replay_ops import backends

    if backends.load("native") is None:
        pytest.skip("the native extension is not built")
    logits, idx = make_logits(3, 4), make_indices(3, 4, 2)
    with pytest.raises(ValueError, match="unknown score function id 7"):
        torch.ops.replay_native.gate_fwd(logits, idx, None, None, 7, True, 1.0, 1, 0, 0, False,
                                         0, 0, 0, False)
