"""Per-layer inputs: an embedding of its own for every layer, and the block that adds it to the residual stream.

Gemma 4's smaller models give each layer a narrow input of its own (`per_layer_input_size` wide), made once
per forward from the tokens and the embedded rows (`PerLayerEmbedding`: a per-layer embedding table plus a
projection of the embedded rows, normed, the two averaged by `2 ** -0.5`), and every layer gates it by its
residual stream after the feed-forward block (`PerLayerInput`: `norm(projection(gelu(gate(h)) * input))`,
added to the stream: a `Layer.after` block). The decoder makes the inputs when the config has them and hands
them to the blocks in the `ForwardContext`; nothing here names a family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferrox_batch.runtime.architectures.checkpoint_taker import CheckpointTaker
from ferrox_batch.runtime.architectures.embedding import Embedding
from ferrox_batch.runtime.architectures.forward_context import ForwardContext
from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.architectures.linear_factory import LinearFactory
from ferrox_batch.runtime.architectures.norms import norm, rms_norm
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear
from ferrox_batch.runtime.config import ModelConfig

#: The tensors outside the layers, by their Hugging Face names.
EMBEDDING = "model.embed_tokens_per_layer.weight"
PROJECTION = "model.per_layer_model_projection.weight"
PROJECTION_NORM = "model.per_layer_projection_norm.weight"


@dataclass(slots=True)
class PerLayerEmbedding:
    """Every layer's input `[rows, layers, size]` from the forward's tokens and embedded rows."""

    #: Each token's inputs to every layer, `[layers * size]` a row.
    embedding: Embedding
    projection: Linear | QuantizedLinear
    projection_norm: torch.Tensor
    layers: int
    size: int
    hidden: int

    @classmethod
    def build(cls, config: ModelConfig, take: CheckpointTaker, factory: LinearFactory) -> PerLayerEmbedding | None:
        """The model's per-layer inputs from the checkpoint (None where the config has none)."""
        size, layers = config.per_layer_input_size, config.num_layers
        if not size:
            return None
        norm_weight = take(PROJECTION_NORM, (size,))
        assert isinstance(norm_weight, torch.Tensor)
        return cls(factory.embedding(take(EMBEDDING, (config.per_layer_vocab_size, layers * size))),
                   factory.linear(take(PROJECTION, (layers * size, config.hidden_size)), narrow=False),
                   norm_weight, layers, size, config.hidden_size)

    def __call__(self, tokens: torch.Tensor, embedded: torch.Tensor, eps: float) -> torch.Tensor:
        rows = tokens.numel()
        # Each scale rounded to the compute dtype first, as the reference multiplies by it.
        own = self.embedding(tokens) * torch.tensor(math.sqrt(self.size), dtype=embedded.dtype)
        projected = self.projection(embedded) * (self.hidden ** -0.5)
        projected = rms_norm(projected.view(rows, self.layers, self.size), self.projection_norm, eps)
        return (projected + own.view(rows, self.layers, self.size)) * (2.0 ** -0.5)

    @property
    def nbytes(self) -> int:
        """The embedding's and the norm's bytes (the projection is among the decoder's linears)."""
        return self.embedding.nbytes + self.projection_norm.numel() * self.projection_norm.element_size()


@dataclass(slots=True)
class PerLayerInput:
    """Layer `layer`'s input gated by its residual stream: `norm(projection(gelu(gate(h)) * input))`."""

    layer: int
    gate: Linear | QuantizedLinear
    projection: Linear | QuantizedLinear
    out_norm: torch.Tensor

    #: Row by row wherever its linears are (`Block.batch_invariant`).
    batch_invariant = True

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        assert ctx.layer_inputs is not None, "a per-layer input block needs the forward's per-layer inputs"
        gated = F.gelu(self.gate(h), approximate="tanh") * ctx.layer_inputs[:, self.layer]
        return norm(self.projection(gated), self.out_norm, ctx.eps, ctx.kernels)

    def linears(self) -> list[Linear | QuantizedLinear | GateUp]:
        return [self.gate, self.projection]

    def norms(self) -> list[torch.Tensor]:
        return [self.out_norm]

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.projection.nbytes + self.out_norm.numel() * self.out_norm.element_size()
