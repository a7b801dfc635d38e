"""`LayerWeights`: one decoder layer's weights as the forward and the C layer stack both read them.

Its own module because two readers share it: the decoder (`decoder`) that builds and runs the layers in
Python, and the layer stack (`layer_stack`) that binds the same weights for one C call per forward.
Neither of them imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.linear import Linear


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: GateUp
    down: Linear
    #: The RMSNorm weights (`[head_dim]`) of each head's queries and keys, applied before RoPE (Qwen3).
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    #: Which RoPE tables the layer rotates by (`ModelConfig.rope_kind`): "global", "local" or "none".
    rope: str = "global"
    #: The sliding window its attention is local over (its last positions); None: global attention.
    window: int | None = None
    #: Gemma 3's norms on the attention's and the MLP's outputs, before each is added to the residual.
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """Whether the layer is the Llama layer exactly (no per-head or output norms, global RoPE): what the C
        stack runs."""
        return (self.q_norm is None and self.k_norm is None and self.rope == "global"
                and self.attn_out_norm is None and self.mlp_out_norm is None)
