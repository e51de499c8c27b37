#!/usr/bin/env bash
# The CUDA build job of `make test`: what a GPU user's `pip install` does, on a machine
# without a GPU. `make test` runs it twice, for both ends of the supported torch range:
# torch 2.14.1 in build/cuda-job/ (sm_80 and sm_90), and the floor, torch 2.11.0 (the GPU
# machines' torch), in build/cuda-job-2.11/ (CUDA_JOB_DIR; sm_90 only, CUDA_JOB_ARCHS=9.0).
#
#   1. a venv under $CUDA_JOB_DIR with $CUDA_TORCH (torch==2.14.1, a CUDA 13 build);
#   2. a wheel of a copy of the tree (`pip wheel --no-build-isolation --no-deps .`) with
#      REPLAY_OPS_CUDA=1 and TORCH_CUDA_ARCH_LIST="8.0;9.0", the toolkit found by setup.py
#      itself (CUDA_HOME unset);
#   3. the wheel installed into that venv (which never held replay_ops otherwise) with
#      --no-index, so its pinned requirements are checked against the venv;
#   4. tools/check_native_build.py: every native op has a CPU and a CUDA kernel, the library
#      loads with every symbol bound (LD_BIND_NOW), holds sm_80 and sm_90 code, carries no
#      debug info, and the wheel pins the torch it was built for;
#   5. the CPU suite under that torch, run against the installed wheel (not the tree);
#   6. the refusals: this build's library loaded under the project's torch (another
#      release), the project's library loaded under this torch, and the wheel offered to
#      pip beside the project's torch.
# Every step is timed. A failure is a failure; nothing here skips.
#
#   .ci/cuda_build_job.sh          all steps
#   .ci/cuda_build_job.sh build    steps 1-3 (what `make test` starts in the background,
#                                  niced, while the main suite runs)
#   .ci/cuda_build_job.sh wait     waits for that background build (its exit status and log
#                                  under build/cuda-job/), then steps 4-6
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY="${PY:-python3}"
CUDA_TORCH="${CUDA_TORCH:-torch==2.14.1}"
ARCHS="${CUDA_JOB_ARCHS:-8.0;9.0}"
# A venv (under build/) whose torch's CUDA runtime libraries this job's torch takes
# instead of its own pins (the floor job takes the 2.14.1 job's, already on local disk).
LIBS_FROM="${CUDA_JOB_LIBS_FROM:-}"
LIBS_FROM="${LIBS_FROM%/}"
JOB="${CUDA_JOB_DIR:-build/cuda-job}"
JOB="${JOB%/}"
case "$JOB" in build/*) ;; *) echo "cuda-job: CUDA_JOB_DIR must be a folder under build/ ($JOB)"; exit 2;; esac
VENV=$JOB/venv
VPY=$ROOT/$VENV/bin/python
PIP_Q=(--quiet --disable-pip-version-check)
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

want=${CUDA_TORCH#torch==}
PHASE="${1:-all}"
case "$PHASE" in all|build|wait) ;; *) echo "cuda-job: unknown phase '$PHASE' (all, build or wait)"; exit 2;; esac
t_start=$SECONDS
step() { echo "cuda-job: [$((SECONDS - t_start))s] $*"; }
elapsed() { echo "cuda-job: $1 took $(($SECONDS - $2))s"; }

NVCC_BIN=$(command -v nvcc || true)
if [[ -z "$NVCC_BIN" && ! -x /usr/local/cuda/bin/nvcc && -z "${CUDA_HOME:-}" ]]; then
  echo "cuda-job: FAIL: no CUDA toolkit (nvcc) on this machine; the CUDA build cannot be checked"
  exit 1
fi

SRC=$JOB/src
DIST=$JOB/dist
if [[ "$PHASE" == wait ]]; then
  step "waiting for the background CUDA build ($JOB/build-phase.log)"
  if [[ ! -f "$JOB/build-phase.rc" && ! -f "$JOB/build-phase.log" ]]; then
    echo "cuda-job: FAIL: no background build was started (CUDA_JOB_DIR=$JOB .ci/cuda_build_job.sh build)"; exit 1
  fi
  for _ in $(seq 1 3600); do [[ -f "$JOB/build-phase.rc" ]] && break; sleep 1; done
  if [[ ! -f "$JOB/build-phase.rc" ]]; then
    echo "cuda-job: FAIL: the background build did not finish within an hour"; exit 1
  fi
  cat "$JOB/build-phase.log"
  rc=$(cat "$JOB/build-phase.rc")
  if [[ "$rc" != 0 ]]; then echo "cuda-job: FAIL: the background build exited with $rc"; exit 1; fi
  elapsed "waiting" $t_start
else
  # 1. the venv
  t=$SECONDS
  have=$("$VPY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
  if [[ "$have" != "$want" ]]; then
    step "creating $VENV with $CUDA_TORCH"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    if [[ -n "$LIBS_FROM" ]]; then
      # torch alone, its own requirements but the CUDA runtime libraries, and those libraries
      # as the torch in $LIBS_FROM pins them: the same major versions (the same sonames)
      # from local disk, instead of several GB of other minor versions from the index
      "$VPY" -m pip install "${PIP_Q[@]}" --no-deps "$CUDA_TORCH"
      mapfile -t reqs < <( (cd / && "$VPY" "$ROOT/.ci/torch_requires.py" own) \
        && (cd / && "$ROOT/$LIBS_FROM/bin/python" "$ROOT/.ci/torch_requires.py" cuda) )
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
    "$VPY" -m pip install "${PIP_Q[@]}" "setuptools>=70,<82" wheel ninja numpy zstandard \
        pytest hypothesis pyyaml omegaconf safetensors
  else
    "$VPY" -m pip install "${PIP_Q[@]}" "$CUDA_TORCH" "setuptools>=70" wheel ninja numpy \
        zstandard pytest hypothesis pyyaml omegaconf safetensors
  fi
  "$VPY" -c "import torch, sys; assert torch.version.cuda, 'not a CUDA build: ' + torch.__version__; print('cuda-job: venv torch', torch.__version__, 'CUDA', torch.version.cuda)"
  elapsed "venv" $t

  # 2. the wheel, from a copy of the tree (the tree's own build/ and .so stay untouched)
  t=$SECONDS
  rm -rf "$SRC" "$DIST"
  mkdir -p "$SRC" "$DIST"
  git ls-files -co --exclude-standard -z | grep -zv '^build/' | xargs -0 cp --parents -t "$SRC"
  step "building the wheel (REPLAY_OPS_CUDA=1, TORCH_CUDA_ARCH_LIST=$ARCHS)"
  ( cd "$SRC" && env -u CUDA_HOME -u CUDA_PATH REPLAY_OPS_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCHS" \
      MAX_JOBS="${MAX_JOBS:-2}" "$VPY" -m pip wheel -v --disable-pip-version-check --no-build-isolation --no-deps \
      -w "$ROOT/$DIST" . ) > "$JOB/build.log" 2>&1 || {
    echo "cuda-job: FAIL: the wheel did not build; the end of $JOB/build.log:"
    tail -40 "$JOB/build.log"; exit 1; }
  grep -E "^\s*replay_ops:" "$JOB/build.log" | sed 's/^ *//' | sort -u || true
  # compiler warnings (g++ "file:line:col: warning:", nvcc/cudafe "warning #NNN-D") fail the job
  if grep -E "(\.(cpp|cu|cuh|h):[0-9]+(:[0-9]+)?: warning:|warning #[0-9]+)" "$JOB/build.log" >"$JOB/warnings.log"; then
    echo "cuda-job: FAIL: compiler warnings in the CUDA build:"
    head -20 "$JOB/warnings.log"
    exit 1
  fi
  echo "cuda-job: ok   0 compiler warnings"
  WHEEL=$(ls "$DIST"/replay_ops-*.whl)
  ls -l "$WHEEL"
  elapsed "CUDA build (wheel)" $t

  # 3. install it
  t=$SECONDS
  "$VPY" -m pip uninstall "${PIP_Q[@]}" -y replay_ops >/dev/null 2>&1 || true
  # (with $LIBS_FROM, --no-deps: torch's own CUDA pins are not the libraries installed)
  "$VPY" -m pip install "${PIP_Q[@]}" --no-index ${LIBS_FROM:+--no-deps} --find-links "$DIST" "$WHEEL"
  elapsed "wheel install" $t
fi
if [[ "$PHASE" == build ]]; then
  echo "cuda-job: build phase OK in $((SECONDS - t_start))s"
  exit 0
fi
WHEEL=$(ls "$DIST"/replay_ops-*.whl)

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
    $(for f in $SUITE; do echo "$ROOT/$f"; done))
elapsed "CPU suite under the CUDA torch" $t

# 6. this build's library under the project's torch, and the wheel offered to its pip
t=$SECONDS
REPLAY_OPS_FOREIGN_LIB="$LIB_CUDA" REPLAY_OPS_REQUIRE_FOREIGN_LIB=1 \
  "$PY" -m pytest -q -p no:cacheprovider tests/test_extension_load.py
if out=$("$PY" -m pip install --dry-run --no-index --find-links "$DIST" "$WHEEL" 2>&1); then
  echo "cuda-job: FAIL: pip would install the torch-$want wheel beside $("$PY" -c 'import torch; print(torch.__version__)'):"
  echo "$out" | tail -5; exit 1
fi
echo "$out" | grep -q -i "torch" || { echo "cuda-job: FAIL: pip refused the wheel without naming torch:"; echo "$out" | tail -5; exit 1; }
echo "cuda-job: ok   pip refuses the wheel beside torch $("$PY" -c 'import torch; print(torch.__version__)'): $(echo "$out" | grep -i -m1 "torch")"
elapsed "refusals" $t
echo "cuda-job: OK in $((SECONDS - t_start))s"
