"""The token embedding: ids to rows of a dense table, or of one kept in quantized blocks.

A quantized table (the default model's and Gemma's are Q8_0 in their files) is repacked for the int8
kernel, in the file's bytes, and read row by row: only the rows a forward's tokens name are decoded
(`PackedQuant.rows`). Where the model ties its output head to the table, the head is a quantized linear
over the same packing (`decoder`), so neither holds a second copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ferrox_batch.runtime.architectures.quantized_linear import pack
from ferrox_batch.runtime.kernels.packed_quant import PackedQuant
from ferrox_batch.runtime.quant.weight import QuantizedWeight, Weight

if TYPE_CHECKING:
    from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels


class Embedding:
    """`tokens` `[n]` -> `[n, hidden]` rows in the decoder's dtype."""

    __slots__ = ("_dtype", "_kernels", "weight")

    def __init__(self, weight: Weight, dtype: torch.dtype, kernels: CpuKernels | None,
                 int8_activations: bool = True) -> None:
        """A quantized `weight` is packed for the int8 kernel when `int8_activations` (what a tied head will
        multiply by), else kept in the file's blocks (the weight-only kernel's layout)."""
        self.weight: torch.Tensor | QuantizedWeight | PackedQuant
        if isinstance(weight, QuantizedWeight):
            if kernels is None:
                raise ValueError("a quantized embedding is read by the CPU kernels; widen it where they are not")
            if len(weight.segments) != 1:
                raise ValueError(f"an embedding is stored in one format; got {'+'.join(weight.format_names)}")
        self.weight = pack(weight, kernels) if isinstance(weight, QuantizedWeight) and int8_activations else weight
        self._dtype = dtype
        self._kernels = kernels

    @property
    def nbytes(self) -> int:
        if isinstance(self.weight, (PackedQuant, QuantizedWeight)):
            return self.weight.nbytes
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, PackedQuant):
            return self.weight.rows(tokens, self._dtype)
        if isinstance(self.weight, QuantizedWeight):
            (segment,) = self.weight.segments
            assert self._kernels is not None
            return self._kernels.quant_rows(segment.format, segment.data, tokens, self.weight.cols, self._dtype)
        return F.embedding(tokens, self.weight)
