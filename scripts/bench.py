"""The batcher benchmark: a wrapper over `ferrox_batch.bench.batcher` (also `ferrox-batch bench`).

The code moved into the package so the installed command can run it; this
file keeps `python scripts/bench.py ...` working, from a checkout that is not
installed too. `--help` describes the workloads and the flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrox_batch.bench.batcher import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
