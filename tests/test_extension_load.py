"""A native library that cannot be used is refused with its reason, never a crash or a
silent slow path (replay_ops/_extension.py).

Each test puts a copy of the installed package (Python files only) in a temporary folder,
drops a library in as `replay_ops/_C<suffix>`, and runs a fresh interpreter on it:

* a library built for another torch release: the real one when REPLAY_OPS_FOREIGN_LIB names
  it (the CUDA build job of `make test` builds the extension under torch 2.14.1 and loads it
  here under 2.13.0, and the other way round); with REPLAY_OPS_REQUIRE_FOREIGN_LIB=1 its
  absence fails the test;
* a `_build_info.py` naming another torch: refused before the library is loaded;
* libraries made here with the C compiler whose load fails as a foreign build's does (a
  symbol the running torch lacks) or as a machine without the CUDA runtime does (a missing
  `lib*.so`).

In every case `backend="native"` raises with the reason, and automatic selection warns once
with it and names the backend that runs instead; the results stay the reference's.
"""
from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import replay_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]

PROBE = textwrap.dedent(
    """
    import json, warnings
    import torch, replay_ops
    from replay_ops import reference as ref
    logits = torch.randn(6, 5, dtype=torch.float64)
    idx = torch.tensor([[0, 1], [2, -1], [4, 3], [-1, -1], [3, 0], [1, 2]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plans = [replay_ops.gate(logits, idx) for _ in range(3)]
    want = ref.gate(logits, idx)
    same = all(torch.allclose(p.weights, want.weights, rtol=1e-12, atol=1e-12) and
               all(a is b is None or torch.equal(a, b) for a, b in zip(p[1:], want[1:]))
               for p in plans)
    runs = replay_ops.backends(op="gate_fwd", device="cpu", shape=(6, 5, 2))["call"]["runs"]
    try:
        replay_ops.gate(logits, idx, backend="native")
        forced = None
    except RuntimeError as e:
        forced = str(e)
    print(json.dumps({"runs": runs, "same": same, "forced": forced,
                      "warnings": [str(w.message) for w in caught
                                   if issubclass(w.category, RuntimeWarning)]}))
    """
)


def _package_copy(dest):
    """The installed package's Python files (and Triton kernels) without any library."""
    src = os.path.dirname(os.path.abspath(replay_ops.__file__))
    pkg = os.path.join(dest, "replay_ops")
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns(
        "*.so", "_build_info.py", "__pycache__"))
    if not os.path.exists(os.path.join(pkg, "triton_kernels")):  # a source tree
        shutil.copytree(os.path.join(ROOT, "triton_kernels"), os.path.join(pkg, "triton_kernels"),
                        ignore=shutil.ignore_patterns("__pycache__"))
    return pkg


def _run(tmp_path, library=None, build_info=None):
    pkg = _package_copy(str(tmp_path))
    if library is not None:
        shutil.copy(library, os.path.join(pkg, "_C" + SUFFIX))
    if build_info is not None:
        with open(os.path.join(pkg, "_build_info.py"), "w") as f:
            f.write(f"BUILD = {build_info!r}\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TRITON_INTERPRET="1")
    env.pop("REPLAY_OPS_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=300, cwd=str(tmp_path), env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_refused(res, *needles):
    assert res["runs"] == "torch", res
    assert res["same"], res
    assert res["forced"] is not None and "native" in res["forced"], res
    for needle in needles:
        assert needle in res["forced"], (needle, res["forced"])
    # warned once (three calls), naming the reason and the backend used instead
    assert len(res["warnings"]) == 1, res["warnings"]
    warning = res["warnings"][0]
    assert "using the torch backend instead" in warning, warning
    for needle in needles:
        assert needle in warning, (needle, warning)


def _cc():
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler (cc/gcc) to build the test libraries with")
    return cc


def _shared_library(tmp_path, name, source, libs=()):
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / f"{name}.so"
    cmd = [_cc(), "-shared", "-fPIC", "-o", str(out), str(src), f"-L{tmp_path}", *libs]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return str(out)


def _marker(torch_version, cuda):
    return f'const char replay_build_marker[] = "replay_ops build: torch={torch_version};' \
           f'cuda={cuda};cxx=20;";\n'


def test_recorded_build_for_another_torch_is_refused_before_loading(tmp_path):
    """_build_info.py names another release: the library is never loaded (a file that is not
    a library at all proves it), and the message names both torch versions."""
    bogus = tmp_path / "not_a_library.so"
    bogus.write_bytes(b"not an ELF file")
    other = "2.99.0+cu999"
    res = _run(tmp_path / "pkg", library=str(bogus),
               build_info={"torch": other, "torch_cuda": "99.9", "with_cuda": True,
                           "cxx_standard": 20, "cuda_arch_list": "9.0"})
    _check_refused(res, "torch 2.99.0+cu999 (CUDA 99.9)", f"torch {torch.__version__}",
                   "was not loaded")


def test_recorded_build_for_this_torch_with_another_cuda_is_refused(tmp_path):
    bogus = tmp_path / "not_a_library.so"
    bogus.write_bytes(b"not an ELF file")
    cuda = "12.1" if torch.version.cuda != "12.1" else "13.0"
    res = _run(tmp_path / "pkg", library=str(bogus),
               build_info={"torch": torch.__version__, "torch_cuda": cuda, "with_cuda": True,
                           "cxx_standard": 20, "cuda_arch_list": "9.0"})
    _check_refused(res, f"(CUDA {cuda})", f"torch {torch.__version__}")


def test_undefined_symbol_names_both_torch_versions(tmp_path):
    """A library that needs a symbol the running torch lacks, as one built against another
    release does: the loader's error, both versions (read from the library's build string),
    and the remedy."""
    lib = _shared_library(tmp_path, "foreign", _marker("2.98.1+cu130", "13.0") + textwrap.dedent(
        """
        extern void _ZN3c1022replay_ops_not_in_torchEv(void);
        void PyInit__C(void) { _ZN3c1022replay_ops_not_in_torchEv(); }
        """))
    res = _run(tmp_path / "pkg", library=lib)
    _check_refused(res, "torch 2.98.1+cu130 (CUDA 13.0)", f"torch {torch.__version__}",
                   "_ZN3c1022replay_ops_not_in_torchEv", "rebuild")


def test_missing_shared_library_is_named(tmp_path):
    """A library whose CUDA runtime dependency is absent: the message names the file."""
    dep = _shared_library(tmp_path, "libcudart_replaytest", "int replay_dep(void){return 1;}\n")
    lib = _shared_library(
        tmp_path, "needs_dep", _marker(torch.__version__, "13.0") +
        "extern int replay_dep(void);\nint PyInit__C(void) { return replay_dep(); }\n",
        libs=["-l:libcudart_replaytest.so"])
    os.remove(dep)
    res = _run(tmp_path / "pkg", library=lib)
    _check_refused(res, "libcudart_replaytest.so", "CUDA runtime library",
                   f"torch {torch.__version__}")


def test_absent_library_is_quiet(tmp_path):
    """No library at all (REPLAY_OPS_NATIVE=0) is a choice: the torch backend runs, nothing is
    warned, and forcing native says it was not built."""
    res = _run(tmp_path / "pkg")
    assert res["runs"] == "torch" and res["same"] and res["warnings"] == [], res
    assert "was not built" in res["forced"], res


def test_foreign_torch_build_is_refused(tmp_path):
    """The real thing: an extension compiled against another torch release (set by `make
    test`'s CUDA build job), loaded under this one, with and without its _build_info.py."""
    lib = os.environ.get("REPLAY_OPS_FOREIGN_LIB")
    if not lib:
        if os.environ.get("REPLAY_OPS_REQUIRE_FOREIGN_LIB") == "1":
            pytest.fail("REPLAY_OPS_REQUIRE_FOREIGN_LIB=1 but REPLAY_OPS_FOREIGN_LIB is unset")
        pytest.skip("REPLAY_OPS_FOREIGN_LIB (a replay_ops._C built under another torch) is unset")
    info_path = os.path.join(os.path.dirname(lib), "_build_info.py")
    with open(info_path) as f:
        ns: dict = {}
        exec(f.read(), ns)
    built = ns["BUILD"]
    assert built["torch"].split("+")[0] != torch.__version__.split("+")[0], \
        (built, torch.__version__)
    want_built = f"torch {built['torch']}"
    # refused before loading, from the build record
    res = _run(tmp_path / "with_info", library=lib, build_info=built)
    _check_refused(res, want_built, f"torch {torch.__version__}", "was not loaded")
    # without the record: the loader's own failure (or the library's BUILD_INFO) is explained
    res = _run(tmp_path / "without_info", library=lib)
    _check_refused(res, want_built, f"torch {torch.__version__}")
