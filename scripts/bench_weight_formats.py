#!/usr/bin/env python3
"""What the default model's linear layers cost per forward in each weight format torch offers on this CPU.

The four linears of one SmolLM2-135M layer (fused qkv 576->960, o 576->576, fused gate/up 576->3072,
down 1536->576), times 30 layers, at 1 and 32 rows, random weights, medians of 30 calls, side by side:
fp32 `F.linear` (MKL); fp32 packed for oneDNN once (`models.linear.Linear`, what the server runs); int8
weight-only (`torch._weight_int8pack_mm`, per-channel scales, fp32 activations); bf16 weights and
activations through `F.linear` (emulated on a CPU without avx512_bf16). The yardstick for making 16-bit or
8-bit weights a speed-up on CPUs without bf16 instructions.

    python scripts/bench_weight_formats.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrox_batch.models.device import cpu_description  # noqa: E402
from ferrox_batch.models.linear import Linear  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer's linears
LAYERS = 30


def median_ms(fn, calls: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def main() -> int:
    torch.manual_seed(0)
    print(f"# cpu: {cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"ms per forward's linears ({LAYERS} layers)")
    print("| rows | fp32 F.linear | fp32 packed (served) | int8 weight-only | bf16 F.linear |")
    print("|---|---|---|---|---|")
    for rows in (1, 32):
        totals = [0.0, 0.0, 0.0, 0.0]
        for out_f, in_f in SHAPES:
            x, w = torch.randn(rows, in_f), torch.randn(out_f, in_f)
            packed = Linear(w.clone(), None)
            scales = w.abs().amax(dim=1) / 127
            w8 = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
            xb, wb = x.bfloat16(), w.bfloat16()
            totals[0] += median_ms(lambda: F.linear(x, w))
            totals[1] += median_ms(lambda: packed(x))
            totals[2] += median_ms(lambda: torch._weight_int8pack_mm(x, w8, scales))
            totals[3] += median_ms(lambda: F.linear(xb, wb))
        print(f"| {rows} | " + " | ".join(f"{t * LAYERS:.1f}" for t in totals) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
