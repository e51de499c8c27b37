"""Megatron-Core's MoE layer with the replay router on 2 processes (gloo over 127.0.0.1,
CPU): EP=2 on the all-to-all dispatcher, TP=2 + sequence parallel (expert TP 1 and 2),
CP=2 data path, PP=2 with 2 virtual stages. One process group runs every phase (startup
is seconds per process); the whole group is bounded by a hard timeout. The phase bodies
are in tests/_megatron_workers.py."""
from __future__ import annotations

import pytest

from _helpers import require_client  # noqa: E402

require_client("megatron.core", "megatron-core")

from replay_ops.testing import megatron_cpu as env  # noqa: E402
import _megatron_workers as workers  # noqa: E402

TIMEOUT_S = 240


@pytest.fixture(scope="module")
def results():
    return env.spawn(workers.run_all, 2, timeout=TIMEOUT_S)


@pytest.mark.parametrize("phase", list(workers.PHASES))
def test_two_ranks(results, phase):
    for rank in (0, 1):
        status, payload = results[rank][phase]
        assert status == "ok", f"rank {rank}, phase {phase}:\n{payload}"


def test_ep2_splits_cover_every_routed_row(results):
    # each rank sends T*K rows in total; rank 0's input splits are rank 1's mirror here
    s0 = results[0]["ep2_alltoall"][1]["splits"]
    s1 = results[1]["ep2_alltoall"][1]["splits"]
    assert sum(s0) == sum(s1) == workers.T * workers.K


def test_pp_stages_hold_interleaved_layers(results):
    assert results[0]["pp2_vpp2"][1]["layers"] == [1, 6]
    assert results[1]["pp2_vpp2"][1]["layers"] == [3, 4, 7, 8]
