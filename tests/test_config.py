"""Router replay config: verl names from YAML and dotted overrides, invalid combinations."""
from __future__ import annotations

import textwrap

import pytest
import torch

from replay_ops.router_replay import (
    ConfigError,
    ReplayMode,
    RouterReplay,
    RouterReplayConfig,
    load_config,
)
from replay_ops.router_replay.files import RecordMeta, RoutingShapeError, write_routing

RR = "actor_rollout_ref.actor.router_replay"
FLAG = "actor_rollout_ref.rollout.enable_rollout_routing_replay"

VERL_YAML = textwrap.dedent(
    """
    trainer:
      total_epochs: 1
    actor_rollout_ref:
      model:
        path: Qwen/Qwen3-30B-A3B
      actor:
        ppo_mini_batch_size: 16
        router_replay:
          mode: R3
          replay_file: null
      rollout:
        name: vllm
        enable_rollout_routing_replay: true
    """
)


def write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_are_disabled():
    cfg = load_config()
    assert cfg.replay_mode is ReplayMode.DISABLED and not cfg.enabled
    assert cfg.enable_rollout_routing_replay is False
    assert cfg.record_file is None and cfg.replay_file is None


def test_full_verl_yaml(tmp_path):
    cfg = load_config(write(tmp_path, VERL_YAML))
    assert cfg.mode == "R3" and cfg.replay_mode is ReplayMode.R3
    assert cfg.enable_rollout_routing_replay is True


def test_dotted_overrides_with_verl_names(tmp_path):
    cfg = load_config(overrides=[f"{RR}.mode=R2", f"{RR}.record_file={tmp_path}/rec.safetensors",
                                 f"{FLAG}=False"])
    assert cfg.mode == "R2" and cfg.record_file == f"{tmp_path}/rec.safetensors"
    assert cfg.enable_rollout_routing_replay is False
    # command-line spellings: leading -- or +, lower-case mode
    cfg = load_config(overrides=[f"--{RR}.mode=r3", f"+{FLAG}=true"])
    assert cfg.mode == "R3" and cfg.enable_rollout_routing_replay is True


def test_overrides_win_over_yaml_and_files_merge_in_order(tmp_path):
    base = write(tmp_path, VERL_YAML)
    extra = write(tmp_path, "actor_rollout_ref:\n  actor:\n    router_replay:\n"
                            "      recompute: false\n", "extra.yaml")
    cfg = load_config([base, extra], [f"{RR}.mode=R2", f"{FLAG}=False", f"{RR}.max_queue=8"])
    assert (cfg.mode, cfg.recompute, cfg.max_queue, cfg.enable_rollout_routing_replay) == (
        "R2", False, 8, False)


def test_r2_with_rollout_routing_replay_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"mode=R2 cannot be combined with .*"
                                          r"enable_rollout_routing_replay=True"):
        load_config(write(tmp_path, VERL_YAML), [f"{RR}.mode=R2"])


def test_r3_with_rollout_flag_off_is_rejected():
    with pytest.raises(ConfigError, match=r"mode=R3 needs the rollout .*"
                                          r"enable_rollout_routing_replay=False"):
        load_config(overrides=[f"{RR}.mode=R3", f"{FLAG}=False"])
    # absent means verl's default, False
    with pytest.raises(ConfigError, match=r"mode=R3 needs the rollout"):
        load_config(overrides=[f"{RR}.mode=R3"])


def test_unknown_mode_and_misspelt_key():
    with pytest.raises(ConfigError, match=r"unknown mode='R4'; expected one of \['disabled', "
                                          r"'R2', 'R3'\]"):
        load_config(overrides=[f"{RR}.mode=R4"])
    with pytest.raises(ConfigError, match="mdoe"):
        load_config(overrides=[f"{RR}.mdoe=R3"])
    with pytest.raises(ConfigError, match="max_queue"):
        load_config(overrides=[f"{RR}.mode=R2", f"{RR}.max_queue=lots"])
    with pytest.raises(ConfigError, match=r"enable_rollout_routing_replay must be true or false, "
                                          r"got 'maybe'"):
        load_config(overrides=[f"{RR}.mode=R3", f"{FLAG}=maybe"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(overrides=[f"{RR}.mode"])


def test_files_or_rollout_flag_without_a_mode_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"record_file='/x.safetensors' is set but mode=disabled"):
        load_config(overrides=[f"{RR}.record_file=/x.safetensors"])
    with pytest.raises(ConfigError, match="rollout routing would be dropped silently"):
        load_config(overrides=[f"{FLAG}=True"])
    with pytest.raises(ConfigError, match=r"replay_file='.*nope.safetensors' does not exist"):
        load_config(overrides=[f"{RR}.mode=R2", f"{RR}.replay_file={tmp_path}/nope.safetensors"])
    with pytest.raises(ConfigError, match=r"config file '.*missing.yaml' does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = write(tmp_path, "a: [1, 2\n", "bad.yaml")
    with pytest.raises(ConfigError, match="cannot parse config file"):
        load_config(bad)


def test_replay_file_whose_model_shape_does_not_match(tmp_path):
    p = tmp_path / "rec.safetensors"
    idx = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dtype=torch.int32)
    write_routing(p, idx, RecordMeta(num_experts=8, top_k=2, moe_layer_ids=[0, 1],
                                     num_hidden_layers=2, model_name="m"))
    cfg = load_config(overrides=[f"{RR}.mode=R2", f"{RR}.replay_file={p}"])
    assert cfg.enable_rollout_routing_replay is False
    rr = RouterReplay(cfg, num_experts=8, top_k=2, moe_layer_ids=[0, 1], num_hidden_layers=2)
    assert rr.routing_source == f"file:{p}" and rr.layer_mapping == "moe"
    with pytest.raises(RoutingShapeError, match=r"rec.safetensors.*moe_layer_ids: file \[0, 1\], "
                                                r"model \[1, 2\]; num_hidden_layers: file 2, "
                                                r"model 3"):
        RouterReplay(cfg, num_experts=8, top_k=2, moe_layer_ids=[1, 2], num_hidden_layers=3)
    with pytest.raises(RoutingShapeError, match="num_experts: file 8, model 64"):
        RouterReplay(cfg, num_experts=64, top_k=2, moe_layer_ids=[0, 1], num_hidden_layers=2)


def test_direct_construction_is_checked_by_router_replay():
    cfg = RouterReplayConfig(mode="R2", enable_rollout_routing_replay=True)
    with pytest.raises(ConfigError, match="mode=R2 cannot be combined"):
        RouterReplay(cfg, num_experts=4, top_k=1, moe_layer_ids=[0])
    with pytest.raises(ConfigError, match="unknown fallback='native'"):
        RouterReplay(RouterReplayConfig(mode="R3", fallback="native"), num_experts=4, top_k=1,
                     moe_layer_ids=[0])


# ------------------------------------------------------------------ verl's generated configs
# verl's own configs, as verl writes them (the installed package ships them): router_replay
# nodes carry `_target_`, the Megatron actor's node is actor_rollout_ref.actor.megatron.
MEGATRON_RR = "actor_rollout_ref.actor.megatron.router_replay"
STRATEGY = "actor_rollout_ref.actor.strategy"


@pytest.fixture(scope="module")
def verl_configs():
    import importlib.util
    import os

    spec = importlib.util.find_spec("verl")  # importing verl itself starts ray: find it only
    if spec is None or spec.origin is None:
        pytest.skip("verl is not installed: its generated trainer configs are not available")
    d = os.path.join(os.path.dirname(spec.origin), "trainer", "config")
    paths = {"megatron": os.path.join(d, "_generated_ppo_megatron_trainer.yaml"),
             "fsdp": os.path.join(d, "_generated_ppo_trainer.yaml")}
    for p in paths.values():
        assert os.path.exists(p), f"verl is installed but ships no {p}"
    return paths


def edited_copy(src, tmp_path, name, **updates):
    """A copy of a verl config with keys set, as a user editing the file would."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(src)
    for key, value in updates.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    out = tmp_path / name
    OmegaConf.save(cfg, out)
    return out


def test_verl_generated_configs_load_as_written(verl_configs):
    for path in verl_configs.values():
        cfg = load_config(path)
        assert cfg.mode is ReplayMode.DISABLED and cfg.enable_rollout_routing_replay is False


def test_verl_megatron_mode_is_read(verl_configs, tmp_path):
    meg = verl_configs["megatron"]
    assert load_config(meg, [f"{MEGATRON_RR}.mode=R2"]).mode is ReplayMode.R2
    cfg = load_config(meg, [f"{MEGATRON_RR}.mode=R3", f"{FLAG}=True"])
    assert cfg.mode is ReplayMode.R3 and cfg.enable_rollout_routing_replay is True
    # the same through an edited copy of the file
    p = edited_copy(meg, tmp_path, "meg_r2.yaml", **{f"{MEGATRON_RR}.mode": "R2"})
    assert load_config(p).mode is ReplayMode.R2
    p = edited_copy(meg, tmp_path, "meg_r3.yaml", **{f"{MEGATRON_RR}.mode": "R3", FLAG: True})
    assert load_config(p).mode is ReplayMode.R3


def test_verl_megatron_r3_and_the_rollout_flag(verl_configs):
    meg = verl_configs["megatron"]
    # R3 without the rollout returning routing: named as R3 (not "mode=disabled")
    with pytest.raises(ConfigError, match=rf"{MEGATRON_RR}\.mode=R3 needs the rollout .*"
                                          rf"{FLAG}=False"):
        load_config(meg, [f"{MEGATRON_RR}.mode=R3"])
    with pytest.raises(ConfigError, match=rf"{MEGATRON_RR}\.mode=R2 cannot be combined with "
                                          rf"{FLAG}=True"):
        load_config(meg, [f"{MEGATRON_RR}.mode=R2", f"{FLAG}=True"])
    with pytest.raises(ConfigError, match=rf"{FLAG}=True but {MEGATRON_RR}\.mode=disabled"):
        load_config(meg, [f"{FLAG}=True"])


def test_verl_target_key_is_accepted_and_only_verl_s(verl_configs, tmp_path):
    target = "verl.workers.config.RouterReplayConfig"
    # the FSDP actor's node as verl's RouterReplayConfig writes it, in a copy of the file
    p = edited_copy(verl_configs["fsdp"], tmp_path, "fsdp_r3.yaml",
                    **{f"{RR}._target_": target, f"{RR}.mode": "R3", f"{RR}.record_file": None,
                       f"{RR}.replay_file": None, FLAG: True})
    cfg = load_config(p)
    assert cfg.mode is ReplayMode.R3 and cfg.enable_rollout_routing_replay is True
    assert load_config(verl_configs["fsdp"], [f"+{RR}._target_={target}", f"{RR}.mode=R2"]
                       ).mode is ReplayMode.R2
    # other unknown keys are still refused, next to _target_ too
    with pytest.raises(ConfigError, match=rf"invalid {RR}: Key 'target' not in"):
        load_config(p, [f"+{RR}.target={target}"])
    with pytest.raises(ConfigError, match=rf"invalid {MEGATRON_RR}: Key 'mdoe' not in"):
        load_config(verl_configs["megatron"], [f"+{MEGATRON_RR}.mdoe=R2"])
    # and so is a _target_ that is not verl's router replay config
    with pytest.raises(ConfigError, match=rf"{RR}\._target_='my.Config' is not verl's router "
                                          r"replay config"):
        load_config(p, [f"{RR}._target_=my.Config"])


def test_verl_fsdp_and_megatron_modes_that_disagree(verl_configs):
    meg = verl_configs["megatron"]
    with pytest.raises(ConfigError, match=rf"{RR}\.mode=R3 and {MEGATRON_RR}\.mode=disabled "
                                          r"disagree"):
        load_config(meg, [f"{RR}.mode=R3", f"{FLAG}=True"])
    with pytest.raises(ConfigError, match=rf"{RR}\.mode=R2 and {MEGATRON_RR}\.mode=R3 disagree"):
        load_config(meg, [f"{RR}.mode=R2", f"{MEGATRON_RR}.mode=R3", f"{FLAG}=True"])
    # the same mode in both is one setting
    cfg = load_config(meg, [f"{RR}.mode=r3", f"{MEGATRON_RR}.mode=R3", f"{FLAG}=True"])
    assert cfg.mode is ReplayMode.R3


def test_mode_set_only_where_the_strategy_s_engine_does_not_read_it():
    with pytest.raises(ConfigError, match=rf"{RR}\.mode=R2 but {STRATEGY}=megatron, whose "
                                          rf"engine reads {MEGATRON_RR}\.mode"):
        load_config(overrides=[f"{STRATEGY}=megatron", f"{RR}.mode=R2"])
    assert load_config(overrides=[f"{STRATEGY}=fsdp", f"{RR}.mode=R2"]).mode is ReplayMode.R2
