"""`Family`: everything the runtime knows about one family of checkpoints, in one value its module exports.

A family module (`families.llama`, `families.gemma3`, ...) names: the Hugging Face architectures and
`model_type` it claims, the config fields it reads beyond the shared ones (into the shared `ModelConfig`
fields and, where it has settings of its own, its own small options value), how its reference reads RoPE,
what its checkpoint's norms are offsets from, how llama.cpp writes it as GGUF, and its layer `i` as a
`LayerSpec` over shared blocks. The registry (`families.registry`) lists the families; the config reader,
the GGUF reader, the decoder and the test fixtures ask it, and none of them names a family.

`ModelShape` is what a layer spec reads of a config: `ModelConfig` has it (the families sit below the
config, which is built from what they read).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.gguf_metadata import GgufFamily
from ferrox_batch.runtime.families.layer_spec import LayerSpec
from ferrox_batch.runtime.families.moe_config import MoeShape
from ferrox_batch.runtime.families.rope_layout import RopeReading


class ModelShape(Protocol):
    """The shared config as a layer spec reads it (`ModelConfig`)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rotary_dim(self) -> int: ...
    @property
    def attention_scale(self) -> float: ...
    @property
    def attention_bias(self) -> bool: ...
    @property
    def hidden_act(self) -> str: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def options(self) -> object | None: ...
    @property
    def moe(self) -> MoeShape | None: ...
    @property
    def per_layer_input_size(self) -> int: ...
    def window(self, layer: int) -> int | None: ...
    def rope_kind(self, layer: int) -> str: ...
    def layer_head_dim(self, layer: int) -> int: ...
    def layer_kv_heads(self, layer: int) -> int: ...
    def kv_of(self, layer: int) -> int: ...


#: A family's own config fields: `ModelConfig` field values read from the raw `config.json`, given the shared
#: ones `families.config_reading` read (which they replace where the family reads a field its own way), and
#: `options` among them where the family has settings of its own.
ConfigFields = Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]
#: A family's layer `i` of a model of this shape.
LayerOf = Callable[[ModelShape, int], LayerSpec]

#: The tensors outside the layers, by their Hugging Face names.
EMBEDDING, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def per_layer_tensors(c: ModelShape) -> dict[str, tuple[int, ...]]:
    """The per-layer input embedding's tensors outside the layers (`ModelConfig.per_layer_input_size`)."""
    size = getattr(c, "per_layer_input_size", 0)
    if not size:
        return {}
    width = c.num_layers * size
    vocab = getattr(c, "per_layer_vocab_size", 0) or c.vocab_size
    return {"model.embed_tokens_per_layer.weight": (vocab, width),
            "model.per_layer_model_projection.weight": (width, c.hidden_size),
            "model.per_layer_projection_norm.weight": (size,)}


@dataclass(frozen=True, slots=True)
class Wrapped:
    """A checkpoint that holds a family's model inside a larger one (a multimodal checkpoint's text model):
    its config under `config_key`, its tensors under `prefix` where the family's own start `model.`. The
    rest of the checkpoint (the other modalities) is not read."""

    #: The larger checkpoint's architecture, and the family's own it holds.
    architecture: str
    inner: str
    config_key: str
    prefix: str

    def config(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """The inner model's `config.json`, as a checkpoint of it alone would have it."""
        inner = raw.get(self.config_key)
        if not isinstance(inner, Mapping):
            raise ModelLoadError(f"{self.architecture}'s config.json has no {self.config_key} object")
        return {**inner, "architectures": [self.inner]}

    def name(self, name: str) -> str | None:
        """A tensor's name in the inner model (`model.` for `prefix`; the head as it is), None where the
        inner model does not read it."""
        if name.startswith(self.prefix):
            return "model." + name[len(self.prefix):]
        return name if name == LM_HEAD else None


@dataclass(frozen=True, slots=True)
class Family:
    """One family of checkpoints (module docstring)."""

    #: The `model_type` its configs carry.
    model_type: str
    #: The Hugging Face architectures it claims (`config.json`'s `architectures`), the first its own.
    architectures: tuple[str, ...]
    #: Its layer `i`.
    layer: LayerOf
    #: How its reference reads RoPE.
    rope: RopeReading = RopeReading()
    #: Its own config fields, beside the shared ones.
    config_fields: ConfigFields = lambda raw, shared: {}
    #: What its checkpoint's RMSNorm weights are offsets from (Gemma stores `weight - 1`), added at load.
    norm_offset: float = 0.0
    #: How llama.cpp's converter writes it; None where llama.cpp has no such architecture.
    gguf: GgufFamily | None = None

    def layers(self, c: ModelShape) -> list[LayerSpec]:
        return [self.layer(c, i) for i in range(c.num_layers)]

    def tensors(self, c: ModelShape) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of this shape holds, by its Hugging Face name, at its shape there (the
        embedding first, then each layer's, the final norm and the output head where it is not tied)."""
        out: dict[str, tuple[int, ...]] = {EMBEDDING: (c.vocab_size, c.hidden_size)}
        for spec in self.layers(c):
            out.update(spec.tensors())
        for name, shape in per_layer_tensors(c).items():
            out[name] = shape
        out[FINAL_NORM] = (c.hidden_size,)
        if not c.tie_word_embeddings:
            out[LM_HEAD] = (c.vocab_size, c.hidden_size)
        return out
