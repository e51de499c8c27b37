"""GPU workloads with their checks: shared by the GPU tests (tests/test_gpu_*.py), which call
the case functions in-process, and by the compute-sanitizer runs, which run this file as a
script in a child process.

    python tools/gpu_workloads.py garbage   # validate=False with indices outside [0, E)
    python tools/gpu_workloads.py mix       # bf16, strided int16 indices, misaligned views
    python tools/gpu_workloads.py mix --backends native
    python tools/gpu_workloads.py select    # the model's own selection of flagged rows, agreement

Every case runs on the CUDA device the native kernels (on each gate launch path:
single_cta, cooperative, three_launches) and the Triton kernels (single program and
chunked), and compares the results with `replay_ops.reference`: integers exactly, floats with
the flash-attention rule of replay_ops.testing.checks against the fp64 reference. The inputs are built
on the CPU and the results are copied back to the CPU before they are compared, so the device
work of a case is the kernels under test, the copies, and the few PyTorch ops the public calls
make (casts, `contiguous`), and every output element is read back by a device-to-host copy,
which initcheck also watches. The script prints `OK <n> cases` at the end and exits non-zero
on the first failed check.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading

import torch

import replay_ops
from replay_ops import reference as ref
from replay_ops.scores import NAMES as SCORE_FUNCS
from replay_ops.testing.checks import (
    assert_fa_close,
    assert_int_equal,
    assert_plan_ints_equal,
    check_plan_structure,
    gen,
    make_indices,
    make_logits,
    strided_indices,
)

DEV = "cuda"
BACKENDS = ("native", "triton")
# The launch paths of the native CUDA gate (torch.ops.replay_native.cuda_gate_path).
NATIVE_PATHS = ("single_cta", "cooperative", "three_launches")
NATIVE_SINGLE_CTA_MAX_SLOTS = 8192  # replay_cuda::kSmallSlots: T*K of the one-CTA path


# ------------------------------------------------------------------------- utilities
@contextlib.contextmanager
def gate_path(name: str | None):
    """Run the native CUDA gate on one launch path inside the block (None: leave it)."""
    if name is None:
        yield
        return
    prev = torch.ops.replay_native.cuda_gate_path(name)
    try:
        yield
    finally:
        torch.ops.replay_native.cuda_gate_path(prev)


@contextlib.contextmanager
def time_limit(seconds: int, what: str):
    """Raise TimeoutError in the block after `seconds` (SIGALRM; main thread only). A test
    stuck in a hung kernel is then reported instead of stalling the whole run."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"{what}: ran past its time limit of {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def triton_is_single_program(T: int, E: int, K: int, align: int) -> bool:
    from replay_ops.triton_kernels import gate as G

    return G.gate_config(T, K, E, align).single


def cpu(t):
    return None if t is None else t.detach().cpu()


def plan_cpu(plan):
    return type(plan)(*(cpu(t) for t in plan))


def grad_of_gate(gate_fn, logits, idx, grad_w, **kw):
    """d(sum(weights * grad_w)) / d logits, through autograd."""
    x = logits.detach().clone().requires_grad_(True)
    (gate_fn(x, idx, **kw).weights * grad_w.to(x.dtype)).sum().backward()
    return x.grad


# ------------------------------------------------------------- indices outside [0, E)
def garbage_values(E: int, dtype: torch.dtype) -> list[int]:
    """Values outside [0, E) that a corrupt or foreign recording can hold, for one index
    dtype. int64 ones whose low 32 bits are a valid expert (2**32 + 3 -> 3) catch a range
    check made after a narrowing to int32."""
    common = [E, E + 3, -5, -2]
    if dtype == torch.int16:
        return common + [32767, -32768]
    if dtype == torch.int32:
        return common + [2**31 - 1, -(2**31)]
    return common + [2**32 + 3, -(2**32) + 3, 2**32, 2**63 - 1, -(2**63), 2**31 + 7]


def garbage_indices(T: int, E: int, K: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[T, K] indices (CPU): distinct valid experts, -1 slots, and about 30% of the slots
    replaced by values outside [0, E). Every garbage value occurs; row 1 holds garbage only."""
    idx = make_indices(T, E, K, dtype=torch.int64, seed=seed, empty=0.1)
    vals = garbage_values(E, dtype)
    g = gen(seed + 1)
    pick = torch.rand(T, K, generator=g) < 0.3
    bad = torch.tensor(vals, dtype=torch.int64)[torch.randint(len(vals), (T, K), generator=g)]
    idx = torch.where(pick, bad, idx)
    flat = idx.view(-1)
    for j, v in enumerate(vals):  # each value at least once, spread over the tokens
        flat[(j * 7919 + 3) % flat.numel()] = v
    if T > 1:
        idx[1] = torch.tensor([vals[j % len(vals)] for j in range(K)], dtype=torch.int64)
    return idx.to(dtype)


def check_garbage_case(backend: str, path: str | None, T: int, E: int, K: int,
                       index_dtype: torch.dtype, align: int = 4, seed: int = 0) -> int:
    """validate=False with indices outside [0, E) on CUDA: such slots are empty (weight 0,
    expert_indices -1, row_id_map -1, no row, not counted) for every score function and
    normalize setting; forward, backward through autograd, a direct gate_backward call with
    the raw int32 indices, and permute/unpermute of the plan. Returns the number of checks."""
    idx_c = garbage_indices(T, E, K, index_dtype, seed=seed)
    wide = idx_c.to(torch.int64)
    valid = (wide >= 0) & (wide < E)
    used = torch.where(valid, wide, -1).to(torch.int32)  # what the plan must hold
    assert (~valid & (wide != -1)).any(), "the case holds no garbage value"
    logits_c = make_logits(T, E, torch.float32, seed=seed + 2)
    grad_w_c = torch.randn(T, K, generator=gen(seed + 3))
    hidden_c = torch.randn(T, 40, generator=gen(seed + 4))
    idx, logits, grad_w, hidden = (t.to(DEV) for t in (idx_c, logits_c, grad_w_c, hidden_c))
    n = 0
    for sf in SCORE_FUNCS:
        for normalize in (True, False):
            kw = dict(score_func=sf, normalize=normalize, scaling_factor=1.5)
            what = f"{backend}/{path} {index_dtype} {sf} normalize={normalize}"
            with gate_path(path):
                plan = replay_ops.gate(logits, idx, align=align, validate=False,
                                       backend=backend, **kw)
                grad = grad_of_gate(lambda x, i, **k: replay_ops.gate(
                    x, i, align=align, validate=False, backend=backend, **k),
                    logits, idx, grad_w, **kw)
            out = plan_cpu(plan)
            # the definition, without the reference
            bad = ~valid
            assert torch.equal(out.weights[bad], torch.zeros_like(out.weights[bad])), \
                f"{what}: weights of slots outside [0, E) must be 0"
            assert (out.expert_indices[bad] == -1).all(), f"{what}: expert_indices must be -1"
            assert (out.row_id_map[bad] == -1).all(), f"{what}: row_id_map must be -1"
            counts = torch.bincount(wide[valid], minlength=E).to(torch.int32)
            assert_int_equal(out.tokens_per_expert, counts, f"{what}: tokens_per_expert")
            check_plan_structure(out, used, E, align)
            # the reference
            want = ref.gate(logits_c, idx_c, align=align, validate=False, **kw)
            assert_plan_ints_equal(out, want)
            w64 = ref.gate(logits_c.double(), idx_c, align=align, validate=False, **kw).weights
            assert_fa_close(out.weights, want.weights, w64, f"{what}: weights")
            ref_grad = grad_of_gate(ref.gate, logits_c, idx_c, grad_w_c, validate=False, **kw)
            ref_grad64 = grad_of_gate(ref.gate, logits_c.double(), idx_c, grad_w_c,
                                      validate=False, **kw)
            assert_fa_close(cpu(grad), ref_grad, ref_grad64, f"{what}: grad logits")
            n += 3
    # gate_backward called directly with the raw indices (int32: the dtype the op takes)
    if index_dtype == torch.int32:
        kw = dict(score_func="sigmoid", normalize=True, scaling_factor=1.5)
        raw = torch.ops.replay.gate_backward(grad_w, logits, idx, kw["score_func"],
                                             kw["normalize"], kw["scaling_factor"], backend)
        ref_grad = grad_of_gate(ref.gate, logits_c, idx_c, grad_w_c, validate=False, **kw)
        ref_grad64 = grad_of_gate(ref.gate, logits_c.double(), idx_c, grad_w_c,
                                  validate=False, **kw)
        assert_fa_close(cpu(raw), ref_grad, ref_grad64,
                        f"{backend}: gate_backward with raw indices outside [0, E)")
        n += 1
    # the plan drives permute and unpermute: garbage slots take no row and add nothing
    x = replay_ops.permute(hidden, plan, plan.max_rows, validate=False, backend=backend)
    y = replay_ops.unpermute(x, plan, backend=backend)
    want_x = ref.permute(hidden_c, out, plan.max_rows)
    assert torch.equal(cpu(x), want_x), f"{backend}/{path}: permute of a garbage-index plan"
    want64 = ref.unpermute(want_x.double(), out._replace(weights=out.weights.double()))
    assert_fa_close(cpu(y), ref.unpermute(want_x, out), want64, f"{backend}/{path}: unpermute")
    return n + 2


def garbage_cases() -> list[tuple]:
    """(backend, path, T, E, K): for native the gate launch path (single_cta, cooperative,
    three_launches, or auto), for Triton "single" (one program, T*K <= 4096) or "chunked"
    (three launches); the small shape fits the single-CTA / single-program paths, the large
    one (T*K > 8192) needs the multi-CTA / multi-program ones."""
    small, large = (300, 64, 6), (2000, 96, 6)
    cases = [("native", p, *small) for p in NATIVE_PATHS]
    cases += [("native", p, *large) for p in ("cooperative", "three_launches", "auto")]
    cases += [("triton", "single", *small), ("triton", "chunked", *large)]
    return cases


def check_case_path(backend: str, path: str, T: int, E: int, K: int, align: int = 4) -> None:
    """The case takes the path it is named after."""
    if backend == "native":
        if path == "single_cta":
            assert T * K <= NATIVE_SINGLE_CTA_MAX_SLOTS, (T, K)
        if path == "auto":
            assert T * K > NATIVE_SINGLE_CTA_MAX_SLOTS, (T, K)  # auto: a multi-CTA launch
    else:
        single = triton_is_single_program(T, E, K, align)
        assert single == (path == "single"), f"Triton gate_config(T={T}, K={K}) single={single}"


def native_path(backend: str, path: str) -> str | None:
    """The native gate path to force (None for Triton, whose path follows from T*K)."""
    return path if backend == "native" else None


# ------------------------------------------------------------------- the mixed chain
def mix_cases() -> list[tuple]:
    """(backend, path, T, dtype): every native gate launch path and both Triton gate paths,
    in bf16, and one fp32 case each (E=64, K=8)."""
    return [("native", "single_cta", 900, torch.bfloat16),
            ("native", "cooperative", 1100, torch.bfloat16),
            ("native", "three_launches", 1100, torch.bfloat16),
            ("native", "auto", 1100, torch.float32),
            ("triton", "single", 400, torch.bfloat16),
            ("triton", "chunked", 1100, torch.bfloat16),
            ("triton", "chunked", 1100, torch.float32)]


def check_mix_case(backend: str, path: str | None, T: int, dtype: torch.dtype,
                   E: int = 64, K: int = 8, H: int = 260, align: int = 16, seed: int = 0) -> int:
    """gate -> permute -> unpermute -> backward with the inputs real callers pass:
    strided int16 indices (a [T, L, K] recording sliced at one layer), `hidden[:, 1:]`
    (not contiguous), `expert_out[1:]` (contiguous, its base 8 bytes off a 16-byte boundary
    in bf16 at H=260), and, at H=256 where rows are whole 16-byte vectors, `hidden` and
    `expert_out` views whose base is 2 bytes off. Returns the number of checks."""
    what = f"{backend}/{path} T={T} {dtype}"
    rec_c, idx_c = strided_indices(T, E, K, L=3, layer=1, dtype=torch.int16, seed=seed + 1,
                                   empty=0.1)
    rec = rec_c.to(DEV)
    idx = rec[:, 1, :]
    assert idx.stride() != (K, 1) and idx.dtype == torch.int16
    logits_c = make_logits(T, E, dtype, seed=seed + 2)
    hfull_c = torch.randn(T, H + 1, generator=gen(seed + 3)).to(dtype)
    gy_c = torch.randn(T, H, generator=gen(seed + 4))
    sf, normalize = ("softmax", False) if T % 2 else ("sigmoid", True)
    kw = dict(score_func=sf, normalize=normalize, scaling_factor=2.0, align=align)

    def chain(gate, permute, unpermute, lg, hfull, idx, cast, max_rows=None):
        lg = lg.to(cast).detach().requires_grad_(True)
        hfull = hfull.to(cast).detach().requires_grad_(True)
        plan = gate(lg, idx, **kw)
        rows = plan.max_rows if max_rows is None else max_rows
        x = permute(hfull[:, 1:], plan, rows)
        pad = torch.zeros(1, H, dtype=cast, device=x.device)
        eo = torch.cat([pad, x * 1.5])[1:]  # contiguous, base one row past the allocation
        y = unpermute(eo, plan)
        acc = torch.float64 if cast == torch.float64 else torch.float32
        (y.to(acc) * gy_c.to(y.device, acc)).sum().backward()
        return plan, x, y, lg.grad, hfull.grad

    with gate_path(path):
        out = chain(
            lambda lg, i, **k: replay_ops.gate(lg, i, validate=False, backend=backend, **k),
            lambda h, p, r: replay_ops.permute(h, p, r, validate=False, backend=backend),
            lambda e, p: replay_ops.unpermute(e, p, backend=backend),
            logits_c.to(DEV), hfull_c.to(DEV), idx, dtype)
    plan, x, y, g_lg, g_h = out
    plan = plan_cpu(plan)
    x, y, g_lg, g_h = (cpu(t) for t in (x, y, g_lg, g_h))
    same = chain(lambda lg, i, **k: ref.gate(lg, i, **k), ref.permute, ref.unpermute,
                 logits_c, hfull_c, idx_c, dtype, plan.max_rows)
    r64 = chain(lambda lg, i, **k: ref.gate(lg, i, **k), ref.permute, ref.unpermute,
                logits_c, hfull_c, idx_c, torch.float64, plan.max_rows)
    assert_plan_ints_equal(plan, same[0])
    assert_fa_close(plan.weights, same[0].weights, r64[0].weights, f"{what}: weights")
    assert torch.equal(x, same[1]), f"{what}: permute of hidden[:, 1:] must be an exact copy"
    for name, o, s, r in zip(("unpermute(expert_out[1:])", "grad logits", "grad hidden"),
                             (y, g_lg, g_h), same[2:], r64[2:]):
        assert_fa_close(o, s, r, f"{what}: {name}")
    n = 6
    # Rows of whole 16-byte vectors with a base 2 bytes off the vector boundary.
    if dtype in (torch.bfloat16, torch.float16):
        H2 = 256
        buf_c = torch.randn(T * H2 + 1, generator=gen(seed + 5)).to(dtype)
        hm_c = buf_c[1:].view(T, H2)
        hm = buf_c.to(DEV)[1:].view(T, H2)
        assert hm.data_ptr() % 16 != 0
        dplan = tuple(None if t is None else t.to(DEV) for t in plan)
        dplan = type(plan)(*dplan)
        x2 = replay_ops.permute(hm, dplan, plan.max_rows, validate=False, backend=backend)
        assert torch.equal(cpu(x2), ref.permute(hm_c, plan, plan.max_rows)), \
            f"{what}: permute of a misaligned hidden"
        ebuf_c = torch.randn(plan.max_rows * H2 + 1, generator=gen(seed + 6)).to(dtype)
        em_c = ebuf_c[1:].view(plan.max_rows, H2)
        em = ebuf_c.to(DEV)[1:].view(plan.max_rows, H2)
        y2 = replay_ops.unpermute(em, dplan, backend=backend)
        p64 = plan._replace(weights=plan.weights.double())
        assert_fa_close(cpu(y2), ref.unpermute(em_c, plan), ref.unpermute(em_c.double(), p64),
                        f"{what}: unpermute of a misaligned expert_out")
        n += 2
    return n


# ------------------------------------------------------- the model's own selection
def select_cases() -> list[tuple]:
    """(backend, path, T, dtype): the selection of flagged rows with the agreement outputs on
    every native gate launch path and both Triton gate paths (E=64, K=8)."""
    return [("native", "single_cta", 200, torch.bfloat16),
            ("native", "cooperative", 1100, torch.bfloat16),
            ("native", "three_launches", 1100, torch.float32),
            ("triton", "single", 200, torch.bfloat16),
            ("triton", "chunked", 1100, torch.float32)]


def check_select_case(backend: str, path: str | None, T: int, dtype: torch.dtype,
                      E: int = 64, K: int = 8, seed: int = 0) -> int:
    """gate and gate_dense with strided int16 indices holding -1 slots, repeats and ids out
    of range, a replay mask, padding="select", DeepSeek-V3's selection (sigmoid, expert bias,
    8 groups, 4 kept) and the agreement outputs, forward and backward (weights and
    set_logprob), against the reference. Returns the number of checks."""
    from replay_ops.options import Selection

    what = f"select {backend}/{path} T={T} {dtype}"
    rec_c, idx_c = strided_indices(T, E, K, L=3, layer=1, dtype=torch.int16, seed=seed + 1,
                                   empty=0.1)
    idx_c[2::11, 0] = idx_c[2::11, 1]  # repeats
    idx_c[3::13, K - 1] = E  # out of range
    rec_c[:, 1, :] = idx_c
    idx = rec_c.to(DEV)[:, 1, :]
    logits_c = make_logits(T, E, dtype, seed=seed + 2)
    mask_c = torch.rand(T, generator=gen(seed + 3)) > 0.1
    bias_c = torch.linspace(0.05, -0.05, E)
    gw_c = torch.randn(T, K, generator=gen(seed + 4))
    glp_c = torch.randn(T, generator=gen(seed + 5))
    n = 0
    for dense in (False, True):
        def run(lg, i, m, bias, **k):
            sel = Selection.deepseek_v3(expert_bias=bias, n_group=8, topk_group=4)
            kw = dict(score_func="sigmoid", selection=sel, replay_mask=m, padding="select",
                      return_agreement=True)
            if dense:
                return ref.gate_dense(lg, i, **kw) if k.get("ref") else replay_ops.gate_dense(
                    lg, i, validate=False, backend=backend, **kw)
            return ref.gate(lg, i, validate=False, **kw) if k.get("ref") else replay_ops.gate(
                lg, i, validate=False, backend=backend, **kw)

        def grad(out, lg):
            w = out.probs.gather(1, out.expert_indices.long().clamp(min=0)) if dense else \
                out.weights
            lp = out.set_logprob
            loss = (w.float() * gw_c.to(w.device)).sum() + (lp * glp_c.to(lp.device, lp.dtype)).sum()
            (g,) = torch.autograd.grad(loss, lg)
            return g

        lg = logits_c.to(DEV).requires_grad_(True)
        with gate_path(path):
            out = run(lg, idx, mask_c.to(DEV), bias_c.to(DEV))
            g = cpu(grad(out, lg))
        lgr = logits_c.clone().requires_grad_(True)
        want = run(lgr, idx_c, mask_c, bias_c, ref=True)
        gr = grad(want, lgr)
        lg64 = logits_c.double().requires_grad_(True)
        g64 = grad(run(lg64, idx_c, mask_c, bias_c.double(), ref=True), lg64)
        assert_int_equal(cpu(out.expert_indices), want.expert_indices, f"{what}: expert_indices")
        assert torch.equal(cpu(out.agreement), want.agreement), f"{what}: agreement"
        torch.testing.assert_close(cpu(out.set_logprob), want.set_logprob, rtol=1e-5, atol=1e-5)
        if dense:
            assert torch.equal(cpu(out.routing_map), want.routing_map), f"{what}: routing_map"
        else:
            assert_plan_ints_equal(plan_cpu(out), want)
        assert_fa_close(g, gr, g64, f"{what}: grad logits (dense={dense})")
        n += 4
    return n


# ---------------------------------------------------------------------------- script
def cuda_reason(backend: str | None = None) -> str | None:
    """Why a CUDA test or workload cannot run here (None: it can): no device, or `backend`
    not usable for CUDA tensors (the registry's reason)."""
    if not torch.cuda.is_available():
        return "needs a CUDA device; none is present on this machine"
    if backend is not None:
        from replay_ops import backends

        verdict = backends.available(backend, "cuda")
        if not verdict:
            return f"the {backend} backend is not usable for CUDA tensors: {verdict.reason}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", choices=["garbage", "mix", "select"])
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help="comma-separated; a backend that is not usable here is an error")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("gpu_workloads: TRITON_INTERPRET=1 is set; these workloads run compiled kernels")
        return 2
    wanted = [b for b in args.backends.split(",") if b]
    for b in wanted or [None]:
        reason = cuda_reason(b)
        if reason:
            print(f"gpu_workloads: {reason}")
            return 2
    n = 0
    if args.workload == "garbage":
        for backend, path, T, E, K in garbage_cases():
            if backend not in wanted:
                continue
            check_case_path(backend, path, T, E, K)
            for dt in (torch.int16, torch.int32, torch.int64):
                n += check_garbage_case(backend, native_path(backend, path), T, E, K, dt)
                print(f"ok garbage {backend} {path} T={T} E={E} K={K} {dt}", flush=True)
    elif args.workload == "select":
        for backend, path, T, dtype in select_cases():
            if backend not in wanted:
                continue
            check_case_path(backend, path, T, 64, 8)
            n += check_select_case(backend, native_path(backend, path), T, dtype)
            print(f"ok select {backend} {path} T={T} {dtype}", flush=True)
    else:
        for backend, path, T, dtype in mix_cases():
            if backend not in wanted:
                continue
            check_case_path(backend, path, T, 64, 8, align=16)
            n += check_mix_case(backend, native_path(backend, path), T, dtype)
            print(f"ok mix {backend} {path} T={T} {dtype}", flush=True)
    torch.cuda.synchronize()
    print(f"OK {n} cases", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
