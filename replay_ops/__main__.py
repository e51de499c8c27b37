"""Command line: `python -m replay_ops demo [flags]` (see `python -m replay_ops demo --help`),
`python -m replay_ops backends` (which implementation serves each device),
`python -m replay_ops files info|verify FILE ...` (record files) and
`python -m replay_ops --version`."""
from __future__ import annotations

import json
import sys

USAGE = """usage: python -m replay_ops <command> [flags]

commands:
  demo      router replay end to end on a small MoE model (CPU, about a minute)
  backends  which replay_ops implementation serves each device
  files     record files: `files info FILE ...` (metadata, checksum verified) and
            `files verify FILE ...` (exit status 1 on a bad file); the same as
            `python -m replay_ops.router_replay`
  --version the package's version, its native library's torch, and the torch in use

more:
  python -m replay_ops.demo.vllm_engine install [VENV]    vLLM for `demo --engine vllm` (CPU)
  python -m replay_ops.demo.sglang_engine install [VENV]  SGLang for `demo --engine sglang` (CPU)
"""


def version_text() -> str:
    """`replay_ops 0.1.0` and, where they exist, the installed distribution's version (its
    local label names the torch a compiled copy is built for), the native library's torch,
    and the torch, Triton and Python in use."""
    import platform
    from importlib import metadata

    from . import __version__

    parts = [f"replay_ops {__version__}"]
    try:
        dist = metadata.version("replay_ops")
        if dist != __version__:
            parts.append(f"(installed as {dist})")
    except metadata.PackageNotFoundError:
        parts.append("(not installed: run from a source tree)")
    lines = [" ".join(parts)]
    try:
        from ._build_info import BUILD

        lines.append(f"native library: built for torch {BUILD['torch']}"
                     + (f", CUDA {BUILD['torch_cuda']}" if BUILD.get("torch_cuda") else
                        ", CPU kernels only"))
    except ImportError:
        lines.append("native library: not built (the Triton and torch backends serve the ops)")
    import torch

    line = f"torch {torch.__version__}"
    try:
        line += f", triton {metadata.version('triton')}"
    except metadata.PackageNotFoundError:
        pass
    lines.append(f"{line}, Python {platform.python_version()}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in ("--version", "-V", "version"):
        print(version_text(), end="")
        return 0
    if cmd == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if cmd == "backends":
        import replay_ops

        print(json.dumps(replay_ops.backends(), indent=2, default=str))
        return 0
    if cmd == "files":
        from .router_replay.__main__ import main as files_main

        return files_main(rest)
    print(f"python -m replay_ops: unknown command {cmd!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
