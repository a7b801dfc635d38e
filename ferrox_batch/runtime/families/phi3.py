"""Phi-3 (Phi-3, Phi-3.5 and Phi-4-mini): the Llama layer with fused projections and partial RoPE.

Phi-3 checkpoints store the attention's Q, K and V as one `qkv_proj` and the MLP's gate and up as one
`gate_up_proj`. Phi-4-mini rotates only the first three quarters of each head (`partial_rotary_factor`);
its `longrope` scaling (or the older names "su" and "yarn" for it) stretches the context, from 4096
positions where the config names no original context. llama.cpp stores the longrope factors as tensors, and
reads Q/K/V fused or as three tensors.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.gguf_metadata import ConfigTensors, GgufFamily, Meta
from ferrox_batch.runtime.families.layer_spec import LayerSpec
from ferrox_batch.runtime.families.rope_layout import RopeReading

#: Phi-3's pretrained context where its config leaves `original_max_position_embeddings` out.
ORIGINAL_CONTEXT = 4096

# Phi-3 keeps its projections fused in GGUF too, as its HF checkpoints do: `ffn_up` holds gate and up stacked.
# llama.cpp also reads Q, K and V as separate tensors (unpermuted: Phi-3 rotates halves, as HF does), stacked here.
GGUF_LAYER = MappingProxyType({
    "attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj",
})


def layer(c: ModelShape, i: int) -> LayerSpec:
    """Layer `i` of a Phi-3 checkpoint."""
    return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size,
                     mixer=llama.attention(c, i, projections=("self_attn.qkv_proj",), bias=False),
                     ffn=llama.gated_mlp(c, projections=("mlp.gate_up_proj",)))


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    head_dim = config["head_dim"]
    rotary = meta.integer("rope.dimension_count", head_dim)
    # HF derives the rotated size back from the factor: it must come back whole and even.
    if not 0 < rotary <= head_dim or rotary % 2 or int(head_dim * (rotary / head_dim)) != rotary:
        raise ModelLoadError(f"{meta.arch}.rope.dimension_count {rotary} does not fit a head of {head_dim}")
    original = meta.integer("rope.scaling.original_context_length", config["max_position_embeddings"])
    # llama.cpp writes a window of 0 for a model without one (Phi-4-mini); Phi-3-mini's 2047 is kept, as its
    # HF config has it.
    extra: dict[str, Any] = {"partial_rotary_factor": rotary / head_dim, "original_max_position_embeddings": original,
                             "sliding_window": meta.integer("attention.sliding_window", 0) or None}
    names = ("rope_factors_short", "rope_factors_long")
    present = [name for name in names if name in tensors]
    if len(present) == 1:
        raise ModelLoadError("a longrope model needs both rope_factors_long and rope_factors_short")
    if present:
        short, long = ([float(str(f)) for f in tensors[name].reshape(-1)] for name in names)
        if len(short) != rotary // 2 or len(long) != rotary // 2:
            raise ModelLoadError(f"longrope factors of lengths {len(short)} and {len(long)}, expected "
                                 f"{rotary // 2} (half the rotated dimensions)")
        # The attention factor llama.cpp also stores is the one HF derives from the two contexts: left to it.
        extra["rope_scaling"] = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                                 "original_max_position_embeddings": original}
    return extra


ARCHITECTURE = "Phi3ForCausalLM"
FAMILY = Family(
    model_type="phi3", architectures=(ARCHITECTURE,), layer=layer,
    rope=RopeReading(partial_rotation=True, longrope_aliases=("su", "yarn"), default_original=ORIGINAL_CONTEXT),
    gguf=GgufFamily("phi3", ARCHITECTURE, "phi3", GGUF_LAYER, gguf_fields,
                    config_tensors=frozenset({"rope_factors_long", "rope_factors_short"}),
                    parts=MappingProxyType({"attn_qkv": ("attn_q", "attn_k", "attn_v")})),
)
