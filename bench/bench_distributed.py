"""Benchmark of replay_ops.distributed dispatch + combine on a local gloo group.

    python bench/bench_distributed.py --world 2 4 --T 1024 --E 32 --K 4 --H 512 --runs 3

Each world size W starts W processes on this machine (gloo over the loopback interface).
Every rank routes T tokens (random distinct experts, global ids) and times, interleaved
round by round, with a barrier before each call:

* replay_ops: `replay_ops.distributed.dispatch` + `combine` (experts = identity), from a
  plan made once by `replay_ops.distributed.gate`;
* reference: plain PyTorch, as expert-parallel MoE code without replay_ops does it: a
  stable argsort of the flat expert ids, bincount, an all_to_all_single of the
  per-expert counts read on the host, a gather of the rows, all_to_all_single, a sort of
  the received chunks by local expert, and the way back (chunks unsorted, all_to_all_single,
  unpermute with index_add weighted by the gates).

Modes: fwd (dispatch + combine) and full (forward and backward, hidden and gate weights
requiring grad). A call's time is the slowest rank's; the table gives the median and the
20/80 quantiles over reps and runs. Bytes: the rows that cross between processes (each
rank's own rows stay local), dispatch plus combine, summed over the ranks; doubled for
full. On this machine gloo over loopback measures the code path (copies through the
kernel's socket buffers on a shared 2-core CPU), not a network; multi-GPU NCCL is not
available here, so there is no GPU figure.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --------------------------------------------------------------------------- reference
def reference_dispatch_combine(hidden, idx, weights, E, group):
    """Plain PyTorch expert-parallel dispatch and combine (experts = identity)."""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_to_all_single as a2a  # differentiable

    W = dist.get_world_size(group)
    E_l = E // W
    T, K = idx.shape
    flat = idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    send_split = counts.view(W, E_l).sum(1).tolist()
    C = recv_counts.view(W, E_l).tolist()  # [source, local expert]
    recv_split = [sum(r) for r in C]
    x = hidden[order // K]
    y = a2a(x.new_empty(sum(recv_split), hidden.shape[1]), x, recv_split, send_split,
            group=group or dist.group.WORLD)
    chunks = list(y.split([c for r in C for c in r]))
    by_expert = [chunks[s * E_l + j] for j in range(E_l) for s in range(W)]
    local = torch.cat(by_expert)
    # experts: identity; way back
    back_chunks = list(local.split([C[s][j] for j in range(E_l) for s in range(W)]))
    by_source = [back_chunks[j * W + s] for s in range(W) for j in range(E_l)]
    z = torch.cat(by_source)
    ret = a2a(z.new_empty(x.shape[0], hidden.shape[1]), z, send_split, recv_split,
              group=group or dist.group.WORLD)
    w = weights.reshape(-1)[order].to(ret.dtype)
    out = torch.zeros_like(hidden).index_add(0, order // K, ret * w[:, None])
    return out


def replay_dispatch_combine(hidden, plan, group):
    from replay_ops import distributed as ep

    x_local, handle = ep.dispatch(hidden, plan, group)
    return ep.combine(x_local, handle), handle


# --------------------------------------------------------------------------- one rank
def _rank_main(rank, world, args, store, out_path):
    import time
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # the reference's autograd a2a
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from replay_ops import distributed as ep

    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(1000 + rank)
    T, E, K, H = args.T, args.E, args.K, args.H
    logits = torch.randn(T, E, generator=g)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    rows = []
    for align in args.align:
        plan = ep.gate(logits, idx, align=align)
        # sanity: both providers compute the same combine
        out_r, handle = replay_dispatch_combine(hidden, plan, None)
        out_p = reference_dispatch_combine(hidden, idx, plan.weights, E, None)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out_r.float(), out_p.float(), rtol=tol, atol=tol), "mismatch"
        remote_rows = handle.num_sent - handle.send_counts[rank]
        for mode in args.modes:
            if mode == "fwd":
                calls = {
                    "replay_ops": lambda: replay_dispatch_combine(hidden, plan, None),
                    "reference": lambda: reference_dispatch_combine(hidden, idx, plan.weights,
                                                                     E, None),
                }
            else:
                lg = logits.clone().requires_grad_(True)
                h = hidden.clone().requires_grad_(True)
                gy = torch.randn(T, H, generator=g).to(dtype)

                def rep_full():
                    p = ep.gate(lg, idx, align=align)
                    out, _ = replay_dispatch_combine(h, p, None)
                    torch.autograd.grad(out, (h, lg), gy)

                def ref_full():
                    p = ep.gate(lg, idx, align=align)  # the same gate; only the EP path differs
                    out = reference_dispatch_combine(h, idx, p.weights, E, None)
                    torch.autograd.grad(out, (h, lg), gy)

                calls = {"replay_ops": rep_full, "reference": ref_full}
            runs = []
            for _ in range(args.runs):
                for fn in calls.values():
                    for _ in range(args.warmup):
                        fn()
                samples = {k: [] for k in calls}
                for _ in range(args.reps):
                    for name, fn in calls.items():
                        dist.barrier()
                        t0 = time.perf_counter()
                        fn()
                        samples[name].append((time.perf_counter() - t0) * 1e3)
                runs.append(samples)
            gathered = [None] * world
            dist.all_gather_object(gathered, {"runs": runs, "remote_rows": remote_rows})
            if rank == 0:
                el = torch.empty((), dtype=dtype).element_size()
                total_remote = sum(g_["remote_rows"] for g_ in gathered)
                nbytes = 2 * total_remote * H * el * (2 if mode == "full" else 1)
                per_run = []
                for r in range(args.runs):
                    per = {}
                    for name in calls:
                        slowest = [max(g_["runs"][r][name][i] for g_ in gathered)
                                   for i in range(args.reps)]
                        per[name] = harness.quantiles(slowest)
                    per_run.append(per)
                res = harness.median_of_runs(per_run)
                for name, q in res.items():
                    row = {"op": "dispatch+combine", "mode": mode, "provider": name,
                           "world": world, "T_per_rank": T, "E": E, "K": K, "H": H,
                           "align": align, "dtype": args.dtype, **q,
                           "bytes_between_ranks": nbytes,
                           "gbps_between_ranks": nbytes / (q["ms_median"] * 1e-3) / 1e9}
                    row["speedup_vs_reference"] = (res["reference"]["ms_median"]
                                                   / q["ms_median"])
                    rows.append(row)
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(world, args):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench_dist_") as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(_rank_main, args=(world, args, os.path.join(tmp, "store"), out),
                           nprocs=world, start_method="spawn", join=True)
        return json.loads(Path(out).read_text())


COLS = ["op", "mode", "provider", "world", "T_per_rank", "E", "K", "H", "align", "dtype",
        "ms_median", "ms_p20", "ms_p80", "speedup_vs_reference", "bytes_between_ranks",
        "gbps_between_ranks"]


def run(args):
    env = harness.env_info("cpu")
    env["device_name"] += (f"; {max(args.world)} ranks max as local processes, gloo over "
                           f"loopback ({socket.gethostname()})")
    copy_bw = harness.copy_bandwidth("cpu")
    rows, summary = [], []
    for world in args.world:
        rows += _spawn(world, args)
    for world in args.world:
        for align in args.align:
            for mode in args.modes:
                sel = {r["provider"]: r for r in rows if r["world"] == world
                       and r["align"] == align and r["mode"] == mode}
                if {"replay_ops", "reference"} <= sel.keys():
                    a, b = sel["replay_ops"], sel["reference"]
                    summary.append(
                        f"W={world} align={align} {mode}: replay_ops {a['ms_median']:.2f} ms vs "
                        f"reference {b['ms_median']:.2f} ms = {b['ms_median'] / a['ms_median']:.2f}x; "
                        f"{a['bytes_between_ranks'] / 2**20:.1f} MiB between ranks "
                        f"({a['gbps_between_ranks']:.2f} GB/s)")
    summary.append("gloo over loopback on one shared 2-core CPU: this measures the code path "
                   "(copies through socket buffers, W processes on 2 cores), not a network. "
                   "Multi-GPU NCCL is not available here; no GPU figure is given.")
    harness.finish_run(args, rows, "cpu", env, copy_bw)
    return rows, summary


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--T", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--E", type=int, default=32)
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--H", type=int, default=512)
    ap.add_argument("--align", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--modes", nargs="+", choices=["fwd", "full"], default=["fwd", "full"])
    harness.add_run_args(ap, reps=10, warmup=2)
    return ap


if __name__ == "__main__":
    harness.cli_main(parser, run, COLS)
