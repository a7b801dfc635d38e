"""A config's RoPE settings by its family's name: `runtime.families.rope_layout`'s reading, under its older path.

Each family names how its reference reads RoPE (`Family.rope`); `rope_settings` asks the registry for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.runtime.families.registry import family_of_model_type
from ferrox_batch.runtime.families.rope_layout import RopeReading, RopeSettings

__all__ = ["RopeReading", "RopeSettings", "rope_settings"]


def rope_settings(raw: Mapping[str, Any], family: str, max_positions: int) -> RopeSettings:
    """The RoPE settings of a config of `family` (a `model_type`), whose `max_position_embeddings` is
    `max_positions`; `ModelLoadError` naming the field for one that cannot be honoured."""
    return family_of_model_type(family).rope.read(raw, max_positions)
