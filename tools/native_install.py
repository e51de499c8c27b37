#!/usr/bin/env python3
"""`pip install --no-build-isolation -e .` of this checkout (`make install`, `make demo`),
done only when something it depends on changed, and with its progress shown.

    python3 tools/native_install.py          # install or say it is up to date
    python3 tools/native_install.py --force  # install anyway

The editable install compiles the native library (four C++ files against the installed
torch, a few minutes on two cores). It is redone only when its stamp,
build/native-install.stamp, does not match a hash of what the build reads: every file of
csrc/, setup.py, CMakeLists.txt and pyproject.toml, the torch release (and its CUDA
version), the Python version, and the build's environment settings (REPLAY_OPS_NATIVE,
REPLAY_OPS_CUDA, REPLAY_OPS_DEBUG, TORCH_CUDA_ARCH_LIST, CXX, CC, CFLAGS, CXXFLAGS). The
stamp also has to describe what is installed: this Python imports replay_ops from this
checkout, and the library's recorded torch (replay_ops/_build_info.py) is the one in use.

While it builds, the compiler's progress lines (`[n/4] ...`) and the setup script's own
lines are printed as they come, with the elapsed time; on a failure, the end of the log
(build/native-install.log).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAMP = ROOT / "build" / "native-install.stamp"
LOG = ROOT / "build" / "native-install.log"
ENV_KEYS = ("REPLAY_OPS_NATIVE", "REPLAY_OPS_CUDA", "REPLAY_OPS_DEBUG", "TORCH_CUDA_ARCH_LIST",
            "CXX", "CC", "CFLAGS", "CXXFLAGS")
SHOWN = re.compile(r"^\s*(\[\d+/\d+\]|replay_ops:|setup\.py:|error|Error|ERROR|Successfully)")


def _torch() -> tuple[str, str]:
    import torch

    return torch.__version__, str(torch.version.cuda)


def key() -> str:
    h = hashlib.sha256()
    files = sorted(p for p in (ROOT / "csrc").rglob("*") if p.is_file())
    files += [ROOT / "setup.py", ROOT / "CMakeLists.txt", ROOT / "pyproject.toml"]
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode() + b"\0")
        h.update(p.read_bytes() if p.exists() else b"<missing>")
    h.update(repr((_torch(), sys.version, sys.executable,
                   [(k, os.environ.get(k)) for k in ENV_KEYS])).encode())
    return h.hexdigest()[:24]


def installed_here() -> str | None:
    """None when this Python imports replay_ops from this checkout with a library built for
    the torch in use (or no library, when REPLAY_OPS_NATIVE=0 asks for none); else why not."""
    code = ("import importlib.util, json, os, sys; "
            "s = importlib.util.find_spec('replay_ops'); "
            "print(json.dumps(None if s is None else list(s.submodule_search_locations)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/")  # not the checkout: the installed package, not the folder
    locs = out.stdout.strip()
    if out.returncode != 0 or locs in ("", "null"):
        return "replay_ops is not installed in this Python"
    if str(ROOT / "replay_ops") not in locs:
        return f"this Python's replay_ops is another copy ({locs})"
    if os.environ.get("REPLAY_OPS_NATIVE", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    if not list((ROOT / "replay_ops").glob("_C*.so")):
        return "no native library in replay_ops/"
    info = ROOT / "replay_ops" / "_build_info.py"
    if not info.exists():
        return "replay_ops/_build_info.py is missing"
    built = re.search(r"'torch': '([^']+)'", info.read_text())
    if not built or built.group(1) != _torch()[0]:
        return (f"the library was built for torch {built.group(1) if built else '?'}, "
                f"this is {_torch()[0]}")
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="install even when up to date")
    args = ap.parse_args(argv)
    k = key()
    why = "--force" if args.force else installed_here()
    if why is None and STAMP.exists() and STAMP.read_text().strip() == k:
        print(f"native: up to date (torch {_torch()[0]}; sources unchanged since the last "
              f"build, stamp {k[:12]}; `make install-force` rebuilds)")
        return 0
    if why is None:
        why = ("csrc/, setup.py, CMakeLists.txt, pyproject.toml, torch or the build settings "
               "changed" if STAMP.exists() else "no build stamp yet")
    native = os.environ.get("REPLAY_OPS_NATIVE", "").strip().lower() not in (
        "0", "false", "no", "off")
    print(f"native: installing replay_ops (pip install --no-build-isolation -e .) because "
          f"{why}; " + (f"compiling the C++ library against torch {_torch()[0]}: about 2-5 "
                        "minutes on 2 cores, progress below" if native else
                        "REPLAY_OPS_NATIVE=0: no library"), flush=True)
    LOG.parent.mkdir(parents=True, exist_ok=True)
    STAMP.unlink(missing_ok=True)
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-v",
           "--no-build-isolation", "-e", str(ROOT)]
    with open(LOG, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        for line in proc.stdout:
            log.write(line)
            if SHOWN.match(line):
                text = line.strip()
                if text.startswith("["):  # a ninja step: its command is long
                    text = re.sub(r"(\[\d+/\d+\]).*?(\S+\.(?:cpp|cu|o|so))\b.*", r"\1 \2", text)
                print(f"  [{time.monotonic() - t0:4.0f} s] {text[:160]}", flush=True)
        rc = proc.wait()
    if rc != 0:
        tail = LOG.read_text().splitlines()[-40:]
        print("\n".join(tail))
        print(f"native: the install failed after {time.monotonic() - t0:.0f} s (exit status "
              f"{rc}; the whole log: {LOG.relative_to(ROOT)})")
        return rc
    why_not = installed_here()
    if why_not is not None:
        print(f"native: installed, but {why_not}")
        return 1
    STAMP.write_text(k + "\n")
    print(f"native: done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
