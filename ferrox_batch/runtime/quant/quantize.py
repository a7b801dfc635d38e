"""Quantizing a dense checkpoint's weights at load (`--weights q8_0`, ...), with llama.cpp's formulas.

A safetensors checkpoint (or a GGUF widened first) can be served in a quantized format to cut its memory
and the bytes each decode step streams. The formulas are gguf-py's reference quantizers, which write
blocks bit for bit as llama.cpp's own `quantize_row_*_ref` do, so a weight quantized here is the weight a
converter would have written to a file. Those cover the 32-weight formats; the K-quants need llama.cpp's
search for their scales and are served only as a file stores them.

Promises: `quantize` returns the weight in `fmt` or raises ValueError naming why it cannot (a format
with no quantizer here, columns not a whole number of blocks); it reads the weight in float32.
"""

from __future__ import annotations

import numpy as np
import torch

from ferrox_batch.runtime.quant.formats import FORMATS, QuantFormat
from ferrox_batch.runtime.quant.weight import QuantizedWeight

#: The formats a dense weight can be quantized to at load.
LOAD_FORMATS: tuple[str, ...] = ("q8_0", "q4_0", "q4_1", "q5_0")


def quantizable(weight: torch.Tensor, fmt: QuantFormat) -> bool:
    """Whether `weight` (2-D, or 3-D: stacked experts) can be stored in `fmt`: its rows a whole number of
    blocks."""
    return weight.dim() in (2, 3) and weight.shape[-1] > 0 and weight.shape[-1] % fmt.block_elems == 0


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> QuantizedWeight:
    """`weight` `[rows, cols]` in `fmt`'s blocks; `[experts, rows, cols]` stacked, each expert's rows exactly
    as they quantize alone (every row is quantized on its own)."""
    from gguf.quants import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if fmt.name not in LOAD_FORMATS:
        raise ValueError(f"weights can be quantized at load to {', '.join(LOAD_FORMATS)}; {fmt.name} is served "
                         f"only as a GGUF file stores it")
    if not quantizable(weight, fmt):
        raise ValueError(f"a {tuple(weight.shape)} weight does not split into {fmt.name}'s rows of "
                         f"{fmt.block_elems}-weight blocks")
    cols = weight.shape[-1]
    values = weight.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1, cols).numpy()
    blocks = np.ascontiguousarray(gguf_quantize(values, GGMLQuantizationType(fmt.ggml_type)))
    if weight.dim() == 3:
        return QuantizedWeight.of(fmt, blocks, cols, experts=weight.shape[0])
    return QuantizedWeight.of(fmt, blocks.reshape(weight.shape[0], -1), cols)


def load_format(name: str) -> QuantFormat:
    """The format `--weights` names, if weights can be quantized to it at load; ValueError otherwise."""
    if name not in LOAD_FORMATS:
        raise ValueError(f"unknown weight format {name!r} to quantize to; use one of {', '.join(LOAD_FORMATS)}")
    return FORMATS[name]
