"""How llama.cpp writes Gemma 4 (`gemma4`) as GGUF, and what its loader reads of it, as the HF config.

llama.cpp's converter (Gemma4Model) writes the global layers' head size as `attention.key_length` and the
local layers' as `key_length_swa`, the KV heads one a layer where the two kinds differ
(`attention.head_count_kv` as an array), the MLP widths one a layer where the KV-sharing layers' are double
(`feed_forward_length`), which layers slide as one flag a layer (`attention.sliding_window_pattern`), the
last `attention.shared_kv_layers` layers as sharing K/V, `embedding_length_per_layer_input`, both RoPE
bases, and the global layers' proportional RoPE as a `rope_freqs` tensor: a factor of 1 for each rotated
pair and 1e30 (no rotation) for the rest. Its norms are stored as they are (Gemma 4's multiply by the
weight, no offset), the per-layer inputs under `per_layer_*` and `inp_gate` / `proj` / `post_norm`, the
layer scalar as `layer_output_scale`, and the mixture beside each MLP as `ffn_gate_inp` (the router, its
scale `ffn_gate_inp.scale`), `ffn_gate_up_exps` and `ffn_down_exps` (each expert's scale
`ffn_down_exps.scale`), in transformers' own shapes.

llama.cpp hardcodes what is not in the file: scores unscaled (1.0), GELU (tanh), the embeddings scaled by
the square root of their width, softmax routing with the top k renormalised. It reads V as K on a layer
whose `attn_v` is absent, and a mixture on a layer with a router. What transformers' Gemma 4 cannot be, and
so this runtime cannot serve, is refused naming the key or tensor: a last layer that slides, V from K on a
local layer or on only some global ones, the mixture on only some layers, heads or widths differing where
transformers has one value, partial rotation on the local layers, any other RoPE factors or scaling.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import numpy as np

from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.gguf_metadata import QK_NORMS, ConfigTensors, GgufFamily, Meta

#: llama.cpp's layer tensors -> transformers' names after `model.layers.{i}.`.
GGUF_LAYER = MappingProxyType({
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", **QK_NORMS,
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm", "layer_output_scale": "layer_scalar",
    "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm",
    "ffn_gate_inp": "router.proj", "ffn_gate_up_exps": "experts.gate_up_proj", "ffn_down_exps": "experts.down_proj",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2", "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
})
#: The router's and the experts' scales, which llama.cpp names `.scale` beside those tensors' `.weight`.
SCALES = MappingProxyType({"ffn_gate_inp": "router.scale", "ffn_down_exps": "router.per_expert_scale"})
#: The per-layer inputs' tensors outside the layers.
GLOBALS = MappingProxyType({"per_layer_token_embd": "model.embed_tokens_per_layer",
                            "per_layer_model_proj": "model.per_layer_model_projection",
                            "per_layer_proj_norm": "model.per_layer_projection_norm"})
#: The factor the converter gives each pair proportional RoPE leaves unrotated (its angle divided by it).
UNROTATED = 1e30
SLIDING, FULL = "sliding_attention", "full_attention"


def _per_layer(meta: Meta, name: str, layers: int, default: int | None = None) -> list[int]:
    """A key llama.cpp reads as one value for every layer or an array of one a layer (required where no
    `default`)."""
    value = meta.key(name) if default is None else meta.key(name, default)
    if not isinstance(value, list):
        return [_integer(meta, name, value)] * layers
    if len(value) != layers:
        raise ModelLoadError(f"{meta.arch}.{name} names {len(value)} layers of {layers}")
    return [_integer(meta, name, v) for v in value]


def _integer(meta: Meta, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 0:
        raise ModelLoadError(f"metadata key {meta.arch}.{name} must hold non-negative integers, got {value!r}")
    return int(value)


def _one(meta: Meta, name: str, values: list[int], what: str) -> int:
    """The one value `values` must hold (transformers has one where llama.cpp allows one a layer)."""
    if len(set(values)) != 1:
        raise ModelLoadError(f"{meta.arch}.{name} differs across {what}: {values}; Gemma 4 has one value there")
    return values[0]


def _partial_rotary(meta: Meta, tensors: ConfigTensors, head_dim: int) -> float:
    """The global layers' share of pairs rotated: `rope_freqs` as the converter writes it (module docstring)."""
    if "rope_freqs" not in tensors:
        raise ModelLoadError("rope_freqs.weight is missing: llama.cpp's gemma4 reads the global layers' "
                             "proportional RoPE from it")
    factors = tensors["rope_freqs"]
    if factors.shape != (head_dim // 2,):
        raise ModelLoadError(f"rope_freqs.weight has shape {factors.shape}, expected ({head_dim // 2},): one "
                             f"factor for each pair of the global layers' heads")
    rotated = int(np.sum(factors == 1.0))
    pattern = np.concatenate([np.ones(rotated), np.full(head_dim // 2 - rotated, UNROTATED)]).astype(np.float32)
    if rotated == 0 or not np.array_equal(factors, pattern):
        raise ModelLoadError(f"rope_freqs.weight holds {factors[:8].tolist()}...: only proportional RoPE is read "
                             f"(factors of 1 for the pairs rotated, then {UNROTATED:g} for the rest)")
    partial = rotated / (head_dim // 2)
    if int(partial * head_dim // 2) != rotated:
        raise ModelLoadError(f"rope_freqs.weight rotates {rotated} of {head_dim // 2} pairs, which no "
                             f"partial_rotary_factor gives back exactly")
    return partial


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    """The config llama.cpp's gemma4 reads (module docstring)."""
    layers = config["num_hidden_layers"]
    pattern = meta.key("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ModelLoadError(f"{meta.arch}.attention.sliding_window_pattern must be one flag for each of the "
                             f"{layers} layers, got {pattern!r}")
    types = [SLIDING if flag else FULL for flag in pattern]
    if types[-1] != FULL:
        raise ModelLoadError(f"{meta.arch}.attention.sliding_window_pattern makes the last layer slide, which "
                             f"Gemma 4 never does (its last layer attends globally)")
    full_dim, local_dim = config["head_dim"], meta.integer("attention.key_length_swa")
    if meta.integer("attention.value_length_swa") != local_dim:
        raise ModelLoadError(f"{meta.arch}.attention.value_length_swa differs from key_length_swa")
    if meta.integer("rope.dimension_count", full_dim) != full_dim:
        raise ModelLoadError(f"{meta.arch}.rope.dimension_count must be key_length ({full_dim}): the global "
                             f"layers' rotation is read from rope_freqs alone")
    # llama.cpp rotates the local layers' first `rope.dimension_count` dimensions where the file names none.
    if meta.integer("rope.dimension_count_swa", full_dim) != local_dim:
        raise ModelLoadError(f"{meta.arch}.rope.dimension_count_swa must be key_length_swa ({local_dim}): partial "
                             f"rotation on the local layers is not supported")
    if config["rope_scaling"] is not None:
        raise ModelLoadError(f"{meta.arch}.rope.scaling.type {config['rope_scaling']['rope_type']!r}: scaled RoPE "
                             f"is not read for Gemma 4")
    heads = _one(meta, "attention.head_count", _per_layer(meta, "attention.head_count", layers), "layers")
    kv = _per_layer(meta, "attention.head_count_kv", layers, heads)
    local_kv = _one(meta, "attention.head_count_kv", [kv[i] for i in range(layers) if types[i] == SLIDING]
                    or [config["num_key_value_heads"]], "the local layers")
    global_kv = _one(meta, "attention.head_count_kv", [kv[i] for i in range(layers) if types[i] == FULL],
                     "the global layers")
    shared = meta.integer("attention.shared_kv_layers", 0)
    if not 0 <= shared < layers:
        raise ModelLoadError(f"{meta.arch}.attention.shared_kv_layers is {shared} of {layers} layers")
    widths = _per_layer(meta, "feed_forward_length", layers)
    width = _one(meta, "feed_forward_length", widths[:layers - shared], "the layers writing K/V")
    tail = set(widths[layers - shared:])
    if tail - {width} and tail != {2 * width}:
        raise ModelLoadError(f"{meta.arch}.feed_forward_length gives the K/V-sharing layers {sorted(tail)}: Gemma 4 "
                             f"gives them {width} or, double-wide, {2 * width}")
    cap = meta.number("final_logit_softcapping", 0.0)
    base = config["rope_theta"]  # rope.freq_base, 10,000 where the file names none (as llama.cpp reads it)
    local_base = meta.number("rope.freq_base_swa", 10_000.0)
    return {
        "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
        "num_attention_heads": heads, "num_key_value_heads": local_kv, "head_dim": local_dim,
        # as transformers writes it: the global layers' KV heads only where they differ from the local ones'
        "per_layer_config": {str(i): {"head_dim": full_dim, **({"num_key_value_heads": global_kv}
                                                               if global_kv != local_kv else {})}
                             for i in range(layers) if types[i] == FULL},
        "intermediate_size": width, "use_double_wide_mlp": bool(shared) and tail == {2 * width},
        "num_kv_shared_layers": shared, "layer_types": types,
        "sliding_window": meta.integer("attention.sliding_window"),
        "hidden_size_per_layer_input": meta.integer("embedding_length_per_layer_input"),
        "final_logit_softcapping": cap or None,  # llama.cpp caps where the value is set and not zero
        "rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon"),
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": local_base},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": _partial_rotary(meta, tensors, full_dim),
                   "rope_theta": base}},
    }


def tensor_fields(meta: Meta, config: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """V from K (`attention_k_eq_v`) where the global layers writing K/V have no `attn_v`, and the mixture
    (`enable_moe_block`) where the layers have a router: each on all such layers or none, as in Gemma 4."""
    layers, types = config["num_hidden_layers"], config["layer_types"]
    writers = range(layers - config["num_kv_shared_layers"])
    no_v = {i for i in writers if f"blk.{i}.attn_v.weight" not in names}
    if any(types[i] == SLIDING for i in no_v):
        raise ModelLoadError(f"blk.{min(i for i in no_v if types[i] == SLIDING)}.attn_v.weight is missing: V from "
                             f"K is read on the global layers only")
    full_writers = {i for i in writers if types[i] == FULL}
    if no_v and no_v != full_writers:
        raise ModelLoadError(f"blk.{min(no_v)}.attn_v.weight is missing but blk.{min(full_writers - no_v)}."
                             f"attn_v.weight is not: V from K is read on every global layer or none")
    routed = {i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names}
    out: dict[str, Any] = {"attention_k_eq_v": bool(no_v), "enable_moe_block": bool(routed)}
    if not routed:
        return out
    if len(routed) != layers:
        raise ModelLoadError(f"blk.{min(set(range(layers)) - routed)}.ffn_gate_inp.weight is missing: Gemma 4 has "
                             f"the mixture of experts on every layer or none")
    experts, used = meta.integer("expert_count"), meta.integer("expert_used_count")
    if not 0 < used <= experts:
        raise ModelLoadError(f"metadata keys {meta.arch}.expert_count ({experts}) and expert_used_count ({used}): "
                             f"between 1 and all of the experts must be used")
    width = _one(meta, "expert_feed_forward_length", _per_layer(meta, "expert_feed_forward_length", layers), "layers")
    if width <= 0:
        raise ModelLoadError(f"metadata key {meta.arch}.expert_feed_forward_length is {width}: it must be positive")
    return {**out, "num_experts": experts, "top_k_experts": used, "moe_intermediate_size": width}


GGUF = GgufFamily("gemma4", "Gemma4ForCausalLM", "gemma4_text", GGUF_LAYER, gguf_fields,
                  config_tensors=frozenset({"rope_freqs"}), bare=frozenset({"layer_output_scale", "ffn_gate_up_exps",
                                                                           "ffn_down_exps"}),
                  global_tensors=GLOBALS, scales=SCALES, vocab_fields=("vocab_size_per_layer_input",),
                  layer_arrays=frozenset({"attention.head_count", "attention.head_count_kv", "feed_forward_length"}),
                  tensor_fields=tensor_fields)
