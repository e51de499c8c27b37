"""Command line: `python -m replay_ops demo [flags]` (see `python -m replay_ops demo --help`)
and `python -m replay_ops backends` (which implementation serves each device)."""
from __future__ import annotations

import json
import sys

USAGE = """usage: python -m replay_ops <command> [flags]

commands:
  demo      router replay end to end on a small MoE model (CPU, about a minute)
  backends  which replay_ops implementation serves each device
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if cmd == "backends":
        import replay_ops

        print(json.dumps(replay_ops.backends(), indent=2, default=str))
        return 0
    print(f"python -m replay_ops: unknown command {cmd!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
