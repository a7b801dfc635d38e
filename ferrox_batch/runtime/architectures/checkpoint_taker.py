"""`CheckpointTaker`: how a decoder's blocks take their named tensors out of a checkpoint.

It pops each tensor (so the checkpoint's copy can be freed as soon as ours exists: one copy of the weights
at the load's peak) and checks its name and shape; the format the tensor is then held in (kept quantized,
quantized at load, or cast to the decoder's dtype and device) is the linear factory's choice
(`LinearFactory.prepare`), never the taker's.

The published MXFP4 experts (`mxfp4`) are two stored tensors, the blocks and their scales, that together
are one weight: the taker pops both and makes them the GGML-layout `QuantizedWeight` (`quant.mxfp4`), which
the factory then keeps as stored where the kernels run it and widens elsewhere.

Promises: a missing tensor or one of another shape is a ModelLoadError naming it; what is left in the dict
afterwards is exactly what no block took.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.families.moe_spec import BLOCKS, SCALES, mxfp4_tensors
from ferrox_batch.runtime.quant.mxfp4 import from_blocks
from ferrox_batch.runtime.quant.weight import QuantizedWeight, Weight

#: Puts a checkpoint's tensor, its shape checked, in the format the decoder holds it in.
Prepare = Callable[[Weight], Weight]


class CheckpointTaker:
    """Takes named tensors out of a checkpoint (consuming the dict), checking their shapes."""

    __slots__ = ("prepare", "weights")

    def __init__(self, weights: dict[str, Weight], prepare: Prepare) -> None:
        self.weights = weights
        self.prepare = prepare

    def __call__(self, name: str, shape: tuple[int, ...]) -> Weight:
        return self.prepare(self._pop(name, shape))

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def float32(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor in float32 as stored (widened from its blocks where quantized), never requantized or
        rounded to the decoder's dtype: for the few weights that run in float32 whatever the model's dtype
        (a router's)."""
        tensor = self._pop(name, shape)
        # A copy of its own: a view into the file's memory may sit at any alignment, and a float32 matmul's
        # rounding may follow its operand's alignment.
        return (tensor.dequantize() if isinstance(tensor, QuantizedWeight) else tensor).float().clone()

    def mxfp4(self, name: str, shape: tuple[int, int, int]) -> Weight:
        """The stacked `[experts, out, in]` weight `name` stored as its published MXFP4 pair (`name_blocks`,
        `name_scales`), in the decoder's format; its rows as stored."""
        if shape[-1] % 32:
            raise ModelLoadError(f"tensor {name!r}: MXFP4 rows hold whole blocks of 32, not {shape[-1]} values")
        blocks, scales = (self._pop(pattern.format(name), want)
                          for pattern, want in zip((BLOCKS, SCALES), mxfp4_tensors(name, shape).values()))
        assert isinstance(blocks, torch.Tensor) and isinstance(scales, torch.Tensor)
        try:
            weight = from_blocks(blocks, scales)
        except ValueError as bad:
            raise ModelLoadError(f"tensor {name!r}: {bad}") from None
        return self.prepare(weight)

    def _pop(self, name: str, shape: tuple[int, ...]) -> Weight:
        tensor = self.weights.pop(name, None)
        if tensor is None:
            raise ModelLoadError(f"checkpoint is missing the tensor {name!r}")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor
