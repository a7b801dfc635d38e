"""`RopeScaling`: how a checkpoint stretches RoPE past the context it was trained on, read from its config.

Hugging Face configs name the variant in `rope_scaling` (or `rope_parameters`) by `rope_type`: `linear`
(positions slowed by a factor), `dynamic` (NTK: the base grows with the sequence), `yarn` (a per-frequency
blend of the two, and a scale on the tables), `longrope` (Phi-3: per-frequency factors, a short set within
the original context and a long set past it) and `llama3` (Llama 3.1: long wavelengths slowed, short ones
kept, a smooth band between). One more is this runtime's own, never written by transformers:
`frequency_factors`, each frequency's angle divided by a factor of its own, which is how llama.cpp's files
carry Llama 3.1's scaling (the `rope_freqs` tensor, its factors precomputed); the GGUF reader writes it.
This module only reads and checks the parameters; the tables they make are `architectures.rope`'s, and
where a config keeps the dict is `rope_layout`'s. Any other variant, and any key a variant does not read, is
refused by name at load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ferrox_batch.runtime.families.errors import ModelLoadError

#: The `rope_type`s this runtime computes (besides plain RoPE: `default`, or no scaling at all).
__all__ = ["COMMON_KEYS", "ROPE_TYPES", "RopeScaling", "VARIANT_KEYS", "rope_variant", "scaling_of"]

ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3", "frequency_factors")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    kind: str
    factor: float = 1.0
    #: The context the model was pretrained on (llama3, yarn and longrope name it; dynamic uses the
    #: config's `max_position_embeddings`).
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    #: A scale on the cos/sin tables (yarn, longrope); None: the variant's own default.
    attention_factor: float | None = None
    # longrope: one factor per rotated frequency
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    #: frequency_factors: what each rotated frequency's angle is divided by (the count is the config's to check,
    #: which knows how many frequencies a head rotates)
    frequency_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ROPE_TYPES:
            raise ModelLoadError(f"rope scaling type {self.kind!r} is not supported "
                                 f"(supported: {', '.join(ROPE_TYPES)})")
        if not self.factor > 0:
            raise ModelLoadError(f"rope scaling factor must be positive, got {self.factor}")
        if self.kind in ("llama3", "yarn", "longrope") and not (self.original_max_position_embeddings or 0) > 0:
            raise ModelLoadError(f"{self.kind} rope scaling needs a positive original_max_position_embeddings")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ModelLoadError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
        if self.kind == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ModelLoadError("longrope scaling needs short_factor and long_factor lists of one length")
        if self.kind == "frequency_factors":
            bad = [f for f in self.frequency_factors if not (math.isfinite(f) and f > 0)]
            if not self.frequency_factors or bad:
                raise ModelLoadError(f"frequency_factors rope scaling needs a list of finite positive factors, got "
                                     f"{list(self.frequency_factors[:4]) if not bad else bad[:4]}")


#: The keys every RoPE dict may hold, whatever its variant: what names it and what `rope_layout` reads itself.
COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
#: The keys each variant reads (transformers 5.25's `_validate_*_rope_parameters`, `dynamic` as it computes it:
#: from `max_position_embeddings`, never an `original_max_position_embeddings` of its own). A key outside these
#: would be ignored here while its author meant it to change the rotation: it is refused instead.
VARIANT_KEYS: Mapping[str, frozenset[str]] = MappingProxyType({
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                       "mscale", "mscale_all_dim", "truncate"}),
    "longrope": frozenset({"short_factor", "long_factor", "original_max_position_embeddings", "attention_factor",
                           "factor"}),
    "llama3": frozenset({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}),
    # Not transformers': what the GGUF reader writes for llama.cpp's `rope_freqs` (module docstring).
    "frequency_factors": frozenset({"factors"}),
})


def rope_variant(params: dict[str, Any], where: str) -> str:
    """The variant a RoPE dict names (`rope_type`, or transformers 4's `type`): "default" when it names none;
    a `ModelLoadError` naming `where` for one this runtime does not compute."""
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in VARIANT_KEYS:
        raise ModelLoadError(f"{where}.rope_type {kind!r} is not supported (supported: "
                             f"{', '.join(VARIANT_KEYS)})")
    unknown = sorted({key for key, value in params.items() if value is not None} - COMMON_KEYS - VARIANT_KEYS[kind])
    if unknown:
        raise ModelLoadError(f"{where} names {', '.join(map(repr, unknown))}, which {kind} RoPE does not read: "
                             f"refused rather than ignored (it would change the rotation)")
    return str(kind)


def scaling_of(params: dict[str, Any], where: str, max_positions: int, original: int | None) -> RopeScaling | None:
    """The scaling a RoPE dict (`params`, found at `where`) names, None for plain RoPE.

    `max_positions` is the config's `max_position_embeddings`: dynamic stretches it, and longrope and yarn
    derive their factor from it when the dict leaves the factor out. `original` is the pretrained context
    where the config names one (`rope_layout` decides which place wins); `max_positions` otherwise."""
    kind = rope_variant(params, where)
    if kind == "default":
        return None
    if kind == "dynamic":  # NTK stretches the context the config itself names
        original = max_positions
    elif original is None and kind in ("llama3", "yarn", "longrope"):
        original = max_positions  # transformers' default for a dict that names none
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope") and original:
        factor = max_positions / int(original)
    if factor is None and kind not in ("longrope", "frequency_factors"):
        raise ModelLoadError(f"{where}: {kind} rope scaling needs a factor")
    if kind == "llama3":
        missing = [name for name in ("low_freq_factor", "high_freq_factor") if params.get(name) is None]
        if missing:
            raise ModelLoadError(f"{where}: llama3 rope scaling needs {' and '.join(missing)}")

    def optional(name: str) -> float | None:
        value = params.get(name)
        return None if value is None else float(value)

    return RopeScaling(
        kind=kind,
        factor=float(factor if factor is not None else 1.0),
        original_max_position_embeddings=None if original is None else int(original),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        attention_factor=optional("attention_factor"),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
        frequency_factors=tuple(float(f) for f in params.get("factors") or ()),
    )
