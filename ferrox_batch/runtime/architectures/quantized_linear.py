"""A linear layer whose weight stays in the quantized blocks a GGUF file stores (`runtime.quant`).

The C kernel (`csrc/quant_gemm.c`) decodes each block as it multiplies: the weight takes the file's bytes
in memory, and a decode step streams those bytes rather than 16 or 32 bits per weight. Activations are
the decoder's dtype (float32, or bf16 where the CPU multiplies bf16 natively) and sums are float32.

Before a format's first layer is built in a process, the kernel is checked once against gguf's reference
dequantization on a small random weight, within the bound its arithmetic allows (`_agrees`); a format
that fails is not served quantized (`formats_that_run`), and the decoder widens those weights instead,
as it does on a device with no kernel.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch

from ferrox_batch.runtime.quant.formats import QuantFormat
from ferrox_batch.runtime.quant.weight import QuantizedWeight

if TYPE_CHECKING:
    from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
    from ferrox_batch.runtime.kernels.packed_gemm import PackedF16Gemm
    from ferrox_batch.runtime.kernels.quant_gemm import QuantGemm

#: Rows and inputs of the weight each format is checked on (two K-quant super-blocks per row).
_PROBE_SHAPE = (19, 512)


class QuantizedLinear:
    """`x @ w.T (+ bias)` for a `QuantizedWeight` on the CPU kernels."""

    __slots__ = ("_gemm", "bias", "quantized")

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, kernels: CpuKernels) -> None:
        self.quantized = weight
        self.bias = bias
        self._gemm: QuantGemm = kernels.bind_quant_linear([(s.format, s.data) for s in weight.segments],
                                                          weight.cols)

    @property
    def weight(self) -> None:
        """No dense copy of the weight exists."""
        return None

    @property
    def kind(self) -> str:
        """The formats its rows are in, joined by "+" where a fused projection mixes them ("q5_0+q8_0")."""
        return "+".join(self.quantized.format_names)

    @property
    def f16_panels(self) -> PackedF16Gemm | None:
        return None

    @property
    def nbytes(self) -> int:
        return self.quantized.nbytes + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._gemm(x)
        return out if self.bias is None else out.add_(self.bias)


def is_quantized_kind(kind: str) -> bool:
    """Whether a layer's `kind` names quantized formats (`QuantizedLinear.kind`) rather than a dense kernel."""
    from ferrox_batch.runtime.quant.formats import FORMATS

    return all(part in FORMATS for part in kind.split("+"))


def formats_that_run(kernels: CpuKernels | None, dtype: torch.dtype) -> frozenset[str]:
    """The formats the kernels serve correctly here for activations in `dtype` (each checked once)."""
    if kernels is None or dtype not in (torch.float32, torch.bfloat16):
        return frozenset()
    from ferrox_batch.runtime.quant.formats import FORMATS

    return frozenset(name for name, fmt in FORMATS.items() if _agrees(kernels, fmt, dtype))


@functools.cache  # per kernels build, format and dtype: the answer never changes
def _agrees(kernels: CpuKernels, fmt: QuantFormat, dtype: torch.dtype) -> bool:
    """Whether the kernel's product equals exact arithmetic over gguf's dequantized weight, within a float32
    sum of k products in any order (gamma(k) relative to |x| |w|: the decoded weights are exact, and bf16
    activations are widened exactly) and one rounding of the output to `dtype`. A broken decode misses by
    whole quantization steps, far outside this."""
    rows, cols = _PROBE_SHAPE
    gen = np.random.default_rng(fmt.ggml_type)
    data = torch.from_numpy(gen.integers(0, 256, size=(rows, fmt.row_bytes(cols)), dtype=np.uint8))
    weight = QuantizedWeight.of(fmt, _sane_scales(data.numpy(), fmt), cols)
    try:
        gemm = kernels.bind_quant_linear([(fmt, weight.segments[0].data)], cols)
    except (ValueError, AttributeError):
        return False
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = gemm(x).double()
    w = weight.dequantize().double()
    want = x.double() @ w.T
    if not bool(want.isfinite().all()):
        return False
    unit = torch.finfo(torch.float32).eps / 2
    gamma = cols * unit / (1 - cols * unit)
    summed = gamma * (x.double().abs() @ w.abs().T)
    bound = summed + torch.finfo(dtype).eps / 2 * (want.abs() + summed)
    return bool(((got - want).abs() <= bound).all())


def _sane_scales(blocks: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    """Random blocks with their fp16 scales replaced by small finite ones (random bytes would put
    infinities and NaNs there), so every bit pattern of the quantized values is still exercised."""
    out = blocks.copy().reshape(blocks.shape[0], -1, fmt.block_bytes)
    scale = np.array([0.01], dtype=np.float16).view(np.uint8)
    # Where each format keeps its fp16 scales within a block (and Q4_1's fp16 minimum, Q4_K's dmin).
    offsets = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}
    for offset in offsets[fmt.name]:
        out[:, :, offset:offset + 2] = scale
    return out.reshape(blocks.shape)
