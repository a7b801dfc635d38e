"""The batcher benchmark, inside the package so the installed `ferrox-batch bench` can run it.

* `bench.batcher`: the program (`main`), its measured child runs and the report;
* `bench.workloads`: the prompts and request shapes, the statistics helpers, and the transformers peers.

`scripts/bench.py` is a thin wrapper over `bench.batcher.main`, kept for the commands in `docs/benchmarks.md`.
"""
