"""The package surface: lazy top-level exports, and arithmetic that imports without torch."""

from __future__ import annotations

import subprocess
import sys

import ferrox_batch


def test_the_admission_arithmetic_imports_without_torch():
    code = (
        "import sys\n"
        "import ferrox_batch.batch.block_budget, ferrox_batch.batch.queue, ferrox_batch.batch.counters\n"
        "import ferrox_batch.batch.config, ferrox_batch.batch.step_budget, ferrox_batch.batch.cache_aware\n"
        "import ferrox_batch.batch.clock, ferrox_batch.batch.status, ferrox_batch.budget, ferrox_batch.generate\n"
        "import ferrox_batch.paged_hold, ferrox_batch.usage, ferrox_batch.errors\n"
        "import ferrox_batch.cancel, ferrox_batch.policy.stop, ferrox_batch.policy.utf8_stream\n"
        "import ferrox_batch.policy.window, ferrox_batch.models.kv\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_top_level_exports_resolve():
    for name in ferrox_batch.__all__:
        assert getattr(ferrox_batch, name) is not None
    assert ferrox_batch.ContinuousBatcher.__name__ == "ContinuousBatcher"
