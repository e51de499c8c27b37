"""The package's import direction, read from the source (every import, the ones inside
functions included): no module imports a layer above its own.

    core (api, ops, plan, scores, ...), backends, triton_kernels
      < router_replay < distributed < integrations < testing, demo

`replay_ops/__main__.py` (the command line) may import the demo."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "replay_ops"

# area -> the areas it must not import
FORBIDDEN = {
    "core": {"router_replay", "distributed", "integrations", "testing", "demo"},
    "backends": {"router_replay", "distributed", "integrations", "testing", "demo"},
    "router_replay": {"backends", "distributed", "integrations", "testing", "demo"},
    "distributed": {"backends", "integrations", "testing", "demo"},
    "integrations": {"backends", "testing", "demo"},
    "testing": {"demo"},
}
AREAS = ("backends", "router_replay", "distributed", "integrations", "testing", "demo",
         "triton_kernels")


def _module(path: Path) -> list[str]:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _area(dotted: str) -> str | None:
    parts = dotted.split(".")
    if parts[0] != "replay_ops":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in AREAS else "core"


def imports_of(path: Path) -> set[str]:
    """The replay_ops modules (or names in them) that `path` imports, as dotted names."""
    mod = _module(path)
    here = mod if path.name == "__init__.py" else mod[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] == "replay_ops"}


def violations() -> list[str]:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        mod = ".".join(_module(path))
        if mod == "replay_ops.__main__":
            continue
        for target in sorted(imports_of(path)):
            if _area(target) in FORBIDDEN.get(_area(mod), ()):
                bad.append(f"{path.relative_to(PKG.parent)} ({_area(mod)}) imports {target} "
                           f"({_area(target)})")
    return bad


def test_no_import_runs_back_up():
    assert violations() == []


def test_the_scan_sees_imports_inside_functions_and_relative_ones(tmp_path, monkeypatch):
    # the checker itself: a lazy relative import from router_replay into integrations is found
    pkg = tmp_path / "replay_ops"
    (pkg / "router_replay").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "router_replay" / "__init__.py").write_text("")
    (pkg / "router_replay" / "x.py").write_text(
        "def f():\n    from ..integrations.hf import patch_model\n    return patch_model\n")
    monkeypatch.setitem(globals(), "PKG", pkg)
    got = violations()
    assert got == ["replay_ops/router_replay/x.py (router_replay) imports "
                   "replay_ops.integrations.hf (integrations)",
                   "replay_ops/router_replay/x.py (router_replay) imports "
                   "replay_ops.integrations.hf.patch_model (integrations)"]


@pytest.mark.parametrize("path, level, module, want", [
    ("router_replay/adapters/vllm.py", 1, "batch", "replay_ops.router_replay.adapters.batch"),
    ("router_replay/adapters/vllm.py", 3, "_deprecated", "replay_ops._deprecated"),
    ("integrations/hf/__init__.py", 1, "patch", "replay_ops.integrations.hf.patch"),
    ("integrations/hf/__init__.py", 2, None, "replay_ops.integrations"),
])
def test_relative_imports_resolve(tmp_path, monkeypatch, path, level, module, want):
    pkg = tmp_path / "replay_ops"
    f = pkg / path
    f.parent.mkdir(parents=True)
    dots = "." * level
    f.write_text(f"from {dots}{module or ''} import name\n" if module else
                 f"from {dots} import name\n")
    monkeypatch.setitem(globals(), "PKG", pkg)
    assert want in imports_of(f)
