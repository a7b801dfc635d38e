"""The bridge between the worker thread (which produces a request's events) and the event loop (which sends them).

Why it exists: the worker hands each request's events to the request's
reply sink on its own thread, and the event loop must never block. So
`ReplyBridge` *is* the request's sink: it posts every chunk, and then the one
final event, to the loop with `loop.call_soon_threadsafe` into an
`asyncio.Queue`, and the loop side awaits `next_event()`. No thread waits per
request: a thousand open streams cost a thousand queues, not a thousand
threads.

What it promises:

* Exactly one final event (`Finished`) per bridge, after every
  `Chunk`; `on_final` runs on the loop thread when it arrives, whether or not
  anyone is still reading (so metrics and the in-flight count see requests
  whose client left).
* `abandon()` (the client left) cancels the request at once through
  `Ticket.cancel`, from the loop thread; the worker then frees its blocks.
  `end(error)` (the server is stopping) does too, and makes `error` the
  final event at once, so a stream still open says why it ends.
* Chunk arrival times are stamped on the worker thread as each chunk is
  handed over (`chunk_times`), which is what time-to-first-token and
  inter-token latency are measured on.
* A loop that has closed (the server is gone) never reaches the worker: the
  post is dropped.
* What it holds for a reader that is not keeping up is bounded: past
  `max_buffered` bytes of queued text (an estimate of its wire size, the
  log-probabilities included) it drops what it queued, queues no more, and
  `overflowed()` returns; the response then ends, which cancels the request.

`PushedResponse` sends a body piece by piece from an async iterator, and
`EventStreamResponse` is the SSE one. It always watches the connection for
`http.disconnect` while sending (whatever ASGI spec version the server
speaks; a plain `StreamingResponse` stops watching under ASGI 2.4, and
uvicorn silently drops writes to a closed connection); each send must be
taken within `write_timeout` seconds, or the client is treated as gone (a
client that stops reading otherwise parks the send on flow control forever,
its request still generating); and when it ends, for whatever reason, it
closes its iterator and runs its `on_close` hook. So a client that leaves or
stalls mid-stream cancels its request deterministically, never at garbage
collection and never only when the answer is complete. A response ended
early returns without finishing the body, and the ASGI server closes the
connection; what it still buffers for it is at most its transport's high
water mark (64 KiB in uvicorn) and the last piece.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import anyio
from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from ferrox_batch.engine.ticket import Ticket
from ferrox_batch.errors import DecodeError
from ferrox_batch.generation_types import GenerationResult
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.replies import Chunk, Finished
from ferrox_batch.server.http.access import request_id

log = logging.getLogger("ferrox_batch.server.http")

#: Wire bytes reckoned per log-probability (a token or one of its alternatives) when bounding a
#: bridge's buffer: a chat entry (`{"token":...,"logprob":...,"bytes":[...]}`) is about this size.
LOGPROB_WIRE_BYTES = 64


T = TypeVar("T")

#: What a bridge delivers on the loop (`ferrox_batch.replies`), and its final one.
Event = Chunk | Finished
Final = Finished


class ReplyBridge:
    """One request's reply sink, delivering to the event loop (see the module docstring).

    `forward_text=False` (a non-streaming request) stamps chunk times but queues no `Chunk`:
    the answer's text comes whole from the result. `max_buffered`: the most bytes of `Chunk`
    it queues for a reader that is not keeping up (None: no bound).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        forward_text: bool,
        on_final: Callable[[ReplyBridge, Final], None],
        clock: Callable[[], float] = time.monotonic,
        max_buffered: int | None = None,
    ) -> None:
        self.ticket: Ticket | None = None  # set once `submit` queued the request
        self.chunk_times: list[float] = []
        self.final: Final | None = None
        self._loop = loop
        self._forward = forward_text
        self._on_final = on_final
        self._clock = clock
        self._max_buffered = max_buffered
        self._queue: asyncio.Queue[tuple[Event, int]] = asyncio.Queue()  # each event with its wire-size estimate
        self._buffered = 0  # the estimates of the queued events (loop thread)
        self._overflow = asyncio.Event()  # binds to the loop on first use, on the loop thread
        self._abandoned = False  # written on the loop, read on the worker thread: a plain flag is enough

    async def next_event(self) -> Event:
        event, size = await self._queue.get()
        self._buffered -= size
        return event

    async def overflowed(self) -> None:
        """Return once the reader fell more than `max_buffered` bytes behind (never, if it does not)."""
        await self._overflow.wait()

    def end(self, error: DecodeError) -> bool:
        """End the request now with `error` as its final event (on the loop thread; the server is stopping):
        the request is cancelled and whatever the worker still sends for it is dropped. True when it was
        still unanswered."""
        if self.final is not None:
            return False
        if self.ticket is not None:
            self.ticket.cancel()
        self._finish(Finished(error, self._clock()))
        return True

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

    def chunk(self, text: str, logprobs: tuple[TokenLogprob, ...] = (), token_ids: tuple[int, ...] = ()) -> None:
        self.chunk_times.append(self._clock())
        if self._forward and not self._abandoned:
            self._post(self._queue_text, Chunk(text, logprobs, token_ids))

    def finished(self, outcome: GenerationResult | DecodeError) -> None:
        final = Finished(outcome, self._clock())
        self._post(self._finish, final)

    def _post(self, fn: Callable[[T], None], event: T) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, event)
        except RuntimeError:  # the loop is closed: the server is gone, nobody can be answered
            pass

    # ---------------------------------------------------------------- the loop's side

    def _queue_text(self, text: Chunk) -> None:
        if self._overflow.is_set() or self.final is not None:  # nothing goes after the final event
            return
        size = len(text.text.encode("utf-8")) + LOGPROB_WIRE_BYTES * sum(1 + len(e.top) for e in text.logprobs)
        if self._max_buffered is not None and self._buffered + size > self._max_buffered:
            # The reader is this far behind: what it has not taken is dropped (the response ends
            # without it), and nothing more is queued but the final event.
            while not self._queue.empty():
                self._queue.get_nowait()
            self._buffered = 0
            self._overflow.set()
            return
        self._buffered += size
        self._queue.put_nowait((text, size))

    def _finish(self, final: Final) -> None:
        if self.final is not None:  # the worker's answer to a request the server already ended (`end`)
            return
        self.final = final
        try:
            self._on_final(self, final)
        finally:
            self._queue.put_nowait((final, 0))


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


class PushedResponse(Response):
    """A body sent piece by piece from an async iterator, watched for disconnects and stalls (module docstring).

    `on_close` runs once the response is over, however it ended (finished, client gone or stalled,
    server cancelled, a `cut` returned): the caller's hook to cancel the request. It is needed besides
    closing the iterator because an async generator that never started runs no `finally` when closed.
    `cut`: awaitables-to-be whose return ends the response early (a reply bridge's `overflowed`).
    `write_timeout`: the seconds each send may wait for the client to take it.
    """

    def __init__(self, pieces: AsyncIterator[bytes], *, write_timeout: float,
                 on_close: Callable[[], None] = lambda: None, cut: Sequence[Callable[[], Awaitable[None]]] = (),
                 status_code: int = 200, headers: Mapping[str, str] | None = None,
                 media_type: str | None = None) -> None:
        self.pieces = pieces
        self.on_close = on_close
        self.cut = tuple(cut)
        self.write_timeout = write_timeout
        self.status_code = status_code
        self.background = None
        if media_type is not None:
            self.media_type = media_type
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = request_id(HTTPConnection(scope))
        try:
            async with anyio.create_task_group() as group:

                async def push() -> None:
                    if await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                               "headers": self.raw_headers}, rid):
                        async for piece in self.pieces:
                            if not await self._send(send, {"type": "http.response.body", "body": piece,
                                                           "more_body": True}, rid):
                                break
                        else:
                            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False},
                                             rid)
                    group.cancel_scope.cancel()

                async def listen() -> None:
                    await wait_for_disconnect(receive)
                    group.cancel_scope.cancel()

                async def watch(signal: Callable[[], Awaitable[None]]) -> None:
                    await signal()
                    log.warning("request %s: the client fell too far behind reading its reply; it is cancelled",
                                rid)
                    group.cancel_scope.cancel()

                group.start_soon(push)
                group.start_soon(listen)
                for signal in self.cut:
                    group.start_soon(watch, signal)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.pieces, "aclose", None)
                if aclose is not None:
                    await aclose()
            self.on_close()

    async def _send(self, send: Send, message: Message, rid: str) -> bool:
        """Send `message`; False if the client did not take it within `write_timeout` (it is treated as gone)."""
        with anyio.move_on_after(self.write_timeout) as deadline:
            await send(message)
        if deadline.cancelled_caught:
            log.warning("request %s: the client took nothing for %g s; its reply is abandoned", rid,
                        self.write_timeout)
            return False
        return True


class EventStreamResponse(PushedResponse):
    """A stream of encoded events from an async iterator: `text/event-stream` unless `media_type` says
    otherwise (an API that streams NDJSON)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], *, write_timeout: float, on_close: Callable[[], None],
                 cut: Sequence[Callable[[], Awaitable[None]]] = (), media_type: str | None = None) -> None:
        if media_type is not None:
            self.media_type = media_type
        # No proxy buffering, no caching: each event must reach the client when it is sent.
        super().__init__(events, write_timeout=write_timeout, on_close=on_close, cut=cut,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def ended_in_band(body: AsyncIterator[bytes], failure: Callable[[BaseException], Sequence[bytes]],
                        rid: str) -> AsyncIterator[bytes]:
    """`body`, whose failure (any exception it raises) ends it with `failure(error)`'s events instead of a
    cut connection: it is sent after the headers, so its status can no longer say so."""
    async with contextlib.aclosing(body):  # closed with the response, however it ends
        try:
            async for piece in body:
                yield piece
        except Exception as error:
            log.error("request %s: its stream failed after it began; it ends with an error event", rid,
                      exc_info=error)
            for piece in failure(error):
                yield piece
