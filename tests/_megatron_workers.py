"""Per-rank bodies of the multi-process Megatron tests (run by megatron_cpu.spawn in
fresh processes over gloo on 127.0.0.1). Each phase re-initialises Megatron's parallel
state on the same 2-rank world, so one process group serves several configurations.
Every check is an assertion here; a failing rank's traceback fails the calling test."""
from __future__ import annotations

import torch
import torch.distributed as dist

from replay_ops.testing import megatron_cpu as env

E, K = env.E_DEFAULT, 2
S, B, H = 8, 2, 16
T = S * B


def _hidden(seed, s=S, b=B):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, H, generator=g)


def phase_ep2_alltoall(rank, world):
    """EP=2 on the all-to-all dispatcher: Megatron's replay path vs the replay router vs
    the replay router with the plan dispatcher (outputs, gradients, splits, permutation)."""
    from replay_ops.integrations import megatron as rom

    env.mp_init(ep=2)
    cfg = env.moe_config(expert_model_parallel_size=2, moe_router_topk=2,
                         moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)
    ref, ours = env.build_pair(cfg)
    _, plan = env.build_pair(cfg)
    rom.enable_plan_dispatch(plan)
    target = env.random_routes(T, E, K, seed=40 + rank)
    x = _hidden(rank)
    a = env.run_layer(ref, x, target)
    b = env.run_layer(ours, x, target)
    c = env.run_layer(plan, x, target)
    env.assert_runs_match(a, b, what=f"ep2 rank {rank} replay router")
    env.assert_runs_match(a, c, what=f"ep2 rank {rank} plan dispatcher")
    for k in ("input_splits", "output_splits", "reversed_local_input_permutation_mapping"):
        assert k in a["meta"] and torch.equal(a["meta"][k], c["meta"][k]), k
    # padding rows spread over the two EP ranks; the all-to-all takes exactly T*K rows
    _, spread = env.build_pair(cfg, options=rom.ReplayOptions(padding="spread"))
    t = target.clone()
    t[: T // 2] = 0  # zero-filled padding rows
    r = env.run_layer(spread, x, t)
    rmap = r["meta"]["routing_map"]
    assert int(rmap.sum()) == T * K
    splits = r["meta"]["input_splits"]
    assert int(splits.sum()) == T * K
    pad_rank = rmap[: T // 2].nonzero()[:, 1] // (E // 2)
    counts = torch.bincount(pad_rank, minlength=2)
    assert counts[0] == counts[1], counts.tolist()  # not all on the first rank
    return {"splits": splits.tolist()}


def phase_tp2_sp(rank, world, etp):
    """TP=2 + sequence parallel (expert TP = etp): the routing is scattered like the hidden
    states; parity with Megatron's replay path; SP helpers against Megatron's own
    scatter/gather."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import (gather_from_sequence_parallel_region,
                                               scatter_to_sequence_parallel_region)
    from replay_ops.integrations import megatron as rom

    env.mp_init(tp=2, etp=etp)
    tp_group = ps.get_tensor_model_parallel_group()
    cfg = env.moe_config(tensor_model_parallel_size=2, sequence_parallel=True,
                         expert_tensor_parallel_size=etp, moe_router_topk=2)
    ref, ours = env.build_pair(cfg)
    routing = env.random_routes(T, E, K, seed=50)  # the same global routing on both ranks
    x_full = _hidden(7)
    x_local = scatter_to_sequence_parallel_region(x_full, group=tp_group)
    local = rom.sp_scatter(routing, tp_group)
    mega = scatter_to_sequence_parallel_region(routing.view(S, B, K), group=tp_group).reshape(-1, K)
    assert torch.equal(local, mega)  # the routing follows the hidden states' split
    a = env.run_layer(ref, x_local, local)
    b = env.run_layer(ours, x_local, local)
    env.assert_runs_match(a, b, what=f"tp2 sp etp={etp} rank {rank}")
    # R2: each TP rank records its tokens; gathered back in order
    r = env.run_layer(ours, x_local, None, "RECORD")
    full = rom.sp_gather(r["recorded"].to(torch.int16), tp_group)
    assert full.dtype == torch.int16 and full.shape == (T, K)
    assert torch.equal(full[rank * T // 2:(rank + 1) * T // 2].long(), r["recorded"])
    assert torch.equal(rom.sp_gather(local.to(torch.int16), tp_group).long(), routing)
    mask = torch.arange(T) % 3 != 0
    assert torch.equal(rom.sp_gather(rom.sp_scatter(mask, tp_group), tp_group), mask)
    mg = gather_from_sequence_parallel_region(local, group=tp_group)
    assert torch.equal(mg, routing)
    # a checked ReplayBatch: its rows and its mask follow the same split, still checked
    from replay_ops.router_replay import ReplayBatch

    shape = rom.model_shape(cfg)
    batch = ReplayBatch(routing[:, None].to(torch.int16), mask,
                        torch.tensor([0, T])).check(shape)
    lb = rom.sp_scatter(batch, tp_group)
    assert torch.equal(lb.indices[:, 0].long(), local) and (lb.sp_size, lb.sp_rank) == (2, rank)
    assert torch.equal(lb.replay_mask, rom.sp_scatter(mask, tp_group)) and lb.checked_for(shape)
    back = rom.sp_gather(lb, tp_group)
    assert torch.equal(back.indices, batch.indices) and back.sp_size == 1
    assert torch.equal(back.replay_mask, mask) and back.checked_shape is None
    try:
        rom.sp_scatter(routing[:-1], tp_group)
        raise AssertionError("an odd token count was not detected")
    except rom.LayoutError as e:
        assert "15 tokens do not split over TP=2" in str(e), str(e)
    return {"local_tokens": int(local.shape[0])}


def phase_cp2(rank, world):
    """CP=2: split and all-gather of a THD pack in both layouts; the zigzag split equals
    Megatron-Core's own get_batch_on_this_cp_rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank
    from replay_ops.integrations import megatron as rom

    env.mp_init(cp=2)
    cp_group = ps.get_context_parallel_group()
    lens = [7, 12, 3]
    routes = [torch.stack([env.random_routes(n - 1, E, K, seed=60 + i + 10 * j) for j in range(3)],
                          dim=1) for i, n in enumerate(lens)]
    align, _ = rom.megatron_thd_alignment(1, 2)
    packed = rom.pack_megatron_thd(routes, lens, align=align, num_experts=E)
    from replay_ops.router_replay import ModelShape

    shape = ModelShape(E, K, (0, 1, 2))
    for scheme in rom.CP_SCHEMES:
        local = rom.cp_split(packed, 2, rank, scheme)
        back = rom.cp_all_gather(local, cp_group)
        assert torch.equal(back.indices, packed.indices) and torch.equal(back.replay_mask,
                                                                          packed.replay_mask)
        checked = rom.cp_split(packed.check(shape), 2, rank, scheme)  # the mark is kept
        assert checked.checked_for(shape) and torch.equal(checked.indices, local.indices)
    # one padded sequence in BSHD: Megatron's zigzag split of the positions
    n = 16
    pos = torch.arange(n)[None]
    import inspect

    extra = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(
        get_batch_on_this_cp_rank).parameters else {}  # megatron-core >= 0.17
    mega = get_batch_on_this_cp_rank({"tokens": pos.clone()}, cp_group=cp_group,
                                     **extra)["tokens"][0]
    ours = rom.cp_partition_index([0, n], 2, rank, "zigzag")
    assert torch.equal(mega, ours), (mega.tolist(), ours.tolist())
    return {"local_rows": int(rom.cp_split(packed, 2, rank).num_tokens)}


PP_PATTERN = [1, 0, 1, 1, 0, 1, 1, 1]  # 8 layers, dense 2 and 5


def phase_pp2_vpp2(rank, world):
    """PP=2 with 2 virtual stages per rank: each rank walks the chunks it holds; routes by
    MoE ordinal and by absolute layer; R2 recording gathered over the PP group in layer
    order (layers interleave across ranks: 1-2 and 5-6 on rank 0, 3-4 and 7-8 on rank 1;
    layers 2 and 5 are dense)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from replay_ops.integrations import megatron as rom

    env.mp_init(pp=2, vpp=2)
    pp_group = ps.get_pipeline_model_parallel_group()
    cfg = env.moe_config(num_layers=len(PP_PATTERN), moe_layer_freq=list(PP_PATTERN),
                         pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                         pipeline_dtype=torch.float32)
    chunks = []
    for vp in range(2):
        spec = rom.replay_spec(get_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                                          vp_stage=vp))
        chunks.append(GPTModel(cfg, spec, vocab_size=32, max_sequence_length=S,
                               pre_process=ps.is_pipeline_first_stage(False, vp),
                               post_process=ps.is_pipeline_last_stage(False, vp), vp_stage=vp))
    slots = rom.find_moe_routers(chunks)
    held = [s.layer_number for s in slots]
    want_layers = [1, 6] if rank == 0 else [3, 4, 7, 8]
    assert held == want_layers, held
    moe_numbers = [i + 1 for i, p in enumerate(PP_PATTERN) if p]
    routing = torch.stack([env.random_routes(T, E, K, seed=70 + j)
                           for j in range(len(moe_numbers))], dim=1)
    rom.set_replay_routing(chunks, routing)
    for s in slots:
        assert torch.equal(s.router.router_replay.target_topk_idx,
                           routing[:, moe_numbers.index(s.layer_number)])
    absolute = torch.full((T, len(PP_PATTERN), K), -1, dtype=torch.long)
    absolute[:, [n - 1 for n in moe_numbers]] = routing
    for s in slots:
        s.router.router_replay.clear_indices()
    rom.set_replay_routing(chunks, absolute)
    for s in slots:
        assert torch.equal(s.router.router_replay.target_topk_idx,
                           routing[:, moe_numbers.index(s.layer_number)])
    # R2: record every router of this rank on its own input, gather in layer order
    rom.set_replay_action(chunks, RouterReplayAction.RECORD)
    mine = {}
    for s in slots:
        s.router(_hidden(100 + s.layer_number))
        mine[s.layer_number] = s.router.router_replay.get_recorded_indices().clone()
    gathered = rom.gather_recorded_routing(chunks, pp_group)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=pp_group)
    merged = {k: v for d in everyone for k, v in d.items()}
    want = torch.stack([merged[n] for n in sorted(merged)], dim=1)
    assert sorted(merged) == moe_numbers
    assert torch.equal(gathered, want)
    full = rom.gather_recorded_routing(chunks, pp_group, layer_index="absolute")
    assert (full[:, [1, 4]] == -1).all() and torch.equal(full[:, [n - 1 for n in moe_numbers]], want)
    return {"layers": held}


PHASES = {
    "ep2_alltoall": phase_ep2_alltoall,
    "tp2_sp_etp1": lambda r, w: phase_tp2_sp(r, w, 1),
    "tp2_sp_etp2": lambda r, w: phase_tp2_sp(r, w, 2),
    "cp2": phase_cp2,
    "pp2_vpp2": phase_pp2_vpp2,
}


def run_all(rank, world):
    """Every phase in order; {phase: ("ok", result) | ("error", traceback)}. A phase that
    fails on one rank while the other waits in a collective ends in spawn's timeout."""
    import traceback

    out = {}
    for name, fn in PHASES.items():
        try:
            out[name] = ("ok", fn(rank, world))
        except Exception:
            out[name] = ("error", traceback.format_exc())
        dist.barrier()
    return out
