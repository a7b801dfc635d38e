"""A `config.json` read into the shared config's fields: the fields every family shares, then the family's own.

The family is the registry's (`registry.family_of_config`); it reads its own fields and RoPE its own way
(`Family.config_fields`, `Family.rope`). What comes back is the keyword arguments of `ModelConfig`, which
checks them (the config is built above the families, from what they read). Every failure is a
`ModelLoadError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.registry import family_of_config, wrapped_of
from ferrox_batch.runtime.families.rope_scaling import RopeScaling


def model_config_fields(raw: Mapping[str, Any], *, checkpoint_layers: int | None = None) -> dict[str, Any]:
    """`ModelConfig`'s fields as `raw` gives them. `checkpoint_layers`, where known, is how many layers the
    checkpoint's tensors hold: `num_hidden_layers` must name as many, checked before anything is built per
    layer (a config's word alone never sizes an allocation)."""
    wrapped = wrapped_of(raw)
    if wrapped is not None:
        raw = wrapped.config(raw)
    family = family_of_config(raw)
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        if checkpoint_layers is not None and layers != checkpoint_layers:
            raise ModelLoadError(f"num_hidden_layers is {layers} but the checkpoint's tensors hold "
                                 f"{checkpoint_layers} layers")
        trained = int(raw.get("max_position_embeddings", 2048))
        window = raw.get("sliding_window")
        eos = raw.get("eos_token_id")
        fields: dict[str, Any] = {
            "architecture": family.architectures[0] if not raw.get("architectures") else str(raw["architectures"][0]),
            "vocab_size": int(raw["vocab_size"]),
            "hidden_size": hidden,
            "intermediate_size": int(raw["intermediate_size"]),
            "num_layers": layers,
            "num_heads": heads,
            "num_kv_heads": int(raw.get("num_key_value_heads") or heads),
            "head_dim": int(raw.get("head_dim") or hidden // heads),
            "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-5)),
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
            "attention_bias": bool(raw.get("attention_bias", False)),
            "sliding_window": int(window) if window else None,
            "bos_token_id": raw.get("bos_token_id"),
            "eos_token_ids": tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            "hidden_act": str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
        }
        own = family.config_fields(raw, fields)
        rope = family.rope.read(raw, trained)
        fields.update(rope_theta=rope.theta, rope_scaling=rope.scaling, partial_rotary_factor=rope.partial_rotary_factor,
                      local_rope_theta=rope.local_theta,
                      max_position_embeddings=servable_positions(trained, rope.scaling))
        fields.update(own)
        return fields
    except KeyError as missing:
        raise ModelLoadError(f"config.json is missing the field {missing.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError, ArithmeticError) as bad:
        raise ModelLoadError(f"config.json has a malformed field: {bad}") from None


def servable_positions(trained: int, scaling: RopeScaling | None) -> int:
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
