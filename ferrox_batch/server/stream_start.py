"""How a stream begins: with its first event, or, when that is slow to come (a long prompt read, a queue),
after its answer format's keep-alive interval, with keep-alives until it comes.

A refusal or failure that comes within the interval is still answered as a status (the caller's
`first_within` result is done before any byte is sent); one that comes later is told in the stream, in the
format's own failure events.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ferrox_batch.server.http.streaming import Event
from ferrox_batch.server.surface import AnswerFormat


async def first_within(events: AsyncIterator[tuple[int, Event]], disconnected: asyncio.Future,
                       interval: float | None) -> asyncio.Future:
    """The first of `events` as a future, awaited for up to `interval` seconds (None: until it comes), done or
    not; cancelled (and its generator idle again) when the client left or the caller was cancelled meanwhile."""
    first: asyncio.Future = asyncio.ensure_future(anext(events))
    try:
        await asyncio.wait({first, disconnected}, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
    finally:
        handler = asyncio.current_task()
        if not first.done() and (disconnected.done() or (handler is not None and handler.cancelling())):
            first.cancel()
            await asyncio.wait({first})  # the events' generator is idle again before it is closed
    return first


async def kept_alive(fmt: AnswerFormat, first: asyncio.Future,
                     events: AsyncIterator[tuple[int, Event]]) -> AsyncIterator[bytes]:
    """A stream's body: `fmt`'s opening, a keep-alive every `keepalive_interval` until `first` (the stream's
    first event) is in, then the answer from it on."""
    try:
        for piece in fmt.opening():
            yield piece
        while not first.done():
            await asyncio.wait({first}, timeout=fmt.keepalive_interval)
            if not first.done():
                yield fmt.keepalive()
        got = first.result()
    finally:
        if not first.done():
            first.cancel()
    async with contextlib.aclosing(fmt.stream(got, events)) as answer:
        async for piece in answer:
            yield piece
