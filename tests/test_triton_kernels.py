"""Triton-specific checks: launch counts, the block-size heuristics, both gate paths
(single program and chunked), the bf16 rounding helper, and GPU-only properties
(no host sync, CUDA-graph capture). Value parity across all backends lives in
test_gate.py / test_permute.py / test_unpermute.py."""
from __future__ import annotations

import os

import pytest
import torch

import replay_ops
from replay_ops import reference as ref

from _helpers import capture_cuda_graph

triton = pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

import triton.language as tl  # noqa: E402

from replay_ops.triton_kernels import gate as G  # noqa: E402
from replay_ops.triton_kernels._common import cast_rne, precise_exp  # noqa: E402


class _CountingKernel:
    """Wraps a JITFunction and counts `kernel[grid](...)` launches."""

    def __init__(self, fn, log, name):
        self.fn, self.log, self.name = fn, log, name

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def run(*args, **kwargs):
            self.log.append((self.name, tuple(grid)))
            return launch(*args, **kwargs)

        return run


@pytest.fixture
def launches(monkeypatch):
    log = []
    for name in ("_gate_fwd_kernel", "_plan_scan_kernel", "_plan_scatter_kernel"):
        monkeypatch.setattr(G, name, _CountingKernel(getattr(G, name), log, name))
    return log


def _indices(T, E, K, seed, empty=0.15):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if T:
        idx[torch.rand(T, K, generator=g) < empty] = -1
    return idx.to(DEVICE)


def _assert_plan_equal(out, exp):
    for name, a, b in zip(out._fields, out, exp):
        if a is None or b is None:  # the agreement outputs, when not asked for
            assert a is b, f"{name}: {a} vs {b}"
            continue
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7, msg=name)
        else:
            assert torch.equal(a, b), f"{name} differs:\n{a}\n{b}"


def test_gate_config_pins():
    small = G.gate_config(T=512, K=8, E=64, align=1)
    assert small.single and small.num_chunks == 1
    big = G.gate_config(T=16384, K=8, E=128, align=16)
    assert not big.single
    # the statistics tile BLOCK_T x E_BLOCK is capped (it spilled at 256 x 128)
    assert big.BLOCK_T == G.STATS_TILE_ELEMS // 128 and big.E_BLOCK == 128
    assert big.num_chunks == 16384 // big.BLOCK_T
    assert big.E_HIST == 128 and big.K_PAD == 8
    assert big.SLOT_BLOCK * big.E_HIST <= G.ONE_HOT_ELEMS
    assert big.PAD_J == 16  # next_pow2(align - 1)
    odd = G.gate_config(T=5000, K=3, E=7, align=1)
    assert odd.K_PAD == 4 and odd.E_HIST == 8
    assert odd.num_chunks == triton.cdiv(5000, odd.BLOCK_T)
    bwd = G.gate_bwd_config(T=4096, K=8, E=256)
    assert bwd.BLOCK_T * bwd.K_PAD * bwd.E_BLOCK <= G.GRAD_TILE_ELEMS


@pytest.mark.parametrize("K", [1, 2, 6, 8, 64, 1024])
@pytest.mark.parametrize("E", [1, 7, 48, 128, 1000, 4096])
def test_gate_tile_cap_and_batch_independent_blocks(K, E):
    """No forward tile above its cap, and E_BLOCK (the blocking of the softmax statistics,
    hence their bits) is the same for every T."""
    if K > E:
        return
    blocks = set()
    for T in (1, 3, 64, 4096, 100000):
        cfg = G.gate_config(T, K, E, 1)
        assert cfg.BLOCK_T * cfg.E_BLOCK <= G.STATS_TILE_ELEMS
        assert cfg.SLOT_BLOCK * cfg.E_HIST <= G.ONE_HOT_ELEMS or cfg.SLOT_BLOCK == 1
        blocks.add(cfg.E_BLOCK)
    assert len(blocks) == 1


@triton.jit
def _exp_kernel(X_ptr, Y_ptr, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    tl.store(Y_ptr + o, precise_exp(tl.load(X_ptr + o, mask=m)), mask=m)


def test_precise_exp_is_within_one_ulp():
    """The fp32 exp of the gate kernels, against fp64, over its whole range: every binade
    of |x| from 2^-30 to 2^7, both signs, and the arguments whose result is subnormal. It
    uses only rounded adds, multiplies, floor and bit operations (no fusion: the launches
    turn it off), so these are the bits a GPU computes too."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    mags = torch.exp2(torch.arange(-30, 7, dtype=torch.float64).repeat_interleave(512)
                      + torch.rand(37 * 512, generator=g, dtype=torch.float64))
    x = torch.cat([mags, -mags, -87.3 - 16.7 * torch.rand(8192, generator=g,
                                                          dtype=torch.float64),
                   torch.tensor([0.0, 88.72283, 88.7229, -103.27, -103.28, -104.5, 1e-40])])
    x = x.to(torch.float32)
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 100.0, -1e4])
    xs = torch.cat([x, specials]).to(DEVICE)
    y = torch.empty_like(xs)
    _exp_kernel[(triton.cdiv(xs.numel(), 1024),)](xs, y, xs.numel(), BLOCK=1024)
    y = y.cpu()
    exact = torch.exp(x.double())
    ulp = torch.from_numpy(np.spacing(np.abs(exact.float().numpy()))).double()
    ulp = ulp.clamp(min=2.0**-149)  # the subnormal spacing
    err = ((y[:x.numel()].double() - exact).abs() / ulp)
    finite = torch.isfinite(exact.float())
    assert err[finite].max() <= 1.0, (err[finite].max(), x[finite][err[finite].argmax()])
    assert torch.isinf(y[:x.numel()][~finite]).all()
    assert (y[:x.numel()][(exact < 2.0**-126) & (exact > 2.0**-149)] > 0).all()  # no flush
    assert y[-5] == float("inf") and y[-4] == 0.0 and torch.isnan(y[-3])
    assert y[-2] == float("inf") and y[-1] == 0.0


@pytest.mark.parametrize("normalize", [False, True])
def test_sqrtsoftplus_of_a_subnormal_softplus(normalize):
    """sqrt(softplus(z)) for z where softplus(z) = exp(z) is subnormal in fp32 (z < -87.3)
    or 0 (z < -103.3), while the score exp(z / 2) is a normal number: the scores and the
    gradient match fp64 to a few ulp (a flushed softplus gave a score of 0 and a gradient
    of 0; computed through the subnormal, z = -100 kept 5 significant bits)."""
    z = torch.tensor([[-88.0, -95.0, -100.0, -103.0, -120.0, -170.0, -40.5, -39.5]])
    idx = torch.arange(z.shape[1])[None, :]
    grad = torch.tensor([[1.0, -2.0, 0.5, 3.0, -1.0, 2.0, 0.25, 1.5]])
    kw = dict(score_func="sqrtsoftplus", normalize=normalize, scaling_factor=2.5)
    lg = z.clone().to(DEVICE).requires_grad_(True)
    out = replay_ops.gate(lg, idx.to(DEVICE), backend="triton", **kw).weights
    (out * grad.to(DEVICE)).sum().backward()
    lg64 = z.double().requires_grad_(True)
    r64 = ref.gate(lg64, idx, validate=False, **kw).weights
    (r64 * grad.double()).sum().backward()
    assert (out != 0).all() and (lg.grad != 0).all()
    torch.testing.assert_close(out.detach().cpu().double(), r64.detach(), rtol=4e-7, atol=0)
    # normalised, dz_k = f'(z_k) (g_k / S - D / S^2) cancels: its error is relative to the
    # largest term
    atol = 1e-6 * lg64.grad.abs().max().item() if normalize else 0.0
    torch.testing.assert_close(lg.grad.cpu().double(), lg64.grad, rtol=1e-6, atol=atol)


def test_one_launch_when_slots_fit_one_program(launches):
    T, E, K = 64, 16, 4
    assert T * K <= G.SINGLE_PROGRAM_MAX_SLOTS
    replay_ops.gate(torch.randn(T, E, device=DEVICE), _indices(T, E, K, 0), align=16,
                    backend="triton")
    assert [name for name, _ in launches] == ["_gate_fwd_kernel"]
    assert launches[0][1] == (1,)


def test_three_launches_in_general(launches, monkeypatch):
    monkeypatch.setattr(G, "SINGLE_PROGRAM_MAX_SLOTS", 0)
    T, E, K = 70, 16, 4
    replay_ops.gate(torch.randn(T, E, device=DEVICE), _indices(T, E, K, 1), backend="triton")
    names = [name for name, _ in launches]
    assert names == ["_gate_fwd_kernel", "_plan_scan_kernel", "_plan_scatter_kernel"]
    cfg = G.gate_config(T, K, E, 1)
    assert launches[0][1] == (cfg.num_chunks,) and launches[1][1] == (1,)


# chunked path: several chunks, a partial last chunk, padding, empty slots, strided int16
CHUNKED = [  # T, E, K, align, BLOCK_T override through CHUNK_SLOTS
    (37, 7, 3, 1, 8),
    (100, 64, 8, 16, 32),
    (33, 256, 2, 128, 16),
    (9, 5, 5, 3, 4),
]


@pytest.mark.parametrize("T,E,K,align,chunk_slots", CHUNKED)
@pytest.mark.parametrize("score_func,normalize", [("softmax", False), ("sigmoid", True)])
def test_chunked_path_matches_reference(monkeypatch, T, E, K, align, chunk_slots,
                                        score_func, normalize):
    monkeypatch.setattr(G, "SINGLE_PROGRAM_MAX_SLOTS", 0)
    monkeypatch.setattr(G, "CHUNK_SLOTS", chunk_slots)
    assert G.gate_config(T, K, E, align).num_chunks > 1
    rec = torch.full((T, 3, K), 99, dtype=torch.int16, device=DEVICE)
    rec[:, 1] = _indices(T, E, K, T).to(torch.int16)
    logits = torch.randn(T, E, device=DEVICE)
    kw = dict(score_func=score_func, normalize=normalize, align=align, scaling_factor=2.5)
    out = replay_ops.gate(logits, rec[:, 1, :], backend="triton", **kw)
    _assert_plan_equal(out, ref.gate(logits, rec[:, 1, :], **kw))


def test_single_and_chunked_paths_agree_bitwise(monkeypatch):
    T, E, K = 300, 32, 6
    logits = torch.randn(T, E, device=DEVICE, dtype=torch.bfloat16)
    idx = _indices(T, E, K, 7)
    single = replay_ops.gate(logits, idx, align=8, backend="triton")
    monkeypatch.setattr(G, "SINGLE_PROGRAM_MAX_SLOTS", 0)
    chunked = replay_ops.gate(logits, idx, align=8, backend="triton")
    for name, a, b in zip(single._fields, single, chunked):
        assert a is b is None or torch.equal(a, b), name


@triton.jit
def _cast_kernel(X_ptr, Y_ptr, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    tl.store(Y_ptr + o, cast_rne(tl.load(X_ptr + o, mask=m), Y_ptr.dtype.element_ty), mask=m)


def test_cast_rne_matches_torch_bf16():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 3
    # exact ties (the low 16 bits are 0x8000), both parities, and specials
    ties = (torch.randint(0, 2**15, (256,), generator=g, dtype=torch.int32) << 16) | 0x8000
    ties = ties[(ties & 0x7F800000) != 0x7F800000]  # finite ones; NaN is checked below
    nan_bits = torch.tensor([0x7FC00000, 0x7FFF8000, 0x7F800001, -1], dtype=torch.int32)
    x = torch.cat([x, ties.view(torch.float32),
                   torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.3895e38]),
                   nan_bits.view(torch.float32)])
    x = x.to(DEVICE)
    y = torch.empty_like(x, dtype=torch.bfloat16)
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    finite = ~torch.isnan(x)
    assert torch.equal(y[finite].view(torch.int16), x[finite].to(torch.bfloat16).view(torch.int16))
    assert torch.isnan(y[~finite]).all()


@pytest.mark.gpu
def test_validate_false_gate_does_not_sync():
    T, E, K = 4096, 64, 4
    logits = torch.randn(T, E, device="cuda")
    idx = _indices(T, E, K, 3)
    mask = torch.rand(T, device="cuda") > 0.1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = replay_ops.gate(logits, idx, replay_mask=mask, validate=False, backend="triton")
        h = torch.randn(T, 128, device="cuda")
        x = replay_ops.permute(h, plan, num_rows=plan.max_rows, validate=False, backend="triton")
        replay_ops.unpermute(x, plan, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    T, E, K, H = 512, 32, 4, 256
    logits = torch.randn(T, E, device="cuda")
    idx = _indices(T, E, K, 4).to(torch.int32)
    h = torch.randn(T, H, device="cuda")

    def step():
        plan = replay_ops.gate(logits, idx, validate=False, align=16, backend="triton")
        x = replay_ops.permute(h, plan, num_rows=plan.max_rows, validate=False,
                               backend="triton")
        return replay_ops.unpermute(x * 2, plan, backend="triton")

    graph, out = capture_cuda_graph(step)  # the warm-up call compiles the kernels
    logits.copy_(torch.randn(T, E, device="cuda"))
    idx.copy_(_indices(T, E, K, 5))
    graph.replay()
    torch.cuda.synchronize()
    plan = ref.gate(logits, idx, align=16)
    expected = ref.unpermute(ref.permute(h, plan, num_rows=plan.max_rows) * 2, plan)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("s", [0.7, 2.5, 1.0, 1e-3, 16.0, 1 / 3, 123456.789])
def test_split_scale_keeps_fp64_precision(s):
    """Triton passes a Python float argument as fp32; the gate kernels take the scale as
    an fp32 (hi, lo) pair so fp64 gates see it to ~48 bits, and fp32 gates see fp32(s)."""
    import numpy as np

    hi, lo = G.split_scale(s)
    assert float(np.float32(hi)) == hi and float(np.float32(lo)) == lo  # both fp32
    assert abs((hi + lo) - s) <= abs(s) * 2.0**-46
    assert np.float32(np.float32(hi) + np.float32(lo)) == np.float32(s)


def test_unpermute_backward_with_many_slots():
    """dw of the unpermute backward keeps one accumulator per slot (dout is read once per
    column block): K = 100 (K_PAD 128, fewer token rows per program) and H = 300 (a
    partial column block) against the torch backend, and the same bits for a token
    whatever the batch size."""
    from replay_ops import backends
    from replay_ops.triton_kernels.unpermute import unpermute_bwd

    torch_backend = backends.load("torch")

    T, E, K, H = 9, 128, 100, 300
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(T, E, generator=g).to(DEVICE)
    idx = _indices(T, E, K, 3)
    plan = replay_ops.gate(logits, idx, backend="triton")
    R = plan.num_rows()
    x = torch.randn(R, H, generator=g).to(DEVICE)
    dout = torch.randn(T, H, generator=g).to(DEVICE)
    args = (plan.row_id_map, plan.sorted_slots, plan.weights)
    out_dx, out_dw = unpermute_bwd(dout, x, *args)
    ref_dx, ref_dw = torch_backend.unpermute_bwd(dout, x, *args)
    torch.testing.assert_close(out_dx, ref_dx, rtol=0, atol=0)
    torch.testing.assert_close(out_dw, ref_dw, rtol=1e-5, atol=1e-5)
    assert (out_dw[idx < 0] == 0).all()
    # tokens 0..2 alone: their rows of x, their slots
    sub = replay_ops.gate(logits[:3], idx[:3], backend="triton")
    rows = plan.row_id_map[:3]
    x3 = torch.zeros(sub.num_rows(), H, device=DEVICE)
    ok = sub.row_id_map >= 0
    x3[sub.row_id_map[ok].long()] = x[rows[ok].long()]
    _, dw3 = unpermute_bwd(dout[:3], x3, sub.row_id_map, sub.sorted_slots, sub.weights)
    assert torch.equal(dw3, out_dw[:3])
