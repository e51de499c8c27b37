"""Benchmark of replay.permute and replay.unpermute (and the two together).

    python bench/bench_permute.py --device cpu --T 2048 --E 64 --K 8 --H 1024 --runs 5

Providers: torch (the vectorised eager PyTorch backend through the ops: the baseline of the
speed targets), reference (replay_ops.reference.permute / unpermute, the oracle), native
(through the ops), native-raw (torch.ops.replay_native.* called
directly), triton (CUDA), torch.compile (with --compile). Modes: fwd, bwd, full; in fwd
mode permute and unpermute are also timed alone. GB/s counts the rows read and written.
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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_case(T, E, K, H, dtype, device, align, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g).to(dtype).to(device)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32).to(device)
    plan = replay_ops.gate(logits, idx, align=align)
    R = plan.num_rows()
    hidden = torch.randn(T, H, generator=g).to(dtype).to(device)
    expert_out = torch.randn(R, H, generator=g).to(dtype).to(device)
    return plan, R, hidden, expert_out


def op_bytes(op, T, K, H, R, el):
    idx = 4 * (R + T * K)  # sorted_slots / row_id_map
    if op == "permute":
        return 2 * R * H * el + idx
    if op == "unpermute":
        return R * H * el + T * H * el + idx + T * K * el
    return op_bytes("permute", T, K, H, R, el) + op_bytes("unpermute", T, K, H, R, el)


def fwd_providers(plan, R, device, compile_):
    ops = torch.ops.replay_native
    p = {
        "reference": (lambda h: ref.permute(h, plan, R), lambda x: ref.unpermute(x, plan)),
        "torch": (lambda h: replay_ops.permute(h, plan, R, validate=False, backend="torch"),
                  lambda x: replay_ops.unpermute(x, plan, backend="torch")),
    }
    if harness.native_available(device):
        p["native"] = (lambda h: replay_ops.permute(h, plan, R, validate=False, backend="native"),
                       lambda x: replay_ops.unpermute(x, plan, backend="native"))
        p["native-raw"] = (
            lambda h: ops.permute_fwd(h, plan.sorted_slots, plan.row_id_map, R),
            lambda x: ops.unpermute_fwd(x, plan.row_id_map, plan.weights))
    if harness.triton_available(device):
        p["triton"] = (lambda h: replay_ops.permute(h, plan, R, validate=False, backend="triton"),
                       lambda x: replay_ops.unpermute(x, plan, backend="triton"))
    if compile_:
        cp = torch.compile(lambda h: ref.permute_rows(h, plan.sorted_slots, plan.top_k, R))
        cu = torch.compile(lambda x: ref.combine(x, plan.row_id_map, plan.weights))
        p["torch.compile"] = (cp, cu)
    return p


def run(args) -> tuple[list[dict], list[str]]:
    device, env, copy_bw = harness.start_run(args, "bench_permute")
    rows, summary = [], []
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        el = torch.empty((), dtype=dtype).element_size()
        for H in args.H:
            plan, R, hidden, expert_out = make_case(args.T, args.E, args.K, H, dtype, device,
                                                    args.align)
            prov = fwd_providers(plan, R, device, args.compile)
            for mode in args.modes:
                calls = {}
                for name, (perm, unperm) in prov.items():
                    if mode == "fwd":
                        calls[(name, "permute+unpermute")] = (
                            lambda perm=perm, unperm=unperm: unperm(perm(hidden)))
                        if args.separate:
                            calls[(name, "permute")] = (lambda perm=perm: perm(hidden))
                            calls[(name, "unpermute")] = (lambda unperm=unperm: unperm(expert_out))
                        continue
                    if name in ("native-raw", "torch.compile"):
                        continue
                    h = hidden.detach().clone().requires_grad_(True)
                    gy = torch.randn_like(hidden)
                    if mode == "bwd":
                        y = unperm(perm(h))
                        calls[(name, "permute+unpermute")] = (
                            lambda y=y, h=h, gy=gy: torch.autograd.grad(y, h, gy, retain_graph=True))
                    else:
                        calls[(name, "permute+unpermute")] = (
                            lambda perm=perm, unperm=unperm, h=h, gy=gy:
                            torch.autograd.grad(unperm(perm(h)), h, gy))
                keyed = {f"{n}|{o}": f for (n, o), f in calls.items()}
                res = harness.median_of_runs([
                    harness.measure_interleaved(keyed, device, warmup=args.warmup, reps=args.reps)
                    for _ in range(args.runs)
                ])
                for key, r in res.items():
                    name, op = key.split("|")
                    row = {"op": op, "mode": mode, "provider": name, "T": args.T, "E": args.E,
                           "K": args.K, "H": H, "R": R, "dtype": dname, **r}
                    harness.add_bandwidth(row, op_bytes(op, args.T, args.K, H, R, el)
                                          * (1 if mode == "fwd" else 2), copy_bw["gbps"])
                    base = res.get(f"torch|{op}")
                    if base:
                        row["speedup_vs_torch"] = base["ms_median"] / r["ms_median"]
                    rows.append(row)
                for op in ("permute+unpermute", "permute", "unpermute"):
                    for base in ("torch", "reference"):
                        n, b = res.get(f"native|{op}"), res.get(f"{base}|{op}")
                        if n and b:
                            nb = op_bytes(op, args.T, args.K, H, R, el)
                            summary.append(
                                f"{op} {mode} T={args.T} K={args.K} H={H} R={R} {dname}: native "
                                f"{n['ms_median']:.3f} ms vs {base} {b['ms_median']:.3f} ms = "
                                f"{b['ms_median'] / n['ms_median']:.2f}x"
                                + (f"; native {nb / (n['ms_median'] * 1e-3) / 1e9:.1f} GB/s = "
                                   f"{nb / (n['ms_median'] * 1e-3) / 1e9 / copy_bw['gbps']:.0%} "
                                   f"of copy" if mode == "fwd" and base == "torch" else ""))
    harness.finish_run(args, rows, device, env, copy_bw)
    return rows, summary


COLS = ["op", "mode", "provider", "T", "K", "H", "R", "dtype", "ms_median", "ms_p20", "ms_p80",
        "speedup_vs_torch", "gbps", "frac_of_copy_bw"]


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--E", type=int, default=64)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--H", type=int, nargs="+", default=[1024])
    ap.add_argument("--align", type=int, default=1)
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"])
    ap.add_argument("--modes", nargs="+", default=["fwd", "bwd", "full"])
    ap.add_argument("--separate", type=int, default=1, help="also time permute and unpermute alone")
    ap.add_argument("--compile", action="store_true", help="add a torch.compile provider")
    harness.add_run_args(ap, reps=15, warmup=2)
    return ap


def main(argv=None):
    return harness.cli_main(parser, run, COLS, argv)


if __name__ == "__main__":
    main()
