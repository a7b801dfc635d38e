"""`RopeScaling`: how a checkpoint stretches RoPE past the context it was trained on, read from its config.

Hugging Face configs name the variant in `rope_scaling` (or `rope_parameters`) by `rope_type`: `linear`
(positions slowed by a factor), `dynamic` (NTK: the base grows with the sequence), `yarn` (a per-frequency
blend of the two, and a scale on the tables), `longrope` (Phi-3: per-frequency factors, a short set within
the original context and a long set past it) and `llama3` (Llama 3.1: long wavelengths slowed, short ones
kept, a smooth band between). This module only reads and checks the parameters; the tables they make are
`architectures.rope`'s. Anything else is refused by name at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferrox_batch.runtime.errors import ModelLoadError

#: The `rope_type`s this runtime computes (besides plain RoPE: `default`, or no scaling at all).
ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")


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


def rope_scaling_of(raw: dict[str, Any], max_positions: int) -> RopeScaling | None:
    """The scaling a config's `rope_scaling` (or `rope_parameters`) names, None for plain RoPE.

    `max_positions` is the config's `max_position_embeddings`: longrope and yarn derive their factor
    from it when the config leaves the factor out."""
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not isinstance(scaling, dict) or not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    original = scaling.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    if kind == "dynamic":  # NTK stretches the context the config itself names
        original = max_positions
    factor = scaling.get("factor")
    if factor is None and kind in ("yarn", "longrope") and original:
        factor = max_positions / int(original)
    if factor is None and kind != "longrope":
        raise ModelLoadError(f"{kind} rope scaling needs a factor")

    def optional(name: str) -> float | None:
        value = scaling.get(name)
        return None if value is None else float(value)

    return RopeScaling(
        kind=str(kind),
        factor=float(factor if factor is not None else 1.0),
        original_max_position_embeddings=None if original is None else int(original),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        truncate=bool(scaling.get("truncate", True)),
        attention_factor=optional("attention_factor"),
        short_factor=tuple(float(f) for f in scaling.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in scaling.get("long_factor") or ()),
    )
