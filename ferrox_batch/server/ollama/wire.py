"""Ollama's wire basics: NDJSON lines, the streamed response that carries them, and RFC 3339 times.

A stream is `application/x-ndjson`: one compact JSON object per line, each line sent as soon as it is
made. `NDJSONResponse` is `EventStreamResponse`'s sibling (`streaming.PushedResponse`): it watches the
connection, bounds each send by the write timeout and cancels the request however the response ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from ferrox_batch.server.streaming import PushedResponse

MEDIA_TYPE = "application/x-ndjson"


def line(payload: dict[str, Any]) -> bytes:
    """One NDJSON line carrying `payload`."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"


def created_at() -> str:
    """Now, as Ollama writes `created_at`: RFC 3339 in UTC with a `Z`."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


class NDJSONResponse(PushedResponse):
    """`application/x-ndjson` from an async iterator of encoded lines."""

    media_type = MEDIA_TYPE

    def __init__(self, lines: AsyncIterator[bytes], *, write_timeout: float, on_close: Callable[[], None],
                 cut: Sequence[Callable[[], Awaitable[None]]] = ()) -> None:
        # No proxy buffering, no caching: each line must reach the client when it is sent.
        super().__init__(lines, write_timeout=write_timeout, on_close=on_close, cut=cut,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
