"""The HTTP-only refusals, and how any `DecodeError` becomes a response.

The batcher's `DecodeError` family already knows its HTTP status, its
`Retry-After` and its OpenAI body; the server adds the few refusals only HTTP
has (an unknown model name, a body over the size cap, more requests open than
the server takes, a request cut by the drain on stop) as members of the same
family, so one function answers them all and the refusal metrics can count
them by the same `code`.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from ferrox_batch.errors import DecodeError
from ferrox_batch.server.http.error_shapes import OPENAI_ERRORS, ErrorShape, shaped_response


class ModelNotFound(DecodeError):
    http_status = 404
    error_type = "invalid_request_error"
    error_code = "model_not_found"
    _fields = ("model", "served")

    def __init__(self, model: str, served: str) -> None:
        self.model = model
        self.served = served
        super().__init__(f"The model `{model}` does not exist: this server serves `{served}`")

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        body["error"]["param"] = "model"
        return body


class RequestTooLarge(DecodeError):
    http_status = 413
    error_type = "invalid_request_error"
    error_code = "request_too_large"
    _fields = ("size", "limit")

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"the request body is {size} bytes, more than this server's limit of {limit} bytes")


class ServerBusy(DecodeError):
    """More generation requests open than `--max-concurrent-requests`: busy, not wrong (503, retry)."""

    retry_after_secs = 1
    http_status = 503
    error_code = "server_busy"
    _fields = ("open", "limit")

    def __init__(self, open: int, limit: int) -> None:
        self.open = open
        self.limit = limit
        super().__init__(f"server is at capacity: {open} generation requests are already open "
                         f"(limit {limit}); retry shortly")


class ServerShuttingDown(DecodeError):
    """A request still running when the server's drain timeout ran out: cancelled, and told so (503, retry:
    another instance, or this one once it is back, will answer it)."""

    retry_after_secs = 1
    http_status = 503
    error_code = "server_shutting_down"
    _fields = ("drain_timeout",)

    def __init__(self, drain_timeout: float) -> None:
        self.drain_timeout = drain_timeout
        super().__init__(f"the server is shutting down: this request was still running when its drain timeout "
                         f"of {drain_timeout:g} s ran out, and was cancelled; retry it")


def error_body(error: BaseException) -> dict[str, Any]:
    """The OpenAI error body for any exception; a non-`DecodeError` is a server bug and says only its type."""
    if isinstance(error, DecodeError):
        return error.to_dict()
    return {"error": {"type": "server_error", "code": "internal_error",
                      "message": f"internal server error ({type(error).__name__})"}}


def error_response(error: DecodeError, shape: ErrorShape = OPENAI_ERRORS) -> JSONResponse:
    """The status, body and `Retry-After` header the error itself declares, in the API's `shape`."""
    headers = None
    if error.retry_after_secs is not None:
        headers = {"Retry-After": str(error.retry_after_secs)}
    return shaped_response(shape, error.http_status, error.to_dict(), headers)


def failure_response(error: BaseException, shape: ErrorShape = OPENAI_ERRORS) -> JSONResponse:
    """A request's failure as its response: a `DecodeError`'s own, anything else (a bug) a 500."""
    if isinstance(error, DecodeError):
        return error_response(error, shape)
    return shaped_response(shape, 500, error_body(error))
