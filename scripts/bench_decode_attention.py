#!/usr/bin/env python3
"""The CPU paged decode attention kernel, by KV pool dtype, on a decode step's shape from DRAM.

The default model's shape (3 KV heads, 3 query heads each, head size 64), `--seqs` sequences of
`--context` positions in blocks of 16 placed at random, one pool per layer (30), so a step streams
the whole cache from memory as the decoder's does. Prints the best of `--repeats` per dtype, with
the bytes read and their rate, and each dtype's time against float32's.

    python scripts/bench_decode_attention.py [--seqs 32] [--context 142] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ferrox_batch.runtime.device import cpu_description  # noqa: E402
from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels  # noqa: E402

LAYERS, KV, GROUP, HEAD, BLOCK = 30, 3, 3, 64, 16


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--context", type=int, default=142)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        print("the CPU kernels did not build here (see the log)")
        return 1
    n, length = args.seqs, args.context
    per_seq = -(-length // BLOCK)
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(n * per_seq, generator=gen).view(n, per_seq).contiguous()
    lo, hi = torch.zeros(n, dtype=torch.int64), torch.full((n,), length, dtype=torch.int64)
    q = torch.randn(n, KV, GROUP, HEAD, generator=gen)
    print(f"# cpu: {cpu_description()}; torch threads {torch.get_num_threads()}")
    print(f"# {n} sequences x {length} positions, {LAYERS} layers, float32 queries")
    print("| pool dtype | ms per step | MB read | GB/s | vs float32 |")
    print("|---|---|---|---|---|")
    base = None
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        pools = [torch.randn(n * per_seq * BLOCK, 2, KV, HEAD, generator=gen).to(dtype) for _ in range(LAYERS)]
        for pool in pools:
            kernels.paged_decode(q, pool, tables, lo, hi, BLOCK, HEAD ** -0.5)
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            for pool in pools:
                kernels.paged_decode(q, pool, tables, lo, hi, BLOCK, HEAD ** -0.5, ranges_checked=True)
            best = min(best, time.perf_counter() - start)
        base = base or best
        mb = n * length * LAYERS * 2 * KV * HEAD * pools[0].element_size() / 1e6
        print(f"| {str(dtype).removeprefix('torch.')} | {best * 1e3:.1f} | {mb:.0f} | {mb / best / 1e3:.1f} | "
              f"{base / best:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
