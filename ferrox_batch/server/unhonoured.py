"""The OpenAI request fields this server cannot honour yet, refused by name rather than silently ignored.

A client that asks for a feature and gets a 200 without it has been lied to;
a 400 naming the field tells it at once. Each field has the one value that asks for nothing, which
common clients send by default and which is therefore accepted (`suffix: ""`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ferrox_batch.errors import InvalidRequest

CHAT = "chat"
COMPLETIONS = "completions"


@dataclass(frozen=True, slots=True)
class NotHonoured:
    """An OpenAI field refused on `endpoints` unless it is null or exactly `nothing` (JSON text)."""

    field: str
    endpoints: tuple[str, ...]
    nothing: str  # the one value that asks for nothing, type included (`false` is not `0`)
    feature: str


#: Where OpenAI defines each field.
NOT_HONOURED = (
    NotHonoured("suffix", (COMPLETIONS,), '""', "insertion"),
)


def refuse_not_honoured(body: Mapping[str, Any], endpoint: str) -> None:
    for row in NOT_HONOURED:
        value = body.get(row.field)
        if endpoint not in row.endpoints or value is None:
            continue
        nothing = json.loads(row.nothing)
        if type(value) is not type(nothing) or value != nothing:
            raise InvalidRequest(row.field, value, f"is not supported by this server ({row.feature}): "
                                                   f"leave it out or send {row.nothing}")
