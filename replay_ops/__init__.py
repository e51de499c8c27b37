"""replay_ops: fused replayed top-k gating for Mixture-of-Experts router replay.

    plan = replay_ops.gate(logits, recorded_indices)          # weights + dispatch plan
    x = replay_ops.permute(hidden, plan)                      # expert-major rows
    y = replay_ops.unpermute(expert_mlp(x), plan)             # weighted combine per token

    d = replay_ops.gate_dense(logits, recorded_indices)       # dense probs + routing_map, plan
    x, row_probs = replay_ops.permute(hidden, d.plan, probs=d.probs)  # + each row's probability

Importing the package registers `torch.ops.replay.{gate, permute, unpermute, gate_dense,
permute_probs}` and their backward ops (`ops.OPS`, the one list; `ops.py`); the wrappers
above live in `api.py`. `replay_ops.backends()` says
which implementation serves each device; `replay_ops.reference` (imported on demand) is
the pure-PyTorch oracle the tests hold every backend to.
"""
from __future__ import annotations

from . import backends
from . import ops as _ops  # noqa: F401  (registers torch.ops.replay.*)
from .api import gate, gate_dense, permute, unpermute
from .errors import RoutingError
from .options import GateOptions, Selection
from .plan import DenseRouting, RoutingPlan

__all__ = ["gate", "gate_dense", "permute", "unpermute", "GateOptions", "Selection",
           "RoutingPlan", "DenseRouting", "RoutingError", "backends"]
__version__ = "0.1.0"
