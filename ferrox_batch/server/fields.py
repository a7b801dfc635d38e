"""`Fields`: typed reads of a request body's optional top-level fields, each problem an `InvalidRequest` naming it.

Absent and `null` both give the default; a bool is not a number and a float is not an integer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.errors import InvalidRequest


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Fields:
    """Typed reads of optional top-level fields; absent and null both give the default."""

    __slots__ = ("_body",)

    def __init__(self, body: Mapping[str, Any]) -> None:
        self._body = body

    def raw(self, name: str) -> Any:
        return self._body.get(name)

    def integer(self, name: str, default: int | None) -> int | None:
        value = self._body.get(name)
        if value is None:
            return default
        if not is_int(value):
            raise InvalidRequest(name, value, "must be an integer")
        return value

    def number(self, name: str, default: float) -> float:
        value = self._body.get(name)
        if value is None:
            return default
        if not is_number(value):
            raise InvalidRequest(name, value, "must be a number")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self._body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InvalidRequest(name, value, "must be true or false")
        return value
