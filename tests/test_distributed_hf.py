"""Hugging Face integration with expert parallelism: a tiny random-weight model patched
with `ep_group` on 2 gloo ranks (each rank: half of the batch, half of the experts)
matches the unsharded model on the whole batch: native routing against the unpatched
model, R3 replay of a given routing against the single-device patch, RECORD against the
unpatched model's own choice; logits and gradients (routers, experts, everything else)."""
from __future__ import annotations

import pytest

from _dist_spawn import run_group

pytest.importorskip("transformers")

WORLD = 2
# (architecture, experts implementation, shard_weights): every family; shared experts
# (gated / MLP), dense layers, softmax with and without normalization, sigmoid + scaling;
# each experts implementation; sharded and replicated expert weights.
CONFIGS = (("qwen2_moe", "grouped_mm", True), ("deepseek_v3", "eager", True),
           ("mixtral", "batched_mm", True), ("qwen3_moe", "grouped_mm", False),
           ("olmoe", "eager", False))
ARCHS = tuple(c[0] for c in CONFIGS)
B_PER_RANK, S = 2, 6
LOGIT_TOL = 1e-5  # other batch sizes in attention and the dense GEMMs (CPU BLAS blocking)
GRAD_TOL = 1e-4   # ... and gradients summed over ranks in another order


def _hf_checks(rank, world):
    import torch
    import torch.distributed as dist

    from _dist_spawn import tiny_model
    from replay_ops.integrations.hf.ep import enable_expert_parallel
    from replay_ops.integrations import hf
    from replay_ops.router_replay import ReplayAction

    def close(a, b, what, tol):
        assert a.shape == b.shape, f"{what}: {tuple(a.shape)} != {tuple(b.shape)}"
        scale = b.abs().max().item() + 1e-12
        err = (a - b).abs().max().item()
        assert err <= tol * scale, f"{what}: max err {err:.3e} > {tol:g} x {scale:.3e}"

    def loss_of(logits, ids):  # a sum over tokens: the ranks' losses add up to the whole
        w = torch.linspace(-1, 1, logits.shape[-1])
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               ids.reshape(-1), reduction="sum")
        return (logits * w).sum() + ce

    done = []
    g = torch.Generator().manual_seed(7)
    ids_all = torch.randint(0, 256, (world * B_PER_RANK, S), generator=g)
    mine = slice(rank * B_PER_RANK, (rank + 1) * B_PER_RANK)
    tok = slice(rank * B_PER_RANK * S, (rank + 1) * B_PER_RANK * S)
    ids = ids_all[mine]
    for arch, impl, shard in CONFIGS:
        where = f"[{arch}, {impl}, shard_weights={shard}, rank {rank}]"

        def build():
            m = tiny_model(arch, seed=1234)
            m.set_experts_implementation(impl)
            return m

        ref = build()
        model = build()
        if shard:
            patch = hf.patch_model(model, "R3", ep_group=dist.group.WORLD)
        else:
            patch = enable_expert_parallel(hf.patch_model(model, "R3"), dist.group.WORLD,
                                           shard_weights=False)
        lay = patch.layout
        E, K, L = lay.num_experts, lay.top_k, len(lay.moe_layer_ids)
        n = E // world
        for blk in lay.blocks.values():
            assert blk.experts.gate_up_proj.shape[0] == (n if shard else E), \
                f"{where} expert weights"

        # 1. No action: native routing, sharded experts == the unpatched model.
        with torch.no_grad():
            want = ref(ids_all).logits[mine]
            got = model(ids).logits
        close(got, want, f"{where} native routing logits", LOGIT_TOL)

        # 2. RECORD picks what the unpatched model picks.
        seen = {}
        hooks = [blk.gate.register_forward_hook(
            lambda m, i, o, lid=lid: seen.__setitem__(lid, o[2]))
            for lid, blk in hf.find_moe_blocks(ref).blocks.items()]
        with torch.no_grad():
            ref(ids_all)
        for h in hooks:
            h.remove()
        native = torch.stack([seen[lid] for lid in sorted(seen)], dim=1)[tok]
        patch.replay.set_action(ReplayAction.RECORD)
        with torch.no_grad():
            model(ids)
        assert torch.equal(patch.replay.recorded(), native.to(torch.int32)), f"{where} RECORD"
        patch.replay.clear()

        # 3. R3 replay of a routing unlike the native one: logits and gradients against
        #    the single-device patch on the whole batch.
        T_all = ids_all.numel()
        routing = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T_all * L)])
        routing = routing.view(T_all, L, K).to(torch.int32)
        single = build()
        sp = hf.patch_model(single, "R3")
        sp.replay.set_routing(routing)
        sp.replay.set_action(ReplayAction.REPLAY_FORWARD)
        want = single(ids_all).logits
        loss_of(want, ids_all).backward()
        patch.replay.set_routing(routing[tok])
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
        # the exchange runs inside the experts module's own call: its hooks see it
        seen_hooks = []
        handles = [blk.experts.register_forward_hook(
            lambda m, i, o: seen_hooks.append((i[0].shape, o.shape)))
            for blk in lay.blocks.values()]
        got = model(ids).logits
        for h in handles:
            h.remove()
        x_shape = (ids.numel(), model.config.hidden_size)
        assert seen_hooks == [(x_shape, x_shape)] * L, f"{where} experts hooks {seen_hooks}"
        loss_of(got, ids).backward()
        close(got.detach(), want.detach()[mine], f"{where} R3 logits", LOGIT_TOL)
        assert torch.equal(patch.last_routing(), routing[tok]), f"{where} replayed routing"
        ref_params = dict(single.named_parameters())
        n_expert = n_other = 0
        for name, p in model.named_parameters():
            r = ref_params[name]
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and shard:
                close(p.grad, r.grad[rank * n:(rank + 1) * n], f"{where} {name} grad", GRAD_TOL)
                close(p.detach(), r.detach()[rank * n:(rank + 1) * n], f"{where} {name}", 0)
                n_expert += 1
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # replicated weights: this rank's experts get gradients, the others none
                mine_e = slice(rank * n, (rank + 1) * n)
                close(p.grad[mine_e], r.grad[mine_e], f"{where} {name} grad", GRAD_TOL)
                others = torch.ones(E, dtype=torch.bool)
                others[mine_e] = False
                assert p.grad[others].abs().max() == 0, f"{where} {name}: other experts' grad"
                n_expert += 1
            elif r.grad is not None:
                g_sum = p.grad.clone()
                dist.all_reduce(g_sum)
                close(g_sum, r.grad, f"{where} {name} grad (summed over ranks)", GRAD_TOL)
                n_other += 1
        assert n_expert == 2 * L and n_other > 0, (n_expert, n_other)

        # 4. After remove(), the sharded experts refuse the original forward (replicated
        #    ones run it: the unpatched model).
        patch.remove()
        if not shard:
            with torch.no_grad():
                close(model(ids).logits, ref(ids).logits, f"{where} unpatched again", 0)
            done.append(arch)
            continue
        try:
            with torch.no_grad():
                model(ids)
        except RuntimeError as exc:
            assert "holds only this rank's experts" in str(exc), str(exc)
        else:
            raise AssertionError(f"{where} sharded experts ran after remove()")
        # ... and patching the sharded model again without the group is refused (it ran
        # expert e + E/W on rank 1 with the global ids, silently, before)
        try:
            hf.patch_model(model, "R3")
        except hf.UnsupportedModelError as exc:
            assert "sharded for expert parallelism" in str(exc), str(exc)
        else:
            raise AssertionError(f"{where} a sharded model was patched without ep_group")
        done.append(arch)
    return done


def test_hf_tiny_model_ep2_matches_unsharded():
    results = run_group("test_distributed_hf:_hf_checks", WORLD, timeout=180)
    assert results == [list(ARCHS)] * WORLD
