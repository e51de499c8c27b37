"""The package's import direction, read from the source (every import, the ones inside
functions included, and the dynamic ones through `importlib.import_module` or `__import__`):
no module imports a layer above its own.

    core (api, ops, plan, scores, ...), backends, triton_kernels
      < router_replay < distributed < integrations < testing, demo

`triton_kernels/` (installed as `replay_ops.triton_kernels`) is scanned with the package.
`replay_ops/__main__.py` (the command line) may import the demo. A dynamic import whose target
the scan cannot read (not a string, an f-string on the module's own name, or a module-level
dict of strings) is itself a violation, so the scan is never blind to one."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "replay_ops"
# Installed as the subpackage replay_ops.triton_kernels (setup.py's package_dir).
KERNELS = ROOT / "triton_kernels"

# area -> the areas it must not import
_UP_FROM_CORE = {"router_replay", "distributed", "integrations", "testing", "demo"}
FORBIDDEN = {
    "core": _UP_FROM_CORE,
    "backends": _UP_FROM_CORE,
    "triton_kernels": _UP_FROM_CORE | {"backends"},
    "router_replay": {"backends", "distributed", "integrations", "testing", "demo"},
    "distributed": {"backends", "integrations", "testing", "demo"},
    "integrations": {"backends", "testing", "demo"},
    "testing": {"demo"},
}
AREAS = ("backends", "router_replay", "distributed", "integrations", "testing", "demo",
         "triton_kernels")
# Imports that run up on purpose, each with its reason (a deprecated alias keeps an old import
# path working for one release; it is removed with the alias).
ALLOWED = {
    ("replay_ops.distributed.hf", "replay_ops.integrations.hf.ep"):
        "deprecated alias of replay_ops.integrations.hf.ep, loaded on first use",
}


def _module(path: Path) -> list[str]:
    """The dotted module name of a file of the package or of triton_kernels/."""
    if path.is_relative_to(KERNELS):
        parts = ["replay_ops", "triton_kernels",
                 *path.relative_to(KERNELS).with_suffix("").parts]
    else:
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _area(dotted: str) -> str | None:
    parts = dotted.split(".")
    if parts[0] != "replay_ops":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in AREAS else "core"


def _module_strings(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level names bound to a string, or to a dict/tuple/list of strings."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if not isinstance(target, ast.Name):
            continue
        items = (value.values if isinstance(value, ast.Dict) else
                 value.elts if isinstance(value, (ast.Tuple, ast.List)) else [value])
        if items and all(isinstance(v, ast.Constant) and isinstance(v.value, str)
                         for v in items):
            found[target.id] = [v.value for v in items]
    return found


def _is_dynamic_import(call: ast.Call, aliases: set[str]) -> bool:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id == "__import__" or f.id in aliases
    return (isinstance(f, ast.Attribute) and f.attr == "import_module"
            and isinstance(f.value, ast.Name) and f.value.id == "importlib")


def _dynamic_targets(call: ast.Call, mod: list[str], here: list[str],
                     strings: dict[str, list[str]]) -> list[str] | None:
    """The modules a dynamic import can load, or None when the scan cannot read them."""
    if not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        names = [arg.value]
    elif isinstance(arg, ast.Name) and arg.id in strings:
        names = strings[arg.id]
    elif (isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name)
          and arg.value.id in strings):
        names = strings[arg.value.id]
    elif (isinstance(arg, ast.JoinedStr) and len(arg.values) >= 2
          and isinstance(arg.values[0], ast.FormattedValue)
          and isinstance(arg.values[0].value, ast.Name)
          and arg.values[0].value.id in ("__name__", "__package__")):
        # f"{__name__}.x": a module below this one (the same area)
        return [".".join(mod)]
    else:
        return None
    out = []
    for name in names:
        if name.startswith("."):  # relative to the package= argument, this package
            level = len(name) - len(name.lstrip("."))
            base = here[:len(here) - level + 1]
            name = ".".join(base + ([name.lstrip(".")] if name.lstrip(".") else []))
        out.append(name)
    return out


def imports_of(path: Path) -> set[str]:
    """The replay_ops modules (or names in them) that `path` imports, as dotted names; a
    dynamic import the scan cannot read is returned as "<unreadable dynamic import at line N>"."""
    mod = _module(path)
    here = mod if path.name == "__init__.py" else mod[:-1]
    tree = ast.parse(path.read_text(), str(path))
    strings = _module_strings(tree)
    aliases = {a.asname or a.name for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module == "importlib"
               for a in node.names if a.name == "import_module"}
    found, unreadable = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and _is_dynamic_import(node, aliases):
            targets = _dynamic_targets(node, mod, here, strings)
            if targets is None:
                unreadable.add(f"<unreadable dynamic import at line {node.lineno}>")
            else:
                found.update(targets)
    return {m for m in found if m.split(".")[0] == "replay_ops"} | unreadable


def _sources() -> list[Path]:
    return sorted(PKG.rglob("*.py")) + sorted(KERNELS.rglob("*.py"))


def violations() -> list[str]:
    bad = []
    for path in _sources():
        mod = ".".join(_module(path))
        if mod == "replay_ops.__main__":
            continue
        for target in sorted(imports_of(path)):
            rel = path.relative_to(ROOT)
            if target.startswith("<"):
                bad.append(f"{rel} ({_area(mod)}): {target[1:-1]}")
            elif _area(target) in FORBIDDEN.get(_area(mod), ()) and (mod, target) not in ALLOWED:
                bad.append(f"{rel} ({_area(mod)}) imports {target} ({_area(target)})")
    return bad


def test_no_import_runs_back_up():
    assert violations() == []


def _fake_tree(tmp_path, monkeypatch, files: dict[str, str]):
    """A package tree under tmp_path (paths relative to it), scanned instead of the real one."""
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    for pkg in ("replay_ops", "triton_kernels"):
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "PKG", tmp_path / "replay_ops")
    monkeypatch.setitem(globals(), "KERNELS", tmp_path / "triton_kernels")


def test_the_scan_sees_imports_inside_functions_and_relative_ones(tmp_path, monkeypatch):
    # the checker itself: a lazy relative import from router_replay into integrations is found
    _fake_tree(tmp_path, monkeypatch, {
        "replay_ops/router_replay/__init__.py": "",
        "replay_ops/router_replay/x.py":
            "def f():\n    from ..integrations.hf import patch_model\n    return patch_model\n"})
    assert violations() == ["replay_ops/router_replay/x.py (router_replay) imports "
                            "replay_ops.integrations.hf (integrations)",
                            "replay_ops/router_replay/x.py (router_replay) imports "
                            "replay_ops.integrations.hf.patch_model (integrations)"]


def test_the_scan_reads_triton_kernels_as_the_installed_subpackage(tmp_path, monkeypatch):
    _fake_tree(tmp_path, monkeypatch, {
        "triton_kernels/gate.py": "from replay_ops.router_replay import ModelShape\n"
                                  "from ..backends import select\nfrom ..plan import x\n"})
    assert violations() == [
        "triton_kernels/gate.py (triton_kernels) imports replay_ops.backends (backends)",
        "triton_kernels/gate.py (triton_kernels) imports replay_ops.backends.select (backends)",
        "triton_kernels/gate.py (triton_kernels) imports replay_ops.router_replay "
        "(router_replay)",
        "triton_kernels/gate.py (triton_kernels) imports replay_ops.router_replay.ModelShape "
        "(router_replay)"]


def test_the_scan_reads_dynamic_imports(tmp_path, monkeypatch):
    _fake_tree(tmp_path, monkeypatch, {
        "replay_ops/distributed/__init__.py": "",
        "replay_ops/distributed/a.py":
            "import importlib\n"
            "def f():\n    return importlib.import_module('replay_ops.integrations.hf.ep')\n",
        "replay_ops/distributed/b.py":
            "from importlib import import_module as im\nMODS = {'x': 'replay_ops.demo'}\n"
            "def f(k):\n    return im(MODS[k])\n",
        "replay_ops/distributed/c.py": "def f():\n    return __import__('replay_ops.testing')\n",
        "replay_ops/distributed/d.py":
            "import importlib\ndef f(n):\n    return importlib.import_module(n)\n",
        # a module below its own package, named from __name__: the same area, not a violation
        "replay_ops/distributed/e.py":
            "import importlib\ndef f(m):\n    return importlib.import_module(f'{__name__}.{m}')\n",
        "replay_ops/distributed/g.py":
            "import importlib\n"
            "def f():\n    return importlib.import_module('..integrations', __package__)\n"})
    assert violations() == [
        "replay_ops/distributed/a.py (distributed) imports replay_ops.integrations.hf.ep "
        "(integrations)",
        "replay_ops/distributed/b.py (distributed) imports replay_ops.demo (demo)",
        "replay_ops/distributed/c.py (distributed) imports replay_ops.testing (testing)",
        "replay_ops/distributed/d.py (distributed): unreadable dynamic import at line 3",
        "replay_ops/distributed/g.py (distributed) imports replay_ops.integrations "
        "(integrations)"]


def test_the_allowed_upward_imports_are_seen_and_still_exist():
    # each allowed exception is a real import the scan finds (else the entry is stale)
    for (mod, target), _why in ALLOWED.items():
        parts = mod.split(".")
        path = (KERNELS.joinpath(*parts[2:]) if parts[1] == "triton_kernels"
                else PKG.parent.joinpath(*parts))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        assert target in imports_of(path), (mod, target)
        assert _area(target) in FORBIDDEN[_area(mod)]


@pytest.mark.parametrize("path, level, module, want", [
    ("router_replay/adapters/vllm.py", 1, "batch", "replay_ops.router_replay.adapters.batch"),
    ("router_replay/adapters/vllm.py", 3, "_deprecated", "replay_ops._deprecated"),
    ("integrations/hf/__init__.py", 1, "patch", "replay_ops.integrations.hf.patch"),
    ("integrations/hf/__init__.py", 2, None, "replay_ops.integrations"),
])
def test_relative_imports_resolve(tmp_path, monkeypatch, path, level, module, want):
    dots = "." * level
    rel = f"replay_ops/{path}"
    _fake_tree(tmp_path, monkeypatch, {rel: f"from {dots}{module or ''} import name\n"
                                       if module else f"from {dots} import name\n"})
    assert want in imports_of(tmp_path / rel)
