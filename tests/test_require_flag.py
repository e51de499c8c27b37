"""REPLAY_OPS_REQUIRE_CLIENTS=1 (`make test`) turns every skip for a missing dependency into
a failure: `pytest.importorskip` (patched in tests/conftest.py), as the clients' guard
(`_helpers.require_client`) and the engines' (`_engine_helpers`) already do."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MISSING = "replay_ops_no_such_module"
TESTS = Path(__file__).resolve().parent


def test_importorskip_fails_under_the_flag(monkeypatch):
    monkeypatch.setenv("REPLAY_OPS_REQUIRE_CLIENTS", "1")
    with pytest.raises(pytest.fail.Exception, match="REPLAY_OPS_REQUIRE_CLIENTS=1"):
        pytest.importorskip(MISSING)
    assert pytest.importorskip("json").dumps(1) == "1"  # a present module is returned


def test_importorskip_skips_without_the_flag(monkeypatch):
    monkeypatch.delenv("REPLAY_OPS_REQUIRE_CLIENTS", raising=False)
    with pytest.raises(pytest.skip.Exception):
        pytest.importorskip(MISSING)


def test_a_module_level_guard_fails_the_run(tmp_path):
    """A test module's `pytest.importorskip(...)` of a module that does not import, under
    the flag and this suite's conftest: the run fails (an error, not a skipped module)."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_guarded.py").write_text(textwrap.dedent(f"""
        import pytest
        pytest.importorskip({MISSING!r})

        def test_never():
            pass
        """))
    env = dict(os.environ, REPLAY_OPS_REQUIRE_CLIENTS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), "test_guarded.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0, out.stdout[-2000:]
    assert "skipped" not in out.stdout.splitlines()[-1], out.stdout[-2000:]
    assert f"{MISSING} is required here (REPLAY_OPS_REQUIRE_CLIENTS=1)" in out.stdout, \
        out.stdout[-2000:]
