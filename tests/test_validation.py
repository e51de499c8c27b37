"""Bad input: a clear error whose message starts with "replay_ops.<op>:" and names the
argument, the row and the value. With validate=False the data checks (range, duplicates)
are skipped but shape, dtype, device and option checks still run.

"Tensors on different devices" is produced on a CPU-only machine with the "meta" device for
one tensor (the op dispatches to its fake kernel, which runs the same checks); the
cpu-vs-cuda version is a gpu-marked test.
"""
from __future__ import annotations

import re

import pytest
import torch

import replay_ops
from replay_ops import backends as rb

from _helpers import DEVICES, HAS_CUDA, backend_params, make_indices, make_logits

BACKENDS = backend_params()
# The input checks run in the ops layer, before a backend is chosen (the test
# `test_checks_run_before_any_backend` holds that), so they are tested once per device.
ONCE = [pytest.param((dev, None), id=dev, marks=[pytest.mark.gpu] if dev == "cuda" else [])
        for dev in DEVICES]


def gate_call(backend, logits, idx, **kw):
    return replay_ops.gate(logits, idx, backend=backend, **kw)


def raises(exc, *fragments):
    """pytest.raises that also requires every fragment (literal text) in the message."""
    pattern = "".join(f"(?=[\\s\\S]*{re.escape(f)})" for f in fragments)
    return pytest.raises(exc, match=pattern)


# ------------------------------------------------------------------- data checks
@pytest.mark.parametrize("dev_backend", ONCE)
@pytest.mark.parametrize("bad", [7, 8, 300, -2, -32768])
@pytest.mark.parametrize("idx_dtype", [torch.int16, torch.int32, torch.int64])
def test_index_out_of_range(dev_backend, bad, idx_dtype):
    device, backend = dev_backend
    T, E, K = 5, 7, 2
    idx = make_indices(T, E, K, dtype=idx_dtype, device=device)
    idx[3, 1] = bad
    with raises(ValueError, "replay_ops.gate:", "expert_indices[3, 1]", f"= {bad}", "E=7", "row 3"):
        gate_call(backend, make_logits(T, E, device=device), idx)


@pytest.mark.parametrize("dev_backend", ONCE)
def test_index_out_of_range_reports_first_bad_row(dev_backend):
    device, backend = dev_backend
    idx = torch.tensor([[0, 1], [2, 9], [-5, 1]], device=device)
    with raises(ValueError, "expert_indices[1, 1] = 9", "row 1"):
        gate_call(backend, make_logits(3, 4, device=device), idx)


@pytest.mark.parametrize("dev_backend", ONCE)
def test_duplicate_expert_in_row(dev_backend):
    device, backend = dev_backend
    T, E, K = 6, 8, 3
    idx = make_indices(T, E, K, device=device)
    idx[4] = torch.tensor([5, 1, 5])
    with raises(ValueError, "replay_ops.gate:", "expert_indices", "row 4", "repeats expert 5",
                "columns 0 and 2"):
        gate_call(backend, make_logits(T, E, device=device), idx)


@pytest.mark.parametrize("dev_backend", ONCE)
def test_zero_padded_rows_are_rejected(dev_backend):
    """verl pads missing routes with all-zero rows: they must not all route to expert 0."""
    device, backend = dev_backend
    idx = torch.tensor([[3, 1], [0, 0], [2, 3]], dtype=torch.int16, device=device)
    with raises(ValueError, "row 1", "repeats expert 0"):
        gate_call(backend, make_logits(3, 4, device=device), idx)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_duplicate_empty_slots_are_fine(dev_backend):
    """Several -1 in a row are not duplicates."""
    device, backend = dev_backend
    idx = torch.tensor([[-1, 2, -1, -1]], device=device)
    plan = gate_call(backend, make_logits(1, 4, device=device), idx)
    assert plan.num_rows() == 1


@pytest.mark.parametrize("dev_backend", ONCE)
def test_fallback_rows_are_not_validated_but_replayed_rows_are(dev_backend):
    device, backend = dev_backend
    idx = torch.tensor([[0, 99], [1, 1], [2, 3]], device=device)
    mask = torch.tensor([False, False, True], device=device)
    gate_call(backend, make_logits(3, 4, device=device), idx, replay_mask=mask)  # fine
    mask = torch.tensor([False, True, True], device=device)
    with raises(ValueError, "row 1", "repeats expert 1"):
        gate_call(backend, make_logits(3, 4, device=device), idx, replay_mask=mask)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_validate_false_skips_data_checks(dev_backend):
    """validate=False: a duplicate row is the caller's promise; no error, and the plan is
    still self-consistent (both slots get a row of that expert)."""
    device, backend = dev_backend
    idx = torch.tensor([[1, 1], [0, 2]], device=device)
    plan = gate_call(backend, make_logits(2, 3, device=device), idx, validate=False)
    assert plan.tokens_per_expert.tolist() == [1, 2, 1]
    assert sorted(plan.row_id_map.flatten().tolist()) == [0, 1, 2, 3]


# ------------------------------------------------------------ static (always) checks
STATIC_CASES = {
    # name: (builder(device) -> (logits, idx, kwargs), exception, fragments)
    "float_index": (
        lambda d: (make_logits(3, 4, device=d), torch.zeros(3, 2, device=d), {}),
        TypeError, ("replay_ops.gate:", "expert_indices", "integer", "torch.float32"),
    ),
    "bf16_index": (
        lambda d: (make_logits(3, 4, device=d),
                   torch.zeros(3, 2, device=d, dtype=torch.bfloat16), {}),
        TypeError, ("replay_ops.gate:", "expert_indices", "torch.bfloat16"),
    ),
    "uint8_index": (
        lambda d: (make_logits(3, 4, device=d), torch.zeros(3, 2, device=d, dtype=torch.uint8), {}),
        TypeError, ("replay_ops.gate:", "expert_indices", "torch.uint8"),
    ),
    "bool_index": (
        lambda d: (make_logits(3, 4, device=d), torch.zeros(3, 2, device=d, dtype=torch.bool), {}),
        TypeError, ("replay_ops.gate:", "expert_indices", "torch.bool"),
    ),
    "int_logits": (
        lambda d: (torch.zeros(3, 4, dtype=torch.int32, device=d),
                   make_indices(3, 4, 2, device=d), {}),
        TypeError, ("replay_ops.gate:", "logits", "torch.int32"),
    ),
    "rows_mismatch": (
        lambda d: (make_logits(5, 4, device=d), make_indices(4, 4, 2, device=d), {}),
        ValueError,
        ("replay_ops.gate:", "shape mismatch", "logits", "T=5", "expert_indices", "4 rows"),
    ),
    "indices_3d": (
        lambda d: (make_logits(5, 4, device=d),
                   torch.zeros(5, 3, 2, dtype=torch.int32, device=d), {}),
        ValueError, ("replay_ops.gate:", "expert_indices", "2-D", "(5, 3, 2)"),
    ),
    "logits_1d": (
        lambda d: (torch.zeros(4, device=d), make_indices(4, 4, 2, device=d), {}),
        ValueError, ("replay_ops.gate:", "logits", "2-D", "(4,)"),
    ),
    "k_greater_than_e": (
        lambda d: (make_logits(3, 2, device=d), torch.tensor([[0, 1, -1]] * 3, device=d), {}),
        ValueError, ("replay_ops.gate:", "K=3", "E=2"),
    ),
    "k_zero": (
        lambda d: (make_logits(3, 2, device=d), torch.zeros(3, 0, dtype=torch.int32, device=d), {}),
        ValueError, ("replay_ops.gate:", "expert_indices", "K=0"),
    ),
    "align_zero": (
        lambda d: (make_logits(3, 4, device=d), make_indices(3, 4, 2, device=d), {"align": 0}),
        ValueError, ("replay_ops.gate:", "align", "align=0"),
    ),
    "align_negative": (
        lambda d: (make_logits(3, 4, device=d), make_indices(3, 4, 2, device=d), {"align": -16}),
        ValueError, ("replay_ops.gate:", "align", "align=-16"),
    ),
    "unknown_score_func": (
        lambda d: (make_logits(3, 4, device=d), make_indices(3, 4, 2, device=d),
                   {"score_func": "relu"}),
        ValueError, ("replay_ops.gate:", "score_func", "'relu'", "softmax"),
    ),
    "mask_dtype": (
        lambda d: (make_logits(3, 4, device=d), make_indices(3, 4, 2, device=d),
                   {"replay_mask": torch.ones(3, dtype=torch.int32, device=d)}),
        TypeError, ("replay_ops.gate:", "replay_mask", "torch.int32"),
    ),
    "mask_shape": (
        lambda d: (make_logits(3, 4, device=d), make_indices(3, 4, 2, device=d),
                   {"replay_mask": torch.ones(4, dtype=torch.bool, device=d)}),
        ValueError, ("replay_ops.gate:", "replay_mask", "(3,)", "(4,)"),
    ),
    "indices_on_other_device": (
        lambda d: (make_logits(3, 4, device=d), make_indices(3, 4, 2, device="meta"), {}),
        ValueError,
        ("replay_ops.gate:", "different devices", "logits on", "expert_indices on meta"),
    ),
    "logits_on_other_device": (
        lambda d: (make_logits(3, 4, device="meta"), make_indices(3, 4, 2, device=d), {}),
        ValueError,
        ("replay_ops.gate:", "different devices", "logits on meta", "expert_indices on"),
    ),
    "mask_on_other_device": (
        lambda d: (make_logits(3, 4, device=d), make_indices(3, 4, 2, device=d),
                   {"replay_mask": torch.ones(3, dtype=torch.bool, device="meta")}),
        ValueError, ("replay_ops.gate:", "different devices", "replay_mask on meta"),
    ),
}


@pytest.mark.parametrize("dev_backend", ONCE)
@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("name", sorted(STATIC_CASES))
def test_gate_static_checks(dev_backend, validate, name):
    """Shape, dtype, device and option errors, raised whether or not validate is set."""
    device, backend = dev_backend
    build, exc, fragments = STATIC_CASES[name]
    logits, idx, kw = build(device)
    with raises(exc, *fragments):
        gate_call(backend, logits, idx, validate=validate, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gate_cpu_and_cuda_tensors_mixed():
    logits = make_logits(3, 4, device="cuda")
    idx = make_indices(3, 4, 2)
    with raises(ValueError, "replay_ops.gate:", "different devices", "cuda", "cpu"):
        replay_ops.gate(logits, idx)
    with raises(ValueError, "replay_ops.gate:", "different devices", "replay_mask"):
        replay_ops.gate(logits, idx.cuda(), replay_mask=torch.ones(3, dtype=torch.bool))
    plan = replay_ops.gate(logits, idx.cuda())
    with raises(ValueError, "replay_ops.permute:", "different devices", "hidden"):
        replay_ops.permute(torch.randn(3, 5), plan)


# ----------------------------------------------------------------- permute checks
def _plan(device, backend, align=4):
    idx = torch.tensor([[0, 3], [-1, 1], [2, 0]], device=device)
    return replay_ops.gate(make_logits(3, 4, device=device), idx, align=align, backend=backend)


@pytest.mark.parametrize("dev_backend", ONCE)
def test_permute_num_rows_too_small(dev_backend):
    device, backend = dev_backend
    plan = _plan(device, backend)
    used = plan.num_rows()
    assert used == 16  # 4 experts, each padded to 4 rows
    with raises(ValueError, "replay_ops.permute:", "num_rows=15", f"{used} rows", "max_rows"):
        replay_ops.permute(torch.randn(3, 2, device=device), plan, 15, backend=backend)
    with raises(ValueError, "replay_ops.permute:", "num_rows", "-1"):
        replay_ops.permute(torch.randn(3, 2, device=device), plan, -1, backend=backend)


@pytest.mark.parametrize("dev_backend", ONCE)
@pytest.mark.parametrize(
    "name,hidden,exc,fragments",
    [
        ("rows", lambda d: torch.randn(4, 2, device=d), ValueError,
         ("replay_ops.permute:", "hidden", "4 rows", "3")),
        ("int", lambda d: torch.zeros(3, 2, dtype=torch.int64, device=d), TypeError,
         ("replay_ops.permute:", "hidden", "floating point", "torch.int64")),
        ("1d", lambda d: torch.zeros(3, device=d), ValueError,
         ("replay_ops.permute:", "hidden", "2-D", "(3,)")),
        ("device", lambda d: torch.zeros(3, 2, device="meta"), ValueError,
         ("replay_ops.permute:", "different devices", "hidden on meta")),
    ],
)
def test_permute_bad_hidden(dev_backend, name, hidden, exc, fragments):
    device, backend = dev_backend
    plan = _plan(device, backend)
    with raises(exc, *fragments):
        replay_ops.permute(hidden(device), plan, plan.max_rows, backend=backend)


@pytest.mark.parametrize("dev_backend", ONCE)
def test_permute_bad_plan_tensors(dev_backend):
    device, backend = dev_backend
    plan = _plan(device, backend)
    h = torch.randn(3, 2, device=device)
    with raises(ValueError, "replay_ops.permute:", "row_id_map", "int32", "torch.int64"):
        replay_ops.permute(h, plan._replace(row_id_map=plan.row_id_map.long()), plan.max_rows,
                           backend=backend)
    with raises(ValueError, "replay_ops.permute:", "sorted_slots", "int32", "torch.int64"):
        replay_ops.permute(h, plan._replace(sorted_slots=plan.sorted_slots.long()), plan.max_rows,
                           backend=backend)
    # a plan with no slot column comes from no gate (it refuses K = 0)
    no_k = plan.row_id_map[:, :0]
    with raises(ValueError, "replay_ops.permute:", "row_id_map", "K >= 1", "(3, 0)"):
        replay_ops.permute(h, plan._replace(row_id_map=no_k), plan.max_rows, backend=backend)
    with raises(ValueError, "replay_ops.unpermute:", "row_id_map", "K >= 1", "(3, 0)"):
        replay_ops.unpermute(torch.zeros(plan.max_rows, 2, device=device),
                             plan._replace(row_id_map=no_k, weights=plan.weights[:, :0]),
                             backend=backend)


# --------------------------------------------------------------- unpermute checks
@pytest.mark.parametrize("dev_backend", ONCE)
@pytest.mark.parametrize(
    "name,make,exc,fragments",
    [
        ("int", lambda d, n: torch.zeros(n, 2, dtype=torch.int32, device=d), TypeError,
         ("replay_ops.unpermute:", "expert_out", "floating point", "torch.int32")),
        ("1d", lambda d, n: torch.zeros(n, device=d), ValueError,
         ("replay_ops.unpermute:", "expert_out", "2-D")),
        ("device", lambda d, n: torch.zeros(n, 2, device="meta"), ValueError,
         ("replay_ops.unpermute:", "different devices", "expert_out on meta")),
    ],
)
def test_unpermute_bad_expert_out(dev_backend, name, make, exc, fragments):
    device, backend = dev_backend
    plan = _plan(device, backend)
    with raises(exc, *fragments):
        replay_ops.unpermute(make(device, plan.max_rows), plan, backend=backend)


@pytest.mark.parametrize("dev_backend", ONCE)
def test_unpermute_bad_weights(dev_backend):
    device, backend = dev_backend
    plan = _plan(device, backend)
    x = torch.randn(plan.max_rows, 2, device=device)
    with raises(ValueError, "replay_ops.unpermute:", "weights", "(3, 2)", "(3, 3)"):
        replay_ops.unpermute(x, plan._replace(weights=torch.zeros(3, 3, device=device)),
                             backend=backend)
    with raises(ValueError, "replay_ops.unpermute:", "weights", "torch.int32"):
        replay_ops.unpermute(x, plan._replace(weights=plan.row_id_map), backend=backend)


@pytest.mark.parametrize("dev_backend", ONCE)
def test_unpermute_expert_out_too_short(dev_backend):
    """An expert_out with fewer rows than the plan uses (expert_offsets[E]) must not silently
    drop the tokens routed to the missing rows."""
    device, backend = dev_backend
    plan = _plan(device, backend)
    used = plan.num_rows()
    x = torch.randn(used - 5, 2, device=device)
    with raises(ValueError, "replay_ops.unpermute:", "expert_out", f"{used - 5}", f"{used}"):
        replay_ops.unpermute(x, plan, backend=backend)
    # exactly the used rows, and the static max_rows, are fine
    replay_ops.unpermute(torch.randn(used, 2, device=device), plan, backend=backend)
    replay_ops.unpermute(torch.randn(plan.max_rows, 2, device=device), plan, backend=backend)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_validate_false_skips_row_count_checks(dev_backend):
    """validate=False: no host read of expert_offsets[E]; the caller promises the sizes."""
    device, backend = dev_backend
    idx = torch.tensor([[0, 1], [2, -1], [1, 2]], device=device)
    plan = replay_ops.gate(make_logits(3, 4, device=device), idx, backend=backend)
    assert plan.num_rows() == 5
    x = torch.randn(5, 2, device=device)
    out = replay_ops.unpermute(x[:3], plan, validate=False, backend=backend)
    assert out.shape == (3, 2)
    h = torch.randn(3, 2, device=device)
    assert replay_ops.permute(h, plan, 5, validate=False, backend=backend).shape == (5, 2)


# ---------------------------------------------------------------- backend choice
def test_unknown_backend_name():
    with raises(ValueError, "unknown backend", "'cuda-fast'"):
        replay_ops.gate(make_logits(2, 3), make_indices(2, 3, 1), backend="cuda-fast")


def test_unknown_backend_from_environment(monkeypatch):
    monkeypatch.setenv(rb.ENV_VAR, "bogus")
    with raises(ValueError, "unknown backend", "'bogus'"):
        replay_ops.gate(make_logits(2, 3), make_indices(2, 3, 1))


def test_unusable_backend_is_a_clear_error(monkeypatch):
    """A backend that is requested but cannot serve CPU tensors raises, naming it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # Triton then cannot take CPU tensors
    unusable = []
    for name in sorted(rb.MODULES):
        if not rb.available(name, "cpu"):
            unusable.append(name)
    assert "torch" not in unusable
    if not unusable:
        pytest.skip("every registered backend serves CPU tensors here")
    for name in unusable:
        with raises(RuntimeError, f"backend {name!r}", "cpu"):
            replay_ops.gate(make_logits(2, 3), make_indices(2, 3, 1), backend=name)


def test_backend_argument_wins_over_environment(monkeypatch):
    monkeypatch.setenv(rb.ENV_VAR, "bogus")
    plan = replay_ops.gate(make_logits(2, 3), make_indices(2, 3, 1), backend="torch")
    assert plan.weights.shape == (2, 1)


def test_checks_run_before_any_backend(monkeypatch):
    """Every backend's kernels replaced by one that fails: the input errors still come out
    (from the ops layer), so running the checks once per device covers every backend."""
    from replay_ops.backends.protocol import OPS

    def unreachable(*a, **k):
        raise AssertionError("a backend kernel ran before the inputs were checked")

    for name in rb.MODULES:
        mod = rb.load(name)
        if mod is not None:
            for op in OPS:
                monkeypatch.setattr(mod, op, unreachable)
    idx = make_indices(5, 7, 2)
    idx[3, 1] = 9
    with raises(ValueError, "expert_indices[3, 1]", "= 9"):
        replay_ops.gate(make_logits(5, 7), idx)
    for name in sorted(STATIC_CASES):
        build, exc, fragments = STATIC_CASES[name]
        logits, idx, kw = build("cpu")
        with raises(exc, *fragments):
            replay_ops.gate(logits, idx, **kw)
