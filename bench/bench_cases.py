"""The GPU cases that have figures to compare with: the permute at a DeepSeek-V3 shape
against a copy of the same bytes, and the gate against the top-k it replaces.

    python bench/bench_cases.py --device cuda --runs 3 --out h100_cases
    python bench/bench_cases.py --device cpu --quick          # small shapes: a smoke test

`bench/bench_all.py` runs it first on CUDA (the GPU run's bench step).

**permute** at T=4096 tokens, top-8 of E=128 experts, H=7168 (DeepSeek-V3's hidden size),
bf16, align 1: R = T*K = 32768 rows. GB/s counts the rows read and written (2*R*H*2 bytes)
and the index bytes, as bench_permute.py does. Its baseline is a device-to-device copy of
the same number of row bytes (`copy (same bytes)`: dst.copy_(src) of R*H bf16 values, read
plus written) timed in the same run, interleaved round by round with the permutes; the
fraction of copy is the permute's GB/s over the copy's. Published H200 figures for this
shape are 2.40 TB/s for the best kernel and about 1.9 TB/s for vLLM's, against a copy
measured there at about 3.9 to 4.3 TB/s (about 56-62% and 44-49% of copy): the fractions
are what compares across machines, never our GB/s against their copy.

**gate** at (T, E, K) = (16384, 128, 8) and (8192, 256, 8), bf16 logits, softmax with the
top-k weights normalised (Mixtral, Qwen3-MoE), every recorded route replayed (0% flagged
rows), with validate=False (no host sync): the weights and the dispatch plan. Its baseline
is what the model computes without a replay, in the same run: `torch.softmax` in fp32,
`torch.topk`, the weights normalised and cast (weights and indices only, no plan).

The same gate with 1% flagged rows (FLAGGED_FRACTIONS): `replay_mask` False on 1% of the
rows, spread over the batch, so the model's own selection (replay_ops.Selection, the default
top-k of the softmax) runs for those rows inside the gate kernel (native CPU, Triton; the
torch backend ranks every row on a GPU, to stay sync-free). Each flagged case is labelled with the backend that
actually serves it (`replay_ops.backends.explain`: a backend whose kernels lack the
selection hands the call on, and the label says so), and checked against the torch backend
before it is timed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import replay_ops  # noqa: E402

PERMUTE_CASE = {"T": 4096, "K": 8, "E": 128, "H": 7168}
GATE_CASES = ((16384, 128, 8), (8192, 256, 8))
# The fractions of flagged rows (replay_mask False) the gate runs with.
FLAGGED_FRACTIONS = (0.0, 0.01)
QUICK_PERMUTE = {"T": 64, "K": 4, "E": 16, "H": 256}
QUICK_GATE = ((256, 32, 4),)
PUBLISHED = ("published for this shape on an H200: best kernel 2.40 TB/s, vLLM's about "
             "1.9 TB/s, against a copy of about 3.9-4.3 TB/s measured there (56-62% and "
             "44-49% of copy)")


def _backends(device: str) -> list[str]:
    out = ["torch"]
    if harness.native_available(device):
        out.insert(0, "native")
    if harness.triton_available(device):
        out.insert(1, "triton")
    return out


# ------------------------------------------------------------------------------ permute
def permute_case(T, K, E, H, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g).to(torch.bfloat16).to(device)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32).to(device)
    plan = replay_ops.gate(logits, idx, validate=False)
    hidden = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    return plan, T * K, hidden


def run_permute(args, device, copy_bw) -> tuple[list[dict], list[str]]:
    c = QUICK_PERMUTE if args.quick else PERMUTE_CASE
    T, K, E, H = c["T"], c["K"], c["E"], c["H"]
    plan, R, hidden = permute_case(T, K, E, H, device)
    el = hidden.element_size()
    row_bytes = R * H * el
    src = torch.randn(R, H, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    calls = {f"{b}": (lambda b=b: replay_ops.permute(hidden, plan, R, validate=False,
                                                      backend=b))
             for b in _backends(device)}
    want = calls["torch"]()
    for name, f in calls.items():  # a wrong kernel's speed is no result
        if not torch.equal(f(), want):
            raise SystemExit(f"bench_cases: permute on {name} differs from the torch backend")
    del want
    calls["copy (same bytes)"] = lambda: dst.copy_(src)
    res = harness.median_of_runs([
        harness.measure_interleaved(calls, device, warmup=args.warmup, reps=args.reps)
        for _ in range(args.runs)])
    copy_gbps = 2 * row_bytes / (res["copy (same bytes)"]["ms_median"] * 1e-3) / 1e9
    nbytes = 2 * row_bytes + 4 * (R + T * K)  # rows read and written, sorted_slots, row_id_map
    rows, parts = [], []
    for name, r in res.items():
        row = {"op": "permute", "mode": "fwd", "provider": name, "T": T, "E": E, "K": K,
               "H": H, "R": R, "dtype": "bfloat16", "baseline": "copy (same bytes)", **r}
        harness.add_bandwidth(row, 2 * row_bytes if name.startswith("copy") else nbytes,
                              copy_gbps)
        row["frac_of_256mib_copy"] = row["gbps"] / copy_bw["gbps"] if row["gbps"] else None
        rows.append(row)
        if not name.startswith("copy"):
            parts.append(f"{name} {r['ms_median']:.3f} ms, {row['gbps']:.1f} GB/s = "
                         f"{row['frac_of_copy_bw']:.0%} of copy")
    summary = [f"permute T={T} K={K} E={E} H={H} bf16 (R={R}): " + "; ".join(parts)
               + f"; a copy of the same {row_bytes / 2**20:.1f} MiB in this run: "
               f"{copy_gbps:.1f} GB/s ({res['copy (same bytes)']['ms_median']:.3f} ms)"]
    if not args.quick:
        summary.append(f"permute T={T} K={K} E={E} H={H} bf16: {PUBLISHED}")
    return rows, summary


# --------------------------------------------------------------------------------- gate
def softmax_topk(logits, K):
    """What the model computes without a replay: the softmax in fp32, the top-k, the
    weights normalised and cast back (weights and indices; no dispatch plan)."""
    w, idx = torch.topk(torch.softmax(logits.float(), dim=-1), K, dim=-1)
    return (w / w.sum(dim=-1, keepdim=True)).to(logits.dtype), idx


def flagged_mask(T, fraction, device, seed=0):
    """A replay_mask with round(fraction * T) rows False (flagged), spread over the batch."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(T, dtype=torch.bool)
    mask[torch.randperm(T, generator=g)[:round(fraction * T)]] = False
    return mask.to(device)


def serving_backend(backend: str, device: str, T: int, E: int, K: int, fraction: float) -> str:
    """The backend that serves a gate call asked of `backend` (the registry hands a call
    whose features a backend lacks to the next one)."""
    from replay_ops import backends
    from replay_ops.backends.protocol import SELECT, OpShape

    feats = frozenset((SELECT,)) if fraction else frozenset()
    return backends.explain("gate_fwd", device, OpShape(T, E, K, 0, feats), torch.bfloat16,
                            backend)[0]


def gate_label(backend: str, fraction: float, runs: str | None = None) -> str:
    if fraction == 0:
        return f"{backend} replay"
    how = ("selection of every row" if (runs or backend) == "torch"
           else "selection in the gate kernel")
    served = "" if runs in (None, backend) else f", served by {runs}"
    return f"{backend} replay, {fraction:.0%} flagged ({how}{served})"


def run_gate(args, device) -> tuple[list[dict], list[str]]:
    rows, summary = [], []
    for T, E, K in (QUICK_GATE if args.quick else GATE_CASES):
        g = torch.Generator().manual_seed(T + E + K)
        logits = (torch.randn(T, E, generator=g) * 2).to(torch.bfloat16).to(device)
        idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32).to(device)
        calls = {"softmax+topk": lambda logits=logits, K=K: softmax_topk(logits, K)}
        flagged = {"softmax+topk": 0.0}
        for frac in args.flagged:
            mask = None if frac == 0 else flagged_mask(T, frac, device)
            want = replay_ops.gate(logits, idx, replay_mask=mask, validate=False,
                                   backend="torch")
            for b in _backends(device):
                def call(b=b, mask=mask):
                    return replay_ops.gate(logits, idx, replay_mask=mask, validate=False,
                                           backend=b)
                out = call()
                same = all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x is y
                           for x, y in zip(out[1:], want[1:]))
                if not same or not torch.allclose(out.weights.float(), want.weights.float(),
                                                  rtol=1e-2, atol=1e-3):
                    raise SystemExit(f"bench_cases: gate on {b} differs from the torch backend "
                                     f"(T={T} E={E} K={K}, {frac:.0%} flagged)")
                label = gate_label(b, frac, serving_backend(b, device, T, E, K, frac))
                calls[label] = call
                flagged[label] = frac
        res = harness.median_of_runs([
            harness.measure_interleaved(calls, device, warmup=args.warmup, reps=args.reps)
            for _ in range(args.runs)])
        base = res["softmax+topk"]["ms_median"]
        for name, r in res.items():
            rows.append({"op": "gate", "mode": "fwd", "provider": name, "T": T, "E": E, "K": K,
                         "dtype": "bfloat16", "flagged": flagged[name],
                         "baseline": "softmax+topk",
                         **r, "speedup_vs_softmax_topk": base / r["ms_median"]})
        parts = [f"{n} {r['ms_median']:.3f} ms = {base / r['ms_median']:.2f}x"
                 for n, r in res.items() if n != "softmax+topk"]
        summary.append(f"gate T={T} E={E} K={K} bf16 softmax normalised, against softmax+topk "
                       f"{base:.3f} ms: " + "; ".join(parts))
    return rows, summary


def run(args) -> tuple[list[dict], list[str]]:
    device, env, copy_bw = harness.start_run(args, "bench_cases")
    rows, summary = run_permute(args, device, copy_bw)
    r2, s2 = run_gate(args, device)
    rows += r2
    summary += s2
    if any(f > 0 for f in args.flagged):
        summary.append("flagged rows: replay_mask False; the model's own selection runs for "
                       "them inside the gate kernel (the torch backend on a GPU ranks every "
                       "row, to stay sync-free); "
                       "each label names the backend that served it")
    harness.finish_run(args, rows, device, env, copy_bw)
    return rows, summary


COLS = ["op", "provider", "T", "E", "K", "H", "dtype", "flagged", "ms_median", "ms_p20",
        "ms_p80", "gbps", "frac_of_copy_bw", "speedup_vs_softmax_topk"]


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    ap.add_argument("--flagged", type=float, nargs="+", default=list(FLAGGED_FRACTIONS),
                    help="fractions of flagged rows for the gate (default: "
                         f"{' '.join(map(str, FLAGGED_FRACTIONS))})")
    harness.add_run_args(ap, reps=20, warmup=3)
    return ap


def main(argv=None):
    return harness.cli_main(parser, run, COLS, argv)


if __name__ == "__main__":
    main()
