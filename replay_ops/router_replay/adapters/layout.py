"""Deprecated module name (one release): the routing batch and its training formats live in
`replay_ops.router_replay.adapters.batch`."""
import warnings

from .batch import *  # noqa: F401,F403
from .batch import __getattr__  # noqa: F401  (ModelLayout, deprecated too)

warnings.warn("replay_ops.router_replay.adapters.layout is deprecated; use "
              "replay_ops.router_replay.adapters.batch", DeprecationWarning, stacklevel=2)
