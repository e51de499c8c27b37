"""Benchmark of replay.gate (gate weights plus dispatch plan).

    python bench/bench_gate.py --device cpu --T 16384 --E 128 --K 8 --runs 5

Providers: torch (the vectorised eager PyTorch backend through the op: the baseline of the
speed targets), reference (replay_ops.reference.gate, the oracle: written for clarity, slow),
native (through the op), native-raw (torch.ops.replay_native.gate_fwd directly),
eager-replay (the plain PyTorch replay path: softmax + gather + argsort + bincount + cumsum),
triton (CUDA), torch.compile (with --compile), vllm-align (vLLM's moe_align_block_size, the
plan only, when vLLM is installed on CUDA). Modes: fwd, bwd (the logits gradient from the
weights gradient), full (both).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import replay_ops  # noqa: E402
from replay_ops import reference as ref  # noqa: E402
from replay_ops import scores  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ISIZE = {torch.int16: 2, torch.int32: 4, torch.int64: 8}


def make_inputs(T, E, K, dtype, device, index_dtype=torch.int32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, E, generator=g) * 2).to(dtype).to(device)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(index_dtype).to(device)
    return logits, idx


def eager_replay_path(logits, idx, normalize=True):
    """What an integration writes without this package: softmax, gather, normalise, then
    the plan with argsort + bincount + cumsum."""
    E = logits.shape[1]
    probs = torch.softmax(logits.float(), dim=-1)
    w = probs.gather(1, idx.long())
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    flat = idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    offsets = torch.cumsum(counts, 0)
    row_id_map = torch.empty_like(order)
    row_id_map[order] = torch.arange(order.numel(), device=order.device)
    return w.to(logits.dtype), order, counts, offsets, row_id_map


def gate_bytes(T, E, K, align, dtype, index_dtype, score_func, normalize):
    el = torch.empty((), dtype=dtype).element_size()
    full = score_func == "softmax" and not normalize
    read = T * K * ISIZE[index_dtype] + (T * E if full else T * K) * el
    write = T * K * el + 4 * (T * K * 2 + (T * K + E * (align - 1)) + 2 * E + 1)
    return read + write


def providers(args, logits, idx, device):
    kw = dict(score_func=args.score_func, normalize=bool(args.normalize), align=args.align)
    v = bool(args.validate)
    p = {
        "reference": lambda x: ref.gate(x, idx, validate=v, **kw).weights,
        "torch": lambda x: replay_ops.gate(x, idx, validate=v, backend="torch", **kw).weights,
    }
    if harness.native_available(device):
        p["native"] = lambda x: replay_ops.gate(x, idx, validate=v, backend="native", **kw).weights
        p["native-raw"] = lambda x: torch.ops.replay_native.gate_fwd(
            x, idx, None, None, scores.get(args.score_func).id, bool(args.normalize), 1.0,
            args.align, 0, 0, False, 0, 0, 0, False)[0]
    if args.score_func == "softmax":
        p["eager-replay"] = lambda x: eager_replay_path(x, idx, bool(args.normalize))[0]
    if harness.triton_available(device):
        p["triton"] = lambda x: replay_ops.gate(x, idx, validate=v, backend="triton", **kw).weights
    if args.compile:
        compiled = torch.compile(lambda x: ref.gate(x, idx, validate=False, **kw).weights)
        p["torch.compile"] = compiled
    if device.startswith("cuda"):
        try:
            from vllm.model_executor.layers.fused_moe.moe_align_block_size import (
                moe_align_block_size,
            )

            p["vllm-align"] = lambda x: moe_align_block_size(idx, args.align, logits.shape[1])[0]
        except Exception:
            pass
    return p


def run(args) -> tuple[list[dict], list[str]]:
    device, env, copy_bw = harness.start_run(args, "bench_gate")
    dtype = DTYPES[args.dtype]
    index_dtype = {"int16": torch.int16, "int32": torch.int32, "int64": torch.int64}[args.index_dtype]
    rows, summary = [], []
    for T in args.T:
        logits, idx = make_inputs(T, args.E, args.K, dtype, device, index_dtype)
        fns = providers(args, logits, idx, device)
        for mode in args.modes:
            calls = {}
            for name, f in fns.items():
                if mode == "fwd":
                    calls[name] = (lambda f=f: f(logits))
                    continue
                if name in ("native-raw", "eager-replay", "vllm-align") and mode != "fwd":
                    continue
                x = logits.detach().clone().requires_grad_(True)
                gw = torch.randn(T, args.K, device=device, dtype=dtype)
                if mode == "bwd":
                    out = f(x)
                    calls[name] = (lambda out=out, x=x, gw=gw:
                                   torch.autograd.grad(out, x, gw, retain_graph=True))
                else:
                    calls[name] = (lambda f=f, x=x, gw=gw: torch.autograd.grad(f(x), x, gw))
            res = harness.median_of_runs([
                harness.measure_interleaved(calls, device, warmup=args.warmup, reps=args.reps)
                for _ in range(args.runs)
            ])
            nbytes = gate_bytes(T, args.E, args.K, args.align, dtype, index_dtype,
                                args.score_func, bool(args.normalize))
            for name, r in res.items():
                row = {"op": "gate", "mode": mode, "provider": name, "T": T, "E": args.E,
                       "K": args.K, "align": args.align, "dtype": args.dtype,
                       "index_dtype": args.index_dtype, "score_func": args.score_func,
                       "normalize": bool(args.normalize), "validate": bool(args.validate), **r}
                if mode == "fwd":
                    harness.add_bandwidth(row, nbytes, copy_bw["gbps"])
                if "torch" in res:
                    row["speedup_vs_torch"] = res["torch"]["ms_median"] / r["ms_median"]
                rows.append(row)
            for base in ("torch", "eager-replay", "reference"):
                if "native" in res and base in res:
                    summary.append(
                        f"gate {mode} T={T} E={args.E} K={args.K} {args.dtype} {args.score_func} "
                        f"normalize={bool(args.normalize)} validate={bool(args.validate)}: native "
                        f"{res['native']['ms_median']:.3f} ms vs {base} "
                        f"{res[base]['ms_median']:.3f} ms = "
                        f"{res[base]['ms_median'] / res['native']['ms_median']:.2f}x")
    harness.finish_run(args, rows, device, env, copy_bw)
    return rows, summary


COLS = ["op", "mode", "provider", "T", "E", "K", "dtype", "score_func", "normalize", "validate",
        "ms_median", "ms_p20", "ms_p80", "speedup_vs_torch", "gbps", "frac_of_copy_bw"]


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--T", type=int, nargs="+", default=[16384])
    ap.add_argument("--E", type=int, default=128)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--align", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--index-dtype", choices=["int16", "int32", "int64"], default="int32")
    ap.add_argument("--score-func", default="softmax")
    ap.add_argument("--normalize", type=int, default=1)
    ap.add_argument("--validate", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=["fwd", "bwd", "full"])
    ap.add_argument("--compile", action="store_true", help="add a torch.compile provider")
    harness.add_run_args(ap, reps=20, warmup=3)
    return ap


def main(argv=None):
    return harness.cli_main(parser, run, COLS, argv)


if __name__ == "__main__":
    main()
