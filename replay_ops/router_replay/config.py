"""Router replay configuration: modes, actions and the verl config names.

The names users already type are accepted as they are:

    actor_rollout_ref.actor.router_replay.mode=R3            # disabled | R2 | R3
    actor_rollout_ref.actor.router_replay.record_file=/path/routing.safetensors
    actor_rollout_ref.actor.router_replay.replay_file=/path/routing.safetensors
    actor_rollout_ref.actor.megatron.router_replay.mode=R3   # verl's Megatron actor
    actor_rollout_ref.actor.veomni.router_replay.mode=R3     # verl's VeOmni actor
    actor_rollout_ref.rollout.enable_rollout_routing_replay=True

`load_config(yaml_files, overrides)` merges YAML files and dotted command-line overrides
with OmegaConf, checks each `router_replay` node against a typed schema (a misspelt key is
an error, not ignored; verl's `_target_` is accepted when it names verl's router replay
config class), refuses nodes that disagree, and checks the combination of options
(`check_combination`).
"""
from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Iterable, Optional

ROUTER_REPLAY_KEY = "actor_rollout_ref.actor.router_replay"
MEGATRON_ROUTER_REPLAY_KEY = "actor_rollout_ref.actor.megatron.router_replay"
VEOMNI_ROUTER_REPLAY_KEY = "actor_rollout_ref.actor.veomni.router_replay"
ROLLOUT_FLAG_KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
STRATEGY_KEY = "actor_rollout_ref.actor.strategy"
# Where verl keeps the actor's router_replay node: the FSDP actor's own node, and the
# engine config of the Megatron and VeOmni actors (verl's generated configs hold these).
ROUTER_REPLAY_KEYS = (ROUTER_REPLAY_KEY, MEGATRON_ROUTER_REPLAY_KEY, VEOMNI_ROUTER_REPLAY_KEY)
# The engine whose node verl reads for each actor strategy (verl's engine_workers).
STRATEGY_KEYS = {"megatron": MEGATRON_ROUTER_REPLAY_KEY, "veomni": VEOMNI_ROUTER_REPLAY_KEY}
# verl writes `_target_` (the dataclass it instantiates) into each router_replay node.
VERL_TARGETS = ("verl.workers.config.RouterReplayConfig",
                "verl.workers.config.EngineRouterReplayConfig")


class ConfigError(ValueError):
    """An invalid router replay configuration (a bad value or a bad combination)."""


class ReplayMode(str, enum.Enum):
    """`disabled`: the model's own routing. `R2`: the training engine records routing in its
    forward-only pass and replays it in the update passes. `R3`: the rollout engine's
    routing is replayed in every training pass."""

    DISABLED = "disabled"
    R2 = "R2"
    R3 = "R3"

    def __str__(self) -> str:  # "R3", not "ReplayMode.R3", in messages
        return self.value

    @classmethod
    def parse(cls, value: "ReplayMode | str | None", *, where: str = "mode") -> "ReplayMode":
        if isinstance(value, ReplayMode):
            return value
        if value is None:
            return cls.DISABLED
        if isinstance(value, str):
            key = value.strip().lower()
            for m in cls:
                if m.value.lower() == key:
                    return m
        raise ConfigError(
            f"router_replay: unknown {where}={value!r}; expected one of "
            f"{[m.value for m in cls]}"
        )


class ReplayAction(enum.Enum):
    """What `RouterReplay.route` does at the next MoE layer call.

    RECORD: run the layer's own top-k, gate with it and store the indices used.
    REPLAY_FORWARD: gate with the routing set by `set_routing` (or recorded), and push the
    indices used onto the layer's first-in first-out queue.
    REPLAY_BACKWARD: pop the layer's queue (activation recompute replays the same indices).
    """

    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"
    REPLAY_BACKWARD = "replay_backward"

    @classmethod
    def parse(cls, value: "ReplayAction | str | None") -> "ReplayAction | None":
        if value is None or isinstance(value, ReplayAction):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for a in cls:
                if key in (a.value, a.name.lower()):
                    return a
        raise ConfigError(
            f"router_replay: unknown action={value!r}; expected None or one of "
            f"{[a.name for a in cls]}"
        )


@dataclass
class RouterReplayConfig:
    """Options of one model's router replay (`actor_rollout_ref.actor.router_replay`).

    mode: a ReplayMode (disabled | R2 | R3); a string is parsed when the config is built.
    record_file: where `RouterReplay.save()` writes by default (R2 recordings).
    replay_file: a recording that `RouterReplay` loads at construction and replays.
    recompute: push the indices of every grad-enabled REPLAY_FORWARD onto the layer's
        queue, for REPLAY_BACKWARD (activation recompute). Turn off when the model does
        not recompute activations, so the queue does not grow.
    max_queue: a queue longer than this raises (a forward was never matched by a
        recompute: the caller forgot REPLAY_BACKWARD or `clear()`).
    validate: check the routing to replay (range, duplicates) once, when it is set, loaded
        or taken from a recording (one host sync each, and none in the MoE layers); the
        gate then runs sync-free. Turn off only for trusted data (e.g. static buffers
        refilled for CUDA-graph replay).
    fallback: rows whose replay mask is False (padding, the final token with no route)
        use "gate" (the model's own selection inside replay_ops.gate's kernel: the top-k of
        the scores, or the `selection` given to `route`, with expert bias and group limits)
        or "topk_fn" (the layer's own top-k function, run on every row).
    padding: what a replayed row with a -1 slot (some slots empty; a row with every slot
        -1 is not replayed) does in the gate: "empty" (the slot routes nowhere: the row
        goes to fewer experts, as a recording that dropped a slot had it) or "select"
        (the row takes the model's own selection inside the gate kernel, as the rows of
        `fallback="gate"`). `route()`'s `padding=`, or options whose padding is not
        "empty", override it for one call.
    enable_rollout_routing_replay: the rollout flag (`actor_rollout_ref.rollout.
        enable_rollout_routing_replay`); `load_config` fills it from there.
    model_name: stored in files written by `save()`, and compared by `load()` if set.
    agreement: every REPLAY_FORWARD gate also writes the routing agreement
        (`replay_ops.gate(return_agreement=True)`, the same kernel pass): the plans carry
        `agreement` and `set_logprob`, and `RouterReplay.agreement()` gives, per MoE layer,
        the fraction of replayed tokens whose replayed set is the model's own selection.
        `route(..., return_agreement=True)` asks for one call.
    """

    mode: ReplayMode = ReplayMode.DISABLED
    record_file: Optional[str] = None
    replay_file: Optional[str] = None
    recompute: bool = True
    max_queue: int = 64
    validate: bool = True
    fallback: str = "gate"
    padding: str = "empty"
    enable_rollout_routing_replay: Optional[bool] = None
    model_name: Optional[str] = None
    agreement: bool = False

    def __setattr__(self, name, value) -> None:
        # a string ("R3", "r3", "disabled") is parsed once, when it is set; the field
        # always holds the enum
        if name == "mode":
            value = ReplayMode.parse(value)
        super().__setattr__(name, value)

    @property
    def replay_mode(self) -> ReplayMode:
        return self.mode

    @property
    def enabled(self) -> bool:
        return self.mode is not ReplayMode.DISABLED

    def check(self) -> "RouterReplayConfig":
        check_combination(self)
        return self


FALLBACKS = ("gate", "topk_fn")
PADDINGS = ("empty", "select")


def check_combination(cfg: RouterReplayConfig, mode_key: str = ROUTER_REPLAY_KEY) -> None:
    """Raise ConfigError on a bad value or an invalid combination of options. `mode_key`:
    the router_replay node the mode was read from, named in the messages."""
    mode = cfg.mode
    flag = cfg.enable_rollout_routing_replay
    if mode is ReplayMode.R2 and flag:
        raise ConfigError(
            f"router_replay: {mode_key}.mode=R2 cannot be combined with {ROLLOUT_FLAG_KEY}"
            f"=True: R2 replays the training engine's own recording; rollout routing replay is R3 "
            f"(set {mode_key}.mode=R3, or {ROLLOUT_FLAG_KEY}=False)"
        )
    if mode is ReplayMode.R3 and flag is not None and not flag:
        raise ConfigError(
            f"router_replay: {mode_key}.mode=R3 needs the rollout to return its routing, but "
            f"{ROLLOUT_FLAG_KEY}={flag}; set {ROLLOUT_FLAG_KEY}=True"
        )
    if mode is ReplayMode.DISABLED and flag:
        raise ConfigError(
            f"router_replay: {ROLLOUT_FLAG_KEY}=True but {mode_key}.mode=disabled: "
            f"the rollout routing would be dropped silently; set {mode_key}.mode=R3"
        )
    if mode is ReplayMode.DISABLED and (cfg.record_file or cfg.replay_file):
        which = "record_file" if cfg.record_file else "replay_file"
        raise ConfigError(
            f"router_replay: {which}={getattr(cfg, which)!r} is set but mode=disabled; "
            f"set mode=R2 or R3, or remove {which}"
        )
    if cfg.fallback not in FALLBACKS:
        raise ConfigError(
            f"router_replay: unknown fallback={cfg.fallback!r}; expected one of {FALLBACKS}"
        )
    if cfg.padding not in PADDINGS:
        raise ConfigError(
            f"router_replay: unknown padding={cfg.padding!r}; expected one of {PADDINGS}"
        )
    if not isinstance(cfg.max_queue, int) or cfg.max_queue < 1:
        raise ConfigError(
            f"router_replay: max_queue must be an integer >= 1, got {cfg.max_queue!r}")
    if cfg.replay_file is not None and not os.path.exists(cfg.replay_file):
        raise ConfigError(f"router_replay: replay_file={cfg.replay_file!r} does not exist")


def load_config(
    yaml_files: Iterable[str | os.PathLike] | str | os.PathLike = (),
    overrides: Iterable[str] = (),
) -> RouterReplayConfig:
    """Merge YAML files (in order) and dotted overrides (`a.b.c=value`, as on a verl
    command line; a leading `--` or `+` is accepted) and return the checked config.

    Only the actor's router_replay nodes (`ROUTER_REPLAY_KEYS`, see
    `config_from_omegaconf`), `actor_rollout_ref.actor.strategy` and `actor_rollout_ref.
    rollout.enable_rollout_routing_replay` are read; the rest of a full training config
    (verl's generated configs included) is left alone. Keys under `router_replay` must be
    fields of RouterReplayConfig, or verl's `_target_`.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(yaml_files, (str, os.PathLike)):
        yaml_files = [yaml_files]
    parts = []
    for path in yaml_files:
        try:
            parts.append(OmegaConf.load(path))
        except FileNotFoundError:
            raise ConfigError(f"router_replay: config file {str(path)!r} does not exist") from None
        except Exception as e:
            raise ConfigError(f"router_replay: cannot parse config file {str(path)!r}: {e}") from e
    dotlist = [_strip_override(o) for o in overrides]
    try:
        parts.append(OmegaConf.from_dotlist(dotlist))
        merged = OmegaConf.merge(*parts) if parts else OmegaConf.create()
    except OmegaConfBaseException as e:
        raise ConfigError(f"router_replay: bad override in {dotlist}: {e}") from e
    return config_from_omegaconf(merged)


def _strip_override(item: str) -> str:
    item = item.strip()
    if item.startswith("--"):
        item = item[2:]
    if item.startswith("++") or item.startswith("+"):
        item = item.lstrip("+")
    if "=" not in item:
        raise ConfigError(f"router_replay: override {item!r} is not of the form key=value")
    return item


def config_from_omegaconf(cfg) -> RouterReplayConfig:
    """RouterReplayConfig from a full (verl-shaped) OmegaConf/dict config.

    The actor's router_replay node is read wherever verl keeps it (`ROUTER_REPLAY_KEYS`:
    the FSDP actor's `actor_rollout_ref.actor.router_replay`, the Megatron engine's
    `actor_rollout_ref.actor.megatron.router_replay`, the VeOmni engine's
    `actor_rollout_ref.actor.veomni.router_replay`). Nodes that set a field to different
    values are refused, naming both keys; with `actor.strategy` megatron or veomni, a mode
    set only under another node is refused (verl's engine would not read it)."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    nodes = {}
    for key in ROUTER_REPLAY_KEYS:
        node = OmegaConf.select(cfg, key, default=None)
        if node is not None:
            nodes[key] = _read_node(node, key)
    values, mode_key = _merge_nodes(nodes)
    strategy = OmegaConf.select(cfg, STRATEGY_KEY, default=None)
    engine_key = STRATEGY_KEYS.get(str(strategy)) if strategy is not None else None
    mode = ReplayMode.parse(values.get("mode"))
    if engine_key is not None and mode is not ReplayMode.DISABLED and engine_key not in nodes:
        raise ConfigError(
            f"router_replay: {mode_key}.mode={mode} but {STRATEGY_KEY}={strategy}, whose "
            f"engine reads {engine_key}.mode (not set, so disabled): verl would not replay. "
            f"Set {engine_key}.mode={mode}")
    flag = OmegaConf.select(cfg, ROLLOUT_FLAG_KEY, default=None)
    # verl's default for the rollout flag is False: a verl-shaped config without it
    # does not return rollout routing, so R3 without it is rejected.
    values["enable_rollout_routing_replay"] = (
        False if flag is None else _as_bool(flag, ROLLOUT_FLAG_KEY))
    out = RouterReplayConfig(**values)
    check_combination(out, mode_key)
    return out


def _read_node(node, key: str) -> dict:
    """One router_replay node checked against the schema -> {field: value} of the fields
    it sets (`_target_` checked and dropped)."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(node, DictConfig):
        raise ConfigError(f"router_replay: {key} must be a mapping, got {node!r}")
    node = node.copy()
    if "_target_" in node:
        target = node.pop("_target_")
        if target not in VERL_TARGETS:
            raise ConfigError(
                f"router_replay: {key}._target_={target!r} is not verl's router replay config; "
                f"expected one of {list(VERL_TARGETS)}")
    try:
        if "mode" in node and node.mode is not None:
            # the schema's enum node takes member names; accept the values users type
            # ("disabled", "r3") by parsing them first
            node = OmegaConf.merge(node, {"mode": ReplayMode.parse(node.mode).name})
        OmegaConf.merge(OmegaConf.structured(RouterReplayConfig), node)  # types and names
        given = OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"router_replay: invalid {key}: {e}") from e
    merged = OmegaConf.merge(OmegaConf.structured(RouterReplayConfig), given)
    full = OmegaConf.to_container(merged, resolve=True)
    return {name: full[name] for name in given}


def _merge_nodes(nodes: dict) -> tuple[dict, str]:
    """The fields set by the router_replay nodes, which must agree -> (fields, the key of
    the node the mode comes from)."""
    values, source = {}, {}
    for key, fields in nodes.items():
        for name, value in fields.items():
            if value is None or name == "enable_rollout_routing_replay":
                continue
            if name in values and values[name] != value:
                shown = [str(v) if name == "mode" else repr(v) for v in (values[name], value)]
                raise ConfigError(
                    f"router_replay: {source[name]}.{name}={shown[0]} and {key}.{name}="
                    f"{shown[1]} disagree: verl's FSDP actor reads {ROUTER_REPLAY_KEY}, its "
                    f"Megatron and VeOmni actors their engine's node ({MEGATRON_ROUTER_REPLAY_KEY}"
                    f", {VEOMNI_ROUTER_REPLAY_KEY}); set {name} in one node, or the same "
                    f"value in both")
            values.setdefault(name, value)
            source.setdefault(name, key)
    return values, source.get("mode", next(iter(nodes), ROUTER_REPLAY_KEY))


def _as_bool(value, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"router_replay: {key} must be true or false, got {value!r}")


def to_dict(cfg: RouterReplayConfig) -> dict:
    return dataclasses.asdict(cfg)
