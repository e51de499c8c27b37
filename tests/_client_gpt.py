"""The small Megatron GPT model that the SkyRL and ms-swift client tests
(`_skyrl_workers.py`, `_msswift_workers.py`) build: 4 layers, layer 2 dense, the others MoE,
with or without replay routers, and the helpers that find its routers and register them in
Megatron's global RouterReplay list (the list both clients index)."""
from __future__ import annotations

import torch

from replay_ops.testing import megatron_cpu as env

E = env.E_DEFAULT
PATTERN = [1, 0, 1, 1]  # layers 1, 3, 4 are MoE, layer 2 is dense
MOE_LAYERS = [0, 2, 3]  # their 0-based global indices (the clients' route columns)
V = 32


def config(k=2, **kw):
    return env.moe_config(num_layers=len(PATTERN), moe_layer_freq=list(PATTERN),
                          moe_router_topk=k, moe_router_pre_softmax=k == 1, **kw)


def gpt(cfg, replay: bool, options=None, pre=True, post=True, vp_stage=None):
    """The GPT model (seed 11 weights); `replay` builds it from a replay spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from replay_ops.integrations import megatron as rom

    kw = {} if vp_stage is None else {"vp_stage": vp_stage}
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, **kw)
    if replay:
        rom.replay_spec(spec, options)
    torch.manual_seed(11)
    return GPTModel(cfg, spec, vocab_size=V, max_sequence_length=64, pre_process=pre,
                    post_process=post, **kw)


def routers(model):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def use(*models):
    """Megatron's global RouterReplay list holds these models' routers only (the clients
    index it), in layer order."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.global_router_replay_instances[:] = [
        r.router_replay for m in models for r in routers(m)]


def assert_same(a, b, what, router_grads=False):
    """Two runs' (loss, {parameter: gradient}) agree (fp32 tolerances), and with
    `router_grads` the second run's router weights got a non-zero gradient."""
    torch.testing.assert_close(a[0], b[0], msg=lambda m: f"{what}: loss: {m}")
    assert set(a[1]) == set(b[1]), f"{what}: gradients of {set(a[1]) ^ set(b[1])}"
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-5, atol=5e-7,
                                   msg=lambda m, n=name: f"{what}: grad {n}: {m}")
    if router_grads:
        assert any("router.weight" in n and g.abs().sum() > 0 for n, g in b[1].items()), what
