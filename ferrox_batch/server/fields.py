"""`Fields`: typed reads of a request body's optional top-level fields, each problem an `InvalidRequest` naming it.

Absent and `null` both give the default; a bool is not a number and a float is not an integer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch import bounded_json
from ferrox_batch.errors import InvalidRequest


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def json_text(where: str, text: str | bytes, *, shown: Any = None, lenient: bool = False, **options: Any) -> Any:
    """The JSON value of `text`, nested no deeper than a request body may nest (`bounded_json`): deeper is a
    400 naming `where`, since what reads it walks it recursively, as a body is walked. Text that is not JSON
    is a 400 too, or with `lenient` comes back as it is. `shown`: what a refusal quotes (default `text`);
    `options`: `json.loads`'."""
    try:
        return bounded_json.loads(text, **options)
    except bounded_json.JsonTooDeep as deep:
        raise InvalidRequest(where, text if shown is None else shown, f"is refused: {deep}") from None
    except ValueError as bad:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        if lenient:
            return text
        raise InvalidRequest(where, text if shown is None else shown, f"is not valid JSON ({bad})") from None


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
