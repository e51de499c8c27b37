"""FSDP2 (`torch.distributed.fsdp.fully_shard` on every decoder layer and the model) with
a Hugging Face MoE model patched by replay_ops, on 2 gloo ranks (127.0.0.1), each rank a
half of the batch: equal to one process running both halves on the unsharded model with the
gradients averaged, as a data-parallel trainer (verl's FSDP actor) sees it.

Cases (each run on both sides, sharded and single-process):
* "r3": R3 replay of a given routing, forward and backward;
* "r3_ac": the same under activation checkpointing (transformers'
  `gradient_checkpointing_enable`, non-reentrant): the recompute replays each layer's
  routing from its queue (auto_recompute);
* "r3_compile": the same, the sharded model under `torch.compile` (AOTAutograd);
* "r2_step": R2 across optimizer steps: RECORD (no grad), REPLAY_FORWARD + backward,
  SGD step, twice; the updated parameters compared after each step.

Losses and gradients are compared bitwise where the sharded run does the same float
operations (eager), within 1e-6 relative under torch.compile (AOTAutograd's backward of
the attention adds in another order, the unsharded compiled model too)."""
from __future__ import annotations

import pytest

from _dist_spawn import run_group

pytest.importorskip("transformers")

WORLD = 2
B_PER_RANK, S = 1, 6
E, K = 8, 2
CASES = ("r3", "r3_ac", "r3_compile", "r2_step")


def _fsdp_checks(rank, world, cases):
    import torch
    from torch.distributed.fsdp import fully_shard

    from _dist_spawn import tiny_model
    from replay_ops.integrations import hf
    from replay_ops.router_replay import ReplayAction

    T = B_PER_RANK * S
    g = torch.Generator().manual_seed(7)
    ids_all = torch.randint(0, 256, (world * B_PER_RANK, S), generator=g)
    r = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(world * T * 2)])
    routing_all = r.view(world * T, 2, K)  # [tokens, MoE layers, K]

    def build(mode, ac):
        m = tiny_model("qwen3_moe", seed=11, num_layers=2, num_experts=E, top_k=K,
                       hidden_size=32, expert_size=16)
        m.train()
        if ac:
            m.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        return m, hf.patch_model(m, mode)

    def loss_of(logits):
        return (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum()

    def step(model, patch, run, ids, routing, mode, scale=1.0):
        if mode == "R3":
            patch.replay.set_routing(routing)
        else:
            patch.replay.set_action(ReplayAction.RECORD)
            with torch.no_grad():
                run(ids)
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        loss = loss_of(run(ids).logits)
        (loss * scale).backward()  # FSDP averages the ranks' gradients; one process: scale
        return loss.detach()

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    report = {}
    for case in cases:
        mode = "R2" if case == "r2_step" else "R3"
        ac, comp = case == "r3_ac", case == "r3_compile"
        nsteps = 2 if case == "r2_step" else 1
        # single process, unsharded: both halves, the gradients of loss / world added
        ref, rp = build(mode, ac)
        ref_run = torch.compile(ref, backend="aot_eager") if comp else ref
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        # sharded
        model, patch = build(mode, ac)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        run = torch.compile(model, backend="aot_eager") if comp else model
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for s in range(nsteps):
            ref_opt.zero_grad(set_to_none=True)
            opt.zero_grad(set_to_none=True)
            ids_s = (ids_all + s) % 256
            ref_losses = []
            for r_ in range(world):
                sl = slice(r_ * B_PER_RANK, (r_ + 1) * B_PER_RANK)
                ref_losses.append(step(ref, rp, ref_run, ids_s[sl],
                                       routing_all[r_ * T:(r_ + 1) * T], mode, 1 / world))
            mine = slice(rank * B_PER_RANK, (rank + 1) * B_PER_RANK)
            loss = step(model, patch, run, ids_s[mine], routing_all[rank * T:(rank + 1) * T],
                        mode)
            where = f"[{case}, step {s}, rank {rank}]"
            if comp:
                torch.testing.assert_close(loss, ref_losses[rank], rtol=1e-6, atol=0)
            else:
                assert torch.equal(loss, ref_losses[rank]), f"{where} loss"
            ref_grads = {n: q.grad for n, q in ref.named_parameters()}
            names = []
            for n, q in model.named_parameters():
                got = full(q.grad)
                want = ref_grads[n]
                if comp:
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9,
                                               msg=f"{where} grad {n}")
                else:
                    assert torch.equal(got, want), \
                        f"{where} grad {n}: max diff {(got - want).abs().max().item():.3e}"
                names.append(n)
            assert any(".mlp.experts." in n for n in names) and any(".mlp.gate." in n
                                                                     for n in names)
            if case == "r3_ac":
                # every recompute popped its layer's queue entry
                assert all(patch.replay.queue_depth(lid) == 0 for lid in patch.moe_layer_ids)
            ref_opt.step()
            opt.step()
            if case == "r2_step":
                for (n, q), (_, qr) in zip(model.named_parameters(), ref.named_parameters()):
                    assert torch.equal(full(q.detach()), qr.detach()), f"{where} param {n}"
        report[case] = float(loss)
    return report


@pytest.mark.parametrize("cases", [("r3", "r3_ac", "r2_step"), ("r3_compile",)],
                         ids=["eager", "compile"])
def test_fsdp2_replay_equals_single_process(cases):
    results = run_group("test_distributed_fsdp:_fsdp_checks", WORLD, timeout=420,
                        cases=list(cases))
    assert all(set(r) == set(cases) for r in results)
