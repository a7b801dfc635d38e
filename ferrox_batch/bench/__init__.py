"""The batcher benchmark, inside the package so the installed `ferrox-batch bench` can run it.

* `bench.batcher`: the program (`main`), its parent side (spawn, collect, report) and its child entry;
* `bench.workloads`: the prompts and request shapes, the statistics helpers, and the transformers peers;
* `bench.shapes`: which requests each shape sends (the texts' shapes and `bench.copying`'s);
* `bench.conversations`: shape c, the multi-turn chat: its plan, turn prompts and closed-loop driver;
* `bench.runs`: the measured runs of our batcher, and of transformers' continuous batching on shape c;
* `bench.report`: the batcher benchmark's table and ids check; `bench.http`: the benchmark over HTTP.

`scripts/bench.py` is a thin wrapper over `bench.batcher.main`, kept for the commands in `docs/benchmarks.md`.
"""
