"""RoPE and the K/V write for one layer: the CPU kernel against the decoder's torch ops, side by side.

The default model's shape (9 query heads, 3 KV heads, head size 64), a decode step's rows (32) and a
prefill step's (1,024), pools in float32 and float16. The torch side is the decoder's fallback path:
index the rope tables, rotate q and k (`runtime.architectures.rope.apply_rope`), stack K and V, cast them to the pool's
dtype and `index_copy_` them in; the kernel does all of it in one call (`CpuKernels.rope_store`). Both
sides start from a fresh copy of the projection, as a layer does. Prints microseconds per layer, the
better of two rounds of `--calls` calls each.

    python scripts/bench_rope_store.py [--calls 300]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ferrox_batch.runtime.architectures.rope import apply_rope  # noqa: E402
from ferrox_batch.runtime.device import cpu_description  # noqa: E402
from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels  # noqa: E402

HEADS, KV, HEAD = 9, 3, 64
POSITIONS, SLOTS = 8192, 40_000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        print("the CPU kernels did not build here (see the log)")
        return 1
    gen = torch.Generator().manual_seed(0)
    cos, sin = torch.randn(POSITIONS, HEAD, generator=gen), torch.randn(POSITIONS, HEAD, generator=gen)
    width, rotated = (HEADS + 2 * KV) * HEAD, (HEADS + KV) * HEAD
    print(f"# cpu: {cpu_description()}; torch threads {torch.get_num_threads()}")
    print("| rows | pool dtype | torch ops us | kernel us | kernel speed-up |")
    print("|---|---|---|---|---|")
    for rows in (32, 1024):
        for dtype in (torch.float32, torch.float16):
            pool = torch.zeros(SLOTS, 2, KV, HEAD, dtype=dtype)
            projection = torch.randn(rows, width, generator=gen)
            positions = torch.randint(0, POSITIONS, (rows,), generator=gen)
            slots = torch.randperm(SLOTS, generator=gen)[:rows]

            def torch_ops() -> None:
                qkv = projection.clone()
                c, s = cos[positions][:, None, :], sin[positions][:, None, :]
                qk = apply_rope(qkv[:, :rotated].view(rows, HEADS + KV, HEAD), c, s)
                v = qkv[:, rotated:].view(rows, KV, HEAD)
                pool.index_copy_(0, slots, torch.stack((qk[:, HEADS:], v), dim=1).to(pool.dtype))

            def kernel() -> None:
                kernels.rope_store(projection.clone(), cos, sin, positions, slots, pool, HEADS, checked=True)

            best = {}
            for name, run in (("torch", torch_ops), ("kernel", kernel)) * 2:
                for _ in range(20):
                    run()
                start = time.perf_counter()
                for _ in range(args.calls):
                    run()
                took = (time.perf_counter() - start) / args.calls * 1e6
                best[name] = min(best.get(name, took), took)
            print(f"| {rows} | {str(dtype).removeprefix('torch.')} | {best['torch']:.0f} | {best['kernel']:.0f} | "
                  f"{best['torch'] / best['kernel']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
