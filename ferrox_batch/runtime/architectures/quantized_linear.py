"""A linear layer whose weight stays in the quantized blocks a GGUF file stores (`runtime.quant`).

The weight is repacked once for the int8 kernel (`kernels.packed_quant`, `csrc/quant_int8.c`) in the
file's bytes, and the file's blocks are dropped: a decode step streams 4.5-8.5 bits per weight rather
than 16 or 32. Each call quantizes x per 32-block to int8 and multiplies with integer dot products, as
llama.cpp's CPU matmuls do; the output is the decoder's dtype (float32, or bf16). A row's result depends
on that row alone, so a request's answer is the same alone or batched.

Before a format's first layer is built in a process, the kernel is checked once against gguf's reference
dequantization on a small random weight (`_agrees`); a format that fails is not served quantized
(`formats_that_run`), and the decoder widens those weights instead, as it does on a device with no kernel.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch

from ferrox_batch.runtime.kernels.packed_quant import PackedQuant
from ferrox_batch.runtime.quant.formats import QuantFormat
from ferrox_batch.runtime.quant.weight import QuantizedWeight

if TYPE_CHECKING:
    from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
    from ferrox_batch.runtime.kernels.packed_gemm import PackedF16Gemm
    from ferrox_batch.runtime.kernels.quant_gemm import QuantGemm

#: Rows and inputs of the weight each format is checked on (two K-quant super-blocks per row).
_PROBE_SHAPE = (19, 512)


class QuantizedLinear:
    """`x @ w.T (+ bias)` for a quantized weight on the CPU kernels. With `int8_activations` (the default)
    the weight is repacked here, or arrives packed (a head tied to a quantized embedding multiplies by the
    embedding's own packing); without, the weight-only kernel reads the file's blocks as they are."""

    __slots__ = ("_gemm", "bias", "stored")

    def __init__(self, weight: QuantizedWeight | PackedQuant, bias: torch.Tensor | None, kernels: CpuKernels,
                 int8_activations: bool = True) -> None:
        if isinstance(weight, QuantizedWeight) and weight.experts is not None:
            raise ValueError(f"a quantized linear takes one expert's weight (`QuantizedWeight.expert`); got "
                             f"{weight.shape} stacked")
        #: What the layer holds: the packing, or the file's blocks.
        self.stored: PackedQuant | QuantizedWeight
        if int8_activations:
            self.stored = weight if isinstance(weight, PackedQuant) else pack(weight, kernels)
            self._gemm: PackedQuant | QuantGemm = self.stored
        elif isinstance(weight, QuantizedWeight):
            self.stored = weight
            self._gemm = kernels.bind_quant_linear([(s.format, s.data) for s in weight.segments], weight.cols)
        else:
            raise ValueError("a packed weight runs the int8-activation kernel only")
        self.bias = bias

    @property
    def weight(self) -> None:
        """No dense copy of the weight exists."""
        return None

    @property
    def kind(self) -> str:
        """The formats its rows are in, joined by "+" where a fused projection mixes them ("q5_0+q8_0")."""
        return "+".join(self.stored.format_names)

    @property
    def f16_panels(self) -> PackedF16Gemm | None:
        return None

    @property
    def packed_gemm(self) -> PackedQuant | None:
        """The int8 kernel's packed weight where the layer is exactly that product (no bias), else None."""
        return self.stored if isinstance(self.stored, PackedQuant) and self.bias is None else None

    @property
    def nbytes(self) -> int:
        return self.stored.nbytes + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._gemm(x)
        return out if self.bias is None else out.add_(self.bias)


def pack(weight: QuantizedWeight, kernels: CpuKernels) -> PackedQuant:
    """`weight`'s segments repacked for the int8 kernel (the caller drops `weight`: one copy is held). A
    stacked weight is packed expert by expert (`pack_experts`)."""
    if weight.experts is not None:
        raise ValueError(f"the int8 kernel packs one expert's weight at a time; got {weight.shape} stacked")
    return kernels.pack_quant([(s.format, s.data) for s in weight.segments], weight.cols)


def pack_experts(weight: QuantizedWeight, kernels: CpuKernels) -> tuple[PackedQuant, ...]:
    """A stacked `[experts, rows, cols]` weight repacked for the int8 kernel, one packing per expert, each
    read straight from its slice of the stacked blocks."""
    if weight.experts is None:
        raise ValueError(f"a {weight.shape} weight stacks no experts; pack it with `pack`")
    return tuple(pack(weight.expert(e), kernels) for e in range(weight.experts))


def is_quantized_kind(kind: str) -> bool:
    """Whether a layer's `kind` names quantized formats (`QuantizedLinear.kind`) rather than a dense kernel."""
    from ferrox_batch.runtime.quant.formats import FORMATS

    return all(part in FORMATS for part in kind.split("+"))


def formats_that_run(kernels: CpuKernels | None, dtype: torch.dtype, int8_activations: bool = True) -> frozenset[str]:
    """The formats the kernels serve correctly here for activations in `dtype` (each checked once), with the
    int8-activation kernel or the weight-only one."""
    if kernels is None or dtype not in (torch.float32, torch.bfloat16):
        return frozenset()
    from ferrox_batch.runtime.quant.formats import FORMATS

    return frozenset(name for name, fmt in FORMATS.items() if _agrees(kernels, fmt, dtype, int8_activations))


@functools.cache  # per kernels build, format, dtype and kernel: the answer never changes
def _agrees(kernels: CpuKernels, fmt: QuantFormat, dtype: torch.dtype, int8_activations: bool) -> bool:
    """Whether the layer's weight decodes to gguf's dequantized values exactly, and its product equals exact
    arithmetic over them for an x that int8 quantization keeps exactly (each 32-block integers up to 127
    in size, one of them 127, times a power of two), within a float32 sum of k products (gamma(k) relative
    to |x| |w|, generously: the kernel's sums are per block, then across blocks) and one rounding of the
    output to `dtype`. A broken packing misses by whole quantization steps, far outside this."""
    rows, cols = _PROBE_SHAPE
    gen = np.random.default_rng(fmt.ggml_type)
    data = torch.from_numpy(gen.integers(0, 256, size=(rows, fmt.row_bytes(cols)), dtype=np.uint8))
    weight = QuantizedWeight.of(fmt, _sane_scales(data.numpy(), fmt), cols)
    try:
        layer = QuantizedLinear(weight, None, kernels, int8_activations)
    except (ValueError, AttributeError):
        return False
    w = weight.dequantize()
    if isinstance(layer.stored, PackedQuant) and not torch.equal(layer.stored.rows(torch.arange(rows), torch.float32), w):
        return False
    ints = torch.from_numpy(gen.integers(-127, 128, size=(7, cols))).double()
    ints[:, ::32] = 127.0
    x = (ints * 2.0 ** -6).to(dtype)  # exact in bf16 too: at most 8 significant bits
    got = layer(x).double()
    want = x.double() @ w.double().T
    if not bool(want.isfinite().all()):
        return False
    unit = torch.finfo(torch.float32).eps / 2
    gamma = cols * unit / (1 - cols * unit)
    summed = gamma * (x.double().abs() @ w.double().abs().T)
    bound = summed + torch.finfo(dtype).eps / 2 * (want.abs() + summed)
    return bool(((got - want).abs() <= bound).all())


def _sane_scales(blocks: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    """Random blocks with their fp16 scales replaced by small finite ones (random bytes would put
    infinities and NaNs there), so every bit pattern of the quantized values is still exercised."""
    out = blocks.copy().reshape(blocks.shape[0], -1, fmt.block_bytes)
    scale = np.array([0.01], dtype=np.float16).view(np.uint8)
    # Where each format keeps its fp16 scales within a block (and Q4_1's fp16 minimum, Q4_K's dmin).
    offsets = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}
    if fmt.name == "mxfp4":
        out[:, :, 0] = 121  # the one E8M0 byte: 2^-7, so a weight is 2^-7 times a doubled FP4 value
        return out.reshape(blocks.shape)
    for offset in offsets[fmt.name]:
        out[:, :, offset:offset + 2] = scale
    return out.reshape(blocks.shape)
