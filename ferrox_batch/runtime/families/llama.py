"""Llama: the layer most families start from, and the helpers they build theirs with.

A layer is an RMSNorm, attention with separate Q, K and V projections (biases where the config has
`attention_bias`), the output projection, a second RMSNorm and the gated MLP (SwiGLU). RoPE may be scaled
(linear, dynamic, yarn, llama3). llama.cpp permutes the Q/K rows of the files it writes for it, and writes
llama3 scaling as its precomputed per-frequency factors (the `rope_freqs` tensor).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.gguf_metadata import (LLAMA_LAYER, ConfigTensors, GgufFamily, Meta,
                                                         frequency_factors, full_rotary)
from ferrox_batch.runtime.families.layer_spec import AttentionSpec, GatedMlpSpec, LayerSpec

#: The Q, K and V projections, as Llama-style checkpoints name them.
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
#: The gated MLP's gate and up projections.
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


def attention(c: ModelShape, i: int, **changes: Any) -> AttentionSpec:
    """Layer `i`'s attention as the Llama layer has it, with `changes` (an `AttentionSpec`'s fields)."""
    fields: dict[str, Any] = dict(
        hidden=c.hidden_size, heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        projections=QKV, output="self_attn.o_proj", scale=c.attention_scale, rope=c.rope_kind(i),
        rotary_dim=c.rotary_dim, window=c.window(i), bias=c.attention_bias)
    fields.update(changes)
    return AttentionSpec(**fields)


def gated_mlp(c: ModelShape, **changes: Any) -> GatedMlpSpec:
    """The gated MLP as the Llama layer has it, with `changes` (a `GatedMlpSpec`'s fields)."""
    fields: dict[str, Any] = dict(hidden=c.hidden_size, intermediate=c.intermediate_size, projections=GATE_UP,
                                  down="mlp.down_proj", activation=c.hidden_act)
    fields.update(changes)
    return GatedMlpSpec(**fields)


def layer(c: ModelShape, i: int) -> LayerSpec:
    """Layer `i` of a Llama checkpoint."""
    return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size, mixer=attention(c, i), ffn=gated_mlp(c))


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    full_rotary(meta, config)
    extra: dict[str, Any] = {"pretraining_tp": 1}
    # Llama 3.1's scaling: llama.cpp writes no metadata for it, only the factors it computed, as a tensor.
    scaling = frequency_factors(meta, config, tensors)
    if scaling is not None:
        extra["rope_scaling"] = scaling
    return extra


def no_window_unless_used(raw: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    """Families whose reference keeps `sliding_window` off unless `use_sliding_window` is set (Qwen2, Qwen3,
    SmolLM3)."""
    return {} if raw.get("use_sliding_window", False) else {"sliding_window": None}


ARCHITECTURE = "LlamaForCausalLM"
FAMILY = Family(
    model_type="llama", architectures=(ARCHITECTURE,), layer=layer,
    gguf=GgufFamily("llama", ARCHITECTURE, "llama", LLAMA_LAYER, gguf_fields, permuted_qk=True,
                    config_tensors=frozenset({"rope_freqs"})),
)
