# Two commands set up a fresh machine:
#   make test   installs what the suite needs and runs it
#   make demo   installs what the demo needs and runs it on CPU
PY ?= python3
# A CPU build of torch is pinned for machines that have no torch yet. A torch that is
# already installed (for example a CUDA build) is kept as long as it is new enough.
TORCH_SPEC ?= torch==2.13.0
TORCH_MIN ?= 2.6
PIP = $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: install-torch install install-test test test-gpu gpu-check demo bench clean check-cuda score-header mutate

install-torch:
	@$(PY) -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= tuple(int(x) for x in '$(TORCH_MIN)'.split('.')) else 1)" 2>/dev/null \
		&& echo "using installed torch $$($(PY) -c 'import torch; print(torch.__version__)')" \
		|| $(PIP) "$(TORCH_SPEC)"

install: install-torch
	$(PIP) triton numpy pyyaml omegaconf safetensors tqdm matplotlib "transformers>=5.0"
	$(PIP) --no-build-isolation -e .

# Megatron-Core for tests/test_megatron*.py: the pinned release without its optional
# extras; the modules the tests import need only torch, numpy and packaging.
install-test: install
	$(PIP) pytest
	$(PIP) --no-deps "megatron-core==0.16.1"
	$(PIP) numpy packaging

# Compile every csrc/cuda/*.cu with nvcc for sm_80 and sm_90a, warnings as errors, 0 spill
# stores (no GPU needed; prints SKIP when nvcc is missing). Cached in build/cuda_check/.
check-cuda:
	PY=$(PY) .ci/check_cuda.sh

# Compile every Triton kernel for sm_80 and sm_90 with Triton's own ptxas (no GPU), for the
# specialisations the launchers choose: no compile error, spill stores within the budget,
# precise math, fp fusion set, 64-bit stride products. Nothing cached; ~2 minutes on 2 cores.
# Writes bench/results/triton_compile_sm80_sm90.{md,json} (tools/triton_compile_check.py).
.PHONY: check-triton
check-triton:
	$(PY) tools/triton_compile_check.py

test: install-test check-cuda check-triton
	$(PY) -m pytest -q tests

# On a GPU machine: the CUDA-only tests, and the rest of the suite on CUDA tensors. Nothing
# is installed or downloaded (GPU machines may have no network): build the extension first
# (`make gpu-check` does). GPU_PYTEST_ARGS adds pytest arguments, e.g. "-k 'not sanitizer'".
GPU_PYTEST_ARGS ?=
test-gpu:
	$(PY) -m pytest -q -m gpu $(GPU_PYTEST_ARGS) tests

# On a GPU machine, offline, within 25 minutes on one H100: build the CUDA extension, run
# make test-gpu, the compute-sanitizer runs and bench/bench_all.py --device cuda, each under a
# time limit; writes bench/results/<device>.md and the logs (tools/gpu_check.py --help).
GPU_CHECK_ARGS ?=
gpu-check:
	$(PY) tools/gpu_check.py $(GPU_CHECK_ARGS)

demo: install
	$(PY) -m replay_ops demo

bench: install
	$(PY) bench/bench_all.py

clean:
	rm -rf build dist *.egg-info replay_ops/*.so

# Regenerate the C++ ids of the score functions from their table (replay_ops/scores.py).
score-header:
	$(PY) -c "import replay_ops.scores as s; print(s.c_header(), end='')" > csrc/include/replay_score_funcs.h

# Mutation testing (not part of `make test`): deliberate bugs, one at a time, each must make
# its tests fail. Writes tools/mutation_results.md.
mutate: install-test
	$(PY) tools/mutate.py
