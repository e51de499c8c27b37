"""verl's own router-replay helpers driving Megatron-Core models built with the replay
router, against the same models with Megatron's router under verl's patch.

verl is real and unmodified (installed from the package index by `make test`); its patch
(`apply_router_replay_patch`) changes Megatron's classes for the whole process, so every
body here runs in a fresh process started by `megatron_cpu.spawn`
(`replay_ops.testing`). The reference is what verl users run today: Megatron's
`TopKRouter` with verl's patched `routing()` and verl's `RouterReplay` objects. Ours is the same model with `ReplayTopKRouter` (`replay_spec`), which
also receives verl's `RouterReplay` objects from the patched constructor.

Token rows are laid out as verl lays them out (THD packing by `preprocess_packed_seqs` for
padded batches, `preprocess_thd_engine` for nested R3 batches). The local attention of
Megatron-Core has no packed-sequence kernel on the CPU, so the packed rows run as one
causal sequence; both models see exactly the same rows, which is all the routing
comparison needs.
"""
from __future__ import annotations

import torch

from replay_ops.testing import megatron_cpu as env

E = env.E_DEFAULT
PATTERN = [1, 0, 1, 1]  # layers 1, 3, 4 are MoE, layer 2 is dense
V, H = 32, 16
LENS = [7, 5, 6]  # valid tokens per sample
S = 8  # padded length


def _cpu_platform() -> None:
    """verl picks its device through its platform registry (`VERL_PLATFORM`, plugins
    registered with `PlatformRegistry.register`) and falls back to CUDA when it detects no
    accelerator. For this CPU-only test process, a platform whose device is the CPU is
    registered through that plugin mechanism before verl first asks for its platform (the
    counterpart of the torch.cuda stand-ins of replay_ops.testing.megatron_cpu)."""
    import os

    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import PlatformRegistry

    @PlatformRegistry.register(platform="replay-ops-test-cpu")
    class _CPU(PlatformCUDA):
        device_name = property(lambda self: "cpu")

        def is_available(self) -> bool:
            return True

        def current_device(self) -> int:
            return 0

        def communication_backend_name(self) -> str:
            return "gloo"

    os.environ["VERL_PLATFORM"] = "replay-ops-test-cpu"


def _verl():
    """verl's patch applied (as verl's MegatronEngine does when router replay is on), and
    its modules."""
    _cpu_platform()
    from verl.utils.megatron import router_replay_patch as patch
    from verl.utils.megatron import router_replay_utils as utils

    patch.apply_router_replay_patch()
    return patch, utils


def _config(k: int, mtp: bool, **kw):
    return env.moe_config(num_layers=len(PATTERN), moe_layer_freq=list(PATTERN),
                          moe_router_topk=k, mtp_num_layers=1 if mtp else None,
                          moe_router_pre_softmax=k == 1, **kw)


def _gpt(cfg, replay: bool, mtp: bool, vp_stage=None, pre=True, post=True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_mtp_block_spec)
    from replay_ops.integrations import megatron as rom

    kw = {} if vp_stage is None else {"vp_stage": vp_stage}
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, **kw)
    mtp_spec = get_gpt_mtp_block_spec(cfg, spec.layer_specs[0], use_transformer_engine=False) \
        if mtp else None
    if replay:
        rom.replay_spec(spec)
        if mtp_spec is not None:
            rom.replay_spec(mtp_spec)
    torch.manual_seed(11)
    return GPTModel(cfg, spec, vocab_size=V, max_sequence_length=64, mtp_block_spec=mtp_spec,
                    pre_process=pre, post_process=post, **kw)


def _pair(k: int, mtp: bool = True):
    cfg = _config(k, mtp)
    ref = _gpt(cfg, replay=False, mtp=mtp)
    ours = _gpt(cfg, replay=True, mtp=mtp)
    ours.load_state_dict(ref.state_dict())
    return cfg, ref, ours


def _batch(seed=0):
    """Right-padded verl batch: input_ids [B, S], attention_mask [B, S]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (len(LENS), S), generator=g)
    mask = torch.arange(S)[None] < torch.tensor(LENS)[:, None]
    return ids * mask, mask


def _run(model, packed_ids: torch.Tensor, grad: bool = True):
    """Forward (+ backward of the summed loss) of a GPTModel on one packed row sequence
    [1, N]. Returns the loss and the parameter gradients."""
    n = packed_ids.shape[1]
    pos = torch.arange(n)[None]
    causal = torch.triu(torch.ones(n, n), 1).bool()[None, None]
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        loss = model(packed_ids, pos, attention_mask=causal, labels=packed_ids)
        if grad:
            loss.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach().clone(), grads


def _assert_same_run(a, b, what):
    torch.testing.assert_close(a[0], b[0], msg=lambda m: f"{what}: loss: {m}")
    assert set(a[1]) == set(b[1]), f"{what}: gradients of {set(a[1]) ^ set(b[1])}"
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name],
                                   msg=lambda m, n=name: f"{what}: grad {n}: {m}")
    assert any("router.weight" in n and g.abs().sum() > 0 for n, g in b[1].items()), what


def _decoder_routers(model):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.decoder.modules() if isinstance(m, TopKRouter)]


def _mtp_routers(model):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.mtp.modules() if isinstance(m, TopKRouter)]


def _routed(router) -> torch.Tensor:
    """int64 [T, K] experts the replay router routed to on its last call."""
    return router.last_plan.expert_indices.long()


def _dense_map(idx: torch.Tensor) -> torch.Tensor:
    return torch.zeros(idx.shape[0], E, dtype=torch.bool).scatter(1, idx.long(), True)


# ------------------------------------------------------------------------- one process
def single(rank, world, k: int):
    """R2 (record, merge, replay by MoE ordinal and by absolute layer), R3 with verl's
    replay mask, the REPLAY_BACKWARD FIFO over two micro-batches, an MTP layer under the
    global action, and the errors a verl user can hit. Top-k `k` (1 and 2)."""
    patch, utils = _verl()
    from verl.models.mcore.util import preprocess_packed_seqs, preprocess_thd_engine

    from replay_ops.integrations import megatron as rom

    Action, RR = patch.RouterReplayAction, patch.RouterReplay
    env.mp_init()
    cfg, ref, ours = _pair(k)
    assert all(type(r).__name__ == "ReplayTopKRouter" for r in _decoder_routers(ours))
    assert all(type(r.router_replay) is RR for r in _decoder_routers(ours) + _mtp_routers(ours))
    assert all(r.is_mtp_layer for r in _mtp_routers(ours))
    assert not any(getattr(r, "is_mtp_layer", False) for r in _decoder_routers(ours))
    ids, amask = _batch()
    packed, _ = preprocess_packed_seqs(ids, amask, pre_process=True)
    T = int(amask.sum())
    assert packed.shape == (1, T)

    # ---- R2: RECORD with verl's enum on every router (MTP included), then merge
    RR.set_global_router_replay_action(Action.RECORD)
    rec = {}
    for name, m in (("ref", ref), ("ours", ours)):
        _run(m, packed, grad=False)
        out = []
        utils.merge_router_topk_indices(amask, ids, out, cfg, model=m)
        rec[name] = out[0]
    assert rec["ours"].dtype == torch.int16 and rec["ours"].shape == (len(LENS), S, 3, k)
    assert torch.equal(rec["ours"], rec["ref"]), "R2 RECORD: ours records other experts"

    # ---- R2 replay: MoE-ordinal columns (L = 3 != num_layers) and absolute (L = 4)
    absolute = torch.zeros(len(LENS), S, len(PATTERN), k, dtype=torch.int16)
    absolute[:, :, [0, 2, 3]] = rec["ref"]
    for layers in (rec["ref"], absolute):
        runs = {}
        for name, m in (("ref", ref), ("ours", ours)):
            RR.clear_global_indices()
            utils.set_router_replay_data(layers, amask, cfg, model=m)
            RR.set_global_router_replay_action(Action.REPLAY_FORWARD)
            runs[name] = _run(m, packed)
        _assert_same_run(runs["ref"], runs["ours"], f"R2 replay L={layers.shape[2]}")
        moe_cols = rec["ref"].permute(2, 0, 1, 3)[:, amask]  # [3, T, k] in packed order
        for j, r in enumerate(_decoder_routers(ours)):
            assert torch.equal(_routed(r), moe_cols[j].long()), f"layer {r.layer_number}"
        # the MTP router was given the action but no target: it routed natively, as
        # Megatron's does under verl's patch (the losses above include the MTP head)
        for r in _mtp_routers(ours):
            assert r.router_replay.target_topk_idx is None

    # ---- R3: rollout routes (len-1 rows per sample), verl's alignment and replay mask;
    # sample 1 has no response tokens, so verl routes all of its rows natively
    g = torch.Generator().manual_seed(5)
    seqs = [ids[b, :n] for b, n in enumerate(LENS)]
    nested_ids = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    rollout = [torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n - 1)])
               [:, None].expand(n - 1, 3, k).contiguous().to(torch.int16) for n in LENS]
    rollout = [r.clone() for r in rollout]
    for r in rollout:  # distinct routes per layer
        r[:, 1] = (r[:, 1] + 1) % E
        r[:, 2] = (r[:, 2] + 3) % E
    routes = utils.align_r3_router_replay_data(
        torch.nested.nested_tensor(rollout, layout=torch.jagged), nested_ids)
    response = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    replay_mask = utils.build_r3_replay_mask(nested_ids, response)
    thd_ids = preprocess_thd_engine(nested_ids, pre_process=True)[0]
    assert thd_ids.shape == (1, T)
    flat_mask = replay_mask.values()
    assert not flat_mask[LENS[0]:LENS[0] + LENS[1]].any() and flat_mask.sum() == \
        (LENS[0] - 1) + (LENS[2] - 1)
    runs = {}
    for name, m in (("ref", ref), ("ours", ours)):
        RR.clear_global_indices()
        utils.set_router_replay_data(routes, None, cfg, replay_mask=replay_mask, model=m)
        RR.set_global_router_replay_action(Action.REPLAY_FORWARD)
        runs[name] = _run(m, thd_ids)
    _assert_same_run(runs["ref"], runs["ours"], "R3 with replay mask")
    flat_routes = torch.cat(list(routes.unbind()))  # [T, 3, k] packed
    for j, r in enumerate(_decoder_routers(ours)):
        got = _routed(r)
        assert torch.equal(got[flat_mask], flat_routes[flat_mask, j].long())
        # rows outside the mask must not be the recorded values: for the sample without
        # response those are real rollout routes; the final row of a sample is verl's zero
        # placeholder, which with k=1 would read as expert 0 (checked against Megatron's
        # native selection through the dispatch maps below)
        assert not torch.equal(got[~flat_mask], flat_routes[~flat_mask, j].long())
    ref_maps = {}
    for name, m in (("ref", ref), ("ours", ours)):  # same rows routed: compare dispatch maps
        ref_maps[name] = [d.token_dispatcher.routing_map.clone()
                          for d in (lay.mlp for lay in m.decoder.layers) if hasattr(d, "router")]
    for a, b in zip(ref_maps["ref"], ref_maps["ours"]):
        assert torch.equal(a, b), "R3: routing maps differ from Megatron's under verl's patch"

    # ---- REPLAY_BACKWARD: two micro-batches pushed on the FIFOs (indices and masks),
    # forwards, then the recompute pops them in order
    mbs = []
    for seed in (21, 22):
        gg = torch.Generator().manual_seed(seed)
        mb_routes = torch.stack([torch.randperm(E, generator=gg)[:k] for _ in range(len(LENS) * S)])
        mb_routes = mb_routes.reshape(len(LENS), S, 1, k).expand(-1, -1, 3, -1)
        mb_mask = torch.rand(len(LENS), S, generator=gg) > 0.3
        mbs.append((mb_routes.to(torch.int16).contiguous(), mb_mask))
    maps = {}
    for name, m in (("ref", ref), ("ours", ours)):
        RR.clear_global_indices()
        RR.set_global_router_replay_action(Action.REPLAY_FORWARD)
        for mb_routes, mb_mask in mbs:
            rows = mb_mask[amask]
            utils.set_router_replay_data(mb_routes, amask, cfg, model=m,
                                         replay_mask=rows)
            _run(m, packed, grad=False)
        for r in _decoder_routers(m):
            assert len(r.router_replay.replay_backward_list) == 2
            assert len(r.router_replay.replay_backward_mask_list) == 2
        utils.set_model_router_replay_action(m, Action.REPLAY_BACKWARD)
        for r in _mtp_routers(m):
            r.router_replay.set_router_replay_action(Action.REPLAY_BACKWARD)
        maps[name] = []
        for _ in mbs:  # the recompute of each micro-batch, in order
            _run(m, packed, grad=False)
            maps[name].append([lay.mlp.token_dispatcher.routing_map.clone()
                               for lay in m.decoder.layers if hasattr(lay.mlp, "router")])
        for r in _decoder_routers(m):
            assert r.router_replay.replay_backward_list == []
            assert r.router_replay.replay_backward_mask_list == []
    for a, b in zip(maps["ref"], maps["ours"]):
        for x, y in zip(a, b):
            assert torch.equal(x, y), "REPLAY_BACKWARD: the FIFO replayed another micro-batch"
    for i, (mb_routes, mb_mask) in enumerate(mbs):  # and each recompute replayed its own
        rows = mb_mask[amask]
        for j, dmap in enumerate(maps["ours"][i]):
            want = _dense_map(mb_routes.permute(2, 0, 1, 3)[j][amask])
            assert torch.equal(dmap[rows], want[rows]), (i, j)

    # ---- errors a verl user can hit
    r0 = _decoder_routers(ours)[0]
    RR.clear_global_indices()
    r0.router_replay.set_target_indices(rec["ref"].permute(2, 0, 1, 3)[0][amask].long(),
                                        replay_mask=torch.ones(T, dtype=torch.bool))
    r0.router_replay.replay_backward_mask_list.pop()  # the two FIFOs drift apart
    r0.router_replay.set_router_replay_action(Action.REPLAY_BACKWARD)
    try:
        r0.routing(torch.randn(T, 1, E))
        raise AssertionError("drifted FIFOs were not refused")
    except rom.ReplayRoutingError as e:
        assert "drifted apart" in str(e), e
    RR.clear_global_indices()
    r0.router_replay.set_router_replay_action(Action.REPLAY_FORWARD)
    try:  # a decoder router given no target never routes natively in silence
        r0.routing(torch.randn(T, 1, E))
        raise AssertionError("a decoder router without target routed")
    except rom.ReplayRoutingError as e:
        assert "no target indices" in str(e), e
    RR.clear_global_router_replay_action()
    return {"T": T}


# ------------------------------------------------------------------ PP=2 x VPP=2, 2 ranks
PP_PATTERN = [1, 0, 1, 1, 0, 1, 1, 1]  # 8 layers, dense 2 and 5


def pp2_vpp2(rank, world):
    """PP=2 with 2 virtual stages per rank: verl's `set_router_replay_data` (per chunk,
    MoE ordinal and absolute columns) sets the same targets on our routers as on
    Megatron's; each router replays them as Megatron's does under verl's patch; verl's
    `merge_router_topk_indices` and `pp_gather` collect our R2 recording in layer order."""
    from megatron.core import parallel_state as ps

    patch, utils = _verl()
    from replay_ops.integrations import megatron as rom

    Action, RR = patch.RouterReplayAction, patch.RouterReplay
    env.mp_init(pp=2, vpp=2)
    k = 2
    cfg = env.moe_config(num_layers=len(PP_PATTERN), moe_layer_freq=list(PP_PATTERN),
                         moe_router_topk=k, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    chunks = {}
    for name, replay in (("ref", False), ("ours", True)):
        chunks[name] = [_gpt(cfg, replay, mtp=False, vp_stage=vp,
                             pre=ps.is_pipeline_first_stage(False, vp),
                             post=ps.is_pipeline_last_stage(False, vp)) for vp in range(2)]
    for a, b in zip(chunks["ref"], chunks["ours"]):
        b.load_state_dict(a.state_dict())
    ids, amask = _batch(3)
    T = int(amask.sum())
    moe_numbers = [i + 1 for i, p in enumerate(PP_PATTERN) if p]
    g = torch.Generator().manual_seed(9)
    by_moe = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(len(LENS) * S
                                                                           * len(moe_numbers))])
    by_moe = by_moe.reshape(len(LENS), S, len(moe_numbers), k).to(torch.int16)
    absolute = torch.zeros(len(LENS), S, len(PP_PATTERN), k, dtype=torch.int16)
    absolute[:, :, [n - 1 for n in moe_numbers]] = by_moe
    hidden = torch.randn(T, 1, H, generator=g)
    for layers in (by_moe, absolute):
        outs = {}
        for name in ("ref", "ours"):
            RR.clear_global_indices()
            outs[name] = {}
            for vp, chunk in enumerate(chunks[name]):
                utils.set_router_replay_data(layers, amask, cfg, vp_rank=vp, model=chunk)
                utils.set_model_router_replay_action(chunk, Action.REPLAY_FORWARD)
                for n, rr in utils.iter_model_routers(chunk):
                    router = next(m for m in chunk.decoder.modules()
                                  if getattr(m, "router_replay", None) is rr)
                    want = by_moe.permute(2, 0, 1, 3)[moe_numbers.index(n)][amask].long()
                    assert torch.equal(rr.target_topk_idx, want), (name, n)
                    probs, rmap = router(hidden)
                    outs[name][n] = (probs.detach(), rmap)
        held = sorted(outs["ours"])
        assert held == ([1, 6] if rank == 0 else [3, 4, 7, 8]), held
        for n in held:
            torch.testing.assert_close(outs["ours"][n][0], outs["ref"][n][0])
            assert torch.equal(outs["ours"][n][1], outs["ref"][n][1])
    # R2 recording on this rank's routers, merged by verl per chunk, gathered over PP
    local = []
    for vp, chunk in enumerate(chunks["ours"]):
        utils.set_model_router_replay_action(chunk, Action.RECORD)
        for n, rr in utils.iter_model_routers(chunk):
            router = next(m for m in chunk.decoder.modules()
                          if getattr(m, "router_replay", None) is rr)
            router(torch.randn(T, 1, H, generator=torch.Generator().manual_seed(100 + n)))
        out = []
        utils.merge_router_topk_indices(amask, ids, out, cfg, vp_rank=vp, model=chunk)
        local.append(out[0])
    merged = utils.pp_gather(torch.cat(local, dim=2), cfg)
    ours = rom.gather_recorded_routing(chunks["ours"], ps.get_pipeline_model_parallel_group())
    assert merged.shape == (len(LENS), S, len(moe_numbers), k)
    assert torch.equal(merged[amask].long(), ours), "verl's PP gather differs from ours"
    return {"held": held}
