"""OLMo 2: norms after each block rather than before, and norms over the whole query and key projections.

Each block reads the residual stream itself and its output is normalised before it joins the stream
(`post_attention_layernorm`, `post_feedforward_layernorm`); the queries and keys are normalised over the
whole projection (`num_heads * head_dim` and `num_kv_heads * head_dim` weights) before they are split into
heads and rotated. llama.cpp writes it as `olmo2`, without permuting the Q/K rows.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.gguf_metadata import QK_NORMS, ConfigTensors, GgufFamily, Meta, full_rotary
from ferrox_batch.runtime.families.layer_spec import LayerSpec

GGUF_LAYER = MappingProxyType({
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", **QK_NORMS, "post_attention_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
})


def layer(c: ModelShape, i: int) -> LayerSpec:
    """Layer `i` of an OLMo 2 checkpoint."""
    mixer = llama.attention(c, i, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_norm_span="projection",
                            out_norm="post_attention_layernorm")
    return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size, mixer=mixer,
                     ffn=llama.gated_mlp(c, out_norm="post_feedforward_layernorm"), input_norm=None, post_norm=None)


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    full_rotary(meta, config)
    return {}


ARCHITECTURE = "Olmo2ForCausalLM"
FAMILY = Family(
    model_type="olmo2", architectures=(ARCHITECTURE,), layer=layer,
    gguf=GgufFamily("olmo2", ARCHITECTURE, "olmo2", GGUF_LAYER, gguf_fields),
)
