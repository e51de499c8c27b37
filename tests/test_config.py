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
