"""Router replay: record the experts each MoE layer picked, and force them again later.

    from replay_ops.router_replay import RouterReplay, RouterReplayConfig, ReplayAction

    rr = RouterReplay(RouterReplayConfig(mode="R2"), num_experts=E, top_k=K,
                      moe_layer_ids=[1, 2, 3], num_hidden_layers=4)
    rr.set_action(ReplayAction.RECORD)          # old-logprob pass: record
    ...                                          # each MoE layer: plan = rr.route(...)
    rr.set_action(ReplayAction.REPLAY_FORWARD)   # update pass: replay what was recorded
    rr.set_action(ReplayAction.REPLAY_BACKWARD)  # activation recompute: same indices, FIFO

Modes (`RouterReplayConfig.mode`, a `ReplayMode`): disabled, R2, R3. The model's expert
and layer shape: `ModelShape`. Record files: `files`. Rollout engines' routing (vLLM,
SGLang, verl) to training layouts: `adapters` (one module per engine). Compact lossless
routing bytes (transport, record files): `codec`.
See docs/router_replay.md.
"""
from __future__ import annotations

from .config import (
    ConfigError,
    ReplayAction,
    ReplayMode,
    RouterReplayConfig,
    check_combination,
    config_from_omegaconf,
    load_config,
)
from .._deprecated import deprecated_names
from .replay import RouterReplay, RouterReplayError
from .shape import ModelShape
from . import adapters, codec, files
from .adapters import ReplayBatch, RoutingMismatchError
from .files import RecordMeta, RoutingFileError, RoutingShapeError, open_routing

__all__ = [
    "ConfigError",
    "ModelShape",
    "RecordMeta",
    "ReplayBatch",
    "RoutingFileError",
    "RoutingMismatchError",
    "RoutingShapeError",
    "adapters",
    "codec",
    "files",
    "open_routing",
    "ReplayAction",
    "ReplayMode",
    "RouterReplay",
    "RouterReplayConfig",
    "RouterReplayError",
    "check_combination",
    "config_from_omegaconf",
    "load_config",
]


# deprecated (one release): the model shape is ModelShape
__getattr__ = deprecated_names(__name__, {"ModelLayout": ("ModelShape", ModelShape)})
