"""The base class of the package's routing errors.

Routing that cannot be used as given raises a subclass of `RoutingError`, wherever it is
found, so a caller catches one class:

    codec.CodecError              a routing blob that cannot be decoded (or encoded)
    files.RoutingFileError        a record file that cannot be used (truncated, corrupt, ...)
    files.RoutingShapeError       a record file recorded for another model shape
    adapters.RoutingMismatchError rollout routing that does not line up with its batch
    replay.RouterReplayError      routing that cannot be replayed as asked
    megatron.ReplayRoutingError   replay data Megatron's router cannot use
    megatron.LayoutError          routing that does not fit Megatron's data layout

Each keeps its built-in base too (ValueError or RuntimeError), so existing `except` clauses
keep catching it.
"""
from __future__ import annotations


class RoutingError(Exception):
    """Routing that cannot be used as given; the message names what is wrong and where."""
