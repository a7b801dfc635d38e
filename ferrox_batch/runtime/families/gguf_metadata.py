"""How llama.cpp writes a family as GGUF, and the metadata reading every family shares.

llama.cpp's converter gives every family its metadata under its own prefix (`qwen3.embedding_length`),
its tensors llama.cpp's names (`blk.0.attn_q_norm`), and a few value changes: some families have their Q/K
rows permuted, Gemma's RMSNorm weights are stored with the one its norm adds already added, longrope
factors and Llama 3.1's frequency factors are tensors of their own, a fused tensor may be stored as its
parts (Phi-3's Q/K/V), and what llama.cpp hardcodes rather than stores is not in the file at all.
A family module states its own facts as one `GgufFamily` (its architecture name, its layer tensors' names,
its extra config fields from the metadata); this module holds the type and what every family shares:
`Meta` (typed reads under the prefix), `common_config` (the shared fields under llama.cpp's keys) and the
RoPE scaling keys.

Promises: `GgufFamily.config` returns an HF config dict or raises `ModelLoadError` naming the missing or
unsupported metadata; `hf_name` maps every tensor name the family writes, and refuses any other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from ferrox_batch.runtime.families.errors import ModelLoadError

_REQUIRED = object()

#: Tensors outside the layers, llama.cpp's name -> the HF one.
GLOBAL_TENSORS: Mapping[str, str] = MappingProxyType({
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"})

#: The Llama layer's tensors, llama.cpp's name -> the HF module name after `model.layers.{i}.`.
LLAMA_LAYER: Mapping[str, str] = MappingProxyType({
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
})
#: The norms on queries and keys, where a family has them.
QK_NORMS: Mapping[str, str] = MappingProxyType({"attn_q_norm": "self_attn.q_norm",
                                                 "attn_k_norm": "self_attn.k_norm"})


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
    #: Fused layer tensors llama.cpp also reads as separate parts, stacked by rows in the order named (Phi-3's
    #: `attn_qkv` as `attn_q`, `attn_k`, `attn_v`): each part maps to the fused tensor's HF name (`part`).
    parts: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    #: Claims the files of `arch` whose `{arch}.expert_count` is positive (Mixtral, written as `llama`); the
    #: family of that architecture without it claims the rest.
    experts_variant: bool = False
    #: Layer tensors whose HF name has no `.weight` (gpt-oss's `self_attn.sinks`), which llama.cpp's files
    #: name with one (`attn_sinks.weight`).
    bare: frozenset[str] = frozenset()
    #: Tensors outside the layers beyond `GLOBAL_TENSORS` (Gemma 4's per-layer embedding), llama.cpp's name ->
    #: the HF module name.
    global_tensors: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: Layer tensors llama.cpp names `.scale` beside a `.weight` of the same name (Gemma 4's router scale,
    #: `ffn_gate_inp.scale`) -> the HF tensor's full name after `model.layers.{i}.`.
    scales: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: Keys llama.cpp reads as a scalar or one value a layer (`feed_forward_length`): `common_config` takes a
    #: list's first value for them, and the family's `extra` reads them whole.
    layer_arrays: frozenset[str] = frozenset()
    #: Config fields that are the embedding's rows too (the vocabulary), set by the reader beside `vocab_size`.
    vocab_fields: tuple[str, ...] = ()
    #: Config fields that follow from which tensors the file holds (Gemma 4's values from keys where a layer has
    #: no `attn_v`, as llama.cpp reads that layer), after `extra`'s.
    tensor_fields: Callable[[Meta, dict[str, Any], set[str]], dict[str, Any]] | None = None

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF name of a weight tensor (None for a config tensor); ModelLoadError for an unknown one."""
        parts = gguf_name.split(".")
        if len(parts) == 2 and parts[1] == "weight" and parts[0] in self.config_tensors:
            return None
        if len(parts) == 2 and parts[1] == "weight" and parts[0] in self._globals:
            return f"{self._globals[parts[0]]}.weight"
        if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "scale" \
                and parts[2] in self.scales:
            return f"model.layers.{int(parts[1])}.{self.scales[parts[2]]}"
        if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
            short = self._fused.get(parts[2], (parts[2], 0))[0]
            if short in self.bare and parts[3] == "weight":
                return f"model.layers.{int(parts[1])}.{self.layer_tensors[short]}"
            if short in self.layer_tensors and (parts[3] == "weight" or (parts[3] == "bias" and short in self.biased)):
                return f"model.layers.{int(parts[1])}.{self.layer_tensors[short]}.{parts[3]}"
        raise ModelLoadError(f"unexpected tensor {gguf_name!r} for a {self.arch} model")

    def gguf_name(self, hf_name: str) -> str | None:
        """The name this family's files give a weight (`hf_name`'s inverse); None for one they do not hold."""
        pieces = hf_name.split(".", 3)
        if len(pieces) == 4 and pieces[:2] == ["model", "layers"] and pieces[2].isdigit():
            short = next((name for name in self.bare if self.layer_tensors[name] == pieces[3]), None)
            if short is not None:
                return f"blk.{pieces[2]}.{short}.weight"
            short = next((name for name, hf in self.scales.items() if hf == pieces[3]), None)
            if short is not None:
                return f"blk.{pieces[2]}.{short}.scale"
        module, _, suffix = hf_name.rpartition(".")
        by_hf = {hf: name for name, hf in self._globals.items()}
        if module in by_hf:
            return f"{by_hf[module]}.{suffix}"
        pieces = module.split(".", 3)
        if len(pieces) == 4 and pieces[:2] == ["model", "layers"] and pieces[2].isdigit():
            short = next((name for name, hf in self.layer_tensors.items() if hf == pieces[3]), None)
            return None if short is None else f"blk.{pieces[2]}.{short}.{suffix}"
        return None

    @property
    def _globals(self) -> dict[str, str]:
        return {**GLOBAL_TENSORS, **self.global_tensors}

    @property
    def _fused(self) -> dict[str, tuple[str, int]]:
        """Each part's fused tensor and its place among the parts."""
        return {name: (fused, i) for fused, names in self.parts.items() for i, name in enumerate(names)}

    def part(self, gguf_name: str) -> tuple[int, int] | None:
        """(its place, how many parts) for a part of a fused tensor (`blk.0.attn_k.weight`: (1, 3)); None
        for any other tensor."""
        pieces = gguf_name.split(".")
        found = self._fused.get(pieces[2]) if len(pieces) == 4 and pieces[0] == "blk" else None
        return None if found is None else (found[1], len(self.parts[found[0]]))

    def check_parts(self, tensor_names: set[str]) -> None:
        """Each layer holds a fused tensor whole or as every one of its parts: never both, never only some."""
        for name in sorted(tensor_names):
            pieces = name.split(".")
            if len(pieces) != 4 or pieces[0] != "blk" or pieces[2] not in self._fused:
                continue
            fused = self._fused[pieces[2]][0]
            whole = f"blk.{pieces[1]}.{fused}.{pieces[3]}"
            if whole in tensor_names:
                raise ModelLoadError(f"{name} beside {whole}: a file holds the fused tensor or its parts, not both")
            missing = [f"blk.{pieces[1]}.{part}.{pieces[3]}" for part in self.parts[fused]
                       if f"blk.{pieces[1]}.{part}.{pieces[3]}" not in tensor_names]
            if missing:
                raise ModelLoadError(f"{missing[0]} is missing beside {name}: {', '.join(self.parts[fused])} "
                                     f"stand for {fused} only all together")

    def is_norm(self, gguf_name: str) -> bool:
        return gguf_name.split(".")[-2].endswith("norm")

    def config(self, values: Mapping[str, Any], tensor_names: set[str], tensors: ConfigTensors) -> dict[str, Any]:
        """The HF `config.json` of the checkpoint this file was converted from."""
        meta = Meta(values, self.arch)
        config = common_config(meta, self, tensor_names)
        held = max((int(name.split(".")[1]) for name in tensor_names
                    if name.startswith("blk.") and name.split(".")[1].isdigit()), default=-1) + 1
        if config["num_hidden_layers"] != held:  # checked before anything is built per layer
            raise ModelLoadError(f"metadata key {self.arch}.block_count is {config['num_hidden_layers']} but the "
                                 f"file's tensors hold {held} layers")
        self.check_parts(tensor_names)
        if self.biased:  # Qwen2's biases: present on every layer or none (the shape check holds them to it)
            config["attention_bias"] = any(f"blk.0.{short}.bias" in tensor_names for short in self.biased)
        config.update(self.extra(meta, config, tensors))
        if self.tensor_fields is not None:
            config.update(self.tensor_fields(meta, config, tensor_names))
        return config


def common_config(meta: Meta, family: GgufFamily, tensor_names: set[str]) -> dict[str, Any]:
    """The fields every family shares, under llama.cpp's keys."""
    def integer(name: str, default: Any = _REQUIRED) -> int:
        value = meta.key(name, default)
        if isinstance(value, list) and name in family.layer_arrays and value:
            return Meta({f"{meta.arch}.{name}": value[0]}, meta.arch).integer(name)  # `extra` reads it whole
        return meta.integer(name, default)

    hidden, heads = meta.integer("embedding_length"), integer("attention.head_count")
    if heads <= 0 or hidden <= 0:
        raise ModelLoadError(f"{meta.arch}.embedding_length and attention.head_count must be positive")
    head_dim = meta.integer("attention.key_length", hidden // heads)
    if meta.integer("attention.value_length", head_dim) != head_dim:
        raise ModelLoadError("attention.value_length differs from key_length: not a model this runtime runs")
    if "rope_freqs.weight" in tensor_names and "rope_freqs" not in family.config_tensors:
        raise ModelLoadError(f"rope_freqs (per-frequency RoPE factors) is not read for a {meta.arch} model")
    return {
        "architectures": [family.hf_architecture],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "intermediate_size": integer("feed_forward_length"),
        "num_hidden_layers": meta.integer("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": integer("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta.integer("context_length"),
        "rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": meta.number("rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling(meta),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        # llama.cpp writes no output.weight when the head reuses the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }


def rope_scaling(meta: Meta) -> dict[str, Any] | None:
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


def frequency_factors(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any] | None:
    """The `rope_freqs` tensor (llama.cpp's Llama 3.1 scaling, one factor per rotated frequency that its
    rope op divides that frequency's angle by) as a `frequency_factors` RoPE dict; None where the file has
    none. `ModelLoadError` naming the tensor unless it holds exactly one finite, positive factor per rotated
    frequency."""
    if "rope_freqs" not in tensors:
        return None
    values, half = tensors["rope_freqs"], meta.integer("rope.dimension_count", config["head_dim"]) // 2
    if values.ndim != 1 or values.shape[0] != half:
        raise ModelLoadError(f"rope_freqs.weight has shape {values.shape}, expected ({half},): one factor for each "
                             f"of the {half} rotated frequencies")
    if not bool(np.all(np.isfinite(values) & (values > 0))):
        raise ModelLoadError(f"rope_freqs.weight holds factors that are not finite and positive: "
                             f"{values[~(np.isfinite(values) & (values > 0))][:4].tolist()}")
    if config.get("rope_scaling") is not None:
        # llama.cpp would apply both; no checkpoint it converts carries both, so none is read here.
        raise ModelLoadError(f"rope_freqs.weight beside {meta.arch}.rope.scaling.type "
                             f"{config['rope_scaling']['rope_type']!r}: the two together are not supported")
    # The shortest decimal of each float32 factor, which reads back as that float32 exactly.
    return {"rope_type": "frequency_factors", "factors": [float(str(f)) for f in values.astype(np.float32)]}


def full_rotary(meta: Meta, config: dict[str, Any]) -> None:
    rotary = meta.integer("rope.dimension_count", config["head_dim"])
    if rotary != config["head_dim"]:
        raise ModelLoadError(f"partial rotary embeddings ({rotary} of {config['head_dim']}) are only "
                             f"supported for phi3")
