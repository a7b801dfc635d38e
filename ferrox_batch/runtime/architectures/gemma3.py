"""The Gemma 3 layer (text): norms around both halves, QK-norm, a GeGLU MLP, local and global attention.

Gemma 3 differs from the Llama layer in how its weights are used, not only in which it has:
* every RMSNorm multiplies by `1 + weight` (the checkpoint stores the offset from one), folded in here
  so the decoder's norms are the Llama ones;
* the attention's output and the MLP's output are each normalised before they join the residual
  (`post_attention_layernorm`, `post_feedforward_layernorm`), and the MLP's input by its own norm
  (`pre_feedforward_layernorm`, the Llama layer's `post_attention_layernorm` in role);
* each query and key head is normalised over its `head_dim` before RoPE, as in Qwen3;
* five layers in six attend over a sliding window, with a RoPE base of their own (`ModelConfig.window`,
  `rope_kind`), and the sixth globally;
* the MLP's gate is tanh-approximated GELU (the config's `hidden_activation`, given to the gate/up
  projection by the decoder).
The embeddings' scale and the attention's scale are config fields the decoder applies.
"""

from __future__ import annotations

import torch

from ferrox_batch.runtime.architectures import llama
from ferrox_batch.runtime.architectures.layer_weights import LayerWeights
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.quant.weight import cat_rows


def layer(take: llama.Take, c: ModelConfig, i: int, linear: llama.MakeLinear,
          gate_up: llama.MakeGateUp) -> LayerWeights:
    """Layer `i` of a Gemma 3 checkpoint."""
    p = f"model.layers.{i}."
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def norm(name: str, size: int) -> torch.Tensor:
        return take(p + name, (size,)) + 1

    return LayerWeights(
        input_norm=norm("input_layernorm.weight", c.hidden_size),
        qkv=linear(cat_rows([
            take(p + "self_attn.q_proj.weight", (q_out, c.hidden_size)),
            take(p + "self_attn.k_proj.weight", (kv_out, c.hidden_size)),
            take(p + "self_attn.v_proj.weight", (kv_out, c.hidden_size)),
        ]), None),
        o=linear(take(p + "self_attn.o_proj.weight", (c.hidden_size, q_out)), None),
        post_norm=norm("pre_feedforward_layernorm.weight", c.hidden_size),
        gate_up=gate_up(cat_rows([
            take(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size)),
            take(p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size)),
        ])),
        down=linear(take(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)), None),
        q_norm=norm("self_attn.q_norm.weight", c.head_dim),
        k_norm=norm("self_attn.k_norm.weight", c.head_dim),
        rope=c.rope_kind(i),
        window=c.window(i),
        attn_out_norm=norm("post_attention_layernorm.weight", c.hidden_size),
        mlp_out_norm=norm("post_feedforward_layernorm.weight", c.hidden_size),
    )

