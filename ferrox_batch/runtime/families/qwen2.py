"""Qwen2: the Llama layer with biases on the Q, K and V projections (on unless the config turns them off)
and a sliding window only where `use_sliding_window` is set."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.family import Family
from ferrox_batch.runtime.families.gguf_metadata import LLAMA_LAYER, ConfigTensors, GgufFamily, Meta, full_rotary


def config_fields(raw: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": bool(raw.get("attention_bias", True)), **llama.no_window_unless_used(raw, shared)}


def gguf_fields(meta: Meta, config: dict[str, Any], tensors: ConfigTensors) -> dict[str, Any]:
    """llama.cpp keeps no window for Qwen2 or Qwen3 (their HF configs leave it off)."""
    full_rotary(meta, config)
    return {"use_sliding_window": False, "sliding_window": None}


ARCHITECTURE = "Qwen2ForCausalLM"
FAMILY = Family(
    model_type="qwen2", architectures=(ARCHITECTURE,), layer=llama.layer, config_fields=config_fields,
    gguf=GgufFamily("qwen2", ARCHITECTURE, "qwen2", LLAMA_LAYER, gguf_fields,
                    biased=frozenset({"attn_q", "attn_k", "attn_v"})),
)
