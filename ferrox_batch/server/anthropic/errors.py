"""Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`, with Anthropic's statuses.

Every refusal is made once in OpenAI's shape (`error_shapes`); this rewrites it for the Messages API's
routes. The type follows the status as Anthropic's API documents it (400 `invalid_request_error`, 401
`authentication_error`, 403 `permission_error`, 404 `not_found_error`, 413 `request_too_large`, 429
`rate_limit_error`, 500 `api_error`, 504 `timeout_error`), and a busy server (OpenAI's 503, with its
`Retry-After`, which the caller keeps) is Anthropic's 529 `overloaded_error`, which its SDKs retry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ferrox_batch.server.http.error_shapes import error_message

#: The routes' shared path prefix (`/v1/messages`, `/v1/messages/count_tokens`).
PREFIX = "/v1/messages"
#: Anthropic's status for an overloaded server (OpenAI's 503).
OVERLOADED = 529
#: Anthropic's error type by status; any other 4xx is an invalid request, any other 5xx an API error.
TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error", 403: "permission_error",
         404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
         500: "api_error", 504: "timeout_error", OVERLOADED: "overloaded_error"}


@dataclass(frozen=True, slots=True)
class AnthropicErrors:
    """The `ErrorShape` of the Messages API's routes."""

    def translate(self, status: int, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        if status == 503:
            status = OVERLOADED
        kind = TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return status, error_body(kind, error_message(body))


ANTHROPIC_ERRORS = AnthropicErrors()


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}
