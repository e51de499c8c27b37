"""Deprecated: moved to `replay_ops.integrations.hf.block`; this alias goes in the next
release."""
import warnings

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

warnings.warn("replay_ops.integrations.hf_block is deprecated; import "
              "replay_ops.integrations.hf.block instead", DeprecationWarning, stacklevel=2)
