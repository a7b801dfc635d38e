"""`ModelConfig`: the shape of a decoder, read from a Hugging Face `config.json`.

The families the runtime runs share one shape (GQA, RMSNorm, a gated MLP, RoPE) and differ in switches,
each a field here: Llama (RoPE with optional scaling, tied or separate embeddings), Qwen2 (biases on the
Q/K/V projections), Mistral (a sliding window), Qwen3 (an RMSNorm on each head's queries and keys before
RoPE, and a head size of its own), SmolLM3 (RoPE skipped on some layers), Phi-3 (RoPE on part of each
head, longrope scaling) and Gemma 3 (local layers with their own window and RoPE base, a GELU MLP, scaled
embeddings, its own attention scale). How each family's weights become a layer is its own module
(`architectures`). Anything else is refused here, by name, before any weight is read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ferrox_batch.runtime.errors import ModelLoadError, UnsupportedArchitecture
from ferrox_batch.runtime.rope_layout import rope_settings
from ferrox_batch.runtime.rope_scaling import RopeScaling

#: Hugging Face architecture -> family (the `model_type` a config of it carries).
SUPPORTED_ARCHITECTURES: Mapping[str, str] = MappingProxyType({
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3_text",
})

#: The most positions a model may be served at: float32 holds every integer up to 2**24 exactly, and the RoPE
#: angles (here as in the reference) are float32 positions times frequencies; past it positions would round
#: together. The longest contexts published are below it (Llama 4 Scout's: 10,485,760).
MAX_POSITIONS = 2**24

#: The MLP gate activations a layer may use: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    #: An RMSNorm (weights of `head_dim`) on each head's queries and keys, before RoPE (Qwen3).
    qk_norm: bool = False
    #: Per layer, whether it rotates its queries and keys (SmolLM3's NoPE layers do not); None: every layer.
    rope_layers: tuple[bool, ...] | None = None
    #: Per layer, whether its attention is local, over the last `sliding_window` positions (Gemma 3's five
    #: layers of six); None: every layer is, when there is a window.
    window_layers: tuple[bool, ...] | None = None
    #: The RoPE base of the local (windowed) layers, when it differs from the global ones' (Gemma 3); those
    #: layers are never scaled.
    local_rope_theta: float | None = None
    #: The share of each head's dimensions that RoPE rotates (Phi-3: the first 3/4 on Phi-4-mini).
    partial_rotary_factor: float = 1.0
    hidden_act: str = "silu"
    #: What the embeddings are multiplied by (Gemma 3: the square root of the hidden size).
    embed_scale: float = 1.0
    #: Attention scores are scaled by `query_pre_attn_scalar ** -0.5` (Gemma 3); None: `head_dim ** -0.5`.
    query_pre_attn_scalar: float | None = None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions RoPE rotates (even; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor) // 2 * 2

    def rope_kind(self, layer: int) -> str:
        """Which RoPE tables `layer` uses: "global", "local" (the windowed layers' own base) or "none"."""
        if not self.rotates(layer):
            return "none"
        if self.local_rope_theta is not None and self.window(layer) is not None:
            return "local"
        return "global"

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def window(self, layer: int) -> int | None:
        """The sliding window `layer` attends over (its last positions, itself included); None: global."""
        if self.window_layers is not None and not self.window_layers[layer]:
            return None
        return self.sliding_window

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer slides by the same one (Mistral-style), else None: only then can a
        sequence give back the pages behind it."""
        if self.sliding_window is None or (self.window_layers is not None and not all(self.window_layers)):
            return None
        return self.sliding_window

    def rotates(self, layer: int) -> bool:
        """Whether `layer` applies RoPE to its queries and keys."""
        return self.rope_layers is None or self.rope_layers[layer]

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"config field {name} must be a positive integer, got {value!r}")
        if self.max_position_embeddings > MAX_POSITIONS:
            raise ModelLoadError(f"max_position_embeddings {self.max_position_embeddings} (with its RoPE scaling's "
                                 f"stretch) is past the {MAX_POSITIONS} positions float32 RoPE angles tell apart")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ModelLoadError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.window_layers is not None and len(self.window_layers) < self.num_layers:
            raise ModelLoadError(f"layer_types names {len(self.window_layers)} layers, fewer than the "
                                 f"{self.num_layers} the model has")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2:
            raise ModelLoadError(f"partial_rotary_factor {self.partial_rotary_factor} leaves no dimension to rotate "
                                 f"in a head of {self.head_dim}")
        if int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ModelLoadError(f"partial_rotary_factor {self.partial_rotary_factor} rotates an odd number of a "
                                 f"head's {self.head_dim} dimensions, which is not supported")
        s = self.rope_scaling
        if s is not None and s.kind == "longrope" and len(s.short_factor) != self.rotary_dim // 2:
            raise ModelLoadError(f"longrope names {len(s.short_factor)} factors for the {self.rotary_dim // 2} "
                                 f"frequencies a head rotates")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"hidden activation {self.hidden_act!r} is not supported "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ModelLoadError(f"query_pre_attn_scalar must be positive, got {self.query_pre_attn_scalar}")
        if self.rope_layers is not None and len(self.rope_layers) < self.num_layers:
            raise ModelLoadError(f"no_rope_layers names {len(self.rope_layers)} layers, fewer than the "
                                 f"{self.num_layers} the model has")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, checkpoint_layers: int | None = None) -> "ModelConfig":
        """The config `raw` describes. `checkpoint_layers`, where known, is how many layers the checkpoint's
        tensors hold: `num_hidden_layers` must name as many, checked before anything is built per layer (a
        config's word alone never sizes an allocation)."""
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch is None:
            model_type = raw.get("model_type")
            arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}.get(model_type, model_type)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitecture(str(arch), sorted(SUPPORTED_ARCHITECTURES))
        family = SUPPORTED_ARCHITECTURES[arch]
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            if checkpoint_layers is not None and layers != checkpoint_layers:
                raise ModelLoadError(f"num_hidden_layers is {layers} but the checkpoint's tensors hold "
                                     f"{checkpoint_layers} layers")
            head_dim = raw.get("head_dim") or hidden // heads
            trained = int(raw.get("max_position_embeddings", 2048))
            window = raw.get("sliding_window")
            if family in ("qwen2", "qwen3", "smollm3") and not raw.get("use_sliding_window", False):
                window = None
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            fields: dict[str, Any] = {}
            if family == "gemma3_text":
                fields = _gemma3_fields(raw, hidden, layers)
            rope = rope_settings(raw, family, trained)
            if family == "smollm3":
                fields["rope_layers"] = _rope_layers(raw, layers)
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                rope_theta=rope.theta,
                rope_scaling=rope.scaling,
                partial_rotary_factor=rope.partial_rotary_factor,
                local_rope_theta=rope.local_theta,
                # Gemma 3's `max_position_embeddings` already counts its linear scaling.
                max_position_embeddings=trained if family == "gemma3_text" else _servable_positions(trained,
                                                                                                  rope.scaling),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", family == "gemma3_text")),
                attention_bias=bool(raw.get("attention_bias", family == "qwen2")),
                sliding_window=int(window) if window else None,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                qk_norm=family in ("qwen3", "gemma3_text"),
                hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
                **fields,
            )
        except KeyError as missing:
            raise ModelLoadError(f"config.json is missing the field {missing.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError, ArithmeticError) as bad:
            raise ModelLoadError(f"config.json has a malformed field: {bad}") from None

    @classmethod
    def from_file(cls, path: str | Path, *, checkpoint_layers: int | None = None) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelLoadError(f"no config.json at {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as bad:
            raise ModelLoadError(f"{path} is not valid JSON: {bad}") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path} must hold a JSON object")
        return cls.from_dict(raw, checkpoint_layers=checkpoint_layers)


def _rope_layers(raw: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """SmolLM3's `no_rope_layers` (1: the layer uses RoPE, 0: it does not), or every `no_rope_layer_interval`-th
    layer without RoPE when the list is absent (its default: 4)."""
    listed = raw.get("no_rope_layers")
    if listed is None:
        interval = int(raw.get("no_rope_layer_interval") or 4)
        return tuple((i + 1) % interval != 0 for i in range(layers))
    return tuple(bool(int(flag)) for flag in listed)


def _servable_positions(trained: int, scaling: RopeScaling | None) -> int:
    """The positions a model can be served at: its `max_position_embeddings`, stretched by the RoPE
    scaling where the config names the pretrained context instead of the stretched one (as vLLM reads
    them: linear and dynamic scale `max_position_embeddings`, yarn the original context)."""
    if scaling is None:
        return trained
    if scaling.kind in ("linear", "dynamic"):
        return int(trained * scaling.factor)
    if scaling.kind == "yarn":
        assert scaling.original_max_position_embeddings is not None
        return max(trained, int(scaling.original_max_position_embeddings * scaling.factor))
    return trained


def _gemma3_fields(raw: dict[str, Any], hidden: int, layers: int) -> dict[str, Any]:
    """Gemma 3's own switches: which layers are local (`layer_types`, or one global layer in every
    `sliding_window_pattern`), the GELU MLP, the scaled embeddings and the attention scale (each layer
    kind's RoPE is `rope_layout`'s)."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(name) is not None:
            raise ModelLoadError(f"{name} is not supported (Gemma 3 checkpoints leave it unset)")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError("bidirectional attention is not supported: this runtime generates causally")
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ModelLoadError(f"layer_types names kinds this runtime does not run: {sorted(unknown)}")
    return {
        "window_layers": tuple(kind == "sliding_attention" for kind in types),
        "embed_scale": math.sqrt(hidden),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or 256),
    }
