#!/usr/bin/env python3
"""The CPU prefill-attention kernel against the torch path it replaces (gather + SDPA per chunk).

The default model's shape (3 KV heads, 3 query heads each, head size 64, an fp16 pool, float32
queries), on the prefill groups a burst of prompts makes: several chunks of different lengths from
position 0, one long chunk, chunks after a cached prefix, and a short chunk after a long context.
Both paths run alternately in one process on the same inputs (`--repeats` rounds, the best of each);
the table gives microseconds per call (one layer) and the speed-up. Their outputs are compared too.

    python scripts/bench_prefill_attention.py [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ferrox_batch.runtime.architectures.attention import attend_prefill  # noqa: E402
from ferrox_batch.runtime.config import ModelConfig  # noqa: E402
from ferrox_batch.runtime.device import cpu_description  # noqa: E402
from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels  # noqa: E402
from ferrox_batch.runtime.kv.batch_inputs import PrefillChunk  # noqa: E402
from ferrox_batch.runtime.kv.prefill_plan import PrefillPlan  # noqa: E402

KV, GROUP, HEAD, SLOTS = 3, 3, 64, 8192
#: (chunk lengths, positions cached before each chunk)
GROUPS = (([110, 60, 180, 40], 0), ([256], 0), ([20, 40], 0), ([100], 300), ([2], 1000))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        print("the CPU kernels did not build here (see the log)")
        return 1
    torch.set_num_threads(args.threads)
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=KV * GROUP * HEAD,
                         intermediate_size=16, num_layers=1, num_heads=KV * GROUP, num_kv_heads=KV, head_dim=HEAD)
    rng = random.Random(0)
    pool = torch.randn(SLOTS, 2, KV, HEAD).half()
    print(f"{cpu_description()}, {args.threads} threads; us per call (one layer), best of {args.repeats}")
    print(f"{'chunks':>22} {'cached':>7} {'sdpa':>9} {'kernel':>9} {'speed-up':>9} {'max |diff|':>11}")
    for lengths, start in GROUPS:
        chunks = []
        for length in lengths:
            keys = torch.arange(start + length)
            mask = keys[None, :] <= keys[start:, None] if start else None
            chunks.append(PrefillChunk(torch.tensor(rng.sample(range(SLOTS), start + length)), length, mask))
        rows = sum(lengths)
        q = torch.randn(rows, (KV * GROUP + 2 * KV) * HEAD)[:, :KV * GROUP * HEAD].view(rows, KV * GROUP, HEAD)
        plan = PrefillPlan.of(chunks)
        paths = {"sdpa": lambda: attend_prefill(q, pool, chunks, config),
                 "kernel": lambda: attend_prefill(q, pool, chunks, config, kernels, plan)}
        diff = float((paths["sdpa"]() - paths["kernel"]()).abs().max())
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(args.repeats):
            for name, run in paths.items():
                calls = 20
                began = time.perf_counter()
                for _ in range(calls):
                    run()
                best[name] = min(best[name], (time.perf_counter() - began) / calls)
        print(f"{str(lengths):>22} {start:>7} {best['sdpa'] * 1e6:>9.0f} {best['kernel'] * 1e6:>9.0f} "
              f"{best['sdpa'] / best['kernel']:>8.2f}x {diff:>11.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
