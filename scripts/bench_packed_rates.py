#!/usr/bin/env python3
"""How fast the int8 kernel (`csrc/quant_int8.c`) reads each GGUF format at one row: in cache and from memory.

Why: a one-row decode step is a matrix-vector product per weight, so its pace is the slower of two rates:
how fast the kernel's arithmetic consumes a format's bytes (measured on a weight that fits the L2 caches,
`--small-rows` x `--k`, called over and over), and how fast it streams them from DRAM (a weight far larger
than the caches, `--big-rows` x `--k`). Where the first is not well above the second, the arithmetic, not
the memory, bounds a step. Random normal weights as gguf-py quantizes each format (random blocks where it does not:
`tests/quant_weights.blocks`), on torch's threads; medians of `--calls` calls.

    python scripts/bench_packed_rates.py [--formats q4_k,q6_k,q8_0,q4_0,mxfp4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from quant_weights import blocks  # noqa: E402

from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels  # noqa: E402
from ferrox_batch.runtime.quant.formats import FORMATS  # noqa: E402


def rate(kernels: object, fmt: str, rows: int, k: int, calls: int) -> float:
    """Bytes per second one-row products over a `rows` x `k` weight in `fmt` read (median of `calls`)."""
    weight = kernels.pack_quant([(FORMATS[fmt], blocks(FORMATS[fmt], rows, k, 1))], k)
    x = torch.randn(1, k)
    for _ in range(3):
        weight(x)
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        weight(x)
        times.append(time.perf_counter() - began)
    return weight.nbytes / statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="q4_k,q6_k,q8_0,q4_0,q5_0,mxfp4")
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--small-rows", type=int, default=768)
    p.add_argument("--big-rows", type=int, default=65536)
    p.add_argument("--calls", type=int, default=15)
    args = p.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        print("no C kernels here")
        return 1
    print(f"# int8 kernel path {kernels.packed_path}, {torch.get_num_threads()} threads; one row x k {args.k}")
    print("| format | in cache GB/s | from memory GB/s |")
    print("|---|---|---|")
    for fmt in args.formats.split(","):
        small = rate(kernels, fmt, args.small_rows, args.k, args.calls * 20)
        big = rate(kernels, fmt, args.big_rows, args.k, args.calls)
        print(f"| {fmt} | {small / 1e9:.1f} | {big / 1e9:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
