"""The `DecodeError` family (docs/upstream.md, Errors and HTTP statuses): every request-level failure, typed.

Messages are the upstream Display text verbatim (clients parse them). Each
error carries its variant's fields as attributes, class attributes
`retry_after_secs` (1 for the "busy, retry shortly" kinds, None for "fix
your request") and `http_status`, and `to_dict()` in the OpenAI error shape.
Errors compare equal when they are the same variant with the same fields,
and pickle.
"""

from __future__ import annotations

from typing import Any, ClassVar


class DecodeError(Exception):
    """Base of every request-level failure a serving path reports to its caller."""

    #: Seconds a client should wait before retrying; None means "fix the request" (or a server bug).
    retry_after_secs: ClassVar[int | None] = None
    http_status: ClassVar[int] = 500
    #: OpenAI error `type` and `code` on the wire.
    error_type: ClassVar[str] = "server_error"
    error_code: ClassVar[str] = "internal_error"
    #: The variant's fields, in constructor order (equality, pickling, repr).
    _fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, message: str) -> None:
        super().__init__(message)

    @property
    def message(self) -> str:
        return str(self)

    def is_retryable(self) -> bool:
        """True for the "busy, retry shortly" kinds (upstream: `retry_after_secs().is_some()`)."""
        return self.retry_after_secs is not None

    @property
    def code(self) -> str:
        return self.error_code

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error body: `{"error": {"type", "code", "message", ...}}`."""
        return {"error": {"type": self.error_type, "code": self.code, "message": str(self)}}

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._fields)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self._values()))

    def __reduce__(self) -> tuple[Any, ...]:
        # The message is derived from the fields, so rebuild from the fields.
        return (type(self), self._values())

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields)
        return f"{type(self).__name__}({inner})"


class TokenOutOfVocab(DecodeError):
    http_status = 400
    error_type = "invalid_request_error"
    error_code = "token_out_of_vocab"
    _fields = ("token", "vocab_size")

    def __init__(self, token: int, vocab_size: int) -> None:
        self.token = token
        self.vocab_size = vocab_size
        super().__init__(
            f"prompt encoded to token id {token}, which is outside this model's vocabulary "
            f"of {vocab_size} (its tokenizer does not match this checkpoint)"
        )


class KvPoolExhausted(DecodeError):
    retry_after_secs = 1
    http_status = 503
    error_code = "kv_pool_exhausted"

    def __init__(self) -> None:
        super().__init__(
            "server is at capacity: the shared KV cache block pool has no free blocks "
            "for a new request; retry shortly"
        )


class KvAllocationFailed(KvPoolExhausted):
    """The KV store could not allocate what the ledger granted (the device ran out of memory); the
    request is refused as busy and the worker keeps serving (port-only: docs/upstream.md D11, D15)."""

    _fields = ("detail",)

    def __init__(self, detail: str) -> None:
        self.detail = detail
        DecodeError.__init__(self, f"server is at capacity: allocating this request's KV cache failed "
                                   f"({detail}); retry shortly")


class QueueFull(DecodeError):
    retry_after_secs = 1
    http_status = 503
    error_code = "queue_full"
    _fields = ("queued", "cap")

    def __init__(self, queued: int, cap: int) -> None:
        self.queued = queued
        self.cap = cap
        super().__init__(
            f"server is at capacity: {queued} requests are already queued for the batch "
            f"scheduler (limit {cap}); retry shortly"
        )


class GrammarConstraint(DecodeError):
    """Grammar-constrained decoding cannot go on: the grammar (a JSON schema) is invalid, which is known
    before anything is queued, or the model's token broke it (upstream's variant, now live)."""

    http_status = 400
    error_type = "invalid_request_error"
    error_code = "grammar_constraint"
    _fields = ("detail", "param")

    def __init__(self, detail: str, param: str | None = None) -> None:
        self.detail = detail
        self.param = param  # the request field whose grammar it is, where known (a compile's refusal)
        super().__init__(f"grammar-constrained decoding stopped: {detail}")

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        if self.param is not None:
            body["error"]["param"] = self.param
        return body


class QueueTimeout(DecodeError):
    """The request waited for admission past its queue deadline and was refused, never admitted (port-only).

    A 503 with `Retry-After`, as SGLang's queued-request timeout: the request was fine, the server was
    too busy to start it in time.
    """

    retry_after_secs = 1
    http_status = 503
    error_code = "queue_timeout"
    _fields = ("waited_ms", "limit_ms")

    def __init__(self, waited_ms: int, limit_ms: int) -> None:
        self.waited_ms = waited_ms
        self.limit_ms = limit_ms
        super().__init__(f"server is at capacity: this request waited {waited_ms} ms for admission, past "
                         f"its queue limit of {limit_ms} ms; retry shortly")


#: The two ceilings a `KvBudgetExceeded` can name (upstream `Ceiling.code()`).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
DEVICE_MEMORY_BUDGET_EXCEEDED = "device_memory_budget_exceeded"


class KvBudgetExceeded(DecodeError):
    http_status = 400
    error_type = "invalid_request_error"
    _fields = ("binding", "estimated_bytes", "limit_bytes", "positions", "positions_limit", "detail")

    def __init__(
        self,
        binding: str,
        estimated_bytes: int,
        limit_bytes: int,
        positions: int,
        positions_limit: int,
        detail: str,
    ) -> None:
        if binding not in (CONTEXT_LENGTH_EXCEEDED, DEVICE_MEMORY_BUDGET_EXCEEDED):
            raise ValueError(f"unknown KV budget binding {binding!r}")
        self.binding = binding
        self.estimated_bytes = estimated_bytes
        self.limit_bytes = limit_bytes
        self.positions = positions
        self.positions_limit = positions_limit
        self.detail = detail
        super().__init__(f"{binding}: {detail}")

    @property
    def code(self) -> str:
        return self.binding

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        body["error"].update(
            estimated_bytes=self.estimated_bytes,
            limit_bytes=self.limit_bytes,
            positions=self.positions,
            positions_limit=self.positions_limit,
        )
        return body


#: How much of an offending value an `InvalidRequest` message quotes.
SHOWN_CHARS = 80


def shown(value: Any) -> str:
    """`value` as an error message quotes it: its repr, cut to `SHOWN_CHARS` characters.

    A 1 MB prompt or stop list must not make a 1 MB message (or error body); a huge
    string, bytes, list or dict is not even repr'd, only named with its length.
    """
    if isinstance(value, (str, bytes, list, dict)) and len(value) >= 1000:
        return f"<{type(value).__name__} of length {len(value)}>"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


class InvalidRequest(DecodeError, ValueError):
    """A request parameter Rust's types would have made impossible (port-only variant: docs/upstream.md D15).

    The message quotes the value shortened (`shown`); the `value` field keeps it whole.
    """

    http_status = 400
    error_type = "invalid_request_error"
    error_code = "invalid_request"
    _fields = ("param", "value", "reason")

    def __init__(self, param: str, value: Any, reason: str) -> None:
        self.param = param
        self.value = value
        self.reason = reason
        super().__init__(f"{param} {reason}, got {shown(value)}")

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        body["error"]["param"] = self.param
        return body

    def __hash__(self) -> int:
        # `value` may be unhashable (a list); hash what always hashes.
        return hash((type(self), self.param, self.reason, shown(self.value)))


class BatcherClosed(DecodeError):
    """The scheduler was shut down on purpose; retrying this process will not help (port-only: docs/upstream.md D6)."""

    http_status = 503
    error_code = "batcher_closed"

    def __init__(self) -> None:
        super().__init__("the batch scheduler has been closed; no new requests are accepted")


class WorkerDied(DecodeError):
    """The scheduler's worker thread crashed; the cause is named (port-only: docs/upstream.md D5)."""

    http_status = 500
    error_code = "worker_died"
    _fields = ("cause",)

    def __init__(self, cause: str) -> None:
        self.cause = cause
        super().__init__(f"the batch scheduler's worker stopped: {cause}")


class InternalError(DecodeError):
    """The model failed while running this request (a forward or the sampler raised); the worker keeps serving."""

    http_status = 500
    error_code = "internal_error"
    _fields = ("detail",)

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(f"the model failed while serving this request: {detail}")


class WaitTimedOut(DecodeError):
    """The caller's wait timeout passed before the answer came; the request was cancelled (port-only: docs/upstream.md D16).

    A server that passed its own deadline this way would answer 504: the request was fine, the
    answer did not come in time, and a retry may do better.
    """

    http_status = 504
    error_code = "wait_timed_out"
    _fields = ("timeout_secs",)

    def __init__(self, timeout_secs: float) -> None:
        self.timeout_secs = timeout_secs
        super().__init__(f"no answer within the wait timeout of {timeout_secs:g} s; the request was cancelled")
