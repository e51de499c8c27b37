"""Benchmark of the gate with flagged rows: replay must never pay for top-k.

    python bench/bench_select.py --device cpu --threads 1 --T 16384 --E 256 --K 8 \\
        --out cpu_2core_select

Rows without a usable route (replay_mask False) get the model's own selection inside the
gate kernel. Providers, timed round-robin in one run (harness.py), each with the launches,
host reads and ops of one call counted on the same device (launch_counter.py):

    <b>:gate                the gate with no flagged row (no replay_mask): the baseline
    <b>:flagged-<p>%        the gate with p% of the rows flagged (replay_mask False),
                            validate=False (the sync-free path)
    <b>:sigmoid-gate        the gate with sigmoid weights and no flagged row: the
                            baseline of the next one
    <b>:deepseek-<p>%       sigmoid weights, and DeepSeek-V3's selection (expert bias,
                            group-limited top-k, top-2 group scores) of p% flagged rows
    <b>:agreement           the gate with return_agreement=True (every row selected)
    softmax+topk            torch.softmax + torch.topk of every row (the model's routing)
    topk-every-row+gate     what the sync-free path ran before the selection moved into the
                            kernel: softmax + topk of every row, a where, then the gate

for the backends <b> = native (the C++ CPU kernels) and torch. The target: native
flagged-1% <= 1.5x native:gate.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from launch_counter import LaunchCounter  # noqa: E402

import replay_ops  # noqa: E402
from replay_ops import Selection  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TARGET = 1.5  # native flagged-1% / native gate


def make_inputs(T, E, K, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, E, generator=g) * 2).to(dtype).to(device)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32).to(device)
    return logits, idx


def masks(T, fractions, device, seed=1):
    """{p: bool [T]} with round(p * T) rows False, spread at random."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in fractions:
        m = torch.ones(T, dtype=torch.bool)
        m[torch.randperm(T, generator=g)[:round(p * T)]] = False
        out[p] = m.to(device)
    return out


def providers(args, logits, idx, device):
    T, E = logits.shape
    K = idx.shape[1]
    ms = masks(T, args.flagged, device)
    groups = 8 if E % 8 == 0 and E // 8 * 4 >= K else 0
    deepseek = Selection(expert_bias=0.1 * torch.randn(E, generator=torch.Generator()
                                                       .manual_seed(2)).to(device),
                         num_groups=groups, group_topk=4 if groups else 0,
                         group_score_topn=2 if groups else 0)
    backends = ["native"] if harness.native_available(device) else []
    backends.append("torch")
    p = {}
    for b in backends:
        p[f"{b}:gate"] = lambda b=b: replay_ops.gate(logits, idx, validate=False, backend=b)
        for f, m in ms.items():
            p[f"{b}:flagged-{f:.0%}"] = (lambda b=b, m=m: replay_ops.gate(
                logits, idx, replay_mask=m, validate=False, backend=b))
        f = args.flagged[min(1, len(args.flagged) - 1)]
        p[f"{b}:sigmoid-gate"] = lambda b=b: replay_ops.gate(logits, idx, score_func="sigmoid",
                                                            validate=False, backend=b)
        p[f"{b}:deepseek-{f:.0%}"] = (lambda b=b, m=ms[f]: replay_ops.gate(
            logits, idx, replay_mask=m, score_func="sigmoid", selection=deepseek,
            validate=False, backend=b))
        p[f"{b}:agreement"] = lambda b=b: replay_ops.gate(logits, idx, return_agreement=True,
                                                         validate=False, backend=b)
    p["softmax+topk"] = lambda: torch.topk(torch.softmax(logits.float(), dim=-1), K, dim=-1)
    m1 = ms[args.flagged[min(1, len(args.flagged) - 1)]]

    def before():
        native_k = torch.topk(torch.softmax(logits.float(), dim=-1), K, dim=-1).indices
        used = torch.where(m1[:, None], idx, native_k.to(torch.int32))
        return replay_ops.gate(logits, used, validate=False, backend=backends[0])

    p["topk-every-row+gate"] = before
    return p


def count(fn) -> dict:
    with LaunchCounter() as c:
        fn()
    ops = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in sorted(c.ops.items()))
    return {"launches": c.launches, "syncs": c.syncs, "ops": ops}


def run(args) -> tuple[list[dict], list[str]]:
    device, env, copy_bw = harness.start_run(args, "bench_select")
    dtype = DTYPES[args.dtype]
    rows, summary, targets = [], [], []
    for T in args.T:
        logits, idx = make_inputs(T, args.E, args.K, dtype, device)
        fns = providers(args, logits, idx, device)
        counts = {name: count(fn) for name, fn in fns.items()}
        res = harness.median_of_runs([
            harness.measure_interleaved(fns, device, warmup=args.warmup, reps=args.reps)
            for _ in range(args.runs)])
        for name, r in res.items():
            backend = name.split(":")[0] if ":" in name else ""
            base = res.get(f"{backend}:{'sigmoid-gate' if 'deepseek' in name else 'gate'}",
                           res.get("native:gate"))
            row = {"op": "gate", "provider": name, "T": T, "E": args.E, "K": args.K,
                   "dtype": args.dtype, **r, "vs_gate": r["ms_median"] / base["ms_median"],
                   **counts[name]}
            rows.append(row)
        for b in ("native", "torch"):
            if f"{b}:gate" not in res:
                continue
            g = res[f"{b}:gate"]["ms_median"]
            gs = res[f"{b}:sigmoid-gate"]["ms_median"]
            parts = [f"{name.split(':')[1]} {res[name]['ms_median']:.3f} ms = "
                     f"{res[name]['ms_median'] / (gs if 'deepseek' in name else g):.2f}x"
                     for name in res if name.startswith(f"{b}:")
                     and name not in (f"{b}:gate", f"{b}:sigmoid-gate")]
            parts.append(f"(deepseek against sigmoid-gate {gs:.3f} ms)")
            summary.append(f"{b} T={T} E={args.E} K={args.K} {args.dtype}: gate {g:.3f} ms; "
                           + "; ".join(parts))
        for name in ("softmax+topk", "topk-every-row+gate"):
            base = "native:gate" if "native:gate" in res else "torch:gate"
            summary.append(f"{name} T={T}: {res[name]['ms_median']:.3f} ms = "
                           f"{res[name]['ms_median'] / res[base]['ms_median']:.2f}x {base}")
        one = f"{args.flagged[min(1, len(args.flagged) - 1)]:.0%}"
        if "native:gate" in res:
            ratio = res[f"native:flagged-{one}"]["ms_median"] / res["native:gate"]["ms_median"]
            targets.append({"target": f"native flagged-{one} / native gate <= {TARGET}",
                            "T": T, "E": args.E, "K": args.K, "ratio": ratio,
                            "met": ratio <= TARGET})
    harness.finish_run(args, rows, device, env, copy_bw, targets=targets)
    return rows, summary


COLS = ["provider", "T", "E", "K", "dtype", "ms_median", "ms_p20", "ms_p80", "vs_gate",
        "launches", "syncs", "ops"]
TARGET_COLS = ["target", "T", "E", "K", "ratio", "met"]


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--T", type=int, nargs="+", default=[16384])
    ap.add_argument("--E", type=int, default=256)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--flagged", type=float, nargs="+", default=[0.0, 0.01, 0.1],
                    help="fractions of flagged rows (the second is the target's)")
    harness.add_run_args(ap, reps=10, warmup=2)
    return ap


def main(argv=None):
    return harness.cli_main(parser, run, COLS, argv, target_cols=TARGET_COLS)


if __name__ == "__main__":
    main()
