"""The bridge between the worker thread (which produces a request's events) and the event loop (which sends them).

Why it exists: the worker hands each request's events to the request's
reply sink on its own thread, and the event loop must never block. So
`ReplyBridge` *is* the request's sink: it posts every chunk, and then the one
final event, to the loop with `loop.call_soon_threadsafe` into an
`asyncio.Queue`, and the loop side awaits `next_event()`. No thread waits per
request: a thousand open streams cost a thousand queues, not a thousand
threads.

What it promises:

* Exactly one final event (`Done` or `Failed`) per bridge, after every
  `Text`; `on_final` runs on the loop thread when it arrives, whether or not
  anyone is still reading (so metrics and the in-flight count see requests
  whose client left).
* `abandon()` (the client left) cancels the request at once through
  `Ticket.cancel`, from the loop thread; the worker then frees its blocks.
* Chunk arrival times are stamped on the worker thread as each chunk is
  handed over (`chunk_times`), which is what time-to-first-token and
  inter-token latency are measured on.
* A loop that has closed (the server is gone) never reaches the worker: the
  post is dropped.

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
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ferrox_batch.batch.ticket import Ticket
from ferrox_batch.errors import DecodeError
from ferrox_batch.generation_types import GenerationResult
from ferrox_batch.logprobs import TokenLogprob


@dataclass(frozen=True, slots=True)
class Text:
    """A piece of visible text, in order, with the log-probabilities of the tokens since the last piece."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Done:
    result: GenerationResult
    finished_at: float


@dataclass(frozen=True, slots=True)
class Failed:
    """The request's typed `DecodeError` (or, from the server itself, any other error that ended it)."""

    error: BaseException


T = TypeVar("T")

Event = Text | Done | Failed
Final = Done | Failed


class ReplyBridge:
    """One request's reply sink, delivering to the event loop (see the module docstring).

    `forward_text=False` (a non-streaming request) stamps chunk times but queues no `Text`:
    the answer's text comes whole from the result.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        forward_text: bool,
        on_final: Callable[[ReplyBridge, Final], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ticket: Ticket | None = None  # set once `submit` queued the request
        self.chunk_times: list[float] = []
        self.final: Final | None = None
        self._loop = loop
        self._forward = forward_text
        self._on_final = on_final
        self._clock = clock
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._abandoned = False  # written on the loop, read on the worker thread: a plain flag is enough

    async def next_event(self) -> Event:
        return await self._queue.get()

    def abandon(self) -> bool:
        """The reader left: cancel the request. True only for the first call that found it unanswered."""
        if self._abandoned:
            return False
        self._abandoned = True
        if self.final is not None:
            return False
        if self.ticket is not None:
            self.ticket.cancel()
        return True

    # ------------------------------------------------- the worker's side (ReplySink)

    def chunk(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        self.chunk_times.append(self._clock())
        if self._forward and not self._abandoned:
            self._post(self._queue.put_nowait, Text(text, logprobs))

    def finished(self, outcome: GenerationResult | DecodeError) -> None:
        final: Final = Failed(outcome) if isinstance(outcome, DecodeError) else Done(outcome, self._clock())
        self._post(self._finish, final)

    def _post(self, fn: Callable[[Event], None], event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, event)
        except RuntimeError:  # the loop is closed: the server is gone, nobody can be answered
            pass

    # ---------------------------------------------------------------- the loop's side

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


async def next_or_disconnect(next_event: Callable[[], Awaitable[T]], disconnected: asyncio.Future) -> T | None:
    """The next event (`next_event()`), or None if the client disconnects first."""
    nxt = asyncio.ensure_future(next_event())
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
