#!/usr/bin/env bash
# The GPU run, one command on a GPU machine (`make gpu-check` calls it), offline, within 8
# minutes of wall time:
#
#   tools/gpu_run.sh              run it (from anywhere; it works in the repository root)
#   tools/gpu_run.sh --dry-run    on any machine: print every step's command and rehearse
#                                 the build step with the local torch (CPU kernels only
#                                 where torch is a CPU build), in a copy of the tree
#
# What it uses: the machine's own python3 (PY), torch, Triton, nvcc and compute-sanitizer.
# Nothing is downloaded. The wheels in .whl/ (GPU_WHEELS; `make gpu-wheels` fills it on a
# machine with network: megatron-core with --no-deps, ninja, pytest, hypothesis, zstandard
# and their small dependencies, about 10 MiB, for Python 3.12) are installed offline, each
# only where the machine lacks that package, into build/gpu_check_site (put first on
# PYTHONPATH, its bin/ on PATH).
#
# Steps (tools/gpu_check.py), each under its own limit, all within GPU_RUN_BUDGET_S (480 s;
# a step that would start with less than 20 s left is recorded as not run):
#   build      150 s  REPLAY_OPS_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=<every core>
#                     python3 -m pip install --no-build-isolation --no-deps --no-index -v -e .
#                     then one native gate call on the GPU
#   test       150 s  pytest -m gpu -k 'not sanitizer' tests   (every gpu-marked test)
#   sanitizer   60 s  the compute-sanitizer subset: memcheck and racecheck of the native
#                     ops (tests/test_native.py), memcheck of the mixed chain
#   bench       45 s  bench/bench_all.py --device cuda --runs 1 (with its baselines)
#   hf          30 s  bench/bench_hf.py --device cuda --runs 1 (HF grouped GEMM vs R3)
#   megatron    30 s  bench/bench_megatron.py --device cuda --runs 1
# A failing or timed-out step is recorded and the next one runs.
#
# Output, under $OUT (default build/gpu_run; 8 files, 2 folders deep at most):
#   $OUT/summary.md, $OUT/summary.json, $OUT/logs/<step>.log (6 logs, each capped at 256 KiB)
# The summary is rewritten after every step and printed at the end, its steps table last.
# Exit status: 0 every step passed, 1 a step failed or timed out, 2 a step could not run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
OUT="${OUT:-build/gpu_run}"
WHEELS="${GPU_WHEELS:-.whl}"
BUDGET_S="${GPU_RUN_BUDGET_S:-480}"
ARCH="${GPU_RUN_ARCH:-9.0}"
DRY=()
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=(--dry-run) ;;
    -h|--help) sed -n '2,36p' "$0"; exit 0 ;;
    *) echo "gpu_run: unknown argument '$a' (--dry-run, --help)"; exit 2 ;;
  esac
done
if ! [[ "$BUDGET_S" =~ ^[0-9]+$ ]] || (( BUDGET_S < 60 )); then
  echo "gpu_run: GPU_RUN_BUDGET_S must be a number of seconds, 60 or more ('$BUDGET_S')"; exit 2
fi
mkdir -p "$OUT" || exit 2
SUBSET=$("$PY" -c "import sys; sys.path.insert(0, 'tools'); import gpu_check; print(gpu_check.SANITIZER_SUBSET)") || {
  echo "gpu_run: $PY cannot load tools/gpu_check.py"; exit 2; }
args=(tools/gpu_check.py --out "$OUT" --arch "$ARCH" --fresh --workers 0
      --budget $((BUDGET_S - 15)) --sanitizer-select "$SUBSET"
      --bench-args "--runs 1" --hf-args "--runs 1" --megatron-args "--runs 1")
[[ -d "$WHEELS" ]] && args+=(--wheels "$WHEELS")
[[ -n "${GIT_SHA:-}" ]] && args+=(--git-sha "$GIT_SHA")
echo "gpu_run: $PY ${args[*]} ${DRY[*]}"
if (( ${#DRY[@]} )); then
  # the rehearsal's build runs on this (CPU) machine, without the GPU run's wall limit
  "$PY" "${args[@]}" "${DRY[@]}"
else
  timeout -k 5 "$BUDGET_S" "$PY" "${args[@]}"
fi
rc=$?
if (( rc == 124 || rc == 137 )); then
  echo "gpu_run: stopped at the wall limit of ${BUDGET_S} s; the summary holds the steps done"
fi
if [[ -f "$OUT/summary.md" ]]; then
  echo; echo "===== $OUT/summary.md ====="
  cat "$OUT/summary.md"
  echo; echo "===== steps ====="
  sed -n '/^## Steps/,/^Commands/p' "$OUT/summary.md" | grep '^|'
fi
echo "gpu_run: exit status $rc; files under $OUT:"
find "$OUT" -type f | sort
exit $rc
