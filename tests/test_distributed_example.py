"""examples/ep_moe.py under torchrun on 2 CPU processes: it checks itself against one
process and exits 1 on a mismatch. The README's command is
`torchrun --nproc-per-node 2 examples/ep_moe.py`; here `--standalone` picks a free port
(other test runs may share the machine) and the batch is smaller."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60


def test_ep_moe_example_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(ROOT / "examples" / "ep_moe.py"), "--tokens", "24"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started
        out, _ = proc.communicate()
        raise AssertionError(f"examples/ep_moe.py still running after {TIMEOUT_S} s:\n{out}")
    assert proc.returncode == 0, out
    assert "ep_moe: OK" in out, out
    for rank in (0, 1):
        assert f"rank {rank}: output bitwise equal to one process: True" in out, out
