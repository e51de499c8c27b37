"""The backend kernels called directly, past the ops' checks (as a framework with its own
dispatch might call them): they make plan tensors contiguous, never read a token past T,
refuse a plan that does not fit int32 before allocating it, and (native) check the device
and dtype of every tensor."""
from __future__ import annotations

import pytest
import torch

import replay_ops
from replay_ops import backends as rb
from replay_ops import reference as ref
from replay_ops.options import GateOptions

from _helpers import backend_params, make_indices, make_logits

BACKENDS = backend_params()


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_plan_past_int32_is_refused_before_allocation(dev_backend):
    """T*K + E*(align-1) >= 2^31 (here through align: nothing large is allocated first)."""
    device, backend = dev_backend
    mod = rb.load(backend)
    logits = make_logits(3, 2, device=device)
    idx = make_indices(3, 2, 1, device=device)
    with pytest.raises(ValueError, match=r"T\*K \+ E\*\(align-1\) = 2147483651 .*int32"):
        mod.gate_fwd(logits, idx, None, GateOptions(align=2**30 + 1))
    with pytest.raises(ValueError, match="does not fit its int32 tensors"):
        replay_ops.gate(logits, idx, align=2**30 + 1, backend=backend)


@pytest.mark.parametrize("dev_backend", BACKENDS)
def test_plan_tensors_may_be_strided_and_tokens_are_bounded(dev_backend):
    device, backend = dev_backend
    mod = rb.load(backend)
    T, E, K, H = 6, 5, 2, 7
    plan = replay_ops.gate(make_logits(T, E, device=device), make_indices(T, E, K, device=device),
                           align=2, backend=backend)
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(device)
    want = ref.permute(hidden, plan, plan.max_rows)
    # sorted_slots as a strided view (every other element of a doubled buffer)
    doubled = torch.stack([plan.sorted_slots, torch.full_like(plan.sorted_slots, 99)], 1)
    strided = doubled[:, 0]
    assert not strided.is_contiguous()
    out = mod.permute_fwd(hidden, strided, plan.row_id_map, plan.max_rows)
    assert torch.equal(out, want)
    # a slot whose token is past T (a corrupt plan) gives a zero row, never a read past T
    bad = plan.sorted_slots.clone()
    bad[0] = T * K + 5
    out = mod.permute_fwd(hidden, bad, plan.row_id_map, plan.max_rows)
    assert torch.equal(out[0], torch.zeros(H, device=device)) and torch.equal(out[1:], want[1:])
    gx, _ = mod.unpermute_bwd(hidden, out, plan.row_id_map, bad, plan.weights)
    assert torch.equal(gx[0], torch.zeros(H, device=device))


def test_native_ops_check_dtypes_and_devices():
    if rb.load("native") is None:
        pytest.skip("the native extension is not built")
    ops = torch.ops.replay_native
    T, E, K, H = 4, 5, 2, 3
    plan = replay_ops.gate(make_logits(T, E), make_indices(T, E, K), backend="native")
    hidden = torch.randn(T, H)
    with pytest.raises(ValueError, match="permute: sorted_slots must be int32, got Long"):
        ops.permute_fwd(hidden, plan.sorted_slots.long(), plan.row_id_map, 4)
    with pytest.raises(ValueError, match="permute: hidden must be float16, bfloat16"):
        ops.permute_fwd(hidden.long(), plan.sorted_slots, plan.row_id_map, 4)
    with pytest.raises(ValueError, match="unpermute: weights must be float"):
        ops.unpermute_fwd(hidden, plan.row_id_map, plan.row_id_map)
    with pytest.raises(ValueError, match="gate_backward: expert_indices must be int32"):
        ops.gate_bwd(plan.weights, make_logits(T, E), plan.expert_indices.long(), None, 0, True,
                     1.0)
    with pytest.raises(ValueError, match="gate: expert_indices must be int16, int32 or int64"):
        ops.gate_fwd(make_logits(T, E), make_indices(T, E, K).float(), None, None, 0, True, 1.0,
                     1, 0, 0, False, 0, 0, 0, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_native_cuda_ops_refuse_host_tensors():
    """A CPU plan tensor beside CUDA rows would hand a host pointer to a kernel: the CUDA
    implementation (picked by the dispatcher for the CUDA tensor) refuses it by name."""
    if not rb.available("native", "cuda"):
        pytest.skip("the native CUDA kernels are not available")
    ops = torch.ops.replay_native
    T, E, K, H = 4, 5, 2, 3
    plan = replay_ops.gate(make_logits(T, E), make_indices(T, E, K), backend="native")
    with pytest.raises(ValueError, match="permute: sorted_slots is on cpu but the op runs on cuda"):
        ops.permute_fwd(torch.randn(T, H, device="cuda"), plan.sorted_slots,
                        plan.row_id_map.cuda(), 4)
    with pytest.raises(ValueError, match="unpermute_backward: weights is on cpu"):
        ops.unpermute_bwd(torch.randn(T, H, device="cuda"), torch.randn(8, H, device="cuda"),
                          plan.row_id_map.cuda(), plan.sorted_slots.cuda(), plan.weights)
