"""What a user installs: the wheel holds every file of the package (the data files that are
not modules included: the engines' start-up hooks, `py.typed`), the version is declared
once, and the command line answers `--version` and lists its commands."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tracked(*paths: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", *paths], cwd=ROOT, capture_output=True,
                         text=True)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()[:200]}")
    return [p for p in out.stdout.split("\0") if p]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of the tracked files (a copy of the tree: the checkout's build/ and
    egg-info stay untouched), without the native library (REPLAY_OPS_NATIVE=0: the data
    files are the same either way, and the build takes seconds)."""
    src = tmp_path_factory.mktemp("src")
    for rel in _tracked():
        if rel.startswith("build/") or not (ROOT / rel).is_file():
            continue
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes((ROOT / rel).read_bytes())
    dist = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, REPLAY_OPS_NATIVE="0")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation",
                          "--no-deps", "--no-index", "-w", str(dist), str(src)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (whl,) = dist.glob("replay_ops-*.whl")
    return whl


def test_wheel_holds_every_file_of_the_package(wheel):
    """Every file git tracks under replay_ops/ and triton_kernels/ (installed as
    replay_ops/triton_kernels/) is in the wheel: a start-up hook or another data file left
    out works from an editable install only (`demo --engine sglang` did)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {("replay_ops/triton_kernels/" + p[len("triton_kernels/"):])
            if p.startswith("triton_kernels/") else p
            for p in _tracked("replay_ops", "triton_kernels")}
    assert "replay_ops/demo/sglang_cpu/sitecustomize.py" in want
    assert "replay_ops/demo/vllm_cpu/sitecustomize.py" in want
    assert "replay_ops/py.typed" in want
    missing = sorted(want - names)
    assert not missing, f"tracked files the wheel leaves out: {missing}"
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert re.search(r"^Version: " + re.escape(_declared_version()) + "$", text, re.M), text
    assert any(n.endswith(".dist-info/LICENSE") or "/licenses/LICENSE" in n for n in names)


def _declared_version() -> str:
    m = re.search(r'^__version__ = "([^"]+)"$',
                  (ROOT / "replay_ops" / "__init__.py").read_text(), re.M)
    assert m, "replay_ops/__init__.py declares no __version__"
    return m.group(1)


def test_version_is_declared_once():
    import replay_ops

    assert replay_ops.__version__ == _declared_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", replay_ops.__version__)
    setup = (ROOT / "setup.py").read_text()
    assert not re.search(r'^VERSION = "', setup, re.M), "setup.py must read __version__"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {replay_ops.__version__}" in changelog


def test_command_line_version_and_help():
    import replay_ops

    out = subprocess.run([sys.executable, "-m", "replay_ops", "--version"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith(f"replay_ops {replay_ops.__version__}"), out.stdout
    assert "torch " in out.stdout and "native library" in out.stdout
    out = subprocess.run([sys.executable, "-m", "replay_ops", "--help"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0
    for cmd in ("demo", "backends", "files", "--version", "vllm_engine install"):
        assert cmd in out.stdout, cmd


def test_files_command_is_the_record_file_tool(tmp_path):
    from replay_ops.__main__ import main

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a record file")
    assert main(["files", "verify", str(bad)]) == 1


def test_a_missing_compiler_names_the_way_without_the_library(tmp_path):
    """No C++ compiler: the build stops before compiling anything, and says how to install
    without the native library (REPLAY_OPS_NATIVE=0) instead of ending in a traceback."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"))
    env.pop("REPLAY_OPS_NATIVE", None)
    out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "no C++ compiler" in text and "REPLAY_OPS_NATIVE=0 pip install" in text, text
    assert "Traceback" not in text, text
