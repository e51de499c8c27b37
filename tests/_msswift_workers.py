"""ms-swift 4.6.0's router-replay helpers (`swift/megatron/utils/router_replay_utils.py`,
unchanged; tests/_client_loaders.py says how it is loaded without TransformerEngine) driving
Megatron-Core GPT models built with the replay router, against the same models with
Megatron's router, both under ms-swift's `apply_router_replay_patch()` (its patch of the
all-to-all dispatcher's `preprocess`, applied process-wide as ms-swift's trainer does: every
body runs in a fresh process started by `replay_ops.testing.megatron_cpu.spawn`).

The calls are those of ms-swift's trainers: R3's old-logprob pass
(`compute_per_token_logps_fn`: `get_local_topk_idx_for_current_rank`, then
`set_router_replay_data`), R2's record pass (`get_router_replay_data`), and GRPO's
`forward_step` (its REPLAY_BACKWARD -> REPLAY_FORWARD flip of the local routers, then
`set_router_replay_data`, then the flip to REPLAY_BACKWARD before backward). Routes are laid
out as ms-swift's padding-free batches are: [1, T, layers, K].
"""
from __future__ import annotations

import torch

import _client_gpt
from replay_ops.testing import megatron_cpu as env
from _client_gpt import E, MOE_LAYERS, PATTERN, V
LENS = [7, 5, 4]  # packed sequences (padding-free)


def _swift(count_preprocess: bool = True):
    """ms-swift's replay module with its patch applied. With `count_preprocess`, every entry
    into Megatron's own `MoEAlltoAllTokenDispatcher.preprocess` (the one ms-swift's patch
    wraps) is counted in `calls[0]`."""
    import _client_loaders
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    calls = [0]
    if count_preprocess and not hasattr(MoEAlltoAllTokenDispatcher, "_preprocess_patched"):
        orig = MoEAlltoAllTokenDispatcher.preprocess

        def counted(self, routing_map):
            calls[0] += 1
            return orig(self, routing_map)

        MoEAlltoAllTokenDispatcher.preprocess = counted
    m = _client_loaders.msswift()
    m.rr.apply_router_replay_patch()
    return m, calls


def get_mcore_model_with_replay(get_mcore_model, *args, **kwargs):
    """The wrapper docs/megatron.md gives ms-swift users around
    `swift.megatron.model.get_mcore_model(args, hf_config)` (it returns the model chunks, one
    per virtual pipeline stage): every router becomes a replay router. Here it wraps a
    builder of the same GPT model (ms-swift's own builder needs TransformerEngine)."""
    from replay_ops.integrations import megatron as rom

    models = get_mcore_model(*args, **kwargs)
    rom.install(models)
    return models


def _routes(T, k, seed=0, layers=len(PATTERN)):
    """A rollout's routes for every layer, as ms-swift's padding-free batch holds them:
    [1, T, layers, K], K distinct experts a row."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(layers)])
                        for _ in range(T)])
    return rows[None]


def _ids(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, V, (1, T), generator=g)


def _forward(model, ids, grad=True, before_backward=None):
    n = ids.shape[1]
    pos = torch.arange(n)[None].expand_as(ids)
    causal = torch.triu(torch.ones(n, n), 1).bool()[None, None]
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        loss = model(ids, pos, attention_mask=causal, labels=ids)
        if grad:
            if before_backward is not None:
                before_backward()
            loss.sum().backward()
    grads = {n_: p.grad.clone() for n_, p in model.named_parameters() if p.grad is not None}
    return loss.detach().clone(), grads


def _assert_same(a, b, what):
    _client_gpt.assert_same(a, b, what)


def _r3_old_logprob(m, model, cfg, global_idx, ids):
    """ms-swift's compute_per_token_logps_fn, R3: local rows for this rank, set, forward
    without grad."""
    rr = m.rr
    assert rr.RouterReplayHelper.is_replay_forward_action(cfg)
    local = rr.get_local_topk_idx_for_current_rank(global_idx, cfg, None)
    rr.set_router_replay_data(local, cfg)
    return _forward(model, ids, grad=False)[0]


def _forward_step(m, model, cfg, layers_topk_idx, ids):
    """ms-swift's GRPO forward_step: flip REPLAY_BACKWARD routers back to REPLAY_FORWARD,
    set the micro-batch's rows, forward, flip to REPLAY_BACKWARD, backward."""
    rr = m.rr
    Action = rr.RouterReplayAction
    if rr.RouterReplayHelper.is_replay_backward_action(cfg):
        for router in rr.RouterReplayHelper.get_micro_batch_router_list(cfg):
            router.set_router_replay_action(Action.REPLAY_FORWARD)
    assert rr.RouterReplayHelper.is_replay_forward_action(cfg)
    rr.set_router_replay_data(layers_topk_idx, cfg)

    def flip():
        for router in rr.RouterReplayHelper.get_micro_batch_router_list(cfg):
            router.set_router_replay_action(Action.REPLAY_BACKWARD)

    return _forward(model, ids, before_backward=flip)


def core(rank, world, k: int):
    """R3 old-logprob pass, R2 record then replay through GRPO's forward_step (two
    micro-batches: the action flip), Megatron's router and ours, and the number of times
    Megatron's dispatcher preprocess runs per MoE layer on our plan dispatcher under
    ms-swift's patch (item 3)."""
    m, calls = _swift()
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    env.mp_init()
    cfg = _client_gpt.config(k)
    ref = _client_gpt.gpt(cfg, replay=False)
    ours = _client_gpt.gpt(cfg, replay=False)
    ours.load_state_dict(ref.state_dict())
    ours = get_mcore_model_with_replay(lambda: [ours])[0]
    T = sum(LENS)
    ids = _ids(T)
    res = {"preprocess_calls": {}}

    # ---- R3: old log-probs with the rollout's routes
    g = _routes(T, k, seed=1)
    logits = {}
    for name, model in (("ref", ref), ("ours", ours)):
        _client_gpt.use(model)
        RouterReplay.clear_global_indices()
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        calls[0] = 0
        logits[name] = _r3_old_logprob(m, model, cfg, g, ids)
        res["preprocess_calls"][name] = calls[0]
        RouterReplay.clear_global_router_replay_action()
    torch.testing.assert_close(logits["ref"], logits["ours"], msg=lambda s: f"R3 loss: {s}")
    for j, r in enumerate(_client_gpt.routers(ours)):
        assert torch.equal(r.last_plan.expert_indices.long(), g[0, :, MOE_LAYERS[j]]), j
    ds = [mod.token_dispatcher for mod in ours.modules() if hasattr(mod, "token_dispatcher")]
    assert [type(d).__name__ for d in ds] == ["PlanAlltoAllTokenDispatcher"] * 3, ds
    res["num_out_tokens"] = [int(d.num_out_tokens) for d in ds]

    # ---- R2: record with each router, then GRPO's forward_step replays it
    rec = {}
    for name, model in (("ref", ref), ("ours", ours)):
        _client_gpt.use(model)
        RouterReplay.clear_global_indices()
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        _forward(model, ids, grad=False)
        assert m.rr.RouterReplayHelper.is_r2_record_action(cfg)
        rec[name] = m.rr.get_router_replay_data(cfg)
        RouterReplay.clear_global_router_replay_action()
    assert rec["ours"].dtype == torch.uint8 and rec["ours"].shape == (1, T, 3, k)
    assert torch.equal(rec["ours"], rec["ref"]), "R2: ours records other experts"
    ids2 = _ids(T, seed=3)
    runs = {}
    for name, model in (("ref", ref), ("ours", ours)):
        _client_gpt.use(model)
        RouterReplay.clear_global_indices()
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        first = _forward_step(m, model, cfg, rec[name], ids)
        assert m.rr.RouterReplayHelper.is_replay_backward_action(cfg)
        second = _forward_step(m, model, cfg, rec[name], ids2)  # the flip back to FORWARD
        runs[name] = (first, second)
        RouterReplay.clear_global_router_replay_action()
    for i in range(2):
        _assert_same(runs["ref"][i], runs["ours"][i], f"R2 forward_step micro-batch {i}")
    for j, r in enumerate(_client_gpt.routers(ours)):
        assert torch.equal(r.last_plan.expert_indices.long(), rec["ref"][0, :, j].long()), j
    return res


def zero_rows(rank, world, k: int, padding: str):
    """ms-swift fills a route row the rollout did not capture with zeros ([0, 0]: expert 0
    K times). Those rows go to our padding policy: padding="error" names the row, "topk"
    routes it as Megatron would, "spread" spreads it."""
    m, _ = _swift(count_preprocess=False)
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from replay_ops.integrations.megatron import ReplayOptions

    env.mp_init()
    cfg = _client_gpt.config(k)
    ours = _client_gpt.gpt(cfg, replay=True, options=ReplayOptions(padding=padding))
    T = sum(LENS)
    g = _routes(T, k, seed=1)
    ends = torch.tensor(LENS).cumsum(0) - 1
    g[0, ends] = 0  # the last token of each sequence: no route, zero-filled
    _client_gpt.use(ours)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        _r3_old_logprob(m, ours, cfg, g, _ids(T))
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "ends": ends.tolist()}
    r = _client_gpt.routers(ours)[0]
    got = r.last_plan.expert_indices.long()
    keep = torch.ones(T, dtype=torch.bool)
    keep[ends] = False
    assert torch.equal(got[keep], g[0, keep, MOE_LAYERS[0]]), "real rows"
    rows = got[ends]
    assert all(len(set(x.tolist())) == k for x in rows), rows  # K distinct experts
    return {"error": None, "ends": ends.tolist(), "pad_rows": rows.tolist()}


def pp2_vpp2(rank, world):
    """Item 6: PP=2 with 2 virtual stages per rank (8 MoE layers; rank 0 holds layers 1-2
    and 5-6, rank 1 layers 3-4 and 7-8). ms-swift's R3 path (`get_local_topk_idx_for_current_rank`,
    then `set_router_replay_data(..., vp_rank=None)` as its trainers call it) gives targets
    to the first chunk's routers only; a router of the second chunk then refuses to run,
    naming its chunk, instead of routing natively. Returns, per router that got a target,
    the global layer whose rollout column it holds, and the second chunk's error."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    m, _ = _swift(count_preprocess=False)
    env.mp_init(pp=2, vpp=2)
    k, n_layers = 2, 8
    cfg = env.moe_config(num_layers=n_layers, moe_router_topk=k, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    chunks = [_client_gpt.gpt(cfg, replay=True, vp_stage=vp, pre=ps.is_pipeline_first_stage(False, vp),
                   post=ps.is_pipeline_last_stage(False, vp)) for vp in range(2)]
    _client_gpt.use(*chunks)
    T = 6
    g = _routes(T, k, seed=4, layers=n_layers)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    local = m.rr.get_local_topk_idx_for_current_rank(g, cfg, None)
    m.rr.set_router_replay_data(local, cfg)
    held, errors = {}, {}
    hidden = torch.randn(T, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    for vp, chunk in enumerate(chunks):
        for r in _client_gpt.routers(chunk):
            tgt = r.router_replay.target_topk_idx
            if tgt is not None:
                cols = [c for c in range(n_layers) if torch.equal(tgt.long(), g[0, :, c].long())]
                held[r.layer_number] = cols[0] + 1 if cols else None
            try:
                r(hidden)
            except Exception as e:  # noqa: BLE001
                errors[r.layer_number] = f"{type(e).__name__}: {e}"
    return {"held": held, "errors": errors}


def cp2(rank, world):
    """CP=2: ms-swift's R3 path splits the rollout's rows with mcore-bridge's
    `split_cp_inputs` (zigzag: rank r keeps chunks r and 2*CP-1-r of every packed sequence),
    and each rank's routers replay exactly its share. The routers are called on hidden
    states of the rank's tokens (Megatron's local attention has no CP path on the CPU)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    m, _ = _swift(count_preprocess=False)
    env.mp_init(cp=2)
    k = 2
    # the model's config leaves CP at 1 (Megatron's local attention refuses CP); ms-swift
    # reads the CP size and rank from the parallel state, which has CP=2
    cfg = _client_gpt.config(k)
    ours = get_mcore_model_with_replay(lambda: [_client_gpt.gpt(cfg, replay=False)])[0]
    _client_gpt.use(ours)
    lens = [8, 12]  # padded to a multiple of 2*CP, as ms-swift pads for CP
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    T = sum(lens)
    g = _routes(T, k, seed=6)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    local = m.rr.get_local_topk_idx_for_current_rank(g, cfg, psp)
    m.rr.set_router_replay_data(local, cfg)
    # the rank's rows, computed here: chunks rank and 3 - rank of each sequence
    rows = []
    for s0, n in zip([0, 8], lens):
        c = n // 4
        rows += list(range(s0 + rank * c, s0 + (rank + 1) * c))
        rows += list(range(s0 + (3 - rank) * c, s0 + (4 - rank) * c))
    hidden = torch.randn(len(rows), 1, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    for j, r in enumerate(_client_gpt.routers(ours)):
        r(hidden)
        assert torch.equal(r.last_plan.expert_indices.long(), g[0, rows, MOE_LAYERS[j]].long()), j
    return {"rows": rows}
