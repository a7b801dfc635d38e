"""Ollama's wire basics: NDJSON lines and RFC 3339 times.

A stream is `application/x-ndjson`: one compact JSON object per line, each line sent as soon as it is
made, by the same response as every stream (`http.streaming.EventStreamResponse`, with this media type):
it watches the connection, bounds each send by the write timeout and cancels the request however the
response ends.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

MEDIA_TYPE = "application/x-ndjson"


def line(payload: dict[str, Any]) -> bytes:
    """One NDJSON line carrying `payload`."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"


def created_at() -> str:
    """Now, as Ollama writes `created_at`: RFC 3339 in UTC with a `Z`."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
