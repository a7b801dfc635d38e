"""SmolLM3: the Llama layer, with RoPE skipped on some layers (`no_rope_layers`: 1 where a layer rotates,
0 where it does not; every fourth layer without it where the list is absent) and a base of 2,000,000
where the config names none."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.family import Family
from ferrox_batch.runtime.families.gguf_metadata import LLAMA_LAYER, ConfigTensors, GgufFamily, Meta, full_rotary
from ferrox_batch.runtime.families.rope_layout import RopeReading

#: llama.cpp hardcodes SmolLM3's layers without RoPE (its `n_no_rope_layer_step`) rather than storing them.
NO_ROPE_INTERVAL = 4


def rope_layers(raw: Mapping[str, Any], layers: int) -> tuple[bool, ...]:
    """Per layer, whether it rotates: `no_rope_layers`, or every `no_rope_layer_interval`-th layer without RoPE
    when the list is absent."""
    listed = raw.get("no_rope_layers")
    if listed is None:
        interval = int(raw.get("no_rope_layer_interval") or NO_ROPE_INTERVAL)
        return tuple((i + 1) % interval != 0 for i in range(layers))
    return tuple(bool(int(flag)) for flag in listed)


def config_fields(raw: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    return {"rope_layers": rope_layers(raw, shared["num_layers"]), **llama.no_window_unless_used(raw, shared)}


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    full_rotary(meta, config)
    layers = config["num_hidden_layers"]
    return {"use_sliding_window": False, "sliding_window": None, "no_rope_layer_interval": NO_ROPE_INTERVAL,
            "no_rope_layers": [int((i + 1) % NO_ROPE_INTERVAL != 0) for i in range(layers)]}


ARCHITECTURE = "SmolLM3ForCausalLM"
FAMILY = Family(
    model_type="smollm3", architectures=(ARCHITECTURE,), layer=llama.layer, config_fields=config_fields,
    rope=RopeReading(default_theta=2_000_000.0),
    gguf=GgufFamily("smollm3", ARCHITECTURE, "smollm3", LLAMA_LAYER, gguf_fields, permuted_qk=True),
)
