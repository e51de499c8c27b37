"""GPU test of tensors with more than 2**31 elements (CUDA only: it skips without a GPU, or
when the device has too little free memory, saying how much it needs).

permute, unpermute, permute_backward and unpermute_backward with R*H > 2**31 (R = 320000
permuted rows of H = 7168 bf16 values: 4.6 GB per [R, H] tensor), on the native CUDA
kernels and the Triton kernels. An element offset computed in 32 bits wraps for every row
past 2**31 / H = 299593; about 20000 of the rows lie there. Every output row is checked
against the definition, in chunks: the copies exactly, the sums with the flash-attention
rule against fp64."""
from __future__ import annotations


import pytest
import torch

import replay_ops
from replay_ops import reference as ref

from _helpers import FLOOR, assert_fa_close, make_indices

import gpu_workloads as W  # tools/ (pyproject's pytest pythonpath)

TIME_LIMIT_S = 600
T, E, K, H = 40000, 64, 8, 7168
R = T * K  # align 1, no empty slot: every slot takes a row
DTYPE = torch.bfloat16
# hidden + x [R, H] + grad_x [R, H] + grad_hidden + the chunked checks (fp64 chunks)
NEED_BYTES = (2 * R * H + 3 * T * H) * 2 + (2 << 30)
CHUNK_ROWS = 1 << 15
CHUNK_TOKENS = 1 << 10


def on_cuda(backend):
    reason = W.cuda_reason(backend)
    return [pytest.mark.gpu, pytest.mark.skipif(bool(reason), reason=reason or "")]


@pytest.fixture(autouse=True)
def _bounded(request):
    with W.time_limit(TIME_LIMIT_S, request.node.nodeid):
        yield


def test_the_sizes_pass_2_31():
    assert R * H > 2**31 and T * H < 2**31
    assert R - (2**31 + H - 1) // H > 10000  # rows past the int32 element offset


def _require_free_memory():
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    if free < NEED_BYTES:
        pytest.skip(f"needs about {NEED_BYTES / 2**30:.1f} GiB of free GPU memory; "
                    f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB are free")


def _gather_sum(rows_src, rid, w, cast):
    """sum_k w[t, k] * rows_src[rid[t, k]] over a chunk of tokens, in `cast`, column order
    (w=None: plain sums)."""
    valid = rid >= 0
    acc = torch.zeros(rid.shape[0], rows_src.shape[1], dtype=cast, device=rows_src.device)
    for k in range(rid.shape[1]):
        v = rows_src[rid[:, k].clamp_min(0).long()].to(cast)
        if w is not None:
            v = w[:, k, None].to(cast) * v
        acc = acc + torch.where(valid[:, k, None], v, 0)
    return acc


class FaRule:
    """The rule of `_helpers.assert_fa_close` over a tensor checked in chunks, on the device
    (the whole [T, H] result in fp64 on the host would cost more than the test): the largest
    error against the fp64 reference, over every chunk, is at most 2x the largest error of
    the same-precision reference plus the dtype's floor; no NaN where the reference has none."""

    def __init__(self, dtype, what):
        self.dtype, self.what = dtype, what
        self.err = self.ref_err = 0.0
        self.worst = None

    def add(self, out, same, r64, where):
        assert out.dtype == same.dtype == self.dtype and out.shape == r64.shape, self.what
        o = out.double()
        assert not torch.isnan(o).any() or torch.isnan(r64).any(), f"{self.what}: NaN, {where}"
        err = (o - r64).abs().nan_to_num(nan=float("inf")).max().item()
        self.ref_err = max(self.ref_err,
                           (same.double() - r64).abs().nan_to_num(nan=0.0).max().item())
        if err > self.err or self.worst is None:
            self.err, self.worst = err, where

    def check(self):
        bound = 2 * self.ref_err + FLOOR[self.dtype]
        assert self.err <= bound, (
            f"{self.what} ({self.dtype}): max error vs fp64 reference {self.err:.3e} > bound "
            f"{bound:.3e} (2 x same-precision reference error {self.ref_err:.3e} + floor); "
            f"worst at {self.worst}")


def _check_gather_sum(out, rows_src, plan, weighted, what):
    rule = FaRule(out.dtype, what)
    for t0 in range(0, T, CHUNK_TOKENS):
        sl = slice(t0, min(T, t0 + CHUNK_TOKENS))
        rid = plan.row_id_map[sl]
        w = plan.weights[sl] if weighted else None
        same = _gather_sum(rows_src, rid, w, torch.float32).to(DTYPE)
        r64 = _gather_sum(rows_src, rid, w, torch.float64)
        rule.add(out[sl], same, r64, f"tokens {sl.start}..{sl.stop}")
    rule.check()


@pytest.mark.parametrize("backend", [pytest.param(b, id=f"cuda-{b}", marks=on_cuda(b))
                                     for b in ("native", "triton")])
def test_gpu_permute_unpermute_and_backward_past_2_31_elements(backend):
    _require_free_memory()
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = make_indices(T, E, K, dtype=torch.int32, seed=1).to("cuda")
    logits = torch.randn(T, E, device="cuda", generator=g).to(DTYPE)
    plan = ref.gate(logits, idx)  # the plan from the reference, independent of the backend
    assert plan.max_rows == R and int(plan.expert_offsets[-1]) == R
    ss = plan.sorted_slots.long()
    hidden = torch.randn(T, H, device="cuda", generator=g, dtype=DTYPE)

    # permute: row r is hidden[sorted_slots[r] // K], exactly
    x = replay_ops.permute(hidden, plan, R, validate=False, backend=backend)
    assert x.shape == (R, H)
    for r0 in range(0, R, CHUNK_ROWS):
        sl = slice(r0, min(R, r0 + CHUNK_ROWS))
        assert torch.equal(x[sl], hidden[ss[sl] // K]), f"permute: rows {sl.start}..{sl.stop}"

    # unpermute: y[t] = sum_k w[t, k] * x[row_id_map[t, k]]
    y = replay_ops.unpermute(x, plan, validate=False, backend=backend)
    _check_gather_sum(y, x, plan, True, "unpermute")
    del y

    # permute_backward: grad_hidden[t] = sum_k grad_x[row_id_map[t, k]] (grad_x := x)
    gh = torch.ops.replay.permute_backward(x, plan.row_id_map, backend)
    _check_gather_sum(gh, x, plan, False, "permute_backward")
    del gh

    # unpermute_backward with grad_y := hidden: grad_x[r] = w[s] * hidden[s // K] (s =
    # sorted_slots[r]), grad_w[t, k] = <hidden[t], x[row_id_map[t, k]]>
    gx, gw = torch.ops.replay.unpermute_backward(hidden, x, plan.row_id_map, plan.sorted_slots,
                                                  plan.weights, backend)
    assert gx.shape == (R, H) and gw.shape == (T, K)
    # bf16 weights times bf16 values is exact in fp32, so the one rounding to bf16 fixes
    # every bit of grad_x: compare exactly.
    wflat = plan.weights.reshape(-1)
    assert plan.weights.dtype == DTYPE
    for r0 in range(0, R, CHUNK_ROWS):
        sl = slice(r0, min(R, r0 + CHUNK_ROWS))
        s = ss[sl]
        want = (wflat[s].float()[:, None] * hidden[s // K].float()).to(DTYPE)
        assert torch.equal(gx[sl], want), f"unpermute_backward grad_x, rows {sl.start}..{sl.stop}"
    same, r64 = [], []  # grad_w is small: [T, K]
    for t0 in range(0, T, CHUNK_TOKENS):
        sl = slice(t0, min(T, t0 + CHUNK_TOKENS))
        rows = x[plan.row_id_map[sl].long().reshape(-1)].view(-1, K, H)
        go = hidden[sl]
        same.append((go.float()[:, None, :] * rows.float()).sum(-1).to(gw.dtype))
        r64.append((go.double()[:, None, :] * rows.double()).sum(-1))
    assert_fa_close(gw, torch.cat(same), torch.cat(r64), "unpermute_backward grad_w")
