"""`ParallelFfn`: feed-forward blocks side by side over one input, their outputs summed, then normed.

Gemma 4's layers with a mixture of experts run their dense MLP beside it: each branch reads the layer's
residual stream through its own RMSNorm (the mixture's router reads it as it came, its experts through
their own norm: `MoeBlock.expert_norm`), each normalises its own output, and the sum is normalised once
more before it joins the stream. Any feed-forward blocks compose this way; nothing here names a family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrox_batch.runtime.architectures.forward_context import ForwardContext
from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.layer import Block
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.architectures.norms import norm
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear


@dataclass(slots=True)
class ParallelFfn:
    branches: tuple[Block, ...]
    #: Each branch's input RMSNorm; None: the block's input as it came.
    in_norms: tuple[torch.Tensor | None, ...]
    out_norm: torch.Tensor | None = None

    @property
    def batch_invariant(self) -> bool:
        return all(branch.batch_invariant for branch in self.branches)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        out: torch.Tensor | None = None
        for branch, weight in zip(self.branches, self.in_norms):
            part = branch.forward(x if weight is None else norm(x, weight, ctx.eps, ctx.kernels), ctx)
            out = part if out is None else out + part
        assert out is not None
        return out if self.out_norm is None else norm(out, self.out_norm, ctx.eps, ctx.kernels)

    def linears(self) -> list[Linear | QuantizedLinear | GateUp]:
        return [linear for branch in self.branches for linear in branch.linears()]

    def norms(self) -> list[torch.Tensor]:
        own = [t for t in (*self.in_norms, self.out_norm) if t is not None]
        return own + [t for branch in self.branches for t in branch.norms()]

    @property
    def nbytes(self) -> int:
        own = [t for t in (*self.in_norms, self.out_norm) if t is not None]
        return sum(branch.nbytes for branch in self.branches) + sum(t.numel() * t.element_size() for t in own)
