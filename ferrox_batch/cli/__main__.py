"""`python -m ferrox_batch.cli`: the same as the `ferrox-batch` command."""

from ferrox_batch.cli import main

raise SystemExit(main())
