"""`CheckpointTaker`: how a decoder's blocks take their named tensors out of a checkpoint.

It pops each tensor (so the checkpoint's copy can be freed as soon as ours exists: one copy of the weights
at the load's peak) and checks its name and shape; the format the tensor is then held in (kept quantized,
quantized at load, or cast to the decoder's dtype and device) is the linear factory's choice
(`LinearFactory.prepare`), never the taker's.

Promises: a missing tensor or one of another shape is a ModelLoadError naming it; what is left in the dict
afterwards is exactly what no block took.
"""

from __future__ import annotations

from collections.abc import Callable

from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.quant.weight import Weight

#: Puts a checkpoint's tensor, its shape checked, in the format the decoder holds it in.
Prepare = Callable[[Weight], Weight]


class CheckpointTaker:
    """Takes named tensors out of a checkpoint (consuming the dict), checking their shapes."""

    __slots__ = ("prepare", "weights")

    def __init__(self, weights: dict[str, Weight], prepare: Prepare) -> None:
        self.weights = weights
        self.prepare = prepare

    def __call__(self, name: str, shape: tuple[int, ...]) -> Weight:
        tensor = self.weights.pop(name, None)
        if tensor is None:
            raise ModelLoadError(f"checkpoint is missing the tensor {name!r}")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return self.prepare(tensor)
