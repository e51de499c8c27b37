#!/usr/bin/env bash
# What `make test` (or `make test-core`) needs, checked in seconds before anything is
# installed or built: it stops naming every missing piece instead of failing an hour later.
#
#   .ci/prereqs.sh test    make test: Python >= 3.10 with pip and venv, git, g++ >= 10,
#                          nvcc (the CUDA builds), network to PyPI, 30 GB free under build/
#   .ci/prereqs.sh core    make test-core: the same without nvcc, and 3 GB free
#
# PY names the Python (default python3). NEED_GB overrides the disk figure.
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT="${1:-test}"
PY="${PY:-python3}"
case "$WHAT" in
  test) NEED_GB="${NEED_GB:-30}"; TARGET="make test" ;;
  core) NEED_GB="${NEED_GB:-3}"; TARGET="make test-core" ;;
  *) echo "prereqs: unknown target '$WHAT' (test or core)"; exit 2 ;;
esac
missing=()
notes=()

# Python, pip, venv
if ! pyv=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
  missing+=("Python: '$PY' does not run (set PY=/path/to/python3, 3.10 or newer)")
elif ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  missing+=("Python 3.10 or newer: '$PY' is $pyv")
else
  notes+=("python $pyv ($PY)")
  "$PY" -m pip --version >/dev/null 2>&1 || missing+=("pip for $PY ($PY -m pip fails; Debian: apt install python3-pip, or use a venv)")
  if [[ "$WHAT" == test ]]; then
    "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=("venv with ensurepip for $PY (the engines and the CUDA builds get their own venvs; Debian: apt install python3-venv)")
  fi
  # PEP 668: a system Python that refuses pip install (Debian, Ubuntu) outside a venv
  if "$PY" -c 'import sys; sys.exit(sys.prefix != sys.base_prefix)' 2>/dev/null; then
    marker=$("$PY" -c 'import sysconfig, os; print(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))' 2>/dev/null)
    if [[ -n "$marker" && -f "$marker" && -z "${PIP_BREAK_SYSTEM_PACKAGES:-}" ]]; then
      missing+=("a virtual environment: $PY is an externally managed system Python that refuses pip install (python3 -m venv .venv && . .venv/bin/activate, then $TARGET PY=.venv/bin/python)")
    fi
  fi
fi

command -v git >/dev/null 2>&1 && git rev-parse --git-dir >/dev/null 2>&1 \
  || missing+=("git and a git checkout (the CUDA builds and the packaging test copy the tracked files)")

# the C++ compiler of the native library (C++20 for torch 2.14 and newer)
CXX_CMD="${CXX:-g++}"
if ! command -v "${CXX_CMD%% *}" >/dev/null 2>&1; then
  missing+=("a C++ compiler: '${CXX_CMD%% *}' is not on PATH (g++ 10 or newer; Debian: apt install g++)")
else
  gv=$("${CXX_CMD%% *}" -dumpversion 2>/dev/null || echo 0)
  if [[ "$("${CXX_CMD%% *}" --version 2>/dev/null | head -1)" == *"g++"* || "$("${CXX_CMD%% *}" --version 2>/dev/null | head -1)" == *"GCC"* ]] && (( ${gv%%.*} < 10 )); then
    missing+=("g++ 10 or newer (C++20 for torch 2.14 and 2.15): ${CXX_CMD%% *} is $gv")
  else
    notes+=("c++ ${CXX_CMD%% *} $gv")
  fi
fi

if [[ "$WHAT" == test ]]; then
  NVCC_BIN=$(command -v nvcc || true)
  [[ -z "$NVCC_BIN" && -x /usr/local/cuda/bin/nvcc ]] && NVCC_BIN=/usr/local/cuda/bin/nvcc
  [[ -z "$NVCC_BIN" && -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]] && NVCC_BIN=$CUDA_HOME/bin/nvcc
  if [[ -z "$NVCC_BIN" ]]; then
    missing+=("nvcc, the CUDA toolkit's compiler (13.x): make test builds the CUDA kernels (no GPU needed); put it on PATH or set CUDA_HOME. Without it: make test-core (the suite without the CUDA builds and the engines)")
  else
    notes+=("nvcc $("$NVCC_BIN" --version | grep -o 'release [0-9.]*' | cut -d' ' -f2) ($NVCC_BIN)")
  fi
fi

# network: the engines, clients and CUDA torch builds come from PyPI
if ! "$PY" - <<'EOF' >/dev/null 2>&1
import urllib.request
urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=15).read(64)
EOF
then
  missing+=("network access to PyPI (https://pypi.org): $TARGET installs the test clients$([[ "$WHAT" == test ]] && echo ', vLLM, SGLang and CUDA builds of torch') from it")
fi

# disk, where build/ lives
# (what build/ already holds from an earlier run counts towards the figure: its venvs and
# builds are reused; at least 2 GB stays required for the run's own files)
mkdir -p build
free_gb=$(df -Pk build | awk 'NR==2 {printf "%d", $4 / 1048576}')
have_gb=$(du -sk build 2>/dev/null | awk '{printf "%d", $1 / 1048576}')
need_gb=$(( NEED_GB - have_gb ))
(( need_gb < 2 )) && need_gb=2
if (( free_gb < need_gb )); then
  missing+=("${need_gb} GB free under build/ (${NEED_GB} GB in all, ${have_gb} GB there already; $(df -Pk build | awk 'NR==2 {print $6}') has ${free_gb} GB; NEED_GB=... overrides)")
else
  notes+=("${free_gb} GB free under build/ (${have_gb} GB of it in use there already)")
fi

if (( ${#missing[@]} )); then
  echo "$TARGET cannot run here; missing:"
  for m in "${missing[@]}"; do echo "  - $m"; done
  exit 1
fi
echo "prereqs: OK ($(IFS=';'; echo "${notes[*]}" | sed 's/;/; /g'))"
