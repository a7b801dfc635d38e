#!/usr/bin/env bash
# The GPU check: on a machine with a GPU and torch (plus transformers, tokenizers,
# safetensors, jinja2, pytest, hypothesis) already installed and no network, run
# the model and batcher tests on CUDA, then the model benchmark on random weights
# of the default model's shape, in one go, within ten minutes.
#
#   scripts/gpu_check.sh                    # CUDA
#   DEVICE=cpu scripts/gpu_check.sh         # the same path on the CPU (how it is tested here)
#
# Logs go to $OUT (default /tmp/gpu_check): tests.log, bench_model.log.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/gpu_check}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FERROX_TEST_DEVICE="$DEVICE" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

"$PY" - <<'PY' 2>&1 | tee "$OUT/env.log"
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
PY

# Model and batcher tests that need no fetched checkpoint (tiny random models made by the fixtures).
timeout 330 "$PY" -m pytest -q -p no:cacheprovider -m "not real_model" \
  tests/runtime/architectures/test_decoder.py tests/runtime/kv/test_paged_kv.py tests/runtime/architectures/test_linear.py \
  tests/runtime/sampling/test_sampler.py tests/runtime/loading/test_loader.py tests/runtime/loading/test_tokenizer.py tests/scheduler \
  tests/e2e/test_from_model.py tests/e2e/test_generate_text.py 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

# The model benchmark, ours vs transformers, on random weights of SmolLM2-135M's shape.
if [ "$DEVICE" = "cuda" ]; then dtypes=bf16,fp32; batches=1,8,32,64; else dtypes=bf16; batches=1,8; fi
timeout 240 "$PY" scripts/bench_model.py --random --device "$DEVICE" --dtypes "$dtypes" \
  --batches "$batches" --steps 12 --repeats 3 2>&1 | tee "$OUT/bench_model.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu_check: tests rc=$tests_rc, bench rc=$bench_rc (logs in $OUT)"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
