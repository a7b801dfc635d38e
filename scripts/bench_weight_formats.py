#!/usr/bin/env python3
"""What the default model's linear layers cost per forward in each weight format torch offers on this CPU.

The four linears of one SmolLM2-135M layer (fused qkv 576->960, o 576->576, fused gate/up 576->3072,
down 1536->576), times 30 layers, plus the lm head (576->49,152) once unless `--no-lm-head`, at 1 to
1,024 rows, random weights, medians of 30 calls (5 at 256 rows and more), side by side:
- fp32 `F.linear` (MKL);
- fp32 packed for oneDNN once (`runtime.architectures.linear.Linear`, what `--dtype fp32` runs);
- fp16 weights through fbgemm (`Linear(..., weights="fp16")`);
- fp16 weights through our kernel (`csrc/f16_gemm.c`, `Linear(..., weights="fp16", kernels=...)`: what
  `--dtype fp16w` runs where the kernels build with AVX2, FMA and F16C; the gate/up projection is timed
  as a plain product here, without the SiLU gate `runtime.architectures.gate_up` folds into it);
- int8 weight-only (`torch._weight_int8pack_mm`, per-channel scales, fp32 activations);
- bf16 weights and activations through `F.linear` (emulated on a CPU without avx512_bf16).
Each row also gives the packed and fp16 kernels' GFLOP/s, so the rate at decode's small row counts can be
read beside prefill's. A column whose kernel did not load here names the fallback that ran instead.

    python scripts/bench_weight_formats.py [--rows 1,32,256,1024]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrox_batch.runtime.architectures.linear import Linear  # noqa: E402
from ferrox_batch.runtime.device import cpu_description  # noqa: E402
from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer's linears
LAYERS = 30
LM_HEAD = (49152, 576)


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
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,32,256,1024")
    p.add_argument("--no-lm-head", action="store_true", help="the layers' linears only")
    p.add_argument("--slow-formats", action="store_true",
                   help="also int8 weight-only and bf16 at 256 rows and more (minutes on an AVX2-only CPU)")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"# cpu: {cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          "ms per forward's linears")
    kernels = cpu_kernels()
    shapes = [(shape, LAYERS) for shape in SHAPES] + ([] if args.no_lm_head else [(LM_HEAD, 1)])
    print(f"# {LAYERS} x the layer's linears" + ("" if args.no_lm_head else " + the lm head once"))
    print("| rows | fp32 F.linear | fp32 packed | fp16 weights, fbgemm | fp16 weights, ours | int8 weight-only | "
          "bf16 F.linear | GFLOP/s packed fp32 / fbgemm fp16 / ours fp16 | ours over fbgemm |")
    print("|---|---|---|---|---|---|---|---|---|")
    flops_per_row = 2 * sum(o * i * times for (o, i), times in shapes)
    for rows in (int(r) for r in args.rows.split(",")):
        calls = 30 if rows < 256 else 5
        slow = rows < 256 or args.slow_formats  # torch's int8 and emulated bf16 take seconds a call there
        totals: list[float | None] = [0.0, 0.0, 0.0, 0.0, 0.0 if slow else None, 0.0 if slow else None]
        for (out_f, in_f), times in shapes:
            x, w = torch.randn(rows, in_f), torch.randn(out_f, in_f)
            packed = Linear(w.clone(), None)
            half = Linear(w.clone(), None, weights="fp16")
            ours = Linear(w.clone(), None, weights="fp16", kernels=kernels)
            timed = [lambda: F.linear(x, w), lambda: packed(x), lambda: half(x), lambda: ours(x)]
            if slow:
                scales = w.abs().amax(dim=1) / 127
                w8 = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
                xb, wb = x.bfloat16(), w.bfloat16()
                timed += [lambda: torch._weight_int8pack_mm(x, w8, scales), lambda: F.linear(xb, wb)]
            for i, fn in enumerate(timed):
                totals[i] += median_ms(fn, calls) * times  # type: ignore[operator]
        cells = ["-" if t is None else f"{t:.1f}" for t in totals]
        for column, layer, kind in ((2, half, "fbgemm_fp16"), (3, ours, "fp16_panels")):
            if layer.kind != kind:  # that kernel is not here: the column ran a fallback
                cells[column] += f" ({layer.kind})"
        rates = [flops_per_row * rows / (t / 1e3) / 1e9 for t in totals[1:4]]  # type: ignore[operator]
        print(f"| {rows} | " + " | ".join(cells) + f" | {' / '.join(f'{r:.0f}' for r in rates)} | "
              f"{totals[2] / totals[3]:.2f}x |")  # type: ignore[operator]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
