"""verl, the framework router replay comes from, driving Megatron-Core models built with
the replay router: verl's own helpers (`verl.utils.megatron.router_replay_utils`) and its
router replay patch, installed from the package index and unmodified. Every check runs in
fresh processes (verl's patch changes Megatron's classes process-wide) and compares with
Megatron's router under verl's patch: routing exactly, losses and gradients within fp32
tolerance. See tests/_verl_workers.py."""
from __future__ import annotations

import pytest

from _helpers import require_client

require_client("megatron.core", "megatron-core")
require_client("verl.utils.megatron.router_replay_utils", "verl")

from replay_ops.testing import megatron_cpu as env  # noqa: E402
import _verl_workers as workers  # noqa: E402


@pytest.mark.parametrize("k", [1, 2])
def test_verl_r2_r3_fifo_mtp_one_process(k):
    """R2 record/merge/replay (MoE ordinal and absolute layers), R3 with verl's
    alignment and replay mask, the REPLAY_BACKWARD FIFO over two micro-batches, an MTP
    layer under the global action, and the FIFO-drift and missing-target errors."""
    out = env.spawn(workers.single, 1, k, timeout=300)
    assert out[0]["T"] == sum(workers.LENS)


def test_verl_pp2_vpp2_two_ranks():
    out = env.spawn(workers.pp2_vpp2, 2, timeout=300)
    assert out[0]["held"] == [1, 6] and out[1]["held"] == [3, 4, 7, 8]
