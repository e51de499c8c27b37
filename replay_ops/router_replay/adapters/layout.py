"""Deprecated module name (one release): the routing batch and its training formats live in
`replay_ops.router_replay.adapters.batch`."""
from ..._deprecated import deprecated_module

from .batch import *  # noqa: F401,F403
from .batch import __getattr__  # noqa: F401  (ModelLayout, deprecated too)

deprecated_module("replay_ops.router_replay.adapters.layout",
                  "replay_ops.router_replay.adapters.batch")
