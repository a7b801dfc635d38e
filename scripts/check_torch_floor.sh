#!/usr/bin/env bash
# The oldest torch pyproject.toml accepts, tested: a venv with exactly that torch (PyPI's build, about
# 3.5 GB with its CUDA libraries, which a CPU run loads but does not use), the project's other
# dependencies held to it, then the test suite. Too heavy for CI; run it by hand when the floor or a
# torch API the code uses changes.
#   scripts/check_torch_floor.sh                 # the whole suite
#   scripts/check_torch_floor.sh tests/runtime/architectures/test_decoder.py -x
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$floor" ] || { echo "no torch>= floor in pyproject.toml" >&2; exit 2; }
# The newest patch release of the floor's minor version.
version=${TORCH_FLOOR_VERSION:-$floor.1}
venv=${FLOOR_VENV:-/tmp/ferrox-torch-floor}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# transformers (the tests' reference) needs torch 2.6 from its 5.0 on.
printf 'torch==%s\ntransformers<5\n' "$version" > "$venv/constraints.txt"
"$venv/bin/pip" install -q -c "$venv/constraints.txt" "torch==$version"
"$venv/bin/pip" install -q -c "$venv/constraints.txt" -e '.[test]'
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
# transformers 4's GGUF tokenizer adds a BOS that 5 (and the checkpoint's own tokenizer) does not: these
# two compare with that reference, not with torch, so they are left to the main suite.
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  --deselect tests/runtime/loading/test_fetch.py::test_real_folder_generates_like_the_gguf \
  --deselect tests/runtime/loading/test_fetch.py::test_real_tokenizer_matches_transformers_gguf_tokenizer "$@"
