"""`ModelConfig`: the shape of a decoder, read from a Hugging Face `config.json`.

The fields are what the shared blocks read: sizes, RoPE, windows, norms, scales. Which of them a checkpoint
sets, and how, is its family's business (`runtime.families`: one module per family, and the registry that
lists them): `from_dict` asks the registry for the config's family and builds from the fields it reads.
An architecture no family claims is refused here, by name, before any weight is read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ferrox_batch.runtime.families.config_reading import model_config_fields
from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.family import Family
from ferrox_batch.runtime.families.moe_config import MoeShape
from ferrox_batch.runtime.families.registry import BY_ARCHITECTURE, family_of_architecture
from ferrox_batch.runtime.families.rope_scaling import RopeScaling

#: Hugging Face architecture -> family (the `model_type` a config of it carries).
SUPPORTED_ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {name: family.model_type for name, family in BY_ARCHITECTURE.items()})

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
    #: What the output head's logits are divided by (Granite's `logits_scaling`).
    logits_scaling: float = 1.0
    #: The family's own settings, read by its module alone (its small config); None where it has none.
    options: object | None = None
    #: The mixture-of-experts shape, for families with sparse feed-forward layers; None: every layer dense.
    moe: MoeShape | None = None
    #: The head size and KV heads of the full-attention (unwindowed) layers where they differ from the
    #: windowed ones' (Gemma 4); None: `head_dim` and `num_kv_heads` on every layer.
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    #: Proportional RoPE on the global layers (Gemma 4): they rotate their first `partial_rotary_factor`
    #: of each head's pairs, at frequencies spaced over the whole head; the local layers rotate every pair.
    proportional_rope: bool = False
    #: Per layer, the layer whose K/V it attends over: itself where it writes its own, an earlier one where
    #: it only reads (Gemma 4's KV-shared layers, which hold no K/V of their own); None: every layer its own.
    kv_source: tuple[int, ...] | None = None
    #: Logits are `cap * tanh(logits / cap)` (Gemma 4's final softcapping); None: left as they are.
    logit_softcap: float | None = None
    #: The width of each layer's own input embedding (Gemma 4's per-layer inputs), and their vocabulary;
    #: 0: none.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0

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

    def layer_head_dim(self, layer: int) -> int:
        """The head size of `layer`'s queries, keys and values."""
        return self.head_dim if self.global_head_dim is None or self.window(layer) is not None else \
            self.global_head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """How many KV heads `layer` has."""
        return self.num_kv_heads if self.global_kv_heads is None or self.window(layer) is not None else \
            self.global_kv_heads

    def kv_of(self, layer: int) -> int:
        """The layer whose K/V `layer` attends over (itself unless it shares another's)."""
        return layer if self.kv_source is None else self.kv_source[layer]

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that write K/V, in order: the KV store holds theirs alone."""
        return tuple(layer for layer in range(self.num_layers) if self.kv_of(layer) == layer)

    def kv_index(self, layer: int) -> int:
        """Where `layer`'s K/V live among `kv_layers` (its source's place)."""
        return self.kv_layers.index(self.kv_of(layer))

    def rope_shape(self, kind: str) -> tuple[int, int]:
        """`(head_dim, rotary_dim)` of the layers of RoPE kind `kind` (under proportional RoPE the frequencies
        are spaced over the head, `rope.rope_tables`)."""
        if not self.proportional_rope:
            return self.head_dim, self.rotary_dim
        if kind == "local":
            return self.head_dim, self.head_dim
        d = self.global_head_dim or self.head_dim
        return d, int(d * self.partial_rotary_factor) // 2 * 2

    @property
    def family(self) -> str:
        """The `model_type` of the family the architecture belongs to."""
        return self.family_spec.model_type

    @property
    def family_spec(self) -> Family:
        """The family module's `Family` (`runtime.families.registry`)."""
        return family_of_architecture(self.architecture)

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
        if s is not None and s.kind == "frequency_factors" and len(s.frequency_factors) != self.rotary_dim // 2:
            raise ModelLoadError(f"rope_scaling names {len(s.frequency_factors)} frequency factors for the "
                                 f"{self.rotary_dim // 2} frequencies a head rotates")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"hidden activation {self.hidden_act!r} is not supported "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
        if not (math.isfinite(self.logits_scaling) and self.logits_scaling > 0):
            raise ModelLoadError(f"logits_scaling must be a positive number, got {self.logits_scaling}")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ModelLoadError(f"query_pre_attn_scalar must be positive, got {self.query_pre_attn_scalar}")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ModelLoadError(f"the config marks {len(self.moe.sparse_layers)} layers sparse or dense, not the "
                                 f"{self.num_layers} the model has")
        if self.kv_source is not None and (len(self.kv_source) != self.num_layers or any(
                not 0 <= source <= layer or self.kv_of(source) != source
                or self.window(source) != self.window(layer) for layer, source in enumerate(self.kv_source))):
            raise ModelLoadError("each KV-sharing layer must read an earlier layer of its own kind that writes "
                                 "its own K/V")
        if self.global_head_dim is not None and (self.global_head_dim <= 0 or self.global_head_dim % 2):
            raise ModelLoadError(f"global_head_dim must be positive and even for RoPE, got {self.global_head_dim}")
        if self.global_kv_heads is not None and (self.global_kv_heads <= 0 or self.num_heads % self.global_kv_heads):
            raise ModelLoadError(f"the global layers' {self.global_kv_heads} KV heads must divide the "
                                 f"{self.num_heads} query heads")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ModelLoadError(f"final_logit_softcapping must be positive, got {self.logit_softcap}")
        if self.rope_layers is not None and len(self.rope_layers) < self.num_layers:
            raise ModelLoadError(f"no_rope_layers names {len(self.rope_layers)} layers, fewer than the "
                                 f"{self.num_layers} the model has")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, checkpoint_layers: int | None = None) -> "ModelConfig":
        """The config `raw` describes, read by its family (`runtime.families`). `checkpoint_layers`, where
        known, is how many layers the checkpoint's tensors hold: `num_hidden_layers` must name as many."""
        return cls(**model_config_fields(raw, checkpoint_layers=checkpoint_layers))

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
