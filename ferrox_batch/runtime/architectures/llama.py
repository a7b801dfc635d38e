"""The Llama family's layer, as its checkpoints name its weights: Llama, Mistral, Qwen2 and SmolLM3.

One layer of the family is an RMSNorm, the attention's Q, K and V projections (fused here into one, with
Qwen2's biases when the config has them), the output projection, a second RMSNorm, and the SwiGLU MLP's
gate and up projections (fused) and down projection. The family's members differ only in switches the
config carries (biases, a sliding window, llama3 RoPE scaling, SmolLM3's layers without RoPE), so they
share this one module; a family whose layer is built differently has a module of its own (`qwen3`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.layer_weights import LayerWeights
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.quant.weight import Weight, cat_rows

#: Takes one named tensor of the checkpoint, checking its shape: a 2-D weight may come quantized.
Take = Callable[[str, tuple[int, ...]], Weight]
#: Builds a linear layer from its weight and optional bias, in the decoder's weight format.
MakeLinear = Callable[[Weight, torch.Tensor | None], Linear | QuantizedLinear]
#: Builds the fused gate/up projection from its weight.
MakeGateUp = Callable[[Weight], GateUp]


def layer(take: Take, c: ModelConfig, i: int, linear: MakeLinear, gate_up: MakeGateUp) -> LayerWeights:
    """Layer `i` of a Llama-family checkpoint."""
    p = f"model.layers.{i}."
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qkv = cat_rows([
        take(p + "self_attn.q_proj.weight", (q_out, c.hidden_size)),
        take(p + "self_attn.k_proj.weight", (kv_out, c.hidden_size)),
        take(p + "self_attn.v_proj.weight", (kv_out, c.hidden_size)),
    ])
    bias = None
    if c.attention_bias:
        bias = torch.cat([
            take(p + "self_attn.q_proj.bias", (q_out,)),
            take(p + "self_attn.k_proj.bias", (kv_out,)),
            take(p + "self_attn.v_proj.bias", (kv_out,)),
        ])
    return LayerWeights(
        input_norm=take(p + "input_layernorm.weight", (c.hidden_size,)),
        qkv=linear(qkv, bias),
        o=linear(take(p + "self_attn.o_proj.weight", (c.hidden_size, q_out)), None),
        post_norm=take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
        gate_up=gate_up(cat_rows([
            take(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size)),
            take(p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size)),
        ])),
        down=linear(take(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)), None),
        rope=c.rope_kind(i),
        window=c.window(i),
    )
