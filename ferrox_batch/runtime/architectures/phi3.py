"""The Phi-3 layer (Phi-3, Phi-3.5 and Phi-4-mini): the Llama layer with fused projections and partial RoPE.

Phi-3 checkpoints store the attention's Q, K and V as one `qkv_proj` and the MLP's gate and up as one
`gate_up_proj`, already in the fused layout the runtime holds. Phi-4-mini rotates only the first three
quarters of each head (`partial_rotary_factor`): each query and key head's dimensions are reordered here
so that its rotated pairs sit where a full rotation puts them, and its RoPE table passes the rest through
(`rope`). Its `longrope` scaling is a table too.
"""

from __future__ import annotations

from ferrox_batch.runtime.architectures import llama
from ferrox_batch.runtime.architectures.layer_weights import LayerWeights
from ferrox_batch.runtime.architectures.rope import reorder_heads, rotary_permutation
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.quant.weight import cat_rows, reorder_rows, split_rows


def layer(take: llama.Take, c: ModelConfig, i: int, linear: llama.MakeLinear,
          gate_up: llama.MakeGateUp) -> LayerWeights:
    """Layer `i` of a Phi-3 checkpoint."""
    p = f"model.layers.{i}."
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qkv = take(p + "self_attn.qkv_proj.weight", (q_out + 2 * kv_out, c.hidden_size))
    if c.rotary_dim < c.head_dim:
        order = rotary_permutation(c.head_dim, c.rotary_dim)
        q, k, v = split_rows(qkv, (q_out, kv_out, kv_out))
        qkv = cat_rows([reorder_rows(q, lambda rows: reorder_heads(rows, c.num_heads, c.head_dim, order)),
                        reorder_rows(k, lambda rows: reorder_heads(rows, c.num_kv_heads, c.head_dim, order)), v])
    return LayerWeights(
        input_norm=take(p + "input_layernorm.weight", (c.hidden_size,)),
        qkv=linear(qkv, None),
        o=linear(take(p + "self_attn.o_proj.weight", (c.hidden_size, q_out)), None),
        post_norm=take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
        gate_up=gate_up(take(p + "mlp.gate_up_proj.weight", (2 * c.intermediate_size, c.hidden_size))),
        down=linear(take(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)), None),
        rope=c.rope_kind(i),
        window=c.window(i),
    )
