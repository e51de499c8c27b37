"""Checks shared by the tests, `tools/gpu_workloads.py` and the benchmarks (not needed to
use the ops): seeded input builders, the flash-attention tolerance rule against the fp64
reference, exact comparison of integer outputs, the plan's structural invariants (from its
definition alone, no reference), and a counter of the host's reads of tensor memory."""
from __future__ import annotations

import torch

# Flash-attention rule: |out - ref64| <= 2 * |ref_same_precision - ref64| + FLOOR[dtype].
# The floor only absorbs the case where the same-precision reference happens to be exact.
FLOOR = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.float16: 1e-4,
    torch.bfloat16: 1e-3,
}



# --------------------------------------------------------------------------- inputs
def gen(seed: int = 0) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def make_logits(T, E, dtype=torch.float32, device="cpu", seed=0, scale=2.0):
    x = torch.randn(T, E, generator=gen(seed), dtype=torch.float64) * scale
    return x.to(dtype).to(device)


def make_indices(T, E, K, *, dtype=torch.int32, device="cpu", seed=1, empty=0.0):
    """[T, K] distinct experts per row in random (unsorted) order; a fraction `empty` of
    the slots (and, when empty > 0 and T >= 3, one whole row) set to -1."""
    g = gen(seed)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    if empty > 0 and T > 0:
        drop = torch.rand(T, K, generator=g) < empty
        idx = torch.where(drop, -1, idx)
        if T >= 3:
            idx[T // 2] = -1
    return idx.to(dtype).to(device)


def strided_indices(T, E, K, *, L=3, layer=1, dtype=torch.int32, device="cpu", seed=1, empty=0.0):
    """A [T, L, K] recording; returns (recording, recording[:, layer, :]) (a strided view)."""
    rec = torch.stack(
        [make_indices(T, E, K, dtype=dtype, seed=seed + 17 * l, empty=empty) for l in range(L)],
        dim=1,
    ).to(device)
    view = rec[:, layer, :]
    return rec, view


# ------------------------------------------------------------------------ tolerance
def assert_fa_close(out, ref_same, ref64, what="output"):
    """The flash-attention rule: the output's error against the fp64 reference is at most
    2x the error of the same-precision reference, plus a tiny floor."""
    assert out.dtype == ref_same.dtype, f"{what}: dtype {out.dtype} != {ref_same.dtype}"
    assert out.shape == ref64.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    assert out.device == ref_same.device, f"{what}: device {out.device} != {ref_same.device}"
    if out.numel() == 0:
        return
    o, r, r64 = (t.detach().double().cpu() for t in (out, ref_same, ref64))
    assert not torch.isnan(o).any() or torch.isnan(r64).any(), f"{what}: NaN in output"
    err = (o - r64).abs().nan_to_num(nan=float("inf")).max().item()
    ref_err = (r - r64).abs().nan_to_num(nan=0.0).max().item()
    bound = 2 * ref_err + FLOOR[out.dtype]
    if err > bound:
        i = int((o - r64).abs().nan_to_num(nan=float("inf")).argmax())
        raise AssertionError(
            f"{what} ({out.dtype}): max error vs fp64 reference {err:.3e} > bound {bound:.3e} "
            f"(2 x same-precision reference error {ref_err:.3e} + floor); worst flat index "
            f"{i}: out={o.flatten()[i].item()!r} ref64={r64.flatten()[i].item()!r}"
        )


def assert_int_equal(out, ref_out, what):
    assert out.dtype == ref_out.dtype, f"{what}: dtype {out.dtype} != {ref_out.dtype}"
    assert out.shape == ref_out.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref_out.shape)}"
    if not torch.equal(out.cpu(), ref_out.cpu()):
        diff = (out.cpu() != ref_out.cpu()).nonzero()[:5].tolist()
        raise AssertionError(
            f"{what}: integer outputs differ at {diff}:\n"
            f"out={out.cpu().tolist()}\nref={ref_out.cpu().tolist()}"
        )


PLAN_INT_FIELDS = (
    "expert_indices", "tokens_per_expert", "expert_offsets", "row_id_map", "sorted_slots"
)


def assert_plan_ints_equal(out_plan, ref_plan):
    for f in PLAN_INT_FIELDS:
        assert_int_equal(getattr(out_plan, f), getattr(ref_plan, f), f)


# ------------------------------------------------------------- structural invariants
def check_plan_structure(plan, idx_used: torch.Tensor, num_experts: int, align: int):
    """The plan's invariants, from its definition alone (no reference):
    every valid slot has exactly one row; an expert's rows are contiguous, in ascending
    flat-slot order, padding at the end; offsets are multiples of align; counts add up;
    sorted_slots and row_id_map are inverse maps."""
    T, K = idx_used.shape
    E = num_experts
    idx = idx_used.cpu().long().tolist()
    counts = plan.tokens_per_expert.cpu().tolist()
    offs = plan.expert_offsets.cpu().tolist()
    rid = plan.row_id_map.cpu().tolist()
    ss = plan.sorted_slots.cpu().tolist()
    for name in PLAN_INT_FIELDS:
        assert getattr(plan, name).dtype == torch.int32, f"{name} must be int32"
    assert plan.expert_indices.cpu().long().tolist() == idx, "expert_indices != used indices"
    assert len(counts) == E and len(offs) == E + 1
    assert len(ss) == T * K + E * (align - 1), f"sorted_slots length {len(ss)}"
    assert plan.max_rows == len(ss)
    assert plan.row_id_map.shape == (T, K) and plan.weights.shape == (T, K)
    # counts from the indices directly
    want_counts = [0] * E
    for t in range(T):
        for k in range(K):
            if idx[t][k] >= 0:
                want_counts[idx[t][k]] += 1
    assert counts == want_counts, f"tokens_per_expert {counts} != {want_counts}"
    n_valid = sum(1 for row in idx for v in row if v >= 0)
    assert sum(counts) == n_valid
    # offsets: start at 0, segment e holds ceil(count/align)*align rows
    assert offs[0] == 0
    for e in range(E):
        size = -(-want_counts[e] // align) * align
        got = offs[e + 1] - offs[e]
        assert got == size, f"segment {e}: {offs[e]}..{offs[e + 1]}, want {size} rows"
        assert offs[e] % align == 0
    R = offs[E]
    assert R == plan.num_rows() and R <= len(ss)
    assert all(s == -1 for s in ss[R:]), "sorted_slots past expert_offsets[E] must be -1"
    # each expert segment: valid slots of that expert ascending, then padding (-1)
    for e in range(E):
        seg = ss[offs[e]:offs[e + 1]]
        want = [t * K + k for t in range(T) for k in range(K) if idx[t][k] == e]
        assert seg[: len(want)] == want, f"expert {e}: rows {seg} should start with slots {want}"
        assert all(s == -1 for s in seg[len(want):]), f"expert {e}: padding rows must be -1: {seg}"
    # inverse maps
    seen = set()
    for t in range(T):
        for k in range(K):
            r = rid[t][k]
            if idx[t][k] < 0:
                assert r == -1, f"empty slot ({t},{k}) has row {r}"
                continue
            assert 0 <= r < R, f"slot ({t},{k}) row {r} outside [0, {R})"
            assert r not in seen, f"row {r} used twice"
            seen.add(r)
            assert ss[r] == t * K + k, f"sorted_slots[{r}]={ss[r]} but row_id_map[{t},{k}]={r}"
            e = idx[t][k]
            assert offs[e] <= r < offs[e + 1], f"slot ({t},{k}) of expert {e} in row {r}"
    assert len(seen) == n_valid
    for r, s in enumerate(ss):
        if s >= 0:
            assert rid[s // K][s % K] == r


# ------------------------------------------------------------------ host syncs on the CPU
# aten ops whose result size or value the host must read from device memory: on a CUDA
# tensor each one stalls the stream until the device catches up.
HOST_READ_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim",
                 "unique_consecutive", "repeat_interleave", "equal")


def _has_bool_index(args) -> bool:
    """aten.index / index_put with a boolean mask: the result size is the mask's count."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class HostSyncCounter:
    """Counts the reads of tensor memory by the host inside a `with` block, on any device:
    the aten ops of HOST_READ_OPS (item, bool, int, nonzero, ...) and indexing with a boolean
    mask, seen by a
    dispatch mode, plus the Python-level reads that do not dispatch on CPU tensors
    (`Tensor.tolist`, `.numpy`, `.cpu`). On a GPU each of them is a device-to-host sync.
    `.events` lists what was counted."""

    def __init__(self):
        self.events: list[str] = []

    @property
    def count(self) -> int:
        return len(self.events)

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name in HOST_READ_OPS or (name in ("index", "index_put", "index_put_")
                                             and _has_bool_index(args)):
                    counter.events.append(f"aten.{name}")
                return func(*args, **(kwargs or {}))

        self._patched = []
        for meth in ("tolist", "numpy", "cpu"):
            orig = getattr(torch.Tensor, meth)

            def wrapper(t, *a, _orig=orig, _meth=meth, **kw):
                counter.events.append(f"Tensor.{_meth}")
                return _orig(t, *a, **kw)

            self._patched.append((meth, orig))
            setattr(torch.Tensor, meth, wrapper)
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for meth, orig in self._patched:
            setattr(torch.Tensor, meth, orig)
        return False


# ------------------------------------------------------------------------- CUDA graphs
def capture_cuda_graph(step, warmup: int = 1):
    """Call `step()` `warmup` times on a side stream (kernel compilation, workspaces, the
    caching allocator's pools), then capture one call into a CUDA graph. Returns (the
    graph, what the captured call returned: its static output buffers). The caller copies
    new inputs into the captured input buffers and calls `graph.replay()`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
