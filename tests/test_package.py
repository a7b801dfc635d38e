"""The package surface: lazy top-level exports, and arithmetic that imports without torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import ferrox_batch


def test_the_admission_arithmetic_imports_without_torch():
    code = (
        "import sys\n"
        "import ferrox_batch.batch.block_budget, ferrox_batch.batch.queue, ferrox_batch.batch.counters\n"
        "import ferrox_batch.batch.config, ferrox_batch.batch.step_budget\n"
        "import ferrox_batch.batch.clock, ferrox_batch.batch.status, ferrox_batch.budget\n"
        "import ferrox_batch.generation_types\n"
        "import ferrox_batch.batch.step_cost\n"
        "import ferrox_batch.usage, ferrox_batch.errors\n"
        "import ferrox_batch.cancel, ferrox_batch.policy.stop, ferrox_batch.policy.utf8_stream\n"
        "import ferrox_batch.models.kv\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_top_level_exports_resolve():
    for name in ferrox_batch.__all__:
        assert getattr(ferrox_batch, name) is not None
    assert ferrox_batch.ContinuousBatcher.__name__ == "ContinuousBatcher"


#: The torch release that brought each torch API the code relies on.
TORCH_APIS = {"scaled_dot_product_attention(enable_gqa=...)": (2, 5)}


def test_the_declared_torch_floor_has_every_api_the_code_uses():
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=([0-9]+)\.([0-9]+)', pyproject)
    assert floor is not None, "pyproject.toml declares no torch floor"
    declared = (int(floor[1]), int(floor[2]))
    for api, since in TORCH_APIS.items():
        assert declared >= since, f"{api} needs torch {since}, pyproject.toml accepts {declared}"
