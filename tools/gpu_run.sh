#!/usr/bin/env bash
# The GPU run, one command on a GPU machine (`make gpu-check` calls it), offline, within 8
# minutes of wall time:
#
#   tools/gpu_run.sh                    run it (from anywhere; it works in the repository root)
#   tools/gpu_run.sh --dry-run          on any machine: print every step's command and limit,
#                                       rehearse the build step with the local torch in a copy
#                                       of the tree (CPU kernels only where torch is a CPU
#                                       build; a build of the same inputs is reused) and the
#                                       test step's collection (the plan, the registry guards)
#   tools/gpu_run.sh --dry-run --no-build   the same, the build only resolved offline (pip
#                                       install --dry-run) and checked on the tree's library
#   tools/gpu_run.sh --steps test --resume last
#                                       a second run on the same machine: some steps only;
#                                       the tests that passed in the last run (or in FILE,
#                                       an earlier summary.json) are not run again, the rest
#                                       in the order of its durations
#
# What it uses: the machine's own python3 (PY), torch, Triton, nvcc and compute-sanitizer.
# Nothing is downloaded. The wheels in .whl/ (GPU_WHEELS; `make gpu-wheels` fills it on a
# machine with network: megatron-core with --no-deps, ninja, pytest, hypothesis, zstandard
# and their small dependencies, about 10 MiB, for Python 3.12) are installed offline, each
# only where the machine lacks that package, into build/gpu_check_site (put first on
# PYTHONPATH, its bin/ on PATH).
#
# Steps (tools/gpu_check.py), each under its own limit; the limits add up to 425 s, and with
# 30 s for the machine facts, the wheels and the probes, to the budget of 455 s
# (GPU_RUN_BUDGET_S less 25 s); `timeout` stops the whole run 5 s before GPU_RUN_BUDGET_S
# (480 s). A step that would start with less than 20 s left is recorded as not run:
#   build      150 s  REPLAY_OPS_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=<every core>
#                     python3 -m pip install --no-build-isolation --no-deps --no-index -v -e .
#                     then one native gate call on the GPU
#   test       150 s  pytest -m gpu -k 'not sanitizer' tests, 12 pytest-xdist workers
#                     (GPU_RUN_WORKERS; the GPU machines have 16 cores): the registry guards
#                     first (the step fails if a backend the registry names for CUDA runs
#                     no CUDA case), then one case per test, backend and dtype, then the
#                     rest, slowest last; a per-test log written as the tests run gives the
#                     counts even when the step is stopped at its limit; the tests that
#                     need two GPUs are reported as not runnable here
#   sanitizer   45 s  the compute-sanitizer subset: memcheck and racecheck of the native
#                     ops (tests/test_native.py), memcheck of the mixed chain
#   bench       40 s  bench/bench_all.py --device cuda --runs 1 (with its baselines; first the
#                     permute at 4096 tokens, top-8, 128 experts, H 7168 in bf16 against a copy
#                     of the same bytes, and the gate against softmax + topk: bench_cases.py)
#   hf          20 s  bench/bench_hf.py --device cuda --runs 1 (HF grouped GEMM vs R3)
#   megatron    20 s  bench/bench_megatron.py --device cuda --runs 1
# A failing or timed-out step is recorded and the next one runs.
#
# Output, under $OUT (default build/gpu_run; 8 files, 2 folders deep at most):
#   $OUT/summary.md, $OUT/summary.json, $OUT/logs/<step>.log (6 logs, each capped at 256 KiB)
# The summary is rewritten after every step and printed at the end, its steps table last;
# summary.json holds every test's outcome and duration.
# Exit status: 0 every step passed, 1 a step failed or timed out, 2 a step could not run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
OUT="${OUT:-build/gpu_run}"
WHEELS="${GPU_WHEELS:-.whl}"
BUDGET_S="${GPU_RUN_BUDGET_S:-480}"
ARCH="${GPU_RUN_ARCH:-9.0}"
WORKERS="${GPU_RUN_WORKERS:-12}"  # pytest-xdist workers of the test step: 16 cores less 4
DRY=()
MORE=()
while (( $# )); do
  case "$1" in
    --dry-run) DRY=(--dry-run) ;;
    --no-build) MORE+=(--rehearse-build resolve) ;;
    --steps) shift; while (( $# )) && [[ "$1" != --* ]]; do STEPS+=("$1"); shift; done; continue ;;
    --resume|--durations)
      [[ $# -ge 2 ]] || { echo "gpu_run: $1 needs a file (an earlier run's summary.json; --resume: or 'last')"; exit 2; }
      [[ "$1" == --resume ]] && MORE+=(--resume "$2") || MORE+=(--test-durations "$2"); shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_run: unknown argument '$1' (--dry-run, --no-build, --steps, --resume, --durations, --help)"; exit 2 ;;
  esac
  shift
done
if ! [[ "$BUDGET_S" =~ ^[0-9]+$ ]] || (( BUDGET_S < 60 )); then
  echo "gpu_run: GPU_RUN_BUDGET_S must be a number of seconds, 60 or more ('$BUDGET_S')"; exit 2
fi
mkdir -p "$OUT" || exit 2
SUBSET=$("$PY" -c "import sys; sys.path.insert(0, 'tools'); import gpu_check; print(gpu_check.SANITIZER_SUBSET)") || {
  echo "gpu_run: $PY cannot load tools/gpu_check.py"; exit 2; }
args=(tools/gpu_check.py --out "$OUT" --arch "$ARCH" --fresh --workers "$WORKERS"
      --budget $((BUDGET_S - 25)) --sanitizer-select "$SUBSET"
      --bench-args "--runs 1" --hf-args "--runs 1" --megatron-args "--runs 1")
[[ ${STEPS+set} ]] && args+=(--steps "${STEPS[@]}")
args+=("${MORE[@]}")
[[ -d "$WHEELS" ]] && args+=(--wheels "$WHEELS")
[[ -n "${GIT_SHA:-}" ]] && args+=(--git-sha "$GIT_SHA")
echo "gpu_run: $PY ${args[*]} ${DRY[*]}"
if (( ${#DRY[@]} )); then
  # the rehearsal's build runs on this (CPU) machine, without the GPU run's wall limit
  "$PY" "${args[@]}" "${DRY[@]}"
else
  timeout -k 5 $((BUDGET_S - 5)) "$PY" "${args[@]}"
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
