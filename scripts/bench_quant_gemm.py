"""The quantized-weight linear kernels beside torch's packed dense linears.

A model's projections (`--shapes smollm2`: (k, n) = (576, 960) fused qkv, (576, 576) o, (576, 3072) fused
gate/up, (1536, 576) down and (576, 49,152) the lm head; `--shapes llama-1b`: the 1B-shaped checkpoint's
(2048, 3072) qkv, (2048, 2048) o, (2048, 16,384) gate/up, (8192, 2048) down and (2048, 49,152) head) at
`--rows`, side by side, bf16 activations:
- torch's oneDNN linear over a weight packed once (`mkldnn._reorder_linear_weight` +
  `mkldnn._linear_pointwise`, what `runtime.architectures.linear.Linear` runs), in float32 and bf16;
- ours over Q8_0, Q4_1, Q4_K and Q6_K blocks: the int8 kernel the layers run (`pack_quant`,
  `csrc/quant_int8.c`) and the weight-only one (`bind_quant_linear`, `csrc/quant_gemm.c`).
Each cell is microseconds per call and the weight's bytes streamed per second (GB/s: the format's
bytes, 4 or 2 bytes a weight for the dense ones); "-" where k is not a whole number of the format's
blocks. The blocks are random bytes with small finite fp16 scales: the kernels' time does not depend on
the values. Medians of `--repeats` timings, each of enough calls to last about 5 ms, on torch's thread
count (2 unless `--threads`).

    python scripts/bench_quant_gemm.py [--shapes smollm2|llama-1b] [--rows 1,4,32,256] [--repeats 5]
        [--build-flags "-O3 -ffast-math -mavx2 -mfma -mf16c -mno-avx512f"]   # another path, forced
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ferrox_batch.runtime.device import cpu_description  # noqa: E402
from ferrox_batch.runtime.kernels import kernel_build  # noqa: E402
from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels, cpu_kernels  # noqa: E402
from ferrox_batch.runtime.quant.formats import FORMATS, QuantFormat  # noqa: E402

SHAPES = {
    "smollm2": [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
                ("lm_head", 576, 49152)],
    "llama-1b": [("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384), ("down", 8192, 2048),
                 ("lm_head", 2048, 49152)],
}
QUANT = ("q8_0", "q4_1", "q4_k", "q6_k")
#: Where each format keeps its fp16 scales (and Q4_1's minimum, Q4_K's dmin) within a block.
SCALE_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}


def random_blocks(fmt: QuantFormat, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    raw = rng.integers(0, 256, size=(n, k // fmt.block_elems, fmt.block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[fmt.name]:
        raw[:, :, offset:offset + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, fmt.row_bytes(k)))


def median_us(repeats: int, fn: Callable[..., object], *args: object) -> float:
    """Microseconds per `fn(*args)`: the median of `repeats` timings of enough calls to last about 5 ms."""
    fn(*args)
    began = time.perf_counter()
    fn(*args)
    calls = max(1, int(0.005 / max(time.perf_counter() - began, 1e-7)))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        times.append((time.perf_counter() - began) / calls)
    return statistics.median(times) * 1e6


def cell(us: float, weight_bytes: int) -> str:
    return f"{us:.0f} ({weight_bytes / us / 1e3:.0f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--build-flags", help="build the kernels with these GCC flags instead (e.g. the AVX2 path: "
                                         "\"-O3 -ffast-math -mavx2 -mfma -mf16c -mno-avx512f\")")
    p.add_argument("--rows", default="1,4,32,256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.build_flags:
        kernel_build.COMPILE_FLAGS = (args.build_flags.split(),)
        kernels = kernel_build.build_library(CpuKernels)
    else:
        kernels = cpu_kernels()
    if kernels is None:
        print("the CPU kernels did not build here (see the log)")
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print(f"# cpu: {cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"int8 path {kernels.packed_path}, weight-only path {kernels.quant_path}")
    print("# us per call (GB/s of weight bytes), bf16 activations; int8: the layers' kernel, w-only: the "
          "weight-only one")
    print("| proj | rows | fp32 packed | bf16 packed | " + " | ".join(f"{q} int8 | {q} w-only" for q in QUANT) + " |")
    print("|---|---|---|---|" + "---|" * (2 * len(QUANT)))
    for name, k, n in SHAPES[args.shapes]:
        w = torch.randn(n, k) / k**0.5
        packed32 = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        packed16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 32)
        gemms = {}
        for q in QUANT:
            if k % FORMATS[q].block_elems == 0:  # a K-quant's rows are whole 256-weight super-blocks
                segment = [(FORMATS[q], random_blocks(FORMATS[q], n, k, rng))]
                gemms[q] = (kernels.pack_quant(segment, k), kernels.bind_quant_linear(segment, k))
        for m in rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            linear = torch.ops.mkldnn._linear_pointwise
            cells = [cell(median_us(args.repeats, linear, x, packed32, None, "none", [], ""), 4 * n * k),
                     cell(median_us(args.repeats, linear, xb, packed16, None, "none", [], ""), 2 * n * k)]
            for q in QUANT:
                if q not in gemms:
                    cells += ["-", "-"]
                    continue
                size = n * FORMATS[q].row_bytes(k)
                cells += [cell(median_us(args.repeats, gemm, xb), size) for gemm in gemms[q]]
            print(f"| {name} {k}->{n} | {m} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
