"""Loading the native extension `replay_ops._C`, and saying why when it cannot be used.

A compiled torch extension runs only with the torch release it was built against (C++
ABI, dispatcher, CUDA runtime). The build records that torch twice: in
`replay_ops/_build_info.py` (written by setup.py and CMake) and as a string inside the
library (`_C.BUILD_INFO`, "replay_ops build: torch=...;cuda=...;cxx=...;").

`load()` returns the module, or raises:

* `ModuleNotFoundError` when no library was built (REPLAY_OPS_NATIVE=0): a choice, not a
  fault; the package runs on its other backends and says nothing.
* `NativeLoadError` (an ImportError) when a library is there but cannot be used. Its
  message names the torch the library was built for and the torch that is running, or the
  shared library the loader could not find, and how to fix it. The cases:
  - `_build_info.py` names another torch release or CUDA version than the running one:
    refused *before* the library is loaded (its static initialisers would run against
    another torch's ABI);
  - the loader fails (an undefined symbol: built for another torch; a missing
    `lib*.so`: CUDA libraries absent);
  - the library loads but its own `BUILD_INFO` names another torch.

`backend="native"` then raises with that message, and automatic backend selection warns
once with it and names the backend it uses instead (replay_ops/backends/__init__.py).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import os
import re

import torch

MODULE = "replay_ops._C"
_MARKER = re.compile(rb"replay_ops build: torch=([^;\x00]*);cuda=([^;\x00]*);cxx=([^;\x00]*);")


class NativeLoadError(ImportError):
    """replay_ops._C is present but cannot be used with the running torch (see message)."""


def running_torch() -> str:
    cuda = torch.version.cuda
    return f"torch {torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU build'})"


def _built_torch(version: str, cuda: str | None) -> str:
    return f"torch {version} ({'CUDA ' + cuda if cuda and cuda != 'none' else 'CPU build'})"


def _public(version: str) -> str:
    return version.split("+")[0]


def _same_torch(version: str, cuda: str | None) -> bool:
    """The library's torch is the running one: the same release and the same CUDA version
    (none for a CPU build). The local label beyond that (+cpu, +cu130) is not compared,
    since one release's CUDA wheel reports "2.14.1" on one index and "2.14.1+cu130" on
    another."""
    cuda = None if cuda in (None, "", "none") else cuda
    return _public(version) == _public(torch.__version__) and cuda == torch.version.cuda


def library_path() -> str | None:
    """The file `import replay_ops._C` loads (the library beside this module; every build
    route puts it there), or None when there is none."""
    pkg_dir = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(pkg_dir, "_C" + suffix)
        if os.path.exists(path):
            return path
    return None


def recorded_build() -> dict | None:
    """What `replay_ops/_build_info.py` says of the build, or None when it is absent."""
    try:
        mod = importlib.import_module("replay_ops._build_info")
    except ImportError:
        return None
    return dict(getattr(mod, "BUILD", {})) or None


def library_build(path: str) -> tuple[str, str, str] | None:
    """(torch, cuda, C++ standard) read from the library file's own build string (no load),
    or None when the file carries none (a build older than the string)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    m = _MARKER.search(data)
    return tuple(x.decode("utf-8", "replace") for x in m.groups()) if m else None


def _rebuild_hint() -> str:
    return ("rebuild it against the running torch (`pip install --no-build-isolation -e .` in "
            "a source tree, or `pip install --no-build-isolation .`), or install the wheel "
            f"built for torch {_public(torch.__version__)}")


def explain_load_error(path: str, err: BaseException) -> str:
    """A message for a failed load of `path`: what the loader said, which torch the library
    was built for, which torch runs, and the remedy."""
    text = str(err)
    built = library_build(path)
    if built is None:
        rec = recorded_build()
        built = (rec["torch"], rec.get("torch_cuda") or "none", str(rec.get("cxx_standard"))) \
            if rec else None
    built_s = (f"built against {_built_torch(built[0], built[1])}" if built
               else "built against an unrecorded torch (no build string in the library)")
    missing = re.search(r"(lib[\w.+-]*\.so[\w.]*): cannot open shared object file", text)
    undefined = re.search(r"undefined symbol: (\S+)", text)
    if missing:
        lib = missing.group(1)
        what = f"the shared library {lib} it needs was not found"
        if lib.startswith(("libc10", "libtorch")):
            what += (" (a library of the torch it was built against, which the running torch "
                     f"does not have: {_rebuild_hint()})")
        elif re.match(r"lib(cuda|cudart|nvrtc|cublas|cusparse|cufft|curand|nvJitLink)", lib):
            what += (" (a CUDA runtime library: install the CUDA build of torch the library "
                     "was built for, which brings it, or put the CUDA toolkit's lib64 on "
                     "LD_LIBRARY_PATH)")
        return (f"replay_ops._C ({path}) cannot be loaded: {what}. It was {built_s}; the running "
                f"one is {running_torch()}. Loader: {text}")
    if undefined:
        return (f"replay_ops._C ({path}) was {built_s} but {running_torch()} is running: the "
                f"library needs the symbol {undefined.group(1)}, which this torch does not "
                f"provide. An extension runs only with the torch it was built against: "
                f"{_rebuild_hint()}.")
    return (f"replay_ops._C ({path}) cannot be loaded under {running_torch()}; it was {built_s}. "
            f"Loader: {type(err).__name__}: {text}. If the torch differs: {_rebuild_hint()}.")


def load():
    """Import replay_ops._C after checking it was built for the running torch (see the module
    docstring for what is raised)."""
    path = library_path()
    if path is None:
        raise ModuleNotFoundError(
            "replay_ops._C was not built (REPLAY_OPS_NATIVE=0, or an install without a "
            "compiler); the package runs on its Triton and PyTorch backends", name=MODULE)
    rec = recorded_build()
    if rec is not None and not _same_torch(rec["torch"], rec.get("torch_cuda")):
        raise NativeLoadError(
            f"replay_ops._C ({path}) was built against "
            f"{_built_torch(rec['torch'], rec.get('torch_cuda'))} but {running_torch()} is "
            f"running (replay_ops/_build_info.py); it was not loaded, since an extension runs "
            f"only with the torch it was built against: {_rebuild_hint()}.", name=MODULE)
    try:
        mod = importlib.import_module(MODULE)
    except ImportError as e:
        if isinstance(e, NativeLoadError):
            raise
        raise NativeLoadError(explain_load_error(path, e), name=MODULE) from e
    except OSError as e:
        raise NativeLoadError(explain_load_error(path, e), name=MODULE) from e
    m = _MARKER.search(getattr(mod, "BUILD_INFO", "").encode())
    if m is not None:
        built_torch, built_cuda = m.group(1).decode(), m.group(2).decode()
        if not _same_torch(built_torch, built_cuda):
            raise NativeLoadError(
                f"replay_ops._C ({path}) was built against {_built_torch(built_torch, built_cuda)}"
                f" but {running_torch()} is running (the library's BUILD_INFO): "
                f"{_rebuild_hint()}.", name=MODULE)
    return mod

