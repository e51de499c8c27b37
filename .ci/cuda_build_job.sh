#!/usr/bin/env bash
# The CUDA build job of `make test`: what a GPU user's `pip install` does, on a machine
# without a GPU. `make test` runs it for both ends of the supported torch range (the
# Makefile's CUDA_JOB=ceiling and CUDA_JOB=floor): the ceiling, torch 2.15.0 (a CUDA 13.2
# build) in build/cuda-job/, and the floor, torch 2.11.0 (CUDA 13.0, the GPU machines'
# torch) in build/cuda-job-2.11/ (CUDA_JOB_DIR), each for the architectures of
# CUDA_JOB_ARCHS.
#
#   1. a venv under $CUDA_JOB_DIR with $CUDA_TORCH and the build tools;
#   2. a wheel of a copy of the tree (`pip wheel --no-build-isolation --no-deps .`) with
#      REPLAY_OPS_CUDA=1 and TORCH_CUDA_ARCH_LIST=$CUDA_JOB_ARCHS, the toolkit found by
#      setup.py itself (CUDA_HOME unset), compiler warnings (g++, nvcc and cudafe, and the
#      host side of the .cu files with -Wall -Wextra) and any register spill that ptxas
#      reports (-warn-spills) failing the job: the checks of `make check-cuda`, on the
#      real build, so that `make test` compiles each architecture once;
#   3. the wheel installed into that venv (which never held replay_ops otherwise) with
#      --no-index, so its pinned requirements are checked against the venv;
#   4. tools/check_native_build.py: every native op has a CPU and a CUDA kernel, the library
#      loads with every symbol bound (LD_BIND_NOW), holds code for each architecture,
#      carries no debug info, and the wheel pins the torch it was built for;
#   5. the ops' suite under that torch, run against the installed wheel (not the tree):
#      the cases that load the native library (parity with the reference, gradcheck,
#      determinism, registration, opcheck and torch.compile under that torch) and the
#      refusal of the project's own library (CUDA_JOB_TESTS, CUDA_JOB_K; the other cases of
#      those files run in the main suite);
#   6. the refusals: this build's library loaded under the project's torch (another
#      release), the project's library loaded under this torch, and the wheel offered to
#      pip beside the project's torch.
# Every step is timed. A failure is a failure; nothing here skips.
#
#   .ci/cuda_build_job.sh          all steps
#   .ci/cuda_build_job.sh venv     step 1 (downloads and unpacking: no compiling)
#   .ci/cuda_build_job.sh build    steps 2-3 (1 when the venv is missing)
#   .ci/cuda_build_job.sh check    steps 4-6, on the wheel of `build`
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY="${PY:-python3}"
CUDA_TORCH="${CUDA_TORCH:-torch==2.15.0}"
ARCHS="${CUDA_JOB_ARCHS:-8.0;9.0}"
# A venv (under build/) whose torch's CUDA runtime libraries this job's torch takes
# instead of its own pins (the floor job takes the ceiling job's: the same CUDA 13 sonames,
# newer minor releases, already downloaded).
LIBS_FROM="${CUDA_JOB_LIBS_FROM:-}"
LIBS_FROM="${LIBS_FROM%/}"
JOB="${CUDA_JOB_DIR:-build/cuda-job}"
JOB="${JOB%/}"
case "$JOB" in build/*) ;; *) echo "cuda-job: CUDA_JOB_DIR must be a folder under build/ ($JOB)"; exit 2;; esac
VENV=$JOB/venv
VPY=$ROOT/$VENV/bin/python
# The CPU suite's part that runs the ops and the replay system on the installed wheel:
# every backend's parity with the reference, gradcheck, determinism, registration and
# torch.compile, validation, routing dtypes, record files. (The clients' and integrations'
# tests need transformers, megatron-core and verl, and no second torch: the main suite runs
# them.) CUDA_JOB_TESTS overrides the list.
SUITE=${CUDA_JOB_TESTS:-"tests/test_extension_load.py tests/test_native.py tests/test_backends.py \
tests/test_ops_registration.py tests/test_gate.py tests/test_gate_dense.py tests/test_permute.py \
tests/test_unpermute.py tests/test_reference.py tests/test_determinism.py tests/test_validation.py \
tests/test_direct_calls.py tests/test_routing_dtypes.py tests/test_scores.py \
tests/test_device_math.py tests/test_router_replay.py tests/test_replay_files.py \
tests/test_codec.py"}
# Of those files, what this build adds to the main suite: the cases that load and run the
# native library (every `[...-native...]` case and tests/test_native.py: parity with the
# reference, gradcheck, determinism, opcheck and torch.compile through the custom ops, under
# this torch) and the foreign library's refusal. The torch backend's and the Triton
# interpreter's cases, and the Python-only files, do not depend on the library: the main
# suite runs them. CUDA_JOB_K is the -k expression (empty: every case of the files).
K_EXPR="${CUDA_JOB_K-native or foreign}"
PYTEST_ARGS=()
[[ -n "$K_EXPR" ]] && PYTEST_ARGS=(-k "$K_EXPR")

want=${CUDA_TORCH#torch==}
PHASE="${1:-all}"
case "$PHASE" in all|venv|build|check) ;; *) echo "cuda-job: unknown phase '$PHASE' (all, venv, build or check)"; exit 2;; esac
t_start=$SECONDS
step() { echo "cuda-job: [$((SECONDS - t_start))s] $*"; }
elapsed() { echo "cuda-job: $1 took $(($SECONDS - $2))s"; }

NVCC_BIN=$(command -v nvcc || true)
if [[ "$PHASE" != venv && -z "$NVCC_BIN" && ! -x /usr/local/cuda/bin/nvcc && -z "${CUDA_HOME:-}" ]]; then
  echo "cuda-job: FAIL: no CUDA toolkit (nvcc) on this machine; the CUDA build cannot be checked"
  exit 1
fi

SRC=$JOB/src
DIST=$JOB/dist
# pip for the venv: no byte-compiling of the GBs it unpacks (Python compiles what it
# imports), no progress bars in the log
PIP_Q=(--quiet --disable-pip-version-check --no-compile)
venv_ready() {
  [[ "$("$VPY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)" == "$want" ]] \
    && [[ -f "$JOB/venv.ok" && "$(cat "$JOB/venv.ok")" == "$CUDA_TORCH ${LIBS_FROM:-own}" ]]
}
if [[ "$PHASE" == all || "$PHASE" == venv ]] || { [[ "$PHASE" == build ]] && ! venv_ready; }; then
  # 1. the venv (kept while it holds this torch, with the libraries it was made with)
  t=$SECONDS
  if ! venv_ready; then
    step "creating $VENV with $CUDA_TORCH"
    rm -rf "$VENV" "$JOB/venv.ok"
    "$PY" -m venv "$VENV"
    # A machine-wide pip constraint that caps torch below this job's pin (a machine
    # provisioned for an older torch) would refuse it: this venv takes no constraint file.
    export PIP_CONSTRAINT=/dev/null
    if [[ -n "$LIBS_FROM" ]]; then
      # torch alone, its own requirements but the CUDA runtime libraries, and those libraries
      # at the versions the torch in $LIBS_FROM pins: the same major versions (the same
      # sonames), from pip's cache, instead of GBs of other minor versions; a library only
      # this torch loads (curand for torch 2.11) comes from the same CUDA release
      "$VPY" -m pip install "${PIP_Q[@]}" --no-deps "$CUDA_TORCH"
      (cd / && "$ROOT/$LIBS_FROM/bin/python" "$ROOT/.ci/torch_requires.py" cuda) > "$JOB/libs-from.txt"
      mapfile -t reqs < <( (cd / && "$VPY" "$ROOT/.ci/torch_requires.py" own) \
        && (cd / && "$VPY" "$ROOT/.ci/torch_requires.py" cuda-from "$ROOT/$JOB/libs-from.txt") )
      echo "cuda-job: $CUDA_TORCH with ${reqs[*]}"
      "$VPY" -m pip install "${PIP_Q[@]}" "${reqs[@]}"
    else
      "$VPY" -m pip install "${PIP_Q[@]}" "$CUDA_TORCH"
    fi
  fi
  # the build tools and the suite's light dependencies (a no-op when present), resolved
  # together with the torch pin so that its own pins hold (torch 2.11 asks setuptools<82;
  # a newer setuptools makes the wheel's --no-index install below fail); with $LIBS_FROM,
  # without it (its CUDA pins are not the ones installed) and setuptools held below 82
  if [[ -n "$LIBS_FROM" ]]; then
    PIP_CONSTRAINT=/dev/null "$VPY" -m pip install "${PIP_Q[@]}" "setuptools>=70,<82" wheel \
        ninja numpy zstandard pytest hypothesis pyyaml omegaconf safetensors
  else
    PIP_CONSTRAINT=/dev/null "$VPY" -m pip install "${PIP_Q[@]}" "$CUDA_TORCH" "setuptools>=70" \
        wheel ninja numpy zstandard pytest hypothesis pyyaml omegaconf safetensors
  fi
  "$VPY" -c "import torch, sys; assert torch.version.cuda, 'not a CUDA build: ' + torch.__version__; print('cuda-job: venv torch', torch.__version__, 'CUDA', torch.version.cuda)"
  echo "$CUDA_TORCH ${LIBS_FROM:-own}" > "$JOB/venv.ok"
  elapsed "venv" $t
fi
if [[ "$PHASE" == venv ]]; then
  echo "cuda-job: venv phase OK in $((SECONDS - t_start))s"
  exit 0
fi

if [[ "$PHASE" == all || "$PHASE" == build ]]; then
  # 2. the wheel, from a copy of the tree (the tree's own build/ and .so stay untouched)
  t=$SECONDS
  rm -rf "$SRC" "$DIST"
  mkdir -p "$SRC" "$DIST"
  git ls-files -co --exclude-standard -z | grep -zv '^build/' | xargs -0 cp --parents -t "$SRC"
  step "building the wheel (REPLAY_OPS_CUDA=1, TORCH_CUDA_ARCH_LIST=$ARCHS)"
  ( cd "$SRC" && env -u CUDA_HOME -u CUDA_PATH REPLAY_OPS_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCHS" \
      REPLAY_OPS_NVCC_FLAGS="-Xptxas -warn-spills -Xcompiler -Wall,-Wextra" \
      MAX_JOBS="${MAX_JOBS:-2}" "$VPY" -m pip wheel -v --disable-pip-version-check --no-build-isolation --no-deps \
      -w "$ROOT/$DIST" . ) > "$JOB/build.log" 2>&1 || {
    echo "cuda-job: FAIL: the wheel did not build; the end of $JOB/build.log:"
    tail -40 "$JOB/build.log"; exit 1; }
  grep -E "^\s*replay_ops:" "$JOB/build.log" | sed 's/^ *//' | sort -u || true
  # compiler warnings (g++ "file:line:col: warning:", nvcc/cudafe "warning #NNN-D") and
  # ptxas's ("ptxas warning : Registers are spilled ...") fail the job
  if grep -E "(\.(cpp|cu|cuh|h):[0-9]+(:[0-9]+)?: warning:|warning #[0-9]+|ptxas (warning|error))" "$JOB/build.log" >"$JOB/warnings.log"; then
    echo "cuda-job: FAIL: compiler warnings in the CUDA build:"
    head -20 "$JOB/warnings.log"
    exit 1
  fi
  echo "cuda-job: ok   0 compiler warnings, 0 register spills"
  # the compile time of each file (ninja's log), for where the build's time goes
  ninja_log=$(find "$SRC/build" -name .ninja_log 2>/dev/null | head -1)
  [[ -n "$ninja_log" ]] && awk 'NR > 1 { n = split($4, p, "/"); printf "cuda-job:      %5.0f s  %s\n", ($2 - $1) / 1000, p[n] }' "$ninja_log"
  WHEEL=$(ls "$DIST"/replay_ops-*.whl)
  ls -l "$WHEEL"
  elapsed "CUDA build (wheel)" $t

  # 3. install it
  t=$SECONDS
  "$VPY" -m pip uninstall "${PIP_Q[@]}" -y replay_ops >/dev/null 2>&1 || true
  # (with $LIBS_FROM, --no-deps: torch's own CUDA pins are not the libraries installed)
  # (no machine-wide constraint: one that caps torch below this job's pin refuses the wheel)
  PIP_CONSTRAINT=/dev/null "$VPY" -m pip install "${PIP_Q[@]}" --no-index ${LIBS_FROM:+--no-deps} \
      --find-links "$DIST" "$WHEEL"
  elapsed "wheel install" $t
fi
if [[ "$PHASE" == build ]]; then
  echo "cuda-job: build phase OK in $((SECONDS - t_start))s"
  exit 0
fi
WHEEL=$(ls "$DIST"/replay_ops-*.whl 2>/dev/null || true)
if [[ -z "$WHEEL" ]]; then
  echo "cuda-job: FAIL: no wheel in $DIST (run the build phase first: $0 build)"; exit 1
fi

# 4. the build's checks, from outside the tree so the installed package is the one imported
t=$SECONDS
(cd "$JOB" && "$VPY" "$ROOT/tools/check_native_build.py" --wheel "$ROOT/$WHEEL" \
    --archs "$ARCHS")
elapsed "build checks" $t

# 5. the CPU suite under the CUDA torch, against the installed wheel
t=$SECONDS
LIB_CUDA=$(cd "$JOB" && "$VPY" -c "import replay_ops._extension as e; print(e.library_path())")
if [[ "$LIB_CUDA" != "$ROOT/$VENV/"* ]]; then
  echo "cuda-job: FAIL: the venv imports replay_ops from $LIB_CUDA, not from the installed wheel"
  exit 1
fi
LIB_CPU=$("$PY" -c "import replay_ops._extension as e; print(e.library_path() or '')")
if [[ -z "$LIB_CPU" || ! -f "$(dirname "$LIB_CPU")/_build_info.py" ]]; then
  echo "cuda-job: FAIL: the project's own build (make install) has no library or _build_info.py"
  exit 1
fi
# shellcheck disable=SC2086
(cd "$JOB" && TRITON_INTERPRET=1 REPLAY_OPS_FOREIGN_LIB="$LIB_CPU" REPLAY_OPS_REQUIRE_FOREIGN_LIB=1 \
    "$VPY" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pyproject.toml" \
    --durations=5 "${PYTEST_ARGS[@]}" $(for f in $SUITE; do echo "$ROOT/$f"; done))
elapsed "CPU suite under the CUDA torch" $t

# 6. this build's library under the project's torch, and the wheel offered to its pip
t=$SECONDS
REPLAY_OPS_FOREIGN_LIB="$LIB_CUDA" REPLAY_OPS_REQUIRE_FOREIGN_LIB=1 \
  "$PY" -m pytest -q -p no:cacheprovider tests/test_extension_load.py -k foreign
if out=$("$PY" -m pip install --dry-run --no-index --find-links "$DIST" "$WHEEL" 2>&1); then
  echo "cuda-job: FAIL: pip would install the torch-$want wheel beside $("$PY" -c 'import torch; print(torch.__version__)'):"
  echo "$out" | tail -5; exit 1
fi
echo "$out" | grep -q -i "torch" || { echo "cuda-job: FAIL: pip refused the wheel without naming torch:"; echo "$out" | tail -5; exit 1; }
echo "cuda-job: ok   pip refuses the wheel beside torch $("$PY" -c 'import torch; print(torch.__version__)'): $(echo "$out" | grep -i -m1 "torch")"
elapsed "refusals" $t
echo "cuda-job: OK in $((SECONDS - t_start))s"
