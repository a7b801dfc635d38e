"""The bridge between a `Ticket` (blocking, thread-side) and the event loop (async, response-side).

Why it exists: `Ticket.wait` blocks until its request finishes and calls
`on_chunk` on the waiting thread; the event loop must never block. So
`TicketBridge` runs `wait` on a pool thread and hands every chunk, and then
the one final event, to the loop with `loop.call_soon_threadsafe` into an
`asyncio.Queue`. The loop side awaits `next_event()`.

What it promises:

* Exactly one final event (`Done` or `Failed`) per bridge, after every
  `Text`; `on_final` runs on the loop thread when it arrives, whether or not
  anyone is still reading (so metrics and the in-flight count see requests
  whose client left).
* `abandon()` (the client left) cancels the request at once through
  `Ticket.cancel`, from the loop thread, even while no pool thread has
  picked the wait up yet; the worker then frees its blocks.
* Chunk arrival times are stamped on the waiting thread (`chunk_times`),
  which is what time-to-first-token and inter-token latency are measured on.

`EventStreamResponse` is the SSE response: it always watches the connection
for `http.disconnect` while streaming (whatever ASGI spec version the server
speaks; a plain `StreamingResponse` stops watching under ASGI 2.4, and
uvicorn silently drops writes to a closed connection), and when it ends, for
whatever reason, it closes its event iterator and runs its `on_close` hook.
So a client that leaves mid-stream cancels its request deterministically,
never at garbage collection and never only when the answer is complete.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ferrox_batch.batch.ticket import Ticket
from ferrox_batch.generation_types import GenerationResult


@dataclass(frozen=True, slots=True)
class Text:
    """A piece of visible text, in order."""

    text: str


@dataclass(frozen=True, slots=True)
class Done:
    result: GenerationResult
    finished_at: float


@dataclass(frozen=True, slots=True)
class Failed:
    """The request's typed `DecodeError`, or (a bug) anything else `wait` raised."""

    error: BaseException


Event = Text | Done | Failed
Final = Done | Failed


class TicketBridge:
    """Runs `ticket.wait` on `pool` and delivers its events to the loop (see the module docstring).

    `forward_text=False` (a non-streaming request) stamps chunk times but queues no `Text`:
    the answer's text comes whole from the result.
    """

    def __init__(
        self,
        ticket: Ticket,
        loop: asyncio.AbstractEventLoop,
        pool: concurrent.futures.Executor,
        *,
        forward_text: bool,
        on_final: Callable[[TicketBridge, Final], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ticket = ticket
        self.chunk_times: list[float] = []
        self.final: Final | None = None
        self._loop = loop
        self._pool = pool
        self._forward = forward_text
        self._on_final = on_final
        self._clock = clock
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._abandoned = False  # written on the loop, read on the pool thread: a plain flag is enough

    def start(self) -> None:
        self._pool.submit(self._run)

    async def next_event(self) -> Event:
        return await self._queue.get()

    def abandon(self) -> bool:
        """The reader left: cancel the request. True only for the first call that found it unanswered."""
        if self._abandoned:
            return False
        self._abandoned = True
        if self.final is not None:
            return False
        self.ticket.cancel()
        return True

    # ------------------------------------------------------------ pool side

    def _run(self) -> None:
        try:
            final: Final = Done(self.ticket.wait(self._on_chunk), self._clock())
        except BaseException as error:  # noqa: BLE001 - delivered to the loop, which decides
            final = Failed(error)
        self._post(self._finish, final)

    def _on_chunk(self, text: str) -> None:
        self.chunk_times.append(self._clock())
        if self._forward and not self._abandoned:
            self._post(self._queue.put_nowait, Text(text))

    def _post(self, fn: Callable[[Event], None], event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, event)
        except RuntimeError:  # the loop is closed: the server is gone, nobody can be answered
            pass

    # ------------------------------------------------------------ loop side

    def _finish(self, final: Final) -> None:
        self.final = final
        try:
            self._on_final(self, final)
        finally:
            self._queue.put_nowait(final)


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone (call only after the request body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def next_or_disconnect(bridge: TicketBridge, disconnected: asyncio.Future) -> Event | None:
    """The bridge's next event, or None if the client disconnects first."""
    nxt = asyncio.ensure_future(bridge.next_event())
    try:
        await asyncio.wait({nxt, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not nxt.done():
            nxt.cancel()  # asyncio.Queue keeps an item a cancelled getter did not take
    if nxt.done() and not nxt.cancelled():
        return nxt.result()
    return None


class EventStreamResponse(Response):
    """`text/event-stream` from an async iterator of encoded events; stops it when the client leaves.

    `on_close` runs once the response is over, however it ended (finished, client gone, server
    cancelled): the caller's hook to cancel the request. It is needed besides closing the iterator
    because an async generator that never started runs no `finally` when closed.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        # No proxy buffering, no caching: each event must reach the client when it is sent.
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    await send({"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
                    async for event in self.events:
                        await send({"type": "http.response.body", "body": event, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    group.cancel_scope.cancel()

                async def listen() -> None:
                    await wait_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(listen)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.events, "aclose", None)
                if aclose is not None:
                    await aclose()
            self.on_close()
