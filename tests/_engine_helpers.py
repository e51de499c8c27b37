"""What the real-engine tests (tests/test_vllm_engine.py, tests/test_sglang_engine.py) share:
their prompts, the replay of an engine's routing through the training engine, the per-layer
expert-set comparison, and how a missing engine is reported."""
from __future__ import annotations

import os
import types

import pytest
import torch

from replay_ops.demo import workload

REQUIRE = os.environ.get("REPLAY_OPS_REQUIRE_CLIENTS") == "1"
PROMPT_LENS = [5, 9, 12, 16, 7, 20]


def unavailable(engine: str, msg: str):
    """A missing or failed engine: a failure under REPLAY_OPS_REQUIRE_CLIENTS=1, else a skip."""
    if REQUIRE:
        pytest.fail(f"{engine} is required here (REPLAY_OPS_REQUIRE_CLIENTS=1): {msg}")
    pytest.skip(msg)


def prompts(seed: int, vocab_size: int, lens=PROMPT_LENS):
    """Prompts of `lens` tokens drawn under `seed` from ids 3 .. vocab_size - 2."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size - 1, (n,), generator=g).tolist() for n in lens]


def replay(eng, seqs: dict, prompt_lens: dict, routing: dict, mask: dict):
    """The training passes (the model's own routing and R3) over `seqs` in batches of 4, longest first."""
    cfg = types.SimpleNamespace(progress=False)
    order = sorted(seqs, key=lambda i: (-len(seqs[i]), i))
    return workload.training_passes(cfg, eng, seqs, prompt_lens, routing,
                                    workload.batches(order, 4), torch.device("cpu"),
                                    infer_mask=mask)


def set_mismatch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[n, L] bool: the expert sets differ."""
    return (a.long().sort(-1).values != b.long().sort(-1).values).any(-1)
