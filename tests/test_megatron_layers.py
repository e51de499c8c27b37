"""Which router replays which layer: walking a real Megatron-Core GPTModel (local spec,
CPU) with dense and MoE layers mixed and an MTP layer; a stale global registry; R2 round
trip through the whole model; token-order (batch-first) detection."""
from __future__ import annotations

import pytest
import torch

from _helpers import require_client  # noqa: E402

require_client("megatron.core", "megatron-core")

from replay_ops.testing import megatron_cpu as env  # noqa: E402

env.install_cpu_shims()
env.set_torch_cuda_shims(False)  # on only while this module runs (fixture below)

from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # noqa: E402

from replay_ops.integrations import megatron as rom  # noqa: E402

E, K = env.E_DEFAULT, 2
PATTERN = [0, 1, 1, 0, 1]  # dense, MoE, MoE, dense, MoE: layer numbers 2, 3, 5 are MoE
S, B, V = 8, 2, 32


from _megatron_env import cuda_stand_ins, single_world  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.usefixtures("single_world")


def build_gpt(mtp: bool = True, replay: bool = True, seed: int = 7):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_mtp_block_spec)

    cfg = env.moe_config(num_layers=len(PATTERN), moe_layer_freq=list(PATTERN),
                         mtp_num_layers=1 if mtp else None)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    mtp_spec = get_gpt_mtp_block_spec(cfg, spec.layer_specs[1], use_transformer_engine=False) \
        if mtp else None
    if replay:
        rom.replay_spec(spec)
        if mtp_spec is not None:
            rom.replay_spec(mtp_spec)
    torch.manual_seed(seed)
    return GPTModel(cfg, spec, vocab_size=V, max_sequence_length=S, mtp_block_spec=mtp_spec)


def forward(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    pos = torch.arange(S).expand(B, S)
    mask = torch.triu(torch.ones(S, S), 1).bool()[None, None]
    labels = ids if getattr(model, "mtp_process", False) else None  # the MTP head needs labels
    return model(ids, pos, attention_mask=mask, labels=labels)


def full_routing(L, seed=0):
    return torch.stack([env.random_routes(S * B, E, K, seed=seed + j) for j in range(L)], dim=1)


def test_mixed_dense_moe_walk_and_both_mappings():
    m = build_gpt(mtp=True)
    slots = rom.find_moe_routers(m)
    assert [s.layer_number for s in slots] == [2, 3, 5]
    assert rom.moe_layer_numbers(m.config) == [2, 3, 5]
    assert all(not s.is_mtp for s in slots)
    # absolute (L = 5, dense columns ignored) and MoE ordinal (L = 3) give the same routes
    absolute = full_routing(5, seed=100)
    by_moe = absolute[:, [1, 2, 4]]
    rep = rom.set_replay_routing(m, absolute)
    assert [(n, c) for _, n, c in rep] == [(2, 1), (3, 2), (5, 4)]
    got_abs = [s.router.router_replay.target_topk_idx.clone() for s in slots]
    for s in slots:
        s.router.router_replay.clear_indices()
    rep = rom.set_replay_routing(m, by_moe)
    assert [(n, c) for _, n, c in rep] == [(2, 0), (3, 1), (5, 2)]
    for s, a in zip(slots, got_abs):
        assert torch.equal(s.router.router_replay.target_topk_idx, a)
        assert torch.equal(a, absolute[:, s.layer_number - 1])
    with pytest.raises(rom.LayoutError, match=r"L=4 layer columns, but the model has 3 MoE layers "
                                              r"and 5 layers"):
        rom.set_replay_routing(m, full_routing(4))
    with pytest.raises(rom.LayoutError, match=r"K=3 slots per token but moe_router_topk=2"):
        rom.set_replay_routing(m, torch.zeros(S * B, 3, 3, dtype=torch.long))


def test_mtp_excluded_unless_asked_and_no_aliasing():
    m = build_gpt(mtp=True)
    mtp = [s for s in rom.find_moe_routers(m, include_mtp=True) if s.is_mtp]
    assert len(mtp) == 1 and mtp[0].name.startswith("mtp.")
    # Megatron versions number MTP layers from 1 again; a walk by layer number alone would
    # give the MTP router the routes of layer 1 (or of the first MoE layer)
    mtp[0].router.layer_number = 1
    routing = full_routing(3, seed=200)
    rom.set_replay_routing(m, routing)
    assert mtp[0].router.router_replay.target_topk_idx is None
    n = rom.set_replay_action(m, RouterReplayAction.REPLAY_FORWARD)
    assert n == 3 and mtp[0].router.router_replay.router_replay_action is None
    forward(m)  # the MTP layer routes natively, the decoder MoE layers replay
    for s in rom.find_moe_routers(m):
        want = routing[:, rom.moe_layer_numbers(m.config).index(s.layer_number)]
        assert torch.equal(s.router.last_plan.expert_indices.long(), want)
    # asked for: the MTP layer takes the column after the decoder layers
    rep = rom.set_replay_routing(m, full_routing(4, seed=300), include_mtp=True)
    assert rep[-1][0].startswith("mtp.") and rep[-1][2] == 3
    rep = rom.set_replay_routing(m, full_routing(6, seed=300), include_mtp=True)  # absolute
    assert rep[-1][2] == 5
    with pytest.raises(rom.LayoutError, match="L=3 layer columns"):
        rom.set_replay_routing(m, full_routing(3), include_mtp=True)


def test_stale_global_registry():
    first = build_gpt(mtp=False, seed=1)
    second = build_gpt(mtp=False, seed=2)  # a rebuild: Megatron's global list now holds 6
    assert len(RouterReplay.global_router_replay_instances) == 6
    routing = full_routing(3, seed=400)
    # Megatron's list API addresses the stale list
    with pytest.raises(ValueError, match=r"number of replay tensors \(3\) does not match instances \(6\)"):
        RouterReplay.set_replay_data([routing[:, j] for j in range(3)])
    rom.set_replay_routing(second, routing)
    for j, s in enumerate(rom.find_moe_routers(second)):
        assert torch.equal(s.router.router_replay.target_topk_idx, routing[:, j])
    for s in rom.find_moe_routers(first):
        assert s.router.router_replay.target_topk_idx is None
    assert rom.prune_global_registry(second) == 3
    RouterReplay.set_replay_data([routing[:, j] for j in range(3)])  # now it addresses `second`
    for j, s in enumerate(rom.find_moe_routers(second)):
        assert torch.equal(s.router.router_replay.replay_backward_list[-1], routing[:, j])


def test_r2_round_trip_through_the_model_is_bitwise():
    m = build_gpt(mtp=False)
    rom.set_replay_action(m, RouterReplayAction.RECORD)
    with torch.no_grad():
        native = forward(m, seed=3)
    rec, ids = rom.recorded_routing(m)
    assert ids == [2, 3, 5] and rec.shape == (S * B, 3, K)
    assert torch.equal(rom.gather_recorded_routing(m), rec)
    absolute = rom.gather_recorded_routing(m, layer_index="absolute")
    assert (absolute[:, [0, 3]] == -1).all() and torch.equal(absolute[:, [1, 2, 4]], rec)
    rom.set_replay_routing(m, rec.to(torch.int16))
    rom.set_replay_action(m, RouterReplayAction.REPLAY_FORWARD)
    with torch.no_grad():
        replayed = forward(m, seed=3)
    assert torch.equal(native, replayed)


def test_token_order_batch_first_is_detected():
    m = build_gpt(mtp=False)
    routing = full_routing(3, seed=500)  # [S*B, L, K], sequence-first
    bsf = routing.view(S, B, 3, K)
    with pytest.raises(rom.LayoutError, match="needs batch_first=True"):
        rom.set_replay_routing(m, bsf)
    rom.set_replay_routing(m, bsf.transpose(0, 1).contiguous(), batch_first=True)
    slots = rom.find_moe_routers(m)
    assert torch.equal(slots[0].router.router_replay.target_topk_idx, routing[:, 0])


def test_stock_router_gets_int64_views_and_needs_replay_flag():
    m = build_gpt(mtp=False, replay=False)
    rom.set_replay_routing(m, full_routing(3).to(torch.int16))
    rr = rom.find_moe_routers(m)[0].router.router_replay
    assert rr.target_topk_idx.dtype == torch.int64  # Megatron's own gather needs int64
    rom.set_replay_action(m, RouterReplayAction.REPLAY_FORWARD)
    forward(m)


@pytest.mark.parametrize("how", ["replay_spec", "install"])
def test_global_action_mtp_router_without_target_routes_natively(how):
    """The global action reaches the MTP router too (as verl sets it); it was given no
    target, so it takes Megatron's native selection; a decoder router without target
    raises. The MTP spec shares the decoder's layer spec objects: marking its routers must
    not turn the decoder routers into MTP routers."""
    if how == "replay_spec":
        m = build_gpt(mtp=True)
    else:
        m = build_gpt(mtp=True, replay=False)
        rom.install(m)
    slots = rom.find_moe_routers(m, include_mtp=True)
    assert [s.router.is_mtp_layer for s in slots] == [s.is_mtp for s in slots] == \
        [False, False, False, True]
    routing = full_routing(3, seed=500)
    rom.set_replay_routing(m, routing)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    forward(m)
    mtp = slots[-1].router
    assert mtp.router_replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD
    x = torch.randn(S * B, 1, 16)
    with torch.no_grad():
        native = mtp.own_topk(mtp.gating(x).view(-1, mtp.config.num_moe_experts))
        _, rmap = mtp(x)
    assert torch.equal(rmap, torch.zeros_like(rmap).scatter(1, native, True))
    slots[0].router.router_replay.clear_indices()
    with pytest.raises(rom.ReplayRoutingError, match=r"layer 2\): REPLAY_FORWARD but no target"):
        forward(m)
    RouterReplay.clear_global_router_replay_action()


# ------------------------------------------------------------------ the model's shape
def test_model_shape_from_megatron():
    import types

    from replay_ops.router_replay import ModelShape

    m = build_gpt(mtp=True)
    assert rom.model_shape(m.config) == ModelShape(E, K, (1, 2, 4), 5)
    assert rom.model_shape(m.config, include_mtp=True) == ModelShape(E, K, (1, 2, 4, 5), 6)

    def cfg(freq, n=6, **kw):
        return types.SimpleNamespace(num_layers=n, moe_layer_freq=freq, num_moe_experts=E,
                                     moe_router_topk=K, **kw)

    assert ModelShape.from_megatron(cfg(2)).moe_layer_ids == (0, 2, 4)
    assert ModelShape.from_megatron(cfg(1)).moe_layer_ids == tuple(range(6))
    # the command line's text of a first-k-dense pattern, as Megatron's arguments give it
    assert ModelShape.from_megatron(cfg("([0]*2+[1]*4)")).moe_layer_ids == (2, 3, 4, 5)
    assert ModelShape.from_megatron(cfg([0, 0, 1, 1, 1, 1])).moe_layer_ids == (2, 3, 4, 5)
    for bad, msg in [(cfg([1, 0]), "moe_layer_freq has 2 entries but num_layers=6"),
                     (cfg("__import__('os')"), "is not a pattern of 0/1 lists"),
                     (cfg("[1]*2097152"), "is not a pattern of 0/1 lists"),
                     (cfg([2] * 6), "only 0 \\(dense\\) and 1 \\(MoE\\)"),
                     (cfg([0] * 6), "moe_layer_ids is empty"),
                     (types.SimpleNamespace(num_layers=2, moe_layer_freq=1, num_moe_experts=None,
                                            moe_router_topk=2), "num_moe_experts is None")]:
        with pytest.raises(ValueError, match=msg):
            ModelShape.from_megatron(bad)
    with pytest.raises(rom.LayoutError, match="moe_layer_freq has 2 entries"):
        rom.model_shape(cfg([1, 0]))


# ------------------------------------------------------------------ record file -> routers
def _write_record(path, shape, T):
    """A record file of one packed sequence of T tokens in the routers' token order."""
    from replay_ops.router_replay import files

    routing = torch.stack([env.random_routes(T, E, K, seed=700 + j)
                           for j in range(shape.num_moe_layers)], dim=1).to(torch.int16)
    files.write_routing(path, routing, files.RecordMeta(shape=shape), cu_seqlens=[0, T])
    return routing


def test_record_file_reaches_the_routers_with_one_scan(tmp_path):
    """record file -> RoutingFile.batch -> pad_thd -> cp_split -> sp_scatter ->
    set_replay_routing: one ReplayBatch all the way, scanned once, its mapping decided
    once; each router replays its layer's column."""
    from test_checked_batch import counting

    from replay_ops.router_replay import files

    m = build_gpt(mtp=False)
    shape = rom.model_shape(m.config)
    routing = _write_record(tmp_path / "r.safetensors", shape, S * B)
    rf = files.open_routing(tmp_path / "r.safetensors")
    with counting() as c:
        batch = rf.batch(shape)
        local = rom.sp_scatter(rom.cp_split(rom.pad_thd(batch, align=2), 1, 0), None)
        rom.set_replay_routing(m, local)
    assert c == {"scans": 1, "scanned": S * B * 3 * K, "mappings": 1}
    assert local.checked_for(shape) and local.layer_ids == [1, 2, 4]
    rom.set_replay_action(m, RouterReplayAction.REPLAY_FORWARD)
    with torch.no_grad():
        forward(m)
    for j, s in enumerate(rom.find_moe_routers(m)):
        assert torch.equal(s.router.last_plan.expert_indices.long(), routing[:, j].long())


def test_record_file_of_another_moe_pattern_is_refused_naming_the_layers(tmp_path):
    """A file recorded for MoE layers 1, 2, 3 (ids 0, 1, 2) replayed into a model whose MoE
    layers are 2, 3, 5: as many MoE layers, so the columns fit; refused, naming both."""
    from replay_ops.router_replay import ModelShape, files

    m = build_gpt(mtp=False)
    other = ModelShape(E, K, (0, 1, 2), 5)
    _write_record(tmp_path / "o.safetensors", other, S * B)
    rf = files.open_routing(tmp_path / "o.safetensors")
    with pytest.raises(files.RoutingShapeError, match=r"moe_layer_ids: file \[0, 1, 2\], "
                                                      r"model \[1, 2, 4\]"):
        rf.batch(rom.model_shape(m.config))
    batch = rf.batch()  # checked for the file's own shape, all the way to the routers
    local = rom.sp_scatter(rom.cp_split(rom.pad_thd(batch), 1, 0), None)
    assert local.checked_for(other)
    with pytest.raises(rom.LayoutError, match=r"checked against another model shape: "
                                              r"moe_layer_ids: batch \[0, 1, 2\], model "
                                              r"\[1, 2, 4\]"):
        rom.set_replay_routing(m, local)
    assert all(s.router.router_replay.target_topk_idx is None for s in rom.find_moe_routers(m))


def test_batch_mask_and_padded_order_reach_the_routers():
    """Rows a batch does not replay reach the routers as -1 (the padding policy routes
    them: Megatron's own top-k by default), though they hold routes; a padded [B, S] batch
    reaches them sequence-first."""
    from replay_ops.router_replay import ReplayBatch

    m = build_gpt(mtp=False)
    shape = rom.model_shape(m.config)
    full = full_routing(3, seed=800).to(torch.int16).view(S, B, 3, K)  # sequence-first
    bsf = full.transpose(0, 1).contiguous()  # the batch's [B, S]
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 5] = mask[0, 0] = False
    batch = ReplayBatch(bsf, mask).check(shape)
    rom.set_replay_routing(m, batch)
    for j, s in enumerate(rom.find_moe_routers(m)):
        got = s.router.router_replay.target_topk_idx.view(S, B, K)
        assert (got[5, 1] == -1).all() and (got[0, 0] == -1).all()
        keep = mask.t()
        assert torch.equal(got[keep], full[:, :, j][keep])
    rom.set_replay_action(m, RouterReplayAction.REPLAY_FORWARD)
    with torch.no_grad():
        forward(m)  # the -1 rows take Megatron's own selection: every row has K experts
    for s in rom.find_moe_routers(m):
        assert (s.router.last_plan.expert_indices >= 0).all()
    with pytest.raises(rom.LayoutError, match="batch_first=False contradicts it"):
        rom.set_replay_routing(m, batch, batch_first=False)


def test_routers_outside_the_configs_moe_layers_are_refused():
    m = build_gpt(mtp=False)
    cfg = m.config
    old = cfg.moe_layer_freq
    cfg.moe_layer_freq = [1, 1, 0, 0, 1]  # the config says layer 3 is dense; its router exists
    try:
        with pytest.raises(rom.LayoutError, match=r"is layer number 3, which is not a MoE layer "
                                                  r"of num_layers=5.*MoE layers \[1, 2, 5\]"):
            rom.set_replay_routing(m, full_routing(3))
    finally:
        cfg.moe_layer_freq = old
