#!/usr/bin/env bash
# Compile-check every CUDA kernel file without a GPU.
#
#   * each csrc/cuda/*.cu is compiled standalone (no PyTorch headers) for every arch in
#     $CUDA_CHECK_ARCHS (default: sm_80 sm_90a), with warnings as errors on the device and
#     host side;
#   * ptxas runs with -v, and any kernel with a non-zero "bytes spill stores" fails the check;
#   * csrc/bindings/register_cuda.cpp is syntax-checked against the installed torch headers,
#     in the C++ standard those headers require (ATen/ATen.h), when they include c10/cuda (a CPU torch wheel may lack the CMake-generated
#     c10/cuda/impl/cuda_cmake_macros.h; a one-line stand-in is used then).
# Results are cached in build/cuda_check/ by a hash of the sources, the flags and the nvcc
# version, so a second run in the same tree costs nothing.
# Without nvcc the check prints SKIP and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [[ -z "$NVCC" ]]; then
  echo "check_cuda: SKIP: nvcc not found (set NVCC or put it on PATH); the CUDA kernels were NOT compile-checked"
  exit 0
fi

ARCHS="${CUDA_CHECK_ARCHS:-sm_80 sm_90a}"
# The __CUDA_NO_*__ macros are the ones torch's CUDAExtension defines (no implicit half /
# bfloat16 conversions), so the standalone check sees the same headers as the real build.
FLAGS=(-std=c++17 -O3 --fmad=false -Icsrc/include -Icsrc/cuda -Werror all-warnings
       -Xcompiler -Wall,-Wextra,-Werror -Xptxas -v,-warn-spills --expt-relaxed-constexpr
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__)
SOURCES=(csrc/cuda/*.cu)
PY="${PY:-python3}"

# Two caches: the kernels' compile (independent of torch) and the bindings' syntax check
# (against the installed torch's headers, so keyed by its version).
key_k=$( { "$NVCC" --version; echo "$ARCHS ${FLAGS[*]}"; cat csrc/cuda/* csrc/include/* "$0"; } | sha256sum | cut -c1-16)
key_b=$( { "$NVCC" --version; "$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || true; cat csrc/include/* csrc/bindings/register_cuda.cpp csrc/bindings/native_checks.h csrc/bindings/native_ops.h csrc/bindings/native_ops.inc "$0"; } | sha256sum | cut -c1-16)
cache=build/cuda_check
if [[ -f "$cache/k-$key_k.ok" && -f "$cache/b-$key_b.ok" ]]; then
  echo "check_cuda: OK (cached $key_k/$key_b): ${#SOURCES[@]} files x [$ARCHS], 0 spill stores; bindings checked against this torch"
  exit 0
fi
mkdir -p "$cache/logs"

fail=0
if [[ -f "$cache/k-$key_k.ok" ]]; then
  echo "check_cuda: ok   kernels (cached $key_k)"
else
  pids=()
  logs=()
  for src in "${SOURCES[@]}"; do
    for arch in $ARCHS; do
      log="$cache/logs/$(basename "$src" .cu).$arch.log"
      ( "$NVCC" "${FLAGS[@]}" -arch="$arch" -c "$src" -o "$cache/$(basename "$src" .cu).$arch.o" ) >"$log" 2>&1 &
      pids+=($!)
      logs+=("$log")
    done
  done
  for i in "${!pids[@]}"; do
    log="${logs[$i]}"
    if ! wait "${pids[$i]}"; then
      echo "check_cuda: FAIL: $(basename "$log" .log) did not compile:"
      grep -v "^ptxas info" "$log" | head -40
      fail=1
      continue
    fi
    kernels=$(grep -c "bytes spill stores" "$log" || true)
    spills=$(grep -E "[1-9][0-9]* bytes spill stores" "$log" || true)
    if [[ -n "$spills" ]]; then
      echo "check_cuda: FAIL: spill stores in $(basename "$log" .log):"
      grep -B2 -E "[1-9][0-9]* bytes spill stores" "$log" | grep -E "Compiling|spill" | head -20
      fail=1
    else
      echo "check_cuda: ok   $(basename "$log" .log): $kernels kernels, 0 spill stores"
    fi
  done
  [[ $fail -eq 0 ]] && touch "$cache/k-$key_k.ok"
fi

# Bindings: syntax check against the torch headers, when they carry c10/cuda.
TORCH_INC=$("$PY" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))" 2>/dev/null || true)
CUDA_INC="$(dirname "$(dirname "$(readlink -f "$NVCC")")")/include"
[[ -f "$CUDA_INC/cuda_runtime.h" ]] || CUDA_INC="${CUDA_HOME:-/usr/local/cuda}/include"
if [[ -f "$cache/b-$key_b.ok" ]]; then
  echo "check_cuda: ok   register_cuda.cpp (cached $key_b)"
elif [[ -n "$TORCH_INC" && -f "$TORCH_INC/c10/cuda/CUDAStream.h" && -f "$CUDA_INC/cuda_runtime.h" ]]; then
  stub="$cache/stub"
  if [[ ! -f "$TORCH_INC/c10/cuda/impl/cuda_cmake_macros.h" ]]; then
    mkdir -p "$stub/c10/cuda/impl"
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$stub/c10/cuda/impl/cuda_cmake_macros.h"
  fi
  # The standard the torch headers require, as setup.py and CMake choose it.
  STD=$(grep -m1 -oE "__cplusplus < [0-9]{4}" "$TORCH_INC/ATen/ATen.h" | grep -oE "[0-9]{4}$")
  if [[ -z "$STD" ]]; then echo "check_cuda: FAIL: $TORCH_INC/ATen/ATen.h states no C++ standard"; exit 1; fi
  if (( STD >= 2020 )); then STD=20; else STD=17; fi
  if "${CXX:-g++}" -std=c++$STD -fsyntax-only -Wall -Wextra -Werror -Wno-unused-parameter \
      -isystem "$stub" -isystem "$TORCH_INC" -isystem "$TORCH_INC/torch/csrc/api/include" \
      -isystem "$CUDA_INC" -Icsrc/include csrc/bindings/register_cuda.cpp >"$cache/logs/bindings.log" 2>&1; then
    echo "check_cuda: ok   register_cuda.cpp (syntax check against torch headers, C++$STD)"
    touch "$cache/b-$key_b.ok"
  else
    echo "check_cuda: FAIL: csrc/bindings/register_cuda.cpp:"
    grep -E "error" "$cache/logs/bindings.log" | head -20
    fail=1
  fi
else
  echo "check_cuda: note: torch headers without c10/cuda; the CUDA bindings were not syntax-checked"
  touch "$cache/b-$key_b.ok"
fi

if [[ $fail -ne 0 ]]; then
  echo "check_cuda: FAILED (logs in $cache/logs)"
  exit 1
fi
echo "check_cuda: OK: ${#SOURCES[@]} files x [$ARCHS], warnings as errors, 0 spill stores"
