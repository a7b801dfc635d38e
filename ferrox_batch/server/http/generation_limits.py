"""`Limits`: the knobs of `create_app` that shape generation requests, and the defaults of those that have one.

Apart from `generation`, which applies them: what a request may cost and how long the server waits on its
client are settings, read by `create_app` for its own defaults, not part of the request pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Seconds a reply's send may wait for the client to take it before the client is treated as gone (its
#: request cancelled, the connection closed): a reader that takes nothing for this long has stalled.
DEFAULT_WRITE_TIMEOUT_SECS = 30.0
#: Bytes of streamed reply queued for a client that reads slower than the model writes, before its
#: request is cancelled: about 1,500 tokens with 20 alternatives each, far more without.
DEFAULT_MAX_BUFFERED_REPLY_BYTES = 2 * 1024 * 1024
#: `/tokenize` and `/detokenize` requests open at once; one more is refused with 503 `server_busy`.
#: They share the prepare pool with generation, whose own cap does not count them.
DEFAULT_MAX_CONCURRENT_TOKENIZATIONS = 32


@dataclass(frozen=True, slots=True)
class Limits:
    """The knobs of `create_app` that shape generation requests."""

    default_max_tokens: int
    default_chat_max_tokens: int
    max_body_bytes: int
    max_concurrent_requests: int
    prepare_threads: int
    body_read_timeout: float  # seconds
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_SECS
    max_buffered_reply_bytes: int = DEFAULT_MAX_BUFFERED_REPLY_BYTES
    max_concurrent_tokenizations: int = DEFAULT_MAX_CONCURRENT_TOKENIZATIONS
