"""The scheduler package is pure Python: importing it (and driving it) loads no torch."""

from __future__ import annotations

import subprocess
import sys


def test_the_scheduler_package_imports_no_torch():
    code = (
        "import sys\n"
        "import ferrox_batch.scheduler.scheduler, ferrox_batch.scheduler.request, ferrox_batch.scheduler.plan\n"
        "import ferrox_batch.scheduler.sink\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'numpy')))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
