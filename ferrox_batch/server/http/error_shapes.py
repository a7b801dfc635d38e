"""Each API's own error shape: one refusal, written the way the client of the API it came through reads it.

Every refusal in the server is made once, as a status and an OpenAI error body (`DecodeError.to_dict`,
`errors.error_body`, the access checks' `Refusal`). The APIs beside OpenAI's (each a translator over the
same engine) read errors in their own shape and, for a few refusals, with their own status. An
`ErrorShape` rewrites the OpenAI status and body into its API's; `ErrorShapes` picks the shape by the
request's path, so the access checks, the routing errors and the generation endpoints all answer a
client in the shape its SDK parses. A path no API claims gets OpenAI's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.responses import JSONResponse


class ErrorShape(Protocol):
    """How one API writes an error the server made in OpenAI's shape."""

    def translate(self, status: int, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """The status and body this API answers for the OpenAI `status` and `body`
        (`{"error": {"type", "code", "message", ...}}`)."""
        ...


@dataclass(frozen=True, slots=True)
class OpenAIErrors:
    """OpenAI's shape: the body and status as made."""

    def translate(self, status: int, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        return status, dict(body)


OPENAI_ERRORS = OpenAIErrors()


@dataclass(frozen=True, slots=True)
class ErrorShapes:
    """The shape of each API by the path prefix its routes share, longest prefix first; OpenAI's elsewhere."""

    by_prefix: Sequence[tuple[str, ErrorShape]] = ()

    def for_path(self, path: str) -> ErrorShape:
        for prefix, shape in self.by_prefix:
            if path == prefix or path.startswith(prefix + "/"):
                return shape
        return OPENAI_ERRORS


def shaped_response(shape: ErrorShape, status: int, body: Mapping[str, Any],
                    headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The JSON response `shape` makes of an OpenAI `status` and `body`, with `headers` (`Retry-After`, ...)."""
    status, shaped = shape.translate(status, body)
    return JSONResponse(shaped, status_code=status, headers=dict(headers) if headers else None)


def error_message(body: Mapping[str, Any]) -> str:
    """The message of an OpenAI error body (what every shape keeps)."""
    error = body.get("error")
    if isinstance(error, Mapping):
        return str(error.get("message", ""))
    return str(error)
