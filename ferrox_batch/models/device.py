"""Choosing where and in what precision the model runs.

CUDA when there is a GPU (bf16 there). On the CPU, bf16 is much faster than
fp32 where the processor has native bf16 matmuls (avx512_bf16 / AMX) and much
slower where it does not, so `auto` measures both on a matmul of the model's
own MLP shape at batch 32 and takes the faster one. fp32 stays available by
name (tests compare against a float32 reference).
"""

from __future__ import annotations

import time

import torch

from ferrox_batch.models.config import ModelConfig

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def choose_device(device: str | torch.device | None = None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chosen = torch.device(device)
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return chosen


def choose_dtype(
    dtype: str | torch.dtype | None, device: torch.device, config: ModelConfig | None = None
) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None and dtype != "auto":
        try:
            return DTYPES[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}") from None
    if device.type == "cuda":
        return torch.bfloat16
    return faster_cpu_dtype(config)


def faster_cpu_dtype(config: ModelConfig | None = None, *, batch: int = 32, repeats: int = 5) -> torch.dtype:
    """bf16 or fp32, whichever runs this model's MLP up-projection faster on this CPU."""
    hidden = config.hidden_size if config else 576
    inter = config.intermediate_size if config else 1536
    timings: dict[torch.dtype, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(batch, hidden).to(dtype)
        w = torch.randn(2 * inter, hidden).to(dtype)
        torch.nn.functional.linear(x, w)  # warm the kernel choice
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(4):
                torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - start)
        timings[dtype] = best
    return torch.bfloat16 if timings[torch.bfloat16] < timings[torch.float32] else torch.float32
