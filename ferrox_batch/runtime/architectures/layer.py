"""`Layer`: one decoder layer as a mixer and a feed-forward block, and the norms and scales between them.

`h += scale * mixer(norm(h))`, then `h += scale * ffn(norm(h))`: the decoder's loop is exactly that for
every layer of every family (`decoder`), and what differs between families lives in the blocks. A mixer
and a feed-forward block each run their `forward` over the forward's rows and say which linears they hold
(the weight formats, bytes, batch invariance and the C layer stack read those) and their bytes. Today's
kinds: `AttentionMixer` and `GatedMlp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ferrox_batch.runtime.architectures.forward_context import ForwardContext
from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear

LinearLayer = Linear | QuantizedLinear | GateUp


class Block(Protocol):
    """A mixer or a feed-forward block."""

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Its output `[rows, hidden]` for its input rows `x` (normed where the layer norms them)."""
        ...

    def linears(self) -> list[LinearLayer]:
        """The linear layers it holds, in the order it runs them."""
        ...

    def norms(self) -> list[torch.Tensor]:
        """The norm weights it holds."""
        ...

    @property
    def nbytes(self) -> int:
        """Its weights' bytes in memory."""
        ...

    @property
    def batch_invariant(self) -> bool:
        """Whether each output row depends on its input row alone wherever its linears' kernels do."""
        ...


@dataclass(slots=True)
class Layer:
    mixer: Block
    ffn: Block
    #: The RMSNorm before the mixer, and before the feed-forward block; None where the block reads the
    #: residual stream itself.
    input_norm: torch.Tensor | None
    post_norm: torch.Tensor | None
    #: What each block's output is multiplied by before it joins the residual stream; None: 1.
    residual_scale: float | None = None
    #: A block that reads the residual stream once the feed-forward block's output joined it, and whose
    #: output joins it too (Gemma 4's per-layer input); None: none.
    after: Block | None = None
    #: What the residual stream is multiplied by at the layer's end (Gemma 4's `layer_scalar`); None: 1.
    output_scale: torch.Tensor | None = None

    def blocks(self) -> list[Block]:
        return [self.mixer, self.ffn] + ([] if self.after is None else [self.after])

    def linears(self) -> list[LinearLayer]:
        return [linear for block in self.blocks() for linear in block.linears()]

    def norms(self) -> list[torch.Tensor]:
        """Every norm weight of the layer: its own and its blocks'."""
        return [t for t in (self.input_norm, self.post_norm) if t is not None] + \
            [t for block in self.blocks() for t in block.norms()]

    @property
    def nbytes(self) -> int:
        norms = [t for t in (self.input_norm, self.post_norm, self.output_scale) if t is not None]
        return sum(block.nbytes for block in self.blocks()) + sum(t.numel() * t.element_size() for t in norms)

    # The attention layer's and the gated MLP's linears by the names the fused layer has always had.
    @property
    def qkv(self) -> LinearLayer:
        return self.linears()[0]

    @property
    def o(self) -> LinearLayer:
        return self.linears()[1]

    @property
    def gate_up(self) -> LinearLayer:
        return self.ffn.linears()[0]

    @property
    def down(self) -> LinearLayer:
        return self.ffn.linears()[1]
