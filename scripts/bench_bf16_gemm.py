#!/usr/bin/env python3
"""Our batch-invariant bf16 linear (`csrc/bf16_gemm.c`) beside oneDNN's packed bf16 linear, side by side in
one run, on one model's projection shapes at several row counts.

Both take bf16 x and a bf16 weight packed once (ours by `CpuKernels.pack_bf16`, oneDNN's by
`mkldnn._reorder_linear_weight`, what `Linear` runs), and return bf16. Each figure is the best of three
rounds of repeated calls, so the weights are warm in cache where they fit: the ratio compares the kernels,
not the memory. The last line per row count sums a decode step's projections (one layer's four and the
lm head).

    python scripts/bench_bf16_gemm.py                      # SmolLM2-135M's shapes
    python scripts/bench_bf16_gemm.py --shapes llama-1b    # Llama-3.2-1B's
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels  # noqa: E402

#: (k, n) of q|k|v, o, gate|up, down and the lm head.
SHAPES = {
    "smollm2": [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)],
    "llama-1b": [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (2048, 128256)],
}


def best_seconds(fn: Callable[[], object], calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - began) / calls)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--rows", default="1,4,32,64,256", help="row counts, comma-separated")
    args = p.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the C kernels did not build here")
    print(f"bf16 kernel path {kernels.bf16_path}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})")
    print("| rows | k | n | ours ms | oneDNN ms | oneDNN / ours |\n|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        ours_total = onednn_total = 0.0
        for k, n in SHAPES[args.shapes]:
            w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
            x = torch.randn(rows, k, generator=gen).bfloat16()
            ours = kernels.pack_bf16(w)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
            calls = max(3, int(2e8 / (rows * k * n + 1e6)))
            a = best_seconds(lambda: ours(x), calls)
            b = best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), calls)
            ours_total += a
            onednn_total += b
            print(f"| {rows} | {k} | {n} | {a * 1e3:.3f} | {b * 1e3:.3f} | {b / a:.2f} |")
        print(f"| {rows} | all | | {ours_total * 1e3:.3f} | {onednn_total * 1e3:.3f} | "
              f"**{onednn_total / ours_total:.2f}** |")


if __name__ == "__main__":
    main()
