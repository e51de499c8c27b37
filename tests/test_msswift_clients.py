"""ms-swift 4.6.0 (Megatron-SWIFT), R2 and R3 on Megatron-Core: its own router-replay helpers
and its dispatcher patch (`swift/megatron/utils/router_replay_utils.py`), installed from the
package index and unmodified, driving GPT models built with the replay router.

ms-swift's package import needs TransformerEngine (mcore-bridge patches it at import, and no
CPU build of TransformerEngine exists), so the replay module is loaded from its own file
with its parent packages registered but not run (tests/_client_loaders.py); the module
itself runs unchanged. Every check runs in fresh processes (ms-swift's patch changes
Megatron's dispatcher process-wide) and compares with Megatron's router under the same
patch. See tests/_msswift_workers.py."""
from __future__ import annotations

import pytest

import _client_loaders
from _helpers import require_client

require_client("megatron.core", "megatron-core")
require_client("swift.megatron.utils.router_replay_utils", "ms-swift 4.6.0",
               load=_client_loaders.msswift)

from replay_ops.testing import megatron_cpu as env  # noqa: E402
import _msswift_workers as workers  # noqa: E402


@pytest.mark.parametrize("k", [1, 2])
def test_msswift_r3_r2_forward_step_match_megatron(k):
    out = env.spawn(workers.core, 1, k, timeout=300)[0]
    # item 3: ms-swift's patched preprocess reads routing_map.sum(); on the plan
    # dispatcher Megatron's preprocess runs once per MoE layer (3), not twice
    assert out["preprocess_calls"] == {"ref": 3, "ours": 3}, out
    assert out["num_out_tokens"] == [sum(workers.LENS) * k] * 3


def test_msswift_zero_filled_rows_padding_error_names_them():
    out = env.spawn(workers.zero_rows, 1, 2, "error", timeout=300)[0]
    assert out["error"] is not None and "ReplayRoutingError" in out["error"], out
    assert f"row {out['ends'][0]} " in out["error"] and "padding='error'" in out["error"]


@pytest.mark.parametrize("padding", ["topk", "spread"])
def test_msswift_zero_filled_rows_padding_policy(padding):
    out = env.spawn(workers.zero_rows, 1, 2, padding, timeout=300)[0]
    assert out["error"] is None, out


def test_msswift_pp2_vpp2_second_chunk_refused():
    """Item 6: ms-swift's helpers under virtual pipeline stages set targets on the first
    chunk's routers only; our routers of the other chunk refuse, naming the chunk."""
    out = env.spawn(workers.pp2_vpp2, 2, timeout=300)
    for rank, second in ((0, [5, 6]), (1, [7, 8])):
        errs = out[rank]["errors"]
        assert sorted(errs) == second, out[rank]
        for e in errs.values():
            assert "ReplayRoutingError" in e and "virtual pipeline chunk 1 of 2" in e, e
    # the first chunk's routers hold their own layers' rollout columns
    assert out[0]["held"] == {1: 1, 2: 2} and out[1]["held"] == {3: 3, 4: 4}, out


def test_msswift_cp2_zigzag_split_cp_inputs():
    out = env.spawn(workers.cp2, 2, timeout=300)
    assert out[0]["rows"][:2] == [0, 1] and out[1]["rows"][:2] == [2, 3]
