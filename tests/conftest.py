"""Test configuration shared by the whole suite.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before
anything imports triton or replay_ops. On a machine without a CUDA device, the Triton
kernels then run under the interpreter on CPU tensors and the parity tests cover them.
"""
from __future__ import annotations

import os
import sys

import torch  # noqa: E402  (torch does not import triton at import time)

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    # Triton picks the interpreter when a kernel is decorated, so the kernel modules must
    # not be imported yet; fail loudly rather than let the Triton tests fail obscurely.
    kernel_modules = ("replay_ops.backends.triton", "replay_ops.triton_kernels")
    early = [m for m in kernel_modules if m in sys.modules]
    if early:
        raise RuntimeError(
            f"tests/conftest.py: {early} imported before TRITON_INTERPRET=1 was set; "
            "run pytest with TRITON_INTERPRET=1 in the environment"
        )
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

# Under REPLAY_OPS_REQUIRE_CLIENTS=1 (`make test`: every dependency is installed) a missing
# or broken import is a failure, never a skip that reads as a pass: `pytest.importorskip`
# (transformers, verl, Triton guards in the test modules) fails instead of skipping. It is
# patched here, before any test module is imported, and reads the flag at each call.
_importorskip = pytest.importorskip


def _importorskip_unless_required(modname, *args, **kwargs):
    try:
        return _importorskip(modname, *args, **kwargs)
    except pytest.skip.Exception as e:
        if os.environ.get("REPLAY_OPS_REQUIRE_CLIENTS") != "1":
            raise
        pytest.fail(f"{modname} is required here (REPLAY_OPS_REQUIRE_CLIENTS=1) but "
                    f"pytest.importorskip({modname!r}) would skip: {e.msg}", pytrace=False)


pytest.importorskip = _importorskip_unless_required


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device (run with `pytest -m gpu` on a GPU machine)"
    )
    config.addinivalue_line("markers", "slow: larger shapes; still CPU-friendly")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present on this machine")
    for item in items:
        # the marker itself (item.keywords also holds directory names: a checkout in a folder
        # named "gpu" must not skip the whole suite)
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_report_header(config):
    import replay_ops

    from _helpers import usable_backends

    lines = [f"replay_ops backends: cpu={usable_backends('cpu')}"]
    if HAS_CUDA:
        lines.append(f"replay_ops backends: cuda={usable_backends('cuda')}")
    lines.append(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}")
    info = replay_ops.backends()["backends"]
    for name, row in sorted(info.items()):
        if row.get("reason"):
            lines.append(f"  {name}: unavailable ({row['reason']})")
    return lines


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
