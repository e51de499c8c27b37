"""Deprecated: moved to `replay_ops.integrations.hf.ep`; this alias goes in the next release.

Its names are looked up on first use, so importing `replay_ops.distributed` never imports
the Hugging Face integration.
"""
from .._deprecated import deprecated_module

__all__ = ["enable_expert_parallel", "EPState"]  # noqa: F822 (served by __getattr__)

deprecated_module("replay_ops.distributed.hf", "replay_ops.integrations.hf.ep")


def __getattr__(name: str):
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("replay_ops.integrations.hf.ep"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
