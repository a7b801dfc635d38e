"""How much memory the KV cache may take when nobody said: a fraction of what the machine has free.

A batcher with no block budget used to grow its KV pool by doubling, without
bound and without ever shrinking, until an allocation failed and took the
worker with it. Every batcher now has a bound. When neither a block count nor
a memory size is given, the bound is a fraction of the memory available when
the batcher starts, after the model is loaded: on the CPU a quarter of what
the kernel reports available (the pool shares RAM with the server, the
tokenizer and everything else on the machine), on CUDA 80% of the device's
free memory (as vLLM's `gpu_memory_utilization`, the rest left for
activations). The pool is allocated whole at start: on CUDA a budget the
device cannot hold fails then, with its size, not later under load. On the
CPU the kernel lends the pool's pages lazily, as blocks are first written, so
there the fraction of *available* memory is what keeps the pool's growth
within what the machine can give.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

#: Fraction of the available host memory a CPU batcher's KV pool takes by default.
CPU_KV_FRACTION = 0.25
#: Fraction of the free device memory (after the weights) a CUDA batcher's KV pool takes by default.
CUDA_KV_FRACTION = 0.8


@dataclass(frozen=True, slots=True)
class KvMemoryBudget:
    bytes: int
    reason: str


def available_memory(device: torch.device) -> int:
    """Bytes free for new allocations on `device`: MemAvailable on the host, free device memory on CUDA."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_memory()


def host_available_memory(meminfo: str | None = None) -> int:
    """The kernel's MemAvailable (what can be allocated without swapping), else free physical pages."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            meminfo = ""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            kib = line.split()[1]
            return int(kib) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_kv_memory(device: torch.device, available: int | None = None) -> KvMemoryBudget:
    """The KV budget for a batcher on `device` that was given none (module docstring)."""
    if available is None:
        available = available_memory(device)
    fraction, what = (CUDA_KV_FRACTION, "free device memory") if device.type == "cuda" else \
        (CPU_KV_FRACTION, "available memory")
    budget = int(available * fraction)
    return KvMemoryBudget(budget, f"{fraction:.0%} of the {available / 2**30:.1f} GiB of {what} on {device}")
