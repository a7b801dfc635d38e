"""Where a `config.json` keeps its RoPE settings, read from either layout transformers writes.

transformers 4 wrote them at the top of the config: `rope_theta`, `rope_scaling` (the variant and its
parameters), `partial_rotary_factor`, `original_max_position_embeddings` and Gemma 3's
`rope_local_base_freq`. transformers 5 writes one `rope_parameters` dict holding them all, and for Gemma 3
one per layer kind (`full_attention`, `sliding_attention`). `RopeReading.read` reads either layout, or a mix
of the two, to one `RopeSettings`: each value from where transformers 5.25 takes it. What differs between
families (the base where none is named, whether part of each head rotates, older names of a variant, a
per-kind layout) is the `RopeReading` each family module names; this module names no family.

It promises that nothing that changes the rotation is dropped: a setting two places name differently, a key
no variant reads, a variant this runtime does not compute, or a setting the family's reference would drop
though its author plainly meant it (partial rotation where the family rotates whole heads, one flat dict
where it keeps one per layer kind, scaled local layers) is a `ModelLoadError` naming the field. A RoPE read wrong answers fluent
nonsense; a refusal says why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.rope_scaling import RopeScaling, rope_variant, scaling_of

DEFAULT_THETA = 10_000.0
#: The layer kinds of a config that keeps one RoPE dict per kind (Gemma 3), in transformers 5's layout.
LAYER_KINDS = ("full_attention", "sliding_attention")
#: The variants that name the context they were pretrained on.
_NAMING_ORIGINAL = ("llama3", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class RopeSettings:
    """Every RoPE setting of a model, wherever its config kept them."""

    theta: float
    scaling: RopeScaling | None = None
    #: The share of each head's dimensions RoPE rotates (where the family rotates part of each head).
    partial_rotary_factor: float = 1.0
    #: The local (windowed) layers' base, where they have their own; None where every layer uses `theta`.
    local_theta: float | None = None


@dataclass(frozen=True, slots=True)
class RopeReading:
    """How one family's reference reads its RoPE settings: each family module names its own."""

    #: The base where the config names none.
    default_theta: float = DEFAULT_THETA
    #: Whether the family rotates part of each head (`partial_rotary_factor`); elsewhere one below 1 is refused.
    partial_rotation: bool = False
    #: Older names of longrope the reference reads as longrope (Phi-3's "su" and "yarn").
    longrope_aliases: tuple[str, ...] = ()
    #: The pretrained context where the config leaves `original_max_position_embeddings` out, and which
    #: then wins over the RoPE dict's own (Phi-3's 4096); None: the dict's own.
    default_original: int | None = None
    #: The local layers' own base where they keep one RoPE dict per layer kind (`LAYER_KINDS`, and
    #: transformers 4's `rope_local_base_freq`); None: one dict for every layer.
    local_theta: float | None = None
    #: Whether the global layers' dict may name proportional RoPE (Gemma 4: the first `partial_rotary_factor`
    #: of a head's pairs rotate at frequencies spaced over the whole head; `ModelConfig.proportional_rope`).
    proportional: bool = False

    def read(self, raw: Mapping[str, Any], max_positions: int) -> RopeSettings:
        """The RoPE settings of `raw`, whose `max_position_embeddings` is `max_positions`; `ModelLoadError`
        naming the field for one that cannot be honoured."""
        if self.local_theta is not None:
            return self._by_layer_kind(raw, max_positions, self.local_theta)
        params, where = _one_dict(raw)
        if params.get("rope_type") in self.longrope_aliases:
            params["rope_type"] = "longrope"
        theta = _agreed(f"{where}.rope_theta", params.get("rope_theta"), "rope_theta", raw.get("rope_theta"))
        partial = _agreed(f"{where}.partial_rotary_factor", params.get("partial_rotary_factor"),
                          "partial_rotary_factor", raw.get("partial_rotary_factor"))
        if not self.partial_rotation:
            _whole_heads(partial, where)
        return RopeSettings(
            theta=_theta(theta, self.default_theta, f"{where}.rope_theta"),
            scaling=scaling_of(params, where, max_positions, _original(raw, params, where, self.default_original)),
            partial_rotary_factor=1.0 if partial is None else float(partial),
        )

    def _by_layer_kind(self, raw: Mapping[str, Any], max_positions: int, default_local: float) -> RopeSettings:
        """One dict per layer kind: the global layers' base and scaling, and the local layers' own base
        (never scaled)."""
        params = _dict(raw, "rope_parameters")
        flat = sorted(key for key, value in params.items() if key not in LAYER_KINDS and value is not None)
        if flat:
            # Its reference reads only the per-kind dicts: a flat one would be dropped silently.
            raise ModelLoadError(f"rope_parameters names {', '.join(map(repr, flat))} for every layer, but this "
                                 f"family keeps one set per layer kind (rope_parameters.full_attention, "
                                 f"rope_parameters.sliding_attention)")
        full = _normalised(_dict(params, "full_attention", "rope_parameters"))
        local = _normalised(_dict(params, "sliding_attention", "rope_parameters"))
        where = "rope_parameters.full_attention"
        old = _normalised(_dict(raw, "rope_scaling"))
        for key, value in old.items():  # transformers 4's scaling is the global layers'
            if full.get(key) is not None and full[key] != value:
                raise ModelLoadError(f"rope_scaling.{key} is {value!r} but {where}.{key} is {full[key]!r}: which "
                                     f"is meant is ambiguous")
            full[key] = value
        local_where = "rope_parameters.sliding_attention"
        partial = 1.0
        if self.proportional and full.get("rope_type") == "proportional":
            partial, full = _proportional(full, where)
        if rope_variant(local, local_where) != "default":
            raise ModelLoadError(f"{local_where}.rope_type {local['rope_type']!r}: scaled RoPE on the local layers "
                                 f"is not supported")
        for place, settings in ((where, full), (local_where, local)):
            _whole_heads(_agreed(f"{place}.partial_rotary_factor", settings.get("partial_rotary_factor"),
                                 "partial_rotary_factor", raw.get("partial_rotary_factor")), place)
        theta = _agreed(f"{where}.rope_theta", full.get("rope_theta"), "rope_theta", raw.get("rope_theta"))
        local_theta = _agreed(f"{local_where}.rope_theta", local.get("rope_theta"),
                              "rope_local_base_freq", raw.get("rope_local_base_freq"))
        return RopeSettings(
            theta=_theta(theta, self.default_theta, f"{where}.rope_theta"),
            scaling=scaling_of(full, where, max_positions, _original(raw, full, where, self.default_original)),
            partial_rotary_factor=partial,
            local_theta=_theta(local_theta, default_local, f"{local_where}.rope_theta"),
        )


def _proportional(params: dict[str, Any], where: str) -> tuple[float, dict[str, Any]]:
    """A proportional RoPE dict's share of each head's pairs it rotates, and the dict as plain RoPE reads it
    (its base alone); a factor other than 1 (which would slow every frequency) or another key is refused."""
    unknown = sorted(set(params) - {"rope_type", "rope_theta", "partial_rotary_factor", "factor"})
    if unknown or float(params.get("factor", 1.0)) != 1.0:
        raise ModelLoadError(f"{where}: proportional RoPE is read with its base and partial_rotary_factor alone, "
                             f"not {', '.join(map(repr, unknown)) or 'a factor'}")
    partial = float(params.get("partial_rotary_factor", 1.0))
    if not 0 < partial <= 1:
        raise ModelLoadError(f"{where}.partial_rotary_factor {partial!r} must be in (0, 1]")
    return partial, {key: value for key, value in params.items() if key == "rope_theta"}


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


def _original(raw: Mapping[str, Any], params: Mapping[str, Any], where: str, default: int | None) -> int | None:
    """The pretrained context a llama3, yarn or longrope scaling stretches. The top-level field wins in the
    reference (`default` where it is absent, for a family that has one), so a dict naming another is
    ambiguous."""
    if params.get("rope_type") not in _NAMING_ORIGINAL:
        return None
    top = raw.get("original_max_position_embeddings")
    implicit = top is None and default is not None
    if implicit:
        top = default
    named = params.get("original_max_position_embeddings")
    if named is not None and top is not None and named != top:
        note = " (the family's default where config.json leaves it out)" if implicit else ""
        raise ModelLoadError(f"{where}.original_max_position_embeddings is {named!r} but "
                             f"original_max_position_embeddings is {top!r}{note}: which is meant is ambiguous")
    chosen = top if top is not None else named
    return None if chosen is None else int(chosen)


def _whole_heads(partial: Any, where: str) -> None:
    """A family that rotates whole heads refuses a partial rotation asked for, rather than dropping it."""
    if partial is not None and float(partial) != 1.0:
        raise ModelLoadError(f"{where}.partial_rotary_factor {partial!r}: this family's layers rotate all of each "
                             f"head (only some families rotate part of it)")


def _theta(value: Any, default: float, where: str) -> float:
    theta = default if value is None else float(value)
    if not (math.isfinite(theta) and theta > 1):
        raise ModelLoadError(f"{where} must be a finite number greater than 1, got {value!r}")
    return theta
