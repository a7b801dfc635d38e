"""Choosing where and in what precision the model runs, the same way on every start.

A precision is the dtype of activations and KV plus how the linear layers
store their weights (`runtime.architectures.linear`): `fp32`, `bf16`, `fp16`, or `fp16w`
(fp32 activations and KV, linear weights in fp16 widened inside the GEMM: our
kernel where it builds with AVX2, FMA and F16C, else fbgemm's; `runtime.architectures.linear`).

CUDA when there is a GPU (bf16 there). On the CPU, bf16 is about twice as fast
as fp32 where the processor has native bf16 matmul instructions
(`avx512_bf16`, or AMX tiles) and about three times slower where it has not
and torch emulates them; there `fp16w` is 1.1-1.7x faster than fp32 for the
model's linears (x86 with fbgemm). All three hold the quality bound
`QUALITY_BOUND` on the default model (a test measures it). `auto` therefore
decides from what the CPU and the torch build report, never from a timing
race: a race run at load flips under load, and the same machine then serves
in a different precision from one start to the next. An x86-64 CPU with
neither native bf16 nor fbgemm (no AVX2) gets fp32 from its flags. Only a
processor that is not x86-64 is timed, and then bf16 must win clearly, else
fp32.

Every choice carries its reason, which the loader logs and the benchmark
prints beside its table.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ferrox_batch.runtime.config import ModelConfig

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

#: The name `--dtype` accepts besides the plain dtypes: an fp32 model whose linear weights are fp16.
FP16_WEIGHTS = "fp16w"
#: Every `--dtype` value but auto.
PRECISION_NAMES = (*DTYPES, FP16_WEIGHTS)

#: What every precision `auto` may pick holds on the default model, against fp32: perplexity on a
#: fixed text within this fraction (measured: bf16 +0.07%, fp16w -0.01%).
QUALITY_BOUND = 0.01

#: How much faster bf16 must measure before a timing picks it (only where the CPU reports nothing):
#: the two dtypes' timings move 10-20% between runs, so a smaller lead is noise, and fp32 is the
#: choice that is never badly wrong.
BF16_CLEAR_LEAD = 1.3

#: /proc/cpuinfo flags worth naming beside a measurement: what decides the dtype and the kernels.
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")

_X86 = ("x86_64", "amd64", "i386", "i686")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """What the processor says it can do, as far as the dtype choice is concerned."""

    machine: str
    avx512_bf16: bool
    amx: bool
    #: Whether this torch build runs fbgemm's fp16-weight linear here (x86 with AVX2).
    fbgemm: bool = False

    @property
    def x86(self) -> bool:
        return self.machine.lower() in _X86

    @property
    def native_bf16(self) -> bool:
        return self.avx512_bf16 or self.amx

    @classmethod
    def probe(cls) -> CpuFeatures:
        """The running CPU, as torch's cpuinfo sees it (independent of ATEN_CPU_CAPABILITY)."""
        return cls(platform.machine(), _torch_cpu_flag("_is_avx512_bf16_supported"),
                   _torch_cpu_flag("_is_amx_tile_supported"), fbgemm_fp16_available())


def fbgemm_fp16_available() -> bool:
    """Whether this torch build runs fbgemm's fp16-weight linear on this CPU."""
    # fbgemm dispatches on the CPU itself (AVX2 at least), independent of ATEN_CPU_CAPABILITY.
    return ("fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_dynamic_fp16"))


def _torch_cpu_flag(name: str) -> bool:
    probe = getattr(torch.cpu, name, None)
    return bool(probe()) if callable(probe) else False


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str
    #: How the linear layers store their weights (`runtime.architectures.linear.WEIGHT_FORMATS`).
    weights: str = "dtype"

    @property
    def name(self) -> str:
        """The precision as `--dtype` spells it."""
        if self.weights == "fp16":
            return FP16_WEIGHTS
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
            self.dtype, str(self.dtype).removeprefix("torch."))


def cpu_dtype_from_features(features: CpuFeatures) -> DtypeChoice | None:
    """bf16, fp16w or fp32 from what an x86-64 CPU reports; None where it reports nothing usable."""
    if not features.x86:
        return None
    if features.native_bf16:
        which = "avx512_bf16" if features.avx512_bf16 else "AMX"
        return DtypeChoice(torch.bfloat16, f"this CPU has native bf16 matmuls ({which}): bf16 is about 2x fp32")
    no_bf16 = "this CPU has no native bf16 matmuls (no avx512_bf16 or AMX): bf16 would be emulated, about 3x " \
              "slower than fp32"
    if features.fbgemm:
        return DtypeChoice(torch.float32, f"{no_bf16}; fp32 with fp16 weights runs the linears "
                                          "1.1-1.7x faster than fp32", "fp16")
    return DtypeChoice(torch.float32, no_bf16)


def choose_dtype_reasoned(
    dtype: str | torch.dtype | None, device: torch.device, config: ModelConfig | None = None,
    features: CpuFeatures | None = None,
) -> DtypeChoice:
    """The dtype to load in, and why: a named dtype as asked, else `auto`'s rule (module docstring)."""
    if isinstance(dtype, torch.dtype):
        return DtypeChoice(dtype, "asked for")
    if dtype == FP16_WEIGHTS:
        if device.type == "cuda":
            raise ValueError(f"{FP16_WEIGHTS} (fp16 weights in fbgemm's GEMM) is a CPU precision; on CUDA use "
                             "bf16 or fp16")
        return DtypeChoice(torch.float32, "asked for", "fp16")
    if dtype is not None and dtype != "auto":
        try:
            return DtypeChoice(DTYPES[dtype], "asked for")
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(PRECISION_NAMES)}") from None
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "auto on CUDA")
    decided = cpu_dtype_from_features(features if features is not None else CpuFeatures.probe())
    if decided is not None:
        return DtypeChoice(decided.dtype, f"auto: {decided.reason}", decided.weights)
    speedup = bf16_speedup(config)
    if speedup >= BF16_CLEAR_LEAD:
        return DtypeChoice(torch.bfloat16, f"auto: the CPU reports no bf16 support we know of; bf16 measured "
                                           f"{speedup:.2f}x fp32 here")
    return DtypeChoice(torch.float32, f"auto: the CPU reports no bf16 support we know of; bf16 measured "
                                      f"{speedup:.2f}x fp32 here, short of the {BF16_CLEAR_LEAD}x that would pick it")


#: What `--kv-cache-dtype` accepts besides auto: the element type the paged KV store holds.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class KvDtypeChoice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        """The KV element type as `--kv-cache-dtype` spells it."""
        return next(name for name, dtype in KV_CACHE_DTYPES.items() if dtype == self.dtype)


def choose_kv_dtype(asked: str | torch.dtype | None, precision: DtypeChoice, device: torch.device,
                    reads_in_place: bool) -> KvDtypeChoice:
    """What the KV store holds, and why: a named type as asked, else `auto`'s rule.

    `auto` stores fp16 K/V in the `fp16w` precision (fp32 arithmetic over 16-bit storage) when
    the decode attention reads K/V from the pool in place (`reads_in_place`: the CPU's C kernel,
    which widens fp16 exactly): a decode step then reads half the KV bytes, the pool holds twice
    the positions in the same memory, and the quality bound holds (a test measures it; llama.cpp's
    server stores f16 K/V by default too). Everywhere else the store holds the compute dtype: plain
    `fp32` stays fp32 throughout (what the tests compare with transformers token for token), the
    torch path gathers the context and would pay a widening copy, and bf16 or fp16 compute is
    already 16 bits.
    """
    if isinstance(asked, torch.dtype):
        if asked not in KV_CACHE_DTYPES.values():
            raise ValueError(f"a KV cache holds one of {', '.join(KV_CACHE_DTYPES)}; got {asked}")
        return KvDtypeChoice(asked, "asked for")
    if asked is not None and asked != "auto":
        try:
            return KvDtypeChoice(KV_CACHE_DTYPES[asked], "asked for")
        except KeyError:
            raise ValueError(f"unknown KV cache dtype {asked!r}; use one of auto, "
                             f"{', '.join(KV_CACHE_DTYPES)}") from None
    if device.type == "cpu" and precision.name == FP16_WEIGHTS and reads_in_place:
        return KvDtypeChoice(torch.float16, f"auto: {FP16_WEIGHTS} with the in-place decode kernel: fp16 K/V halve "
                                            "the bytes a decode step reads and double the pool's positions")
    return KvDtypeChoice(precision.dtype, "auto: the compute dtype")


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
    return choose_dtype_reasoned(dtype, device, config).dtype


def bf16_speedup(config: ModelConfig | None = None, *, batch: int = 32, repeats: int = 5) -> float:
    """fp32 time / bf16 time for this model's MLP up-projection at `batch` rows (> 1: bf16 is faster)."""
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
    return timings[torch.float32] / timings[torch.bfloat16]


def cpu_description(cpuinfo: str | None = None) -> str:
    """The CPU's model name and the flags that matter here, for a benchmark's header line."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return f"{platform.machine()} CPU ({platform.processor() or 'model unknown'})"
    model: str | None = None
    flags: set[str] | None = None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and flags is None:
            flags = set(value.split())
    shown = [flag for flag in REPORTED_FLAGS if flag in (flags or ())]
    named = " ".join(shown) if shown else "none of " + ", ".join(REPORTED_FLAGS)
    return f"{model or platform.machine()}; flags: {named}"
