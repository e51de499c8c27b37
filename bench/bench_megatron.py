"""Megatron-Core's replay path against the replay router, in the same run: launches, host
syncs and bytes (counted with launch_counter.py) beside CPU times, with the targets of the
Megatron fast path marked met or missed.

    python bench/bench_megatron.py --T 4096 16384 --E 128 256 --dtype float32 bfloat16 \\
        --out cpu_2core_megatron

Ops (Megatron-Core 0.16.1, its real code; the CPU stand-ins of
`replay_ops.testing.megatron_cpu` are installed so its router runs without CUDA):

* `route`: the router's `routing(logits)` under REPLAY_FORWARD, giving the dense probs and
  routing map. Providers: `megatron` (TopKRouter: its RouterReplay gathers the scores at
  the target indices, softmax, scatter to [T, E]) and `replay-router` (ReplayTopKRouter,
  default options: padding="topk", validate=True), same weights and targets.
* `step` (route + permute + unpermute, the experts excluded): route, then the all-to-all
  dispatcher's local permutation of the tokens and their probs, then its inverse. The
  experts are left out: the permuted tokens go straight to the unpermute, and the
  backward is given gradients for both the output and the permuted probs. Providers:
  `megatron` (TopKRouter + moe_utils.permute/unpermute, as its dispatcher calls them) and
  `replay-router+plan` (ReplayTopKRouter + the plan dispatcher's calls:
  replay_ops.permute(probs=...) and replay_ops.unpermute without weights).

Modes: fwd, full (forward + backward to the logits and the hidden states).

Counts: one call of each provider under a TorchDispatchMode (bench/launch_counter.py), for
the replay router with validate=True (`replay-router`), validate=False
(`replay-router/novalidate`) and validate=False with verl's replay mask False on 1% of the
rows (`replay-router/novalidate+mask`: those rows take Megatron's own selection, inside the
gate kernel; counted, not compared with Megatron's replay, which has no mask). `model_us` = 4 us per launch + bytes at 3 TB/s (an H100-like
model; on the GPU each native gate call is one launch).

Hidden dtype: --dtype; logits fp32 (moe_router_dtype="fp32").

Devices: `--device cpu` (the default) installs the CPU stand-ins; `--device cuda` runs
Megatron-Core as it runs on a GPU (no stand-ins; its router without TransformerEngine's
fused kernels, as on the CPU) and the replay router on the package's CUDA kernels (or
Triton's, where the extension has no CUDA kernels). On CUDA the counts are also taken on
the GPU and a count whose backward added nothing is refused (autograd runs a GPU backward
on its device thread: the counter must see it there).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's replay_ops, not an installed one
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
from launch_counter import counts, ops_str  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Targets of the fast path (docs/megatron.md): the route is one gate launch forward (its
# rows without a route selected inside the kernel), forward + backward at most three, with
# or without a replay mask.
ROUTE_FWD_LAUNCHES = 1
ROUTE_FULL_LAUNCHES = 3
MASKED_EVERY = 100  # the masked provider: 1% of rows not replayed (Megatron's own selection)
STEP_LAUNCH_RATIO = 0.5
STEP_BYTES_RATIO = 0.8
ROUTE_FWD_SPEEDUP = 2.0
STEP_FULL_SPEEDUP = 1.5


def setup(E, K, H, device="cpu"):
    from replay_ops.testing import megatron_cpu as env  # CPU stand-ins for Megatron

    env.install_cpu_shims()
    env.init_single()
    env.mp_init()
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from replay_ops.integrations import megatron as rom

    cfg = env.moe_config(num_moe_experts=E, moe_router_topk=K, hidden_size=H)
    pg = moe_utils.get_default_pg_collection()
    torch.manual_seed(0)
    routers = {"megatron": TopKRouter(cfg, pg),
               "replay-router": rom.ReplayTopKRouter(cfg, pg),
               "replay-router/novalidate": rom.ReplayTopKRouter(
                   cfg, pg, options=rom.ReplayOptions(validate=False)),
               "replay-router/novalidate+mask": rom.ReplayTopKRouter(
                   cfg, pg, options=rom.ReplayOptions(validate=False))}
    for r in routers.values():
        r.to(device)
        r.load_state_dict(routers["megatron"].state_dict())
        r.set_layer_number(1)
        r.router_replay.clear_indices()
        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    return routers, moe_utils


def make_fns(T, E, K, H, dtype, routers, moe_utils, device="cpu"):
    import replay_ops

    g = torch.Generator().manual_seed(T + E)
    logits0 = (torch.randn(T, E, generator=g) * 2).to(device)
    target = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(device)
    hidden0 = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
    mask = torch.ones(T, dtype=torch.bool)
    mask[::MASKED_EVERY] = False
    mask = mask.to(device)

    def route(name, logits):
        r = routers[name]
        r.router_replay.target_topk_idx = target  # REPLAY_FORWARD reads it, no FIFO growth
        # verl's replay mask (the router reads the field): False rows take Megatron's own
        # selection, inside the gate kernel
        r.router_replay.target_replay_mask = mask if name.endswith("+mask") else None
        return r.routing(logits.view(T, 1, E))

    def megatron_step(logits, hidden):
        probs, rmap = route("megatron", logits)
        # (permuted, probs, sorted indices), then two more values in megatron-core >= 0.17
        permuted, pprobs, sorted_idx = moe_utils.permute(hidden, rmap, probs=probs,
                                                         num_out_tokens=T * K)[:3]
        out = moe_utils.unpermute(permuted, sorted_idx, restore_shape=hidden.shape,
                                  routing_map=rmap)
        return out, pprobs

    def plan_step(name):
        def step(logits, hidden):
            probs, rmap = route(name, logits)
            plan = routers[name].plan_for(rmap)
            permuted, pprobs = replay_ops.permute(hidden, plan, num_rows=T * K, probs=probs,
                                                  validate=False)
            return replay_ops.unpermute(permuted, plan._replace(weights=None),
                                        validate=False), pprobs
        return step

    ops = {
        "route": {n: (lambda lg, hd, n=n: (route(n, lg)[0],)) for n in routers},
        "step": {"megatron": megatron_step,
                 "replay-router+plan": plan_step("replay-router"),
                 "replay-router+plan/novalidate": plan_step("replay-router/novalidate")},
    }
    return logits0, hidden0, ops


def grads_for(outs, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g).to(device=o.device, dtype=o.dtype) for o in outs]


def call(fn, mode, logits0, hidden0, op):
    """A closure running one provider in one mode (inputs and output gradients made
    outside it, so neither is counted nor timed)."""
    if mode == "fwd":
        return lambda: fn(logits0, hidden0)
    lg = logits0.clone().requires_grad_(True)
    hd = hidden0.clone().requires_grad_(op != "route")
    gos = grads_for(fn(lg, hd))

    def full():
        outs = fn(lg, hd)
        inputs = (lg, hd) if hd.requires_grad else (lg,)
        return torch.autograd.grad(outs, inputs, gos)
    return full


def check_same(ops, logits0, hidden0):
    """Every provider of an op computes the same thing, forward and backward (or the counts
    and times mean nothing)."""
    for op, fns in ops.items():
        base = None
        for name, fn in fns.items():
            if name.endswith("+mask"):  # other rows than Megatron's replay (masked rows)
                continue
            outs = [o.detach().float() for o in fn(logits0, hidden0)]
            grads = [g.float() for g in call(fn, "full", logits0, hidden0, op)()]
            if base is None:
                base = (outs, grads)
                continue
            for a, b in zip(base[0] + base[1], outs + grads):
                err = (a - b).abs().max().item() if a.numel() else 0.0
                if err > 1e-3 * max(1.0, a.abs().max().item()):
                    raise RuntimeError(f"bench_megatron: {op} provider {name} differs from "
                                       f"megatron by {err}")


def run(args):
    device, env, copy_bw = harness.start_run(args, "bench_megatron")
    rows, summary, targets = [], [], []
    for E in args.E:
        routers, moe_utils = setup(E, args.K, args.H, device)
        for dtype_name in args.dtype:
            dtype = DTYPES[dtype_name]
            for T in args.T:
                logits0, hidden0, ops = make_fns(T, E, args.K, args.H, dtype, routers,
                                                 moe_utils, device)
                check_same(ops, logits0, hidden0)
                case = dict(T=T, E=E, K=args.K, H=args.H, dtype=dtype_name)
                res = {}
                for op, fns in ops.items():
                    for mode in args.modes:
                        calls = {n: call(f, mode, logits0, hidden0, op) for n, f in fns.items()}
                        cnt = {n: counts(c) for n, c in calls.items()}
                        timed = {n: c for n, c in calls.items() if "/novalidate" not in n}
                        times = harness.median_of_runs([
                            harness.measure_interleaved(timed, device, warmup=args.warmup,
                                                        reps=args.reps)
                            for _ in range(args.runs)])
                        for n in calls:
                            row = {"op": op, "mode": mode, "provider": n, **case, **cnt[n]}
                            if n in times:
                                row.update(times[n])
                                row["speedup_vs_megatron"] = (times["megatron"]["ms_median"]
                                                              / times[n]["ms_median"])
                            rows.append(row)
                            res[(op, mode, n)] = row
                backward_counted(res)
                targets += evaluate(res, case, device)
                m = res[("step", "full", "megatron")]
                o = res[("step", "full", "replay-router+plan")]
                summary.append(
                    f"T={T} E={E} {dtype_name}: route fwd "
                    f"{res[('route', 'fwd', 'replay-router')]['speedup_vs_megatron']:.2f}x, "
                    f"step full {o['speedup_vs_megatron']:.2f}x faster; step full launches "
                    f"{o['launches']} vs {m['launches']}, bytes "
                    f"{o['bytes'] / 1e6:.1f} MB vs {m['bytes'] / 1e6:.1f} MB")
    harness.finish_run(args, rows, device, env, copy_bw, targets=targets)
    return rows, summary


def backward_counted(res):
    """Each provider's fwd+bwd count exceeds its forward count: the counter saw the
    backward (on a GPU autograd runs it on its own device thread)."""
    for (op, mode, name), row in res.items():
        fwd = res.get((op, "fwd", name))
        if mode == "full" and fwd is not None and row["launches"] <= fwd["launches"]:
            raise RuntimeError(f"bench_megatron: {op} {name}: fwd+bwd counted "
                               f"{row['launches']} launches, forward {fwd['launches']}; the "
                               "backward was not seen by the counter")


def evaluate(res, case, device="cpu"):
    """One row per target and case: the value, the bound, met or missed."""
    tag = "T={T} E={E} {dtype}".format(**case)
    clock = "GPU time" if str(device).startswith("cuda") else "CPU time"
    out = []

    def add(name, value, bound, ok, blocking=""):
        out.append({"case": tag, "target": name, "value": value, "bound": bound,
                    "met": bool(ok), "blocking": "" if ok else blocking})

    rf = res[("route", "fwd", "replay-router")]
    for name, what in (("replay-router", ""), ("replay-router/novalidate", ", validate=False"),
                       ("replay-router/novalidate+mask",
                        f", validate=False, {100 // MASKED_EVERY}% rows masked")):
        f, b = res[("route", "fwd", name)], res[("route", "full", name)]
        add(f"route fwd launches{what}", f["launches"], f"<= {ROUTE_FWD_LAUNCHES}",
            f["launches"] <= ROUTE_FWD_LAUNCHES, ops_str(f["ops"]))
        add(f"route fwd+bwd launches{what}", b["launches"], f"<= {ROUTE_FULL_LAUNCHES}",
            b["launches"] <= ROUTE_FULL_LAUNCHES, ops_str(b["ops"]))
    m, o = res[("step", "full", "megatron")], res[("step", "full", "replay-router+plan")]
    lr = o["launches"] / m["launches"]
    add("step fwd+bwd launches / megatron", round(lr, 3), f"<= {STEP_LAUNCH_RATIO}",
        lr <= STEP_LAUNCH_RATIO, ops_str(o["ops"]))
    br = o["bytes"] / m["bytes"]
    add("step fwd+bwd bytes / megatron", round(br, 3), f"<= {STEP_BYTES_RATIO}",
        br <= STEP_BYTES_RATIO, "MB by op: " + ", ".join(
            f"{k} {v / 1e6:.1f}" for k, v in sorted(o["op_bytes"].items(), key=lambda kv: -kv[1])))
    nv = res[("step", "full", "replay-router+plan/novalidate")]
    add("step fwd+bwd host syncs, validate=False, EP=1", nv["syncs"], "== 0", nv["syncs"] == 0,
        ops_str(nv["ops"]))
    add(f"route fwd speedup ({clock})", round(rf["speedup_vs_megatron"], 2),
        f">= {ROUTE_FWD_SPEEDUP}", rf["speedup_vs_megatron"] >= ROUTE_FWD_SPEEDUP,
        f"{rf['ms_median']:.3f} ms vs {res[('route', 'fwd', 'megatron')]['ms_median']:.3f} ms")
    add(f"step fwd+bwd speedup ({clock})", round(o["speedup_vs_megatron"], 2),
        f">= {STEP_FULL_SPEEDUP}", o["speedup_vs_megatron"] >= STEP_FULL_SPEEDUP,
        f"{o['ms_median']:.1f} ms vs {m['ms_median']:.1f} ms")
    return out


COLS = ["op", "mode", "provider", "T", "E", "K", "H", "dtype", "launches", "syncs", "bytes",
        "model_us", "ms_median", "ms_p20", "ms_p80", "speedup_vs_megatron"]
TARGET_COLS = ["case", "target", "value", "bound", "met", "blocking"]


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--E", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--H", type=int, default=1024)
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES),
                    default=["float32", "bfloat16"], help="hidden-state dtype")
    ap.add_argument("--modes", nargs="+", default=["fwd", "full"])
    harness.add_run_args(ap, reps=10, warmup=2)
    return ap


def main(argv=None):
    return harness.cli_main(parser, run, COLS, argv, target_cols=TARGET_COLS)


if __name__ == "__main__":
    main()
