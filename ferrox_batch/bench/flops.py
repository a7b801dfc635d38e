"""How much arithmetic a workload is, and how fast this machine's best GEMM runs: the yardstick for a throughput.

`workload_flops` counts the multiply-adds (2 FLOPs each) a decoder must do to serve requests cold: every
fed token (the prompt, then each generated token but the last) through every linear layer and through
attention over the positions before it, and one lm-head row per generated token. Norms, activations and
sampling are left out: they are a few percent and no GEMM. `gemm_peak` times the GEMMs this machine
offers at sizes where they run fastest (fp32 `torch.mm`; fbgemm's fp16-weight linear where it is
built; our fp16-weight kernel where it is built vectorised), so `achieved / peak` says how much of the
machine a run used.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ferrox_batch.runtime.config import ModelConfig


def linear_params(config: ModelConfig) -> int:
    """Weights of the linear layers one token passes through (the lm head excluded): on a sparse layer the
    router, the k experts it chooses and the shared expert, where there is one (not `intermediate_size`, which
    is the experts' width on some families and an unused dense width on others)."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    h, moe = config.hidden_size, config.moe
    attention = h * (q + 2 * kv) + q * h
    total = 0
    for layer in range(config.num_layers):
        if moe is not None and moe.sparse(layer):
            experts = moe.top_k * moe.intermediate + (moe.shared_intermediate or 0)
            total += attention + h * moe.experts + 3 * h * experts
        else:
            total += attention + 3 * h * config.intermediate_size
    return total


def workload_flops(config: ModelConfig, requests: Sequence[tuple[int, int]]) -> int:
    """FLOPs to serve `(prompt_tokens, new_tokens)` requests with no prefix reused (see the module)."""
    per_token = 2 * linear_params(config)
    head = 2 * config.vocab_size * config.hidden_size
    # Per position attended, per layer: q.k and p.v over every query head.
    attend = 4 * config.num_heads * config.head_dim * config.num_layers
    total = 0
    for prompt, new in requests:
        fed = prompt + max(0, new - 1)
        # Token at position p (0-based) attends to p + 1 positions: sum over p < fed.
        total += fed * per_token + new * head + attend * fed * (fed + 1) // 2
    return total


@dataclass(frozen=True, slots=True)
class GemmPeak:
    """GFLOP/s of the fastest GEMM of each kind measured here, and the best of them."""

    fp32: float
    fp16_weights: float | None  # fbgemm's; None where fbgemm is not built
    fp16_panels: float | None = None  # ours (`csrc/f16_gemm.c`); None where it is not built vectorised

    @property
    def best(self) -> float:
        return max(self.fp32, self.fp16_weights or 0.0, self.fp16_panels or 0.0)


def _rate(flops: int, fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return flops / best / 1e9


def gemm_peak(size: int = 2048, repeats: int = 5) -> GemmPeak:
    """The machine's GEMM rates at `size` x `size` x `size` (fast minimum of `repeats`)."""
    import torch

    from ferrox_batch.runtime.device import fbgemm_fp16_available
    from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    flops = 2 * size ** 3
    fp32 = _rate(flops, lambda: torch.mm(a, b), repeats)
    fp16 = None
    if fbgemm_fp16_available():
        packed = torch.ops.quantized.linear_prepack_fp16(b, None)
        fp16 = _rate(flops, lambda: torch.ops.quantized.linear_dynamic_fp16(a, packed), repeats)
    ours, kernels = None, cpu_kernels()
    if kernels is not None and kernels.f16_gemm_vectorised:
        panels = kernels.pack_f16_panels(b.T)  # the weight is [out, in]: a @ b
        ours = _rate(flops, lambda: kernels.f16_linear(a, panels, size), repeats)
    return GemmPeak(fp32, fp16, ours)
