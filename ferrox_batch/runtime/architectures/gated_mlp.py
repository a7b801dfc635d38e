"""`GatedMlp`: the gated MLP as a layer's feed-forward block, `down(act(gate(x)) * up(x))`.

The gate and up projections are held fused (`GateUp`, which applies the activation, inside the kernel
where one runs it), then the down projection, and the optional RMSNorm on the output before it joins the
residual stream (Gemma 3, OLMo 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrox_batch.runtime.architectures.forward_context import ForwardContext
from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.architectures.norms import norm
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear


@dataclass(slots=True)
class GatedMlp:
    gate_up: GateUp
    down: Linear | QuantizedLinear
    out_norm: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """Whether it is the Llama layer's MLP exactly (no norm of its own): what the C layer stack runs."""
        return self.out_norm is None

    #: Row by row wherever its linears are (`Block.batch_invariant`).
    batch_invariant = True

    def linears(self) -> list[Linear | QuantizedLinear | GateUp]:
        return [self.gate_up, self.down]

    def norms(self) -> list[torch.Tensor]:
        return [] if self.out_norm is None else [self.out_norm]

    @property
    def nbytes(self) -> int:
        return (sum(linear.nbytes for linear in self.linears())
                + sum(t.numel() * t.element_size() for t in self.norms()))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        out = self.down(self.gate_up(x))
        if self.out_norm is not None:
            out = norm(out, self.out_norm, ctx.eps, ctx.kernels)
        return out
