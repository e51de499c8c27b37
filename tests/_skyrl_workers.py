"""SkyRL 0.4.0's own R3 chain driving Megatron-Core GPT models built with the replay router,
against the same models with Megatron's router under SkyRL's calls.

SkyRL is real and unmodified (`make install-test` installs it; see tests/_client_loaders.py
for how it imports on Python 3.11). Its `patch_topk_router_layer_number()` changes
Megatron's `TopKRouter` for the whole process, so every body here runs in a fresh process
started by `replay_ops.testing.megatron_cpu.spawn`. The chain is SkyRL's, function for
function:

    RoutedExpertTrace (two turns, the second with a prompt start)
      -> convert_prompts_responses_to_batch_tensors (collate: left-padded batch, packed routes)
      -> make_router_padding_mask
      -> build_token_metadata_layout / align_token_metadata (the packed micro-batch)
      -> setup_per_microbatch_replay_forward (RouterReplay.set_replay_data, padding_mask=)
      -> GPTModel forward (a dense layer between MoE layers) -> setup_per_microbatch_replay_backward
      -> backward

The expected routes are computed here from the trace arrays alone (the rows a rollout
captured, SkyRL's padding row `0..K-1` where nothing was captured), never from the router.
Megatron's local attention has no packed-sequence kernel on the CPU, so the packed rows run
as one causal sequence; both models see exactly the same rows.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

import _client_gpt
from replay_ops.testing import megatron_cpu as env
from _client_gpt import E, MOE_LAYERS, PATTERN, V


def _skyrl():
    import _client_loaders

    s = _client_loaders.skyrl()
    s.replay_utils.patch_topk_router_layer_number()  # before any model is built, as SkyRL does
    return s


def replay_ops_pre_wrap_hook(model):
    """The hook docs/megatron.md gives SkyRL users (its Megatron worker registers hooks with
    `self.provider.register_pre_wrap_hook(...)`; they get the model chunks before DDP wraps
    them): every router becomes a replay router, SkyRL's replay code unchanged."""
    from replay_ops.integrations import megatron as rom

    rom.install(model)
    return model


def _pair(cfg):
    """Megatron's model, and the same model (same weights) through the pre-wrap hook."""
    ref = _client_gpt.gpt(cfg, replay=False)
    ours = _client_gpt.gpt(cfg, replay=False)
    ours.load_state_dict(ref.state_dict())
    replay_ops_pre_wrap_hook([ours])
    return ref, ours


def _routes(n, k, seed):
    """A rollout's captured routes: int32 [n, all layers, K], K distinct experts a row."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.stack([torch.randperm(E, generator=g)[:k] for _ in PATTERN])
                        for _ in range(n)])
    return rows.numpy().astype(np.int32)


def rollout(s, k):
    """Two trajectories as SkyRL's generator leaves them. Trajectory 0: two turns, the
    second continuing from the first's prompt start (prompt 5, generated 3, observation 2,
    generated 2); trajectory 1: one turn (prompt 4, generated 3). Returns prompts,
    responses, the finalized routes and, per trajectory, the routes of every real token in
    order with None where the rollout captured none."""
    Trace = s.routed_experts.RoutedExpertTrace
    g = torch.Generator().manual_seed(5)
    tok = lambda n: torch.randint(1, V, (n,), generator=g).tolist()  # noqa: E731

    p0, gen1, obs, gen2 = tok(5), tok(3), tok(2), tok(2)
    t0 = Trace()
    r1 = _routes(5 + 3 - 1, k, 1)  # the last generated token is never forwarded in turn 1
    t0.record_generation(prompt_token_count=5, generated_token_count=3, routed_experts=r1)
    assert t0.prompt_start == 7
    r2 = _routes(10 - 7 + 2 - 1, k, 2)  # turn 2 forwards from its prompt start
    t0.record_generation(prompt_token_count=10, generated_token_count=2, routed_experts=r2)
    resp0 = gen1 + obs + gen2
    f0 = t0.finalize(token_count=12, loss_mask=[0] * 5 + [1] * 3 + [0] * 2 + [1] * 2)

    p1, gen = tok(4), tok(3)
    t1 = Trace()
    r3 = _routes(4 + 3 - 1, k, 3)
    t1.record_generation(prompt_token_count=4, generated_token_count=3, routed_experts=r3)
    f1 = t1.finalize(token_count=7, loss_mask=[0] * 4 + [1] * 3)

    captured = [np.concatenate([r1, r2]), r3]
    per_token = [[*captured[0], None], [*captured[1], None]]
    return [p0, p1], [resp0, gen], [f0, f1], per_token


def _collate(s, prompts, responses, routes):
    pre = s.preprocess
    out = pre.convert_prompts_responses_to_batch_tensors(
        0, prompts, responses, [[0.0] * len(r) for r in responses],
        [[1] * len(r) for r in responses], rollout_expert_indices=routes)
    seqs, amask, rei = out[0], out[1], out[6]
    pmask = pre.make_router_padding_mask(amask, [int(r.shape[0]) for r in routes])
    return seqs, amask, rei, pmask


def expected_rows(per_token, layout, k, layer):
    """int64 [N, K] in the packed micro-batch order: each trajectory's real tokens (captured
    route, SkyRL's padding row 0..K-1 where none), then its alignment padding (0..K-1)."""
    pad = list(range(k))
    rows = []
    for b, toks in enumerate(per_token):
        rows += [pad if r is None else r[layer].tolist() for r in toks]
        rows += [pad] * (layout.padded_sequence_lengths[b] - len(toks))
    return torch.tensor(rows, dtype=torch.int64)


def _forward(model, ids, pad_mask, grad=True, backward_hook=None):
    n = ids.shape[1]
    pos = torch.arange(n)[None].expand_as(ids)
    causal = torch.triu(torch.ones(n, n), 1).bool()[None, None]
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        loss = model(ids, pos, attention_mask=causal, labels=ids, padding_mask=pad_mask)
        if grad:
            if backward_hook is not None:
                backward_hook()
            loss.sum().backward()
    grads = {n_: p.grad.clone() for n_, p in model.named_parameters() if p.grad is not None}
    return loss.detach().clone(), grads


def _assert_same(a, b, what):
    _client_gpt.assert_same(a, b, what, router_grads=True)


def _replay_step(s, model, cfg, rei, pmask, amask, layout, ids, packed=True):
    """SkyRL's per-micro-batch replay: setup, forward, switch to REPLAY_BACKWARD, backward."""
    ru = s.replay_utils
    _client_gpt.use(model)
    ru.clear_router_replay()
    kw = ru.setup_per_microbatch_replay_forward(rei, pmask, amask, model, cfg, layout,
                                                remove_microbatch_padding=packed)
    out = _forward(model, ids, kw["padding_mask"],
                   backward_hook=ru.setup_per_microbatch_replay_backward)
    return out, kw["padding_mask"]


def chain(rank, world, k: int, variant: str):
    """SkyRL's chain on Megatron's router and on ours: the same losses and gradients, and
    our routers route every token to the rollout's rows. Variants: "plain",
    "fusion" (moe_router_fusion=True on ours), "recompute" (after SkyRL's switch to
    REPLAY_BACKWARD, a recompute pops each router's queued entry), "bias" (sigmoid router with
    expert bias, item 1)."""
    s = _skyrl()
    from megatron.core.transformer.moe.router_replay import RouterReplay

    tm = s.token_metadata
    env.mp_init()
    kw = {}
    if variant == "bias":
        kw = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_bias_update_rate=1e-3)
    cfg = _client_gpt.config(k, **kw)
    ref, ours = _pair(cfg)
    if variant == "fusion":
        import dataclasses

        ours_cfg = dataclasses.replace(cfg, moe_router_fusion=True)
        for r in _client_gpt.routers(ours):
            r.config = ours_cfg
    prompts, responses, routes, per_token = rollout(s, k)
    seqs, amask, rei, pmask = _collate(s, prompts, responses, routes)
    layout = tm.build_token_metadata_layout(amask, torch.device("cpu"), packed=True,
                                            fp8_enabled=False)
    ids = tm.align_token_metadata(seqs, layout, 0)
    assert ids.shape == (1, sum(layout.padded_sequence_lengths))
    res = {"N": int(ids.shape[1])}

    if variant == "spread":
        # item 5: the rows SkyRL's padding mask marks become padding rows spread over the
        # experts (padding="spread", masked_rows="padding"); the real rows replay as before
        from replay_ops import reference
        from replay_ops.integrations.megatron import ReplayOptions

        opts = ReplayOptions(padding="spread", masked_rows="padding")
        spread = _client_gpt.gpt(cfg, replay=True, options=opts)
        spread.load_state_dict(ours.state_dict())
        _, model_mask = _replay_step(s, spread, cfg, rei, pmask, amask, layout, ids)
        masked = model_mask.reshape(-1)
        assert int(masked.sum()) == 2
        for j, r in enumerate(_client_gpt.routers(spread)):
            got = r.last_plan.expert_indices.long()
            want = expected_rows(per_token, layout, k, MOE_LAYERS[j])
            assert torch.equal(got[~masked], want[~masked]), f"router {j}: real rows"
            for t in masked.nonzero().flatten().tolist():  # the oracle of the spread rows
                row = [reference.spread_expert(t, c, k, E, 1, (r.layer_number - 1) * k)
                       for c in range(k)]
                assert got[t].tolist() == row, (j, t, got[t].tolist(), row)
                assert want[t].tolist() == list(range(k))  # SkyRL's placeholder, not read
        return res
    if variant == "bias":
        # Megatron's own router under SkyRL's mask: _apply_expert_bias gets the flattened
        # [T] mask against the [T, E] routing map
        try:
            _replay_step(s, ref, cfg, rei, pmask, amask, layout, ids)
            res["megatron_error"] = None
        except RuntimeError as e:
            res["megatron_error"] = str(e)
        before = [r.local_tokens_per_expert.clone() for r in _client_gpt.routers(ours)]
        run, model_mask = _replay_step(s, ours, cfg, rei, pmask, amask, layout, ids)
        real = ~model_mask.reshape(-1)
        for j, r in enumerate(_client_gpt.routers(ours)):
            want = expected_rows(per_token, layout, k, MOE_LAYERS[j])
            assert torch.equal(r.last_plan.expert_indices.long(), want), f"router {j}"
            # the expert-bias counts: the real (unmasked) tokens' experts only
            counts = torch.bincount(want[real].reshape(-1), minlength=E).to(before[j].dtype)
            assert torch.equal(r.local_tokens_per_expert - before[j], counts), (
                f"router {j}: tokens per expert {r.local_tokens_per_expert - before[j]} != "
                f"{counts}")
        res["masked_rows"] = int(model_mask.sum())
        return res

    runs = {}
    for name, m in (("ref", ref), ("ours", ours)):
        runs[name], model_mask = _replay_step(s, m, cfg, rei, pmask, amask, layout, ids)
    _assert_same(runs["ref"], runs["ours"], f"SkyRL chain ({variant})")
    for j, r in enumerate(_client_gpt.routers(ours)):
        want = expected_rows(per_token, layout, k, MOE_LAYERS[j])
        assert torch.equal(r.last_plan.expert_indices.long(), want), (
            f"router {j} (layer {r.layer_number}) routed other rows than the rollout's")
    if variant == "recompute":
        # SkyRL switched to REPLAY_BACKWARD before backward: an activation recompute (here
        # the layer's forward run again, as Megatron's checkpoint does in backward) pops
        # each router's queued entry and routes as the forward did; a second one finds the
        # queue empty and raises
        assert all(len(r.router_replay.replay_backward_list) == 1 for r in _client_gpt.routers(ours))
        _forward(ours, ids, model_mask, grad=False)
        for j, r in enumerate(_client_gpt.routers(ours)):
            assert not r.router_replay.replay_backward_list
            want = expected_rows(per_token, layout, k, MOE_LAYERS[j])
            assert torch.equal(r.last_plan.expert_indices.long(), want), f"recompute {j}"
        try:
            _forward(ours, ids, model_mask, grad=False)
            res["empty_queue_error"] = None
        except Exception as e:  # noqa: BLE001
            res["empty_queue_error"] = str(e)
    RouterReplay.clear_global_router_replay_instances()
    return res


def unpacked(rank, world, k: int, order: str):
    """Item 2: SkyRL's unpacked micro-batch (remove_microbatch_padding=False, B = 2) flattens
    its routes batch-first; Megatron's router reads the tokens sequence-first. The replay
    router warns once (token_order="warn"), raises ("error"), and the routed rows show the
    misrouting. Returns the warnings, the error, and how many real tokens replayed another
    token's route."""
    s = _skyrl()
    from replay_ops.integrations.megatron import ReplayOptions

    tm = s.token_metadata
    env.mp_init()
    cfg = _client_gpt.config(k)
    ours = _client_gpt.gpt(cfg, replay=True, options=ReplayOptions(token_order=order))
    prompts, responses, routes, per_token = rollout(s, k)
    seqs, amask, rei, pmask = _collate(s, prompts, responses, routes)
    layout = tm.build_token_metadata_layout(amask, torch.device("cpu"), packed=False,
                                            fp8_enabled=False)
    ids = tm.align_token_metadata(seqs, layout, 0)
    B, S = ids.shape
    assert B == 2
    res = {"warnings": [], "error": None, "misrouted": None, "real": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(2):  # warned once, not once per call
                _replay_step(s, ours, cfg, rei, pmask, amask, layout, ids, packed=False)
        except Exception as e:  # noqa: BLE001
            res["error"] = f"{type(e).__name__}: {e}"
    res["warnings"] = [str(w.message) for w in caught if "token order" in str(w.message)]
    if res["error"] is None:
        r = _client_gpt.routers(ours)[0]
        got = r.last_plan.expert_indices.long().reshape(S, B, k)  # Megatron's [S, B] tokens
        bad = total = 0
        for b, toks in enumerate(per_token):
            for t, row in enumerate(toks):
                if row is None:
                    continue
                total += 1
                bad += not torch.equal(got[t, b], torch.as_tensor(row[MOE_LAYERS[0]]).long())
        res["misrouted"], res["real"] = bad, total
    return res


def dist(rank, world, kind: str):
    """SkyRL's own CP and TP/SP splits of the replay rows ("cp2": CP=2, its front/back
    chunks of every padded sequence; "tp2sp": TP=2 with sequence parallelism, its slice of
    the packed rows), set by `setup_per_microbatch_replay_forward` on this rank's routers.
    Each router is called on hidden states of the rank's tokens (Megatron's local attention
    has no CP path on the CPU) and must route exactly the rank's share of the rollout's
    rows, computed here from the packed layout."""
    s = _skyrl()
    from megatron.core.transformer.moe.router_replay import RouterReplay

    tm = s.token_metadata
    k = 2
    if kind == "cp2":
        env.mp_init(cp=2)
        cfg = _client_gpt.config(k)  # the model's attention stays CP=1; SkyRL reads CP from mpu
    else:
        # SkyRL slices the rows over TP whenever TP > 1 (sequence parallelism, which MoE
        # with TP > 1 needs); the model's config leaves sequence_parallel off because
        # Megatron's torch LayerNorm refuses it (TransformerEngine's norm has it)
        env.mp_init(tp=2)
        cfg = _client_gpt.config(k, tensor_model_parallel_size=2)
    ours = _client_gpt.gpt(cfg, replay=False)
    replay_ops_pre_wrap_hook([ours])
    _client_gpt.use(ours)
    prompts, responses, routes, per_token = rollout(s, k)
    seqs, amask, rei, pmask = _collate(s, prompts, responses, routes)
    layout = tm.build_token_metadata_layout(amask, torch.device("cpu"), packed=True,
                                            fp8_enabled=False)
    s.replay_utils.clear_router_replay()
    s.replay_utils.setup_per_microbatch_replay_forward(rei, pmask, amask, ours, cfg, layout,
                                                       remove_microbatch_padding=True)
    rows, start = [], 0
    for n in layout.padded_sequence_lengths:
        if kind == "cp2":  # zigzag: chunks rank and 3 - rank of the sequence's 4 chunks
            c = n // 4
            rows += list(range(start + rank * c, start + (rank + 1) * c))
            rows += list(range(start + (3 - rank) * c, start + (4 - rank) * c))
        start += n
    if kind == "tp2sp":
        rows = list(range(rank * start // 2, (rank + 1) * start // 2))
    hidden = torch.randn(len(rows), 1, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    for j, r in enumerate(_client_gpt.routers(ours)):
        r(hidden)
        want = expected_rows(per_token, layout, k, MOE_LAYERS[j])[rows]
        assert torch.equal(r.last_plan.expert_indices.long(), want), (kind, rank, j)
    RouterReplay.clear_global_router_replay_instances()
    return {"rows": rows, "padded": list(layout.padded_sequence_lengths)}
