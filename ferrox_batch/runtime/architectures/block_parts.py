"""What a block builder reads a checkpoint with: the checkpoint (`Take`), the linear factory (`LinearMaker`),
and `BlockParts`, which holds both with the layer's prefix, index and norm offset.

Shared by the layer builder and the builders of the larger blocks (`moe_builder`), so each block kind's
reading of its tensors lives with its own kind and none re-derives a name or an offset.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear
from ferrox_batch.runtime.quant.weight import Weight


class Take(Protocol):
    """The checkpoint, as blocks take their tensors out of it (`CheckpointTaker`)."""

    def __call__(self, name: str, shape: tuple[int, ...]) -> Weight:
        """The tensor `name`, its shape checked, in the decoder's format: a 2-D weight may come quantized."""
        ...

    def __contains__(self, name: str) -> bool:
        """Whether the checkpoint (still) holds `name`."""
        ...

    def float32(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name`, its shape checked, in float32 as stored."""
        ...

    def mxfp4(self, name: str, shape: tuple[int, int, int]) -> Weight:
        """The stacked weight `name` of `shape` stored as its published MXFP4 blocks and scales, in the
        decoder's format."""
        ...


class LinearMaker(Protocol):
    """What builds a block's linears in the decoder's weight format (the linear factory)."""

    def linear(self, weight: Weight, bias: torch.Tensor | None = None, *, keep_weight: bool = False,
               narrow: bool = True) -> Linear | QuantizedLinear:
        """A linear layer of `weight` (and `bias`); `narrow=False`: no narrow steps' copy."""
        ...

    def gate_up(self, weight: Weight, activation: str, *, narrow: bool = True) -> GateUp:
        """The fused gate/up projection of `weight` (gate rows, then up rows), gated by `activation`."""
        ...

    def experts(self, weight: Weight, bias: torch.Tensor | None = None) -> tuple[Linear | QuantizedLinear, ...]:
        """One linear per expert of a stacked `[experts, out, in]` weight."""
        ...

    def gate_up_experts(self, weight: Weight, activation: str) -> tuple[GateUp, ...]:
        """One gated projection per expert of a stacked `[experts, 2n, k]` gate/up weight."""
        ...


class BlockParts:
    """What a block builder reads with: the checkpoint, the linear maker, the layer's prefix and index, and
    its norms (the family's offset added)."""

    __slots__ = ("index", "make", "offset", "prefix", "take")

    def __init__(self, take: Take, make: LinearMaker, prefix: str, index: int, offset: float) -> None:
        self.take, self.make, self.prefix, self.index, self.offset = take, make, prefix, index, offset

    def tensor(self, name: str, shape: tuple[int, ...]) -> Weight:
        return self.take(self.prefix + name, shape)

    def float32(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.take.float32(self.prefix + name, shape)

    def holds(self, name: str) -> bool:
        return self.prefix + name in self.take

    def norm(self, name: str | None, size: int) -> torch.Tensor | None:
        if name is None:
            return None
        weight = self.take(f"{self.prefix}{name}.weight", (size,))
        assert isinstance(weight, torch.Tensor)
        return weight + self.offset if self.offset else weight


    def vector(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A 1-D or small tensor (a bias, a scale) in the decoder's dtype: never quantized."""
        value = self.tensor(name, shape)
        assert isinstance(value, torch.Tensor)
        return value
