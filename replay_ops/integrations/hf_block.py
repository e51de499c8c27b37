"""Deprecated: moved to `replay_ops.integrations.hf.block`; this alias goes in the next
release."""
from replay_ops._deprecated import deprecated_module
from replay_ops.integrations.hf.block import (  # noqa: F401
    GROUPED_MM,
    BlockRouting,
    block_forward,
    experts_function,
    grouped_mlp,
    plan_experts,
    route_block,
    rows_experts,
)

__all__ = ["BlockRouting", "GROUPED_MM", "block_forward", "experts_function", "grouped_mlp",
           "plan_experts", "route_block", "rows_experts"]

deprecated_module("replay_ops.integrations.hf_block", "replay_ops.integrations.hf.block")
