"""Inspect or verify record files:

    python -m replay_ops.router_replay info FILE [FILE ...]     # metadata, file verified
    python -m replay_ops.router_replay verify FILE [FILE ...]   # exit status 1 on a bad file

Both commands read each file whole and check it as a replay would use it: the header and
data checksums, the layout, every token decoded (a codec file's chunks with their content
checksums) and every route checked (expert ids in range, no expert twice in a token's
layer). A file that fails any of these is reported as `BAD` with the package's error on
stderr, and the exit status is 1.
"""
from __future__ import annotations

import argparse
import json
import sys

from .files import RoutingFileError, open_routing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m replay_ops.router_replay",
                                 description="Inspect router replay record files.")
    ap.add_argument("command", choices=("info", "verify"))
    ap.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    status = 0
    for path in args.files:
        try:
            rf = open_routing(path, verify=True)
            rf.check_routes()
            if args.command == "verify":
                print(f"OK   {path}")
                continue
            m = rf.meta
            report = {
                "file": path,
                "num_tokens": rf.num_tokens,
                "num_sequences": rf.num_sequences,
                "num_experts": m.num_experts,
                "top_k": m.top_k,
                "layer_index": m.layer_index,
                "num_layers": m.num_layers,
                "moe_layer_ids": m.moe_layer_ids,
                "num_hidden_layers": m.num_hidden_layers,
                "model_name": m.model_name,
                "dtype": str(rf.dtype),
                "routed_tokens": int(rf.replay_mask().sum()),
                "checksum": rf.metadata["checksum"],
            }
        except (RoutingFileError, OSError) as e:  # FileNotFoundError, a permission...
            print(f"BAD  {e}", file=sys.stderr)
            status = 1
            continue
        print(json.dumps(report, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
