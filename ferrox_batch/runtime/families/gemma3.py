"""Gemma 3 (text): norms around both halves, QK-norm, a GeGLU MLP, local and global attention.

Gemma 3 differs from the Llama layer in how its weights are used, not only in which it has:
* every RMSNorm multiplies by `1 + weight` (the checkpoint stores the offset from one: `norm_offset`);
* the attention's output and the MLP's output are each normalised before they join the residual
  (`post_attention_layernorm`, `post_feedforward_layernorm`), and the MLP's input by its own norm
  (`pre_feedforward_layernorm`, the Llama layer's `post_attention_layernorm` in role);
* each query and key head is normalised over its `head_dim` before RoPE, as in Qwen3;
* five layers in six attend over a sliding window (`layer_types`, or one global layer in every
  `sliding_window_pattern`), with a RoPE base of their own (one RoPE dict per layer kind), and the sixth
  globally;
* the MLP's gate is tanh-approximated GELU (`hidden_activation`), the embeddings are scaled by the square
  root of the hidden size, and attention scores by `query_pre_attn_scalar ** -0.5`;
* its embeddings are tied by default, and its `max_position_embeddings` already counts its linear scaling.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.gguf_metadata import QK_NORMS, ConfigTensors, GgufFamily, Meta, full_rotary
from ferrox_batch.runtime.families.layer_spec import LayerSpec
from ferrox_batch.runtime.families.rope_layout import RopeReading

#: The local layers' RoPE base where the config names none.
LOCAL_THETA = 10_000.0

# llama.cpp's `ffn_norm` is Gemma 3's pre-feedforward norm, not the Llama layer's post-attention one.
GGUF_LAYER = MappingProxyType({
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", **QK_NORMS,
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
})


def layer(c: ModelShape, i: int) -> LayerSpec:
    """Layer `i` of a Gemma 3 checkpoint."""
    mixer = llama.attention(c, i, bias=False, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
                            out_norm="post_attention_layernorm")
    return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size, mixer=mixer,
                     ffn=llama.gated_mlp(c, out_norm="post_feedforward_layernorm"),
                     post_norm="pre_feedforward_layernorm")


def config_fields(raw: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    """Which layers are local, the scaled embeddings and the attention's scale; the context as named."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(name) is not None:
            raise ModelLoadError(f"{name} is not supported (Gemma 3 checkpoints leave it unset)")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError("bidirectional attention is not supported: this runtime generates causally")
    layers = shared["num_layers"]
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ModelLoadError(f"layer_types names kinds this runtime does not run: {sorted(unknown)}")
    return {
        "window_layers": tuple(kind == "sliding_attention" for kind in types),
        "embed_scale": math.sqrt(shared["hidden_size"]),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or 256),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "qk_norm": True,
        "max_position_embeddings": int(raw.get("max_position_embeddings", 2048)),
    }


#: Gemma 3's local layers: one global layer in six and a local RoPE base of 10000, which llama.cpp hardcodes
#: unless the file names them (`attention.sliding_window_pattern`, `rope.freq_base_swa`).
GEMMA3_PATTERN, GEMMA3_LOCAL_ROPE_BASE = 6, 10_000.0


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    full_rotary(meta, config)
    layers, window = config["num_hidden_layers"], meta.integer("attention.sliding_window", 0)
    pattern = meta.key("attention.sliding_window_pattern", GEMMA3_PATTERN)
    if isinstance(pattern, list):  # one flag per layer: true where the layer is local
        if len(pattern) != layers:
            raise ModelLoadError(f"sliding_window_pattern names {len(pattern)} layers of {layers}")
        local = [bool(flag) for flag in pattern]
    else:
        period = meta.integer("attention.sliding_window_pattern", GEMMA3_PATTERN)
        local = [period == 0 or i % period < period - 1 for i in range(layers)]  # 0: every layer, as llama.cpp
    if not window:
        local = [False] * layers
    # llama.cpp scales the queries by 1/sqrt(head_dim), and by 1/sqrt(hidden/heads) on the 62-layer 27B, whose
    # HF config names that as query_pre_attn_scalar.
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    scalar = hidden // heads if layers == 62 else config["head_dim"]
    extra: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "rope_theta": meta.number("rope.freq_base", 1_000_000.0),
        "rope_local_base_freq": meta.number("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE),
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if is_local else "full_attention" for is_local in local],
        "query_pre_attn_scalar": scalar,
        "rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon", 1e-6),
    }
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if meta.key(name, None) is not None:
            raise ModelLoadError(f"{meta.arch}.{name} is set: logit softcapping is not supported "
                                 f"(Gemma 3 checkpoints leave it unset)")
        extra[name] = None
    return extra


ARCHITECTURE = "Gemma3ForCausalLM"
FAMILY = Family(
    model_type="gemma3_text", architectures=(ARCHITECTURE,), layer=layer, config_fields=config_fields,
    rope=RopeReading(default_theta=1_000_000.0, local_theta=LOCAL_THETA), norm_offset=1.0,
    gguf=GgufFamily("gemma3", ARCHITECTURE, "gemma3_text", GGUF_LAYER, gguf_fields, norm_offset=1.0),
)
