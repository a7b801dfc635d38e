"""Where a `config.json` keeps its RoPE settings, read from either layout transformers writes.

transformers 4 wrote them at the top of the config: `rope_theta`, `rope_scaling` (the variant and its
parameters), `partial_rotary_factor`, `original_max_position_embeddings` and Gemma 3's
`rope_local_base_freq`. transformers 5 writes one `rope_parameters` dict holding them all, and for Gemma 3
one per layer kind (`full_attention`, `sliding_attention`). `rope_settings` reads either layout, or a mix of
the two, to one `RopeSettings` for every family: each value from where transformers 5.25 takes it, and the
family's own default base where no place names one (SmolLM3's is 2,000,000; Gemma 3's 1,000,000 globally
and 10,000 locally; the others' 10,000).

It promises that nothing that changes the rotation is dropped: a setting two places name differently, a key
no variant reads, a variant this runtime does not compute, or a setting the family's reference would drop
though its author plainly meant it (partial rotation outside Phi-3, one flat dict for Gemma 3's two layer
kinds, scaled local layers) is a `ModelLoadError` naming the field. A RoPE read wrong answers fluent
nonsense; a refusal says why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.rope_scaling import RopeScaling, rope_variant, scaling_of

#: The base a family's reference takes where its config names none (the rest: 10,000).
DEFAULT_THETAS: Mapping[str, float] = MappingProxyType({"smollm3": 2_000_000.0, "gemma3_text": 1_000_000.0})
DEFAULT_THETA = 10_000.0
#: Gemma 3's local layers' base where its config names none.
GEMMA3_LOCAL_THETA = 10_000.0
#: Gemma 3's layer kinds, each with its own RoPE dict in transformers 5's layout.
LAYER_KINDS = ("full_attention", "sliding_attention")
#: Phi-3's pretrained context where its config leaves `original_max_position_embeddings` out (its reference's
#: default, which wins over the RoPE dict's own).
PHI3_ORIGINAL_CONTEXT = 4096
#: Phi-3's earlier names for longrope, read as longrope as its reference reads them.
PHI3_LONGROPE_NAMES = ("su", "yarn")
#: The variants that name the context they were pretrained on.
_NAMING_ORIGINAL = ("llama3", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class RopeSettings:
    """Every RoPE setting of a model, wherever its config kept them."""

    theta: float
    scaling: RopeScaling | None = None
    #: The share of each head's dimensions RoPE rotates (Phi-3 only).
    partial_rotary_factor: float = 1.0
    #: The local (windowed) layers' base (Gemma 3); None where every layer uses `theta`.
    local_theta: float | None = None


def rope_settings(raw: Mapping[str, Any], family: str, max_positions: int) -> RopeSettings:
    """The RoPE settings of a config of `family` (a `model_type`), whose `max_position_embeddings` is
    `max_positions`; `ModelLoadError` naming the field for one that cannot be honoured."""
    if family == "gemma3_text":
        return _gemma3(raw, max_positions)
    params, where = _one_dict(raw)
    if family == "phi3" and params.get("rope_type") in PHI3_LONGROPE_NAMES:
        params["rope_type"] = "longrope"
    theta = _agreed(f"{where}.rope_theta", params.get("rope_theta"), "rope_theta", raw.get("rope_theta"))
    partial = _agreed(f"{where}.partial_rotary_factor", params.get("partial_rotary_factor"),
                      "partial_rotary_factor", raw.get("partial_rotary_factor"))
    if family != "phi3":
        _whole_heads(partial, where)
    original = _original(raw, params, where, family)
    return RopeSettings(
        theta=_theta(theta, DEFAULT_THETAS.get(family, DEFAULT_THETA), f"{where}.rope_theta"),
        scaling=scaling_of(params, where, max_positions, original),
        partial_rotary_factor=1.0 if partial is None else float(partial),
    )


def _gemma3(raw: Mapping[str, Any], max_positions: int) -> RopeSettings:
    """Gemma 3: the global layers' base and scaling, and the local layers' own base (never scaled)."""
    params = _dict(raw, "rope_parameters")
    flat = sorted(key for key, value in params.items() if key not in LAYER_KINDS and value is not None)
    if flat:
        # Its reference reads only the per-kind dicts: a flat one would be dropped silently.
        raise ModelLoadError(f"rope_parameters names {', '.join(map(repr, flat))} for every layer, but Gemma 3 keeps "
                             f"one set per layer kind (rope_parameters.full_attention, "
                             f"rope_parameters.sliding_attention)")
    full = _normalised(_dict(params, "full_attention", "rope_parameters"))
    local = _normalised(_dict(params, "sliding_attention", "rope_parameters"))
    where = "rope_parameters.full_attention"
    old = _normalised(_dict(raw, "rope_scaling"))
    for key, value in old.items():  # transformers 4's scaling is the global layers'
        if full.get(key) is not None and full[key] != value:
            raise ModelLoadError(f"rope_scaling.{key} is {value!r} but {where}.{key} is {full[key]!r}: which is "
                                 f"meant is ambiguous")
        full[key] = value
    local_where = "rope_parameters.sliding_attention"
    if rope_variant(local, local_where) != "default":
        raise ModelLoadError(f"{local_where}.rope_type {local['rope_type']!r}: scaled RoPE on Gemma 3's local layers "
                             f"is not supported")
    for place, settings in ((where, full), (local_where, local)):
        _whole_heads(_agreed(f"{place}.partial_rotary_factor", settings.get("partial_rotary_factor"),
                             "partial_rotary_factor", raw.get("partial_rotary_factor")), place)
    theta = _agreed(f"{where}.rope_theta", full.get("rope_theta"), "rope_theta", raw.get("rope_theta"))
    local_theta = _agreed(f"{local_where}.rope_theta", local.get("rope_theta"),
                          "rope_local_base_freq", raw.get("rope_local_base_freq"))
    return RopeSettings(
        theta=_theta(theta, DEFAULT_THETAS["gemma3_text"], f"{where}.rope_theta"),
        scaling=scaling_of(full, where, max_positions, _original(raw, full, where, "gemma3_text")),
        local_theta=_theta(local_theta, GEMMA3_LOCAL_THETA, f"{local_where}.rope_theta"),
    )


def _one_dict(raw: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The config's RoPE dict and its name: transformers 4's `rope_scaling` or transformers 5's
    `rope_parameters` (both only where they agree)."""
    scaling, parameters = _normalised(_dict(raw, "rope_scaling")), _normalised(_dict(raw, "rope_parameters"))
    if scaling and parameters and scaling != parameters:
        # transformers takes `rope_scaling` and drops the other whole (its theta too): neither reading is safe.
        raise ModelLoadError("config.json names both rope_scaling and rope_parameters, and they differ: which is "
                             "meant is ambiguous")
    return (scaling, "rope_scaling") if scaling else (parameters, "rope_parameters")


def _dict(raw: Mapping[str, Any], key: str, parent: str = "") -> dict[str, Any]:
    """`raw[key]`, an object or absent (null: absent)."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        name = f"{parent}.{key}" if parent else key
        raise ModelLoadError(f"{name} must be an object, got {value!r}")
    return dict(value)


def _normalised(params: dict[str, Any]) -> dict[str, Any]:
    """`params` with transformers 4's `type` spelled `rope_type` (which wins where both are given, as in
    transformers) and null values dropped (null reads as absent everywhere)."""
    out = {key: value for key, value in params.items() if value is not None}
    kind = out.pop("type", None)
    if kind is not None:
        out.setdefault("rope_type", kind)
    return out


def _agreed(where: str, value: Any, top: str, top_value: Any) -> Any:
    """One setting named in a RoPE dict (`where`) and at the top of the config (`top`): either, or both
    where they agree."""
    if value is None:
        return top_value
    if top_value is not None and top_value != value:
        raise ModelLoadError(f"{where} is {value!r} but {top} is {top_value!r}: which is meant is ambiguous")
    return value


def _original(raw: Mapping[str, Any], params: Mapping[str, Any], where: str, family: str) -> int | None:
    """The pretrained context a llama3, yarn or longrope scaling stretches. The top-level field wins in the
    reference (Phi-3's default of 4096 where it is absent), so a dict naming another is ambiguous."""
    if params.get("rope_type") not in _NAMING_ORIGINAL:
        return None
    top = raw.get("original_max_position_embeddings")
    implicit = top is None and family == "phi3"
    if implicit:
        top = PHI3_ORIGINAL_CONTEXT
    named = params.get("original_max_position_embeddings")
    if named is not None and top is not None and named != top:
        note = " (Phi-3's default where config.json leaves it out)" if implicit else ""
        raise ModelLoadError(f"{where}.original_max_position_embeddings is {named!r} but "
                             f"original_max_position_embeddings is {top!r}{note}: which is meant is ambiguous")
    chosen = top if top is not None else named
    return None if chosen is None else int(chosen)


def _whole_heads(partial: Any, where: str) -> None:
    """Outside Phi-3 every layer rotates its whole head; a partial rotation asked for is refused, not dropped."""
    if partial is not None and float(partial) != 1.0:
        raise ModelLoadError(f"{where}.partial_rotary_factor {partial!r}: only Phi-3 rotates part of each head here "
                             f"(this family's layers rotate all of it)")


def _theta(value: Any, default: float, where: str) -> float:
    theta = default if value is None else float(value)
    if not (math.isfinite(theta) and theta > 1):
        raise ModelLoadError(f"{where} must be a finite number greater than 1, got {value!r}")
    return theta
