"""What llama.cpp writes for each family it converts, and how it maps back to a Hugging Face checkpoint.

llama.cpp's converter gives every family its metadata under its own prefix (`qwen3.embedding_length`),
its tensors llama.cpp's names (`blk.0.attn_q_norm`), and a few value changes: the Llama-style families
(`llama`, `smollm3`) have their Q/K rows permuted, Gemma 3's RMSNorm weights are stored with the one its
norm adds already added, Phi-3's longrope factors are tensors of their own, and what llama.cpp hardcodes
rather than stores (Gemma 3's local RoPE base and layer pattern, SmolLM3's every-fourth-layer-without-RoPE)
is not in the file at all. This module holds those facts, one `GgufFamily` per `general.architecture`,
and turns a file's metadata into the `config.json` fields `ModelConfig.from_dict` (and transformers) read.

Promises: `FAMILIES` names every architecture `gguf_convert` accepts; `GgufFamily.config` returns an HF
config dict or raises `ModelLoadError` naming the missing or unsupported metadata; `expected_shapes`
lists every tensor the config implies, at its HF shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from ferrox_batch.runtime.errors import ModelLoadError

_REQUIRED = object()

#: Tensors outside the layers, llama.cpp's name -> the HF one.
GLOBAL_TENSORS: Mapping[str, str] = MappingProxyType({
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"})

_LLAMA_LAYER: Mapping[str, str] = MappingProxyType({
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
})
_QK_NORMS: Mapping[str, str] = MappingProxyType({"attn_q_norm": "self_attn.q_norm",
                                                  "attn_k_norm": "self_attn.k_norm"})
# Phi-3 keeps its projections fused, as its HF checkpoints do: `ffn_up` holds gate and up stacked.
_PHI3_LAYER: Mapping[str, str] = MappingProxyType({
    "attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj",
})
# Gemma 3 has norms around both halves; llama.cpp's `ffn_norm` is its pre-feedforward norm, not the Llama
# layer's post-attention one.
_GEMMA3_LAYER: Mapping[str, str] = MappingProxyType({
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", **_QK_NORMS,
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
})


@dataclass(frozen=True, slots=True)
class Meta:
    """A file's metadata, read under its architecture's prefix (`key("embedding_length")`)."""

    values: Mapping[str, Any]
    arch: str

    def key(self, name: str, default: Any = _REQUIRED) -> Any:
        value = self.values.get(f"{self.arch}.{name}")
        if value is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"metadata key {self.arch}.{name} is missing")
            return default
        return value

    def integer(self, name: str, default: Any = _REQUIRED) -> int:
        value = self.key(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ModelLoadError(f"metadata key {self.arch}.{name} must be an integer, got {value!r}")
        return int(value)

    def number(self, name: str, default: Any = _REQUIRED) -> float:
        value = self.key(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"metadata key {self.arch}.{name} must be a number, got {value!r}")
        return float(str(np.float32(value)))  # the shortest decimal of a float32 (1e-05, not 9.99e-06)


#: Global tensors a family turns into config fields (Phi-3's longrope factors), by name, dequantized.
ConfigTensors = Mapping[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class GgufFamily:
    """One `general.architecture` llama.cpp writes, and the HF checkpoint it came from."""

    arch: str
    hf_architecture: str
    model_type: str
    #: llama.cpp's per-layer tensor name -> the HF module name after `model.layers.{i}.`.
    layer_tensors: Mapping[str, str]
    #: Extra config fields for this family, from the metadata (and any `config_tensors`).
    extra: Callable[[Meta, dict[str, Any], ConfigTensors], dict[str, Any]]
    #: Q/K rows were reordered by llama.cpp's Llama permutation (each head's rotary halves interleaved).
    permuted_qk: bool = False
    #: What llama.cpp added to every RMSNorm weight (Gemma stores `1 + weight`); subtracted back here.
    norm_offset: float = 0.0
    #: Layer tensors that may carry a `.bias` (Qwen2's Q/K/V).
    biased: frozenset[str] = frozenset()
    #: Global tensors that hold config, not weights.
    config_tensors: frozenset[str] = frozenset()

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF name of a weight tensor (None for a config tensor); ModelLoadError for an unknown one."""
        parts = gguf_name.split(".")
        if len(parts) == 2 and parts[1] == "weight" and parts[0] in self.config_tensors:
            return None
        if len(parts) == 2 and parts[1] == "weight" and parts[0] in GLOBAL_TENSORS:
            return f"{GLOBAL_TENSORS[parts[0]]}.weight"
        if (len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in self.layer_tensors
                and (parts[3] == "weight" or (parts[3] == "bias" and parts[2] in self.biased))):
            return f"model.layers.{int(parts[1])}.{self.layer_tensors[parts[2]]}.{parts[3]}"
        raise ModelLoadError(f"unexpected tensor {gguf_name!r} for a {self.arch} model")

    def is_norm(self, gguf_name: str) -> bool:
        return gguf_name.split(".")[-2].endswith("norm")

    def config(self, values: Mapping[str, Any], tensor_names: set[str], tensors: ConfigTensors) -> dict[str, Any]:
        """The HF `config.json` of the checkpoint this file was converted from."""
        meta = Meta(values, self.arch)
        config = _common(meta, self, tensor_names)
        held = max((int(name.split(".")[1]) for name in tensor_names
                    if name.startswith("blk.") and name.split(".")[1].isdigit()), default=-1) + 1
        if config["num_hidden_layers"] != held:  # checked before anything is built per layer
            raise ModelLoadError(f"metadata key {self.arch}.block_count is {config['num_hidden_layers']} but the "
                                 f"file's tensors hold {held} layers")
        if self.biased:  # Qwen2's biases: present on every layer or none (the shape check holds them to it)
            config["attention_bias"] = any(f"blk.0.{short}.bias" in tensor_names for short in self.biased)
        config.update(self.extra(meta, config, tensors))
        return config

    def expected_shapes(self, c: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """Every tensor the config implies, by HF name, at its HF shape."""
        h, ff, v, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
        q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q),
                  "mlp.gate_proj": (ff, h), "mlp.up_proj": (ff, h), "mlp.gate_up_proj": (2 * ff, h),
                  "mlp.down_proj": (h, ff), "self_attn.q_norm": (d,), "self_attn.k_norm": (d,)}
        out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = (v, h)
        for i in range(c["num_hidden_layers"]):
            for module in self.layer_tensors.values():
                out[f"model.layers.{i}.{module}.weight"] = shapes.get(module, (h,))  # the rest are norms
            if c.get("attention_bias"):
                for short in self.biased:
                    module = self.layer_tensors[short]
                    out[f"model.layers.{i}.{module}.bias"] = shapes[module][:1]
        return out


def _common(meta: Meta, family: GgufFamily, tensor_names: set[str]) -> dict[str, Any]:
    """The fields every family shares, under llama.cpp's keys."""
    hidden, heads = meta.integer("embedding_length"), meta.integer("attention.head_count")
    if heads <= 0 or hidden <= 0:
        raise ModelLoadError(f"{meta.arch}.embedding_length and attention.head_count must be positive")
    head_dim = meta.integer("attention.key_length", hidden // heads)
    if meta.integer("attention.value_length", head_dim) != head_dim:
        raise ModelLoadError("attention.value_length differs from key_length: not a model this runtime runs")
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError("rope_freqs (llama3-style frequency factors) is not supported by the converter")
    return {
        "architectures": [family.hf_architecture],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "intermediate_size": meta.integer("feed_forward_length"),
        "num_hidden_layers": meta.integer("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.integer("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta.integer("context_length"),
        "rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": meta.number("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        # llama.cpp writes no output.weight when the head reuses the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }


def _rope_scaling(meta: Meta) -> dict[str, Any] | None:
    """`{arch}.rope.scaling.*` as HF's `rope_scaling` (linear and yarn; none is plain RoPE)."""
    kind = meta.key("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta.number("rope.scaling.factor")}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": meta.number("rope.scaling.factor"),
                   "original_max_position_embeddings": meta.integer("rope.scaling.original_context_length")}
        for name in ("beta_fast", "beta_slow"):
            if meta.key(f"rope.scaling.yarn_{name}", None) is not None:
                scaling[name] = meta.number(f"rope.scaling.yarn_{name}")
        return scaling
    raise ModelLoadError(f"rope scaling {kind!r} is not supported by the converter (supported: linear, yarn)")


def _full_rotary(meta: Meta, config: dict[str, Any]) -> None:
    rotary = meta.integer("rope.dimension_count", config["head_dim"])
    if rotary != config["head_dim"]:
        raise ModelLoadError(f"partial rotary embeddings ({rotary} of {config['head_dim']}) are only "
                             f"supported for phi3")


def _llama(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    _full_rotary(meta, config)
    return {"pretraining_tp": 1}


def _qwen(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    """Qwen2 and Qwen3: llama.cpp keeps no window for them (their HF configs leave it off)."""
    _full_rotary(meta, config)
    return {"use_sliding_window": False, "sliding_window": None}


def _smollm3(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    _full_rotary(meta, config)
    # llama.cpp stores no key for it: every fourth layer skips RoPE (its `n_no_rope_layer_step`).
    layers = config["num_hidden_layers"]
    return {"use_sliding_window": False, "sliding_window": None, "no_rope_layer_interval": 4,
            "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(layers)]}


def _phi3(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
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


#: Gemma 3's local layers: one global layer in six and a local RoPE base of 10000, which llama.cpp hardcodes
#: unless the file names them (`attention.sliding_window_pattern`, `rope.freq_base_swa`).
GEMMA3_PATTERN, GEMMA3_LOCAL_ROPE_BASE = 6, 10_000.0


def _gemma3(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    _full_rotary(meta, config)
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


FAMILIES: Mapping[str, GgufFamily] = MappingProxyType({
    "llama": GgufFamily("llama", "LlamaForCausalLM", "llama", _LLAMA_LAYER, _llama, permuted_qk=True),
    "qwen2": GgufFamily("qwen2", "Qwen2ForCausalLM", "qwen2", _LLAMA_LAYER, _qwen,
                        biased=frozenset({"attn_q", "attn_k", "attn_v"})),
    "qwen3": GgufFamily("qwen3", "Qwen3ForCausalLM", "qwen3", MappingProxyType({**_LLAMA_LAYER, **_QK_NORMS}), _qwen),
    "smollm3": GgufFamily("smollm3", "SmolLM3ForCausalLM", "smollm3", _LLAMA_LAYER, _smollm3, permuted_qk=True),
    "phi3": GgufFamily("phi3", "Phi3ForCausalLM", "phi3", _PHI3_LAYER, _phi3,
                       config_tensors=frozenset({"rope_factors_long", "rope_factors_short"})),
    "gemma3": GgufFamily("gemma3", "Gemma3ForCausalLM", "gemma3_text", _GEMMA3_LAYER, _gemma3, norm_offset=1.0),
})
