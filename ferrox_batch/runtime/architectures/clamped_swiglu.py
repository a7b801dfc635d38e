"""`ClampedSwiGlu`: gpt-oss's gated projection, `(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)` with
`g = min(gate, l)`, over a fused `[2n, k]` gate/up linear (gate rows first, biases included).

The projection runs on whatever kernel the linear factory gave it (one product, biases added by it); the
clamps and the gate run in torch over the `[rows, 2n]` result. It stands where a `GateUp` stands in a
mixture of experts (`MoeBlock`), and says what kernel runs it and its bytes as a linear does.
"""

from __future__ import annotations

import torch

from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear
from ferrox_batch.runtime.families.moe_spec import SwiGluClamp


class ClampedSwiGlu:
    __slots__ = ("_half", "clamp", "linear")

    def __init__(self, linear: Linear | QuantizedLinear, clamp: SwiGluClamp, half: int) -> None:
        self.linear, self.clamp, self._half = linear, clamp, half

    @property
    def kind(self) -> str:
        return self.linear.kind

    @property
    def nbytes(self) -> int:
        return self.linear.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        projected = self.linear(x)
        gate, up = projected[..., :self._half], projected[..., self._half:]
        limit, alpha = self.clamp.limit, self.clamp.alpha
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))
