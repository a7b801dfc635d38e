"""Reading a request's body under a size cap and a deadline, before anything else of it is looked at.

A body past the cap is read to its end and dropped (`RequestTooLarge`, 413), so the connection stays
usable; a body that has not arrived whole within the deadline is `BodyReadTimedOut` (408). The deadline
is on the whole body, so a client that trickles bytes cannot hold an open-request slot forever.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from ferrox_batch.errors import DecodeError
from ferrox_batch.server.http.errors import RequestTooLarge

#: Seconds a generation request may take to send its whole body before it gets 408. Generous for any
#: honest client (the 4 MiB body cap in 30 s is about 140 KB/s), short enough that uploads which stall
#: hand their open-request slots back long before anyone would wait on a 503 that long.
DEFAULT_BODY_READ_TIMEOUT_SECS = 30.0


class BodyReadTimedOut(DecodeError):
    """The request body did not arrive within the server's deadline (408: the client may send it again)."""

    http_status = 408
    error_type = "invalid_request_error"
    error_code = "request_timeout"
    _fields = ("timeout_secs",)

    def __init__(self, timeout_secs: float) -> None:
        self.timeout_secs = timeout_secs
        super().__init__(f"the request body did not arrive within {timeout_secs:g} s")


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The whole body, or `RequestTooLarge` once it passes `limit` (the rest is read and dropped).

    `BodyReadTimedOut` if the whole body (the dropped rest of a too-large one included) has
    not arrived `timeout` seconds after the handler started reading it. The deadline is on
    the whole body, not on the gap between two parts: a client sending a byte now and then
    would otherwise keep its slot forever.
    """
    async def read() -> bytes:
        parts: list[bytes] = []
        size = 0
        async for part in request.stream():
            size += len(part)
            if size <= limit:
                parts.append(part)
        if size > limit:
            raise RequestTooLarge(size, limit)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        raise BodyReadTimedOut(timeout) from None
