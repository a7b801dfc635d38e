# The one entry point for developers and CI. `make test` is the test command.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned to the CPU wheel that lies on this machine's disk; a bare
# `torch` would make pip fetch a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv deps fetch test test-fast bench-model clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(PY)

deps: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e '.[test]'

fetch: deps
	$(PY) -m ferrox_batch.cli fetch

test: deps fetch
	$(PY) -m pytest -q

test-fast: deps
	$(PY) -m pytest -q -m "not real_model and not slow"

bench-model: deps fetch
	$(PY) scripts/bench_model.py

clean:
	rm -rf build *.egg-info .pytest_cache .hypothesis
