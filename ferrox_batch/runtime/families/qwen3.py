"""Qwen3 (dense): the Llama layer with an RMSNorm on each query and key head before RoPE.

Qwen3 normalises every query head and every key head over its `head_dim` with weights of its own
(`self_attn.q_norm`, `self_attn.k_norm`, shared by the heads), after the projections and before the
rotation; its `head_dim` is a field of its own, not `hidden_size / heads`.
"""

from __future__ import annotations

from types import MappingProxyType

from ferrox_batch.runtime.families import llama, qwen2
from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.gguf_metadata import LLAMA_LAYER, QK_NORMS, GgufFamily
from ferrox_batch.runtime.families.layer_spec import LayerSpec


def layer(c: ModelShape, i: int) -> LayerSpec:
    """Layer `i` of a Qwen3 checkpoint."""
    mixer = llama.attention(c, i, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
    return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size, mixer=mixer, ffn=llama.gated_mlp(c))


ARCHITECTURE = "Qwen3ForCausalLM"
FAMILY = Family(
    model_type="qwen3", architectures=(ARCHITECTURE,), layer=layer,
    config_fields=lambda raw, shared: {"qk_norm": True, **llama.no_window_unless_used(raw, shared)},
    gguf=GgufFamily("qwen3", ARCHITECTURE, "qwen3", MappingProxyType({**LLAMA_LAYER, **QK_NORMS}), qwen2.gguf_fields),
)
