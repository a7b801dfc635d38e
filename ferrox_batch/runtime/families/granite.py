"""IBM Granite 3.x (dense): the Llama layer with four multipliers.

The embeddings are multiplied by `embedding_multiplier`, attention scores by `attention_multiplier` (in
place of `head_dim ** -0.5`; its reference's default is 1), what each block adds to the residual stream by
`residual_multiplier`, and the logits divided by `logits_scaling`. llama.cpp writes them as
`granite.embedding_scale`, `granite.attention.scale`, `granite.residual_scale` and `granite.logit_scale`,
and permutes the Q/K rows as it does Llama's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.family import Family, ModelShape
from ferrox_batch.runtime.families.gguf_metadata import LLAMA_LAYER, ConfigTensors, GgufFamily, Meta, full_rotary
from ferrox_batch.runtime.families.layer_spec import LayerSpec


@dataclass(frozen=True, slots=True)
class GraniteOptions:
    """Granite's own settings: the ones its layers read (the other two are the shared embedding and logits
    scales)."""

    attention_multiplier: float
    residual_multiplier: float


def _multiplier(raw: Mapping[str, Any], name: str) -> float:
    value = raw.get(name, 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelLoadError(f"config field {name} must be a positive number, got {value!r}")
    return float(value)


def config_fields(raw: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    if raw.get("mlp_bias"):
        raise ModelLoadError("mlp_bias is not supported: this runtime's MLP projections have no biases")
    return {
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),  # its reference's default, not Llama's
        "embed_scale": _multiplier(raw, "embedding_multiplier"),
        "logits_scaling": _multiplier(raw, "logits_scaling"),
        "options": GraniteOptions(attention_multiplier=_multiplier(raw, "attention_multiplier"),
                                  residual_multiplier=_multiplier(raw, "residual_multiplier")),
    }


def layer(c: ModelShape, i: int) -> LayerSpec:
    """Layer `i` of a Granite checkpoint."""
    own = c.options
    if not isinstance(own, GraniteOptions):
        raise ModelLoadError("a Granite layer needs its multipliers (a config read by the granite family)")
    return LayerSpec(prefix=f"model.layers.{i}.", hidden=c.hidden_size,
                     mixer=llama.attention(c, i, scale=own.attention_multiplier), ffn=llama.gated_mlp(c),
                     residual_scale=own.residual_multiplier)


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    """The multipliers as llama.cpp reads them: the logit scale required, the others optional, a missing
    (or zero) one meaning no scaling, and a missing attention scale `head_dim ** -0.5`."""
    full_rotary(meta, config)
    logit_scale = meta.number("logit_scale")

    def optional(key: str, default: float) -> float:
        value = meta.number(key, 0.0)
        return value if value else default

    return {"embedding_multiplier": optional("embedding_scale", 1.0),
            "attention_multiplier": optional("attention.scale", config["head_dim"] ** -0.5),
            "residual_multiplier": optional("residual_scale", 1.0),
            "logits_scaling": logit_scale}


ARCHITECTURE = "GraniteForCausalLM"
FAMILY = Family(
    model_type="granite", architectures=(ARCHITECTURE,), layer=layer, config_fields=config_fields,
    gguf=GgufFamily("granite", ARCHITECTURE, "granite", LLAMA_LAYER, gguf_fields, permuted_qk=True),
)
