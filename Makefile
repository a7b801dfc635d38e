# The one entry point for developers and CI. `make serve` runs the server; `make test` is the test command.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned to the CPU wheel that lies on this machine's disk; a bare
# `torch` would make pip fetch a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# Where `make serve` listens: `make serve PORT=8123`, `make serve HOST=0.0.0.0`.
HOST ?= 127.0.0.1
PORT ?= 8000
# `make generate PROMPT="..."`: one chat reply from the default model, streamed.
PROMPT ?= Tell me about continuous batching in one paragraph.

# The installs are done once and remembered by stamp files inside the venv, redone only
# when pyproject.toml changes (or the venv is deleted): `make serve` on an installed
# checkout goes straight to the server instead of asking pip again (seconds each time).
RUN_STAMP := $(VENV)/.ferrox-deps-run
TEST_STAMP := $(VENV)/.ferrox-deps-test

.PHONY: venv deps deps-run fetch serve generate test test-fast bench bench-model clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(PY)

# The runtime: torch, then the project (editable) with its runtime dependencies only.
$(RUN_STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e .
	@touch $@

# The test extra on top (transformers, openai, pytest, ...).
$(TEST_STAMP): $(RUN_STAMP)
	$(PIP) install -q -e '.[test]'
	@touch $@

deps-run: $(RUN_STAMP)

deps: $(TEST_STAMP)

fetch: deps-run
	$(PY) -m ferrox_batch.cli fetch

serve: deps-run fetch
	$(VENV)/bin/ferrox-batch serve --host $(HOST) --port $(PORT)

generate: deps-run fetch
	$(VENV)/bin/ferrox-batch generate --chat "$(PROMPT)"

test: deps fetch
	$(PY) -m pytest -q

test-fast: deps
	$(PY) -m pytest -q -m "not real_model and not slow"

# The batcher benchmark (docs/benchmarks.md); its peers need transformers, hence `deps`.
bench: deps fetch
	$(VENV)/bin/ferrox-batch bench

bench-model: deps fetch
	$(PY) scripts/bench_model.py

clean:
	rm -rf build *.egg-info .pytest_cache .hypothesis $(RUN_STAMP) $(TEST_STAMP)
