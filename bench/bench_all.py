"""All benchmarks at the shapes of the speed targets (`make bench` runs this).

    python bench/bench_all.py                 # the device present: CUDA if any, else CPU
    python bench/bench_all.py --device cpu --runs 5 --out cpu_2core

CPU targets: gate plus plan at T=16384, E=128, K=8 (native vs the vectorised eager PyTorch
backend, >= 3x), and permute plus unpermute at H=1024 (native vs the same, >= 2x).
GPU targets: gate plus plan at T=16k..128k, E=64..256, K=2..8 (native vs the eager replay
path, >= 10x), and permute / unpermute at H=4096 and 7168 in bf16 (>= 80% of the copy
bandwidth measured in the same run). On CUDA, bench_cases.py runs first: the permute at
4096 tokens, top-8 of 128 experts, H=7168 in bf16 against a copy of the same bytes, and the
gate at (16384, 128, 8) and (8192, 256, 8) against softmax + topk.
Results go to bench/results/<out>.json and .md (default stem: <device>_<UTC date>),
rewritten after each benchmark, so a run stopped at a time limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cases  # noqa: E402
import bench_gate  # noqa: E402
import bench_permute  # noqa: E402
import harness  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=0, help="0: 20 on CUDA, 10 on CPU")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="one small shape each (smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    cuda = dev.startswith("cuda")
    reps = args.reps or (20 if cuda else 10)
    copy_bw = harness.copy_bandwidth(dev)
    common = ["--device", dev, "--runs", str(args.runs), "--reps", str(reps)]
    gate_runs, perm_runs = [], []
    if args.quick:
        gate_runs.append(["--T", "2048", "--E", "64", "--K", "8", "--modes", "fwd"])
        perm_runs.append(["--T", "256", "--H", "256", "--modes", "fwd", "--dtypes", "float32"])
    elif cuda:
        for E in (64, 128, 256):
            for K in (2, 8):
                gate_runs.append(["--T", "16384", "65536", "131072", "--E", str(E), "--K", str(K),
                                  "--dtype", "bfloat16", "--modes", "fwd"])
        gate_runs.append(["--T", "65536", "--E", "128", "--K", "8", "--dtype", "bfloat16",
                          "--modes", "bwd", "full"])
        perm_runs.append(["--T", "16384", "--E", "128", "--K", "8", "--H", "4096", "7168",
                          "--dtypes", "bfloat16"])
    else:
        for sf, norm in (("softmax", 1), ("softmax", 0), ("sigmoid", 1)):
            gate_runs.append(["--T", "16384", "--E", "128", "--K", "8", "--score-func", sf,
                              "--normalize", str(norm), "--modes", "fwd"])
        gate_runs.append(["--T", "16384", "--E", "128", "--K", "8", "--validate", "1",
                          "--modes", "fwd"])
        gate_runs.append(["--T", "16384", "--E", "128", "--K", "8", "--modes", "bwd", "full"])
        perm_runs.append(["--T", "2048", "--E", "64", "--K", "8", "--H", "1024",
                          "--dtypes", "float32", "bfloat16"])
    case_runs = [[]] if cuda and not args.quick else []
    rows, summary = [], []
    stem = args.out or f"{'cuda' if cuda else 'cpu'}_{_dt.datetime.now(_dt.timezone.utc):%Y%m%d_%H%M}"
    cols = ["op", "mode", "provider", "T", "E", "K", "H", "dtype", "score_func", "normalize",
            "validate", "flagged", "ms_median", "ms_p20", "ms_p80", "speedup_vs_torch",
            "speedup_vs_softmax_topk", "gbps", "frac_of_copy_bw"]
    for bench, runs in ((bench_cases, case_runs), (bench_gate, gate_runs),
                        (bench_permute, perm_runs)):
        for extra in runs:
            a = bench.parser().parse_args(common + extra)
            a.copy_bw = copy_bw
            r, s = bench.run(a)
            rows += r
            summary += s
            env = dict(a.env, command=" ".join(["python"] + sys.argv))
            print("\n".join(s), flush=True)
            paths = harness.save(rows, summary, stem, env, copy_bw, cols)  # after each
    print("wrote", *paths)


if __name__ == "__main__":
    main()
