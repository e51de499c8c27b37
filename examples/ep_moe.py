"""A small expert-parallel MoE layer with router replay, on CPU with gloo.

    torchrun --nproc-per-node 2 examples/ep_moe.py

Every rank holds the router (replicated) and E/W of the E experts. Each rank replays the
routing recorded for its own tokens (as a rollout engine would return it: global expert
ids, some slots empty (-1), and the last token of each sequence without a route, which
falls back to the model's own top-k), sends the rows to the experts' owners, and combines
the results. The script then checks the layer against the same layer run in one process on
the whole batch (rank 0's tokens, then rank 1's, ...): outputs and the experts'
gradients are bitwise equal, the router gradient (summed over the ranks) equal to fp32
rounding. It exits with status 1 if they are not.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import replay_ops
from replay_ops import distributed as ep


class EPReplayMoE(torch.nn.Module):
    """Router + this rank's experts (SwiGLU). `forward(x, recorded, replay_mask)`."""

    def __init__(self, hidden, ffn, num_experts, top_k, *, group=None, align=1, seed=0):
        super().__init__()
        _, rank, world = ep.group_info(group)
        self.group, self.top_k, self.align = group, top_k, align
        self.local = ep.local_expert_range(num_experts, group)
        full = make_weights(hidden, ffn, num_experts, seed)  # same seed on every rank
        self.router = torch.nn.Parameter(full["router"])
        lo, hi = self.local.start, self.local.stop
        self.w_gate_up = torch.nn.Parameter(full["w_gate_up"][lo:hi].clone())
        self.w_down = torch.nn.Parameter(full["w_down"][lo:hi].clone())

    def forward(self, x, recorded, replay_mask=None):
        logits = x @ self.router
        plan = ep.gate(logits, recorded, group=self.group, replay_mask=replay_mask,
                       align=self.align)
        x_local, handle = ep.dispatch(x, plan, self.group)
        y_local = expert_mlps(x_local, handle.local_offsets.tolist(), self.w_gate_up,
                              self.w_down)
        return ep.combine(y_local, handle), handle


def make_weights(hidden, ffn, num_experts, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(hidden, num_experts, generator=g) / hidden ** 0.5,
        "w_gate_up": torch.randn(num_experts, 2 * ffn, hidden, generator=g) / hidden ** 0.5,
        "w_down": torch.randn(num_experts, hidden, ffn, generator=g) / ffn ** 0.5,
    }


def expert_mlps(rows, offsets, w_gate_up, w_down):
    """One SwiGLU per expert segment rows[offsets[j]:offsets[j+1]] (padding rows included,
    as a grouped GEMM would compute them); rows past offsets[-1] stay zero."""
    outs = []
    for j in range(len(offsets) - 1):
        g, u = F.linear(rows[offsets[j]:offsets[j + 1]], w_gate_up[j]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(g) * u, w_down[j]))
    outs.append(rows[offsets[-1]:] * 0)
    return torch.cat(outs)


def make_batch(rank, tokens, hidden, num_experts, top_k, seed):
    """This rank's tokens and their recorded routing (what a rollout engine returned)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(tokens, hidden, generator=g)
    recorded = torch.rand(tokens, num_experts, generator=g).argsort(dim=1)[:, :top_k]
    recorded = recorded.to(torch.int16)  # rollout engines send int16
    recorded[torch.rand(tokens, top_k, generator=g) < 0.1] = -1  # empty slots
    replay_mask = torch.ones(tokens, dtype=torch.bool)
    replay_mask[-1] = False  # the last token has no route: own top-k
    return x, recorded, replay_mask


def single_process(x, recorded, mask, weights, top_k, align):
    """The same layer on the whole batch in one process (all E experts)."""
    x = x.clone().requires_grad_(True)
    w = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
    plan = replay_ops.gate(x @ w["router"], recorded, replay_mask=mask, align=align)
    rows = replay_ops.permute(x, plan)
    y = expert_mlps(rows, plan.expert_offsets.tolist(), w["w_gate_up"], w["w_down"])
    return replay_ops.unpermute(y, plan), w


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=96)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--align", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if os.environ.get("MASTER_ADDR", "127.0.0.1") in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: loopback only
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    layer = EPReplayMoE(args.hidden, args.ffn, args.experts, args.top_k, align=args.align,
                        seed=args.seed)
    x, recorded, mask = make_batch(rank, args.tokens, args.hidden, args.experts, args.top_k,
                                   args.seed)
    x.requires_grad_(True)
    out, handle = layer(x, recorded, mask)
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(99 + rank))
    (out * gout).sum().backward()
    print(f"rank {rank}/{world}: experts {handle.local_experts.start}..{handle.local_experts.stop - 1}, "
          f"sent {handle.send_counts} rows, received {handle.recv_counts}, local rows "
          f"{handle.local_offsets.tolist()} (align {args.align}), output {tuple(out.shape)}",
          flush=True)

    # Check against one process on the whole batch (every rank rebuilds it from the seeds).
    parts = [make_batch(r, args.tokens, args.hidden, args.experts, args.top_k, args.seed)
             for r in range(world)]
    x_all, rec_all, mask_all = (torch.cat([p[i] for p in parts]) for i in range(3))
    weights = make_weights(args.hidden, args.ffn, args.experts, args.seed)
    ref_out, ref_w = single_process(x_all, rec_all, mask_all, weights, args.top_k, args.align)
    gouts = [torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(99 + r))
             for r in range(world)]
    (ref_out * torch.cat(gouts)).sum().backward()
    mine = slice(rank * args.tokens, (rank + 1) * args.tokens)
    lo, hi = layer.local.start, layer.local.stop
    out_equal = torch.equal(out.detach(), ref_out.detach()[mine])
    experts_equal = (torch.equal(layer.w_gate_up.grad, ref_w["w_gate_up"].grad[lo:hi])
                     and torch.equal(layer.w_down.grad, ref_w["w_down"].grad[lo:hi]))
    router_grad = layer.router.grad.clone()
    dist.all_reduce(router_grad)
    router_err = ((router_grad - ref_w["router"].grad).abs().max()
                  / ref_w["router"].grad.abs().max()).item()
    ok = out_equal and experts_equal and router_err < 1e-5
    print(f"rank {rank}: output bitwise equal to one process: {out_equal}; expert gradients "
          f"bitwise equal: {experts_equal}; router gradient (summed over ranks) relative "
          f"error {router_err:.1e}", flush=True)
    dist.barrier()
    if rank == 0:
        print("ep_moe: OK" if ok else "ep_moe: MISMATCH", flush=True)
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
