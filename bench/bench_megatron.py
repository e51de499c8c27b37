"""Megatron-Core's replay path against the replay router, in the same run.

    python bench/bench_megatron.py --device cpu --runs 3 --out cpu_2core_megatron

Ops (Megatron-Core 0.16.1, its real code; the CPU stand-ins of tests/_megatron_env.py are
installed so its router runs without CUDA):

* `route`: the router's `routing(logits)` under REPLAY_FORWARD, giving the dense probs and
  routing map. Providers: `megatron` (TopKRouter: its RouterReplay gathers the scores at
  the target indices, softmax, scatter to [T, E]) and `replay-router` (ReplayTopKRouter:
  replay_ops.gate, then the dense form), both with the same weights and targets.
* `route+permute+unpermute`: route, then the all-to-all dispatcher's local permutation
  and its inverse, with the probs gathered per permuted row as the dispatcher does.
  Providers: `megatron` (TopKRouter + moe_utils.permute/unpermute), `replay-router`
  (ReplayTopKRouter + Megatron's permute/unpermute) and `replay-router+plan` (the plan
  dispatcher's path: replay_ops.permute/unpermute on the RoutingPlan, no argsort).

Modes: fwd, full (forward + backward to the logits and hidden states).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import harness  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def setup(args):
    import _megatron_env as env  # CPU stand-ins for Megatron (test/bench only)

    env.install_cpu_shims()
    env.init_single()
    env.mp_init()
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from replay_ops.integrations import megatron as rom

    cfg = env.moe_config(num_moe_experts=args.E, moe_router_topk=args.K, hidden_size=args.H,
                         moe_router_pre_softmax=bool(args.pre_softmax))
    pg = moe_utils.get_default_pg_collection()
    torch.manual_seed(0)
    meg = TopKRouter(cfg, pg)
    ours = rom.ReplayTopKRouter(cfg, pg, options=rom.ReplayOptions(validate=bool(args.validate)))
    ours.load_state_dict(meg.state_dict())
    for r in (meg, ours):
        r.set_layer_number(1)
    return cfg, meg, ours, RouterReplayAction, moe_utils


def make_fns(args, T, meg, ours, action, moe_utils, dtype, device):
    g = torch.Generator().manual_seed(T)
    E, K, H = args.E, args.K, args.H
    logits0 = (torch.randn(T, E, generator=g) * 2).to(device)
    target = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(device)
    hidden0 = torch.randn(T, H, generator=g).to(dtype).to(device)
    for r in (meg, ours):
        r.router_replay.clear_indices()
        r.router_replay.set_router_replay_action(action.REPLAY_FORWARD)

    def route(router, logits):
        router.router_replay.target_topk_idx = target  # REPLAY_FORWARD reads it, no FIFO growth
        return router.routing(logits.view(T, 1, E))

    def megatron_dispatch(hidden, probs, rmap):
        permuted, pprobs, sorted_idx = moe_utils.permute(hidden, rmap, probs=probs,
                                                         num_out_tokens=T * K)
        y = permuted * pprobs.unsqueeze(-1).to(permuted.dtype)  # stand-in for the experts
        return moe_utils.unpermute(y, sorted_idx, restore_shape=hidden.shape, routing_map=rmap)

    def plan_dispatch(hidden, probs, rmap):
        import replay_ops

        plan = ours.plan_for(rmap)
        permuted = replay_ops.permute(hidden, plan, num_rows=T * K)
        slots = plan.sorted_slots[:T * K].long()
        tok = torch.div(slots, K, rounding_mode="floor")
        expert = plan.expert_indices.reshape(-1)[slots].long()
        pprobs = probs.reshape(-1).index_select(0, tok * E + expert)
        y = permuted * pprobs.unsqueeze(-1).to(permuted.dtype)
        return replay_ops.unpermute(y, plan._replace(weights=torch.ones_like(plan.weights)))

    providers = {
        "route": {
            "megatron": lambda lg, hd: route(meg, lg)[0],
            "replay-router": lambda lg, hd: route(ours, lg)[0],
        },
        "route+permute+unpermute": {
            "megatron": lambda lg, hd: megatron_dispatch(hd, *route(meg, lg)),
            "replay-router": lambda lg, hd: megatron_dispatch(hd, *route(ours, lg)),
            "replay-router+plan": lambda lg, hd: plan_dispatch(hd, *route(ours, lg)),
        },
    }
    return logits0, hidden0, providers


def check_same(providers, logits0, hidden0):
    """Every provider of an op computes the same thing (or the timing means nothing)."""
    for op, fns in providers.items():
        outs = {n: f(logits0, hidden0).detach().float() for n, f in fns.items()}
        base = outs["megatron"]
        for n, o in outs.items():
            err = (o - base).abs().max().item()
            if err > 1e-4 * max(1.0, base.abs().max().item()):
                raise RuntimeError(f"bench_megatron: {op} provider {n} differs from megatron by {err}")


def run(args):
    device = args.device
    if device != "cpu":
        raise SystemExit("bench_megatron: the Megatron stand-ins here are for the CPU; on a GPU "
                         "run Megatron's own CUDA path (not measured in this file)")
    dtype = DTYPES[args.dtype]
    env = harness.env_info(device)
    copy_bw = args.copy_bw or harness.copy_bandwidth(device)
    cfg, meg, ours, action, moe_utils = setup(args)
    rows, summary = [], []
    for T in args.T:
        logits0, hidden0, providers = make_fns(args, T, meg, ours, action, moe_utils, dtype, device)
        check_same(providers, logits0, hidden0)
        for op, fns in providers.items():
            if op != "route" and T > args.max_dispatch_T:
                continue
            for mode in args.modes:
                calls = {}
                for name, f in fns.items():
                    if mode == "fwd":
                        calls[name] = (lambda f=f: f(logits0, hidden0))
                    else:
                        lg = logits0.clone().requires_grad_(True)
                        hd = hidden0.clone().requires_grad_(op != "route")
                        go = torch.ones(T, args.H if op != "route" else args.E, dtype=torch.float32)

                        def full(f=f, lg=lg, hd=hd, go=go):
                            out = f(lg, hd)
                            inputs = (lg, hd) if hd.requires_grad else (lg,)
                            return torch.autograd.grad(out, inputs, go.to(out.dtype))
                        calls[name] = full
                res = harness.median_of_runs([
                    harness.measure_interleaved(calls, device, warmup=args.warmup, reps=args.reps)
                    for _ in range(args.runs)])
                for name, r in res.items():
                    row = {"op": op, "mode": mode, "provider": name, "T": T, "E": args.E,
                           "K": args.K, "H": args.H if op != "route" else None,
                           "dtype": args.dtype, "pre_softmax": bool(args.pre_softmax),
                           "validate": bool(args.validate), **r,
                           "speedup_vs_megatron": res["megatron"]["ms_median"] / r["ms_median"]}
                    rows.append(row)
                for name in res:
                    if name == "megatron":
                        continue
                    summary.append(
                        f"{op} {mode} T={T} E={args.E} K={args.K}"
                        f"{'' if op == 'route' else f' H={args.H} {args.dtype}'}: {name} "
                        f"{res[name]['ms_median']:.3f} ms vs megatron "
                        f"{res['megatron']['ms_median']:.3f} ms = "
                        f"{res['megatron']['ms_median'] / res[name]['ms_median']:.2f}x")
    for r in rows:
        r["device"] = device
    args.env = env
    args.copy_bw = copy_bw
    return rows, summary


COLS = ["op", "mode", "provider", "T", "E", "K", "H", "dtype", "ms_median", "ms_p20", "ms_p80",
        "speedup_vs_megatron"]


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--E", type=int, default=128)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--H", type=int, default=512)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--pre-softmax", type=int, default=0)
    ap.add_argument("--validate", type=int, default=1,
                    help="the replay router's range check (its default; one host read)")
    ap.add_argument("--max-dispatch-T", type=int, default=4096,
                    help="largest T for the permute ops (memory/time on small machines)")
    ap.add_argument("--modes", nargs="+", default=["fwd", "full"])
    harness.add_run_args(ap, reps=15, warmup=3)
    return ap


def main(argv=None):
    return harness.cli_main(parser, run, COLS, argv)


if __name__ == "__main__":
    main()
