"""Where a request's replies go: a `ReplySink` the caller chooses when it submits.

The worker thread produces a request's events: zero or more `Chunk`s of
visible text, then exactly one `Finished` carrying the result or the typed
error. It hands each to the request's sink and never waits on it, so a sink
must be quick and must not block:

* `QueueSink` (the blocking handle's): events go on a `queue.SimpleQueue`
  that the caller's `Ticket.wait` reads on its own thread.
* The HTTP server's sink posts each event straight to its event loop, so no
  thread waits per request (`server.streaming`).

`OnceSink` wraps whichever sink a request has and promises the rest of the
engine two things: `finished` reaches the sink at most once, and a sink that
raises never reaches the worker (a chunk that cannot be delivered cancels
only its own request; see `Request.emit`).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Protocol

from ferrox_batch.errors import DecodeError
from ferrox_batch.generation_types import GenerationResult
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.replies import Chunk, Finished, Reply

log = logging.getLogger("ferrox_batch.scheduler")


class ReplySink(Protocol):
    """Receives one request's events on the worker thread; must return quickly and never block."""

    def chunk(self, text: str, logprobs: tuple[TokenLogprob, ...] = (), token_ids: tuple[int, ...] = ()) -> None:
        """`text` with the log-probabilities of its tokens (when the request asked for them) and their ids
        (when its params set `stream_token_ids`). `OnceSink` passes only what is non-empty, `token_ids` by
        keyword, so a sink that never asks for either may take `text` alone."""

    def finished(self, outcome: GenerationResult | DecodeError) -> None: ...


class QueueSink:
    """Events on a `queue.SimpleQueue`, for a caller that waits on its own thread (`Ticket`)."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events: queue.SimpleQueue[Reply] = queue.SimpleQueue()

    def chunk(self, text: str, logprobs: tuple[TokenLogprob, ...] = (), token_ids: tuple[int, ...] = ()) -> None:
        self.events.put(Chunk(text, logprobs, token_ids))

    def finished(self, outcome: GenerationResult | DecodeError) -> None:
        self.events.put(Finished(outcome))


class OnceSink:
    """A request's sink as the engine uses it: one final event, and a sink's failure stays its own.

    `finished` may be called from two threads in one race only (a crashing worker answering
    everyone while the handle refuses a send), hence the lock.
    """

    __slots__ = ("_sink", "_lock", "_answered")

    def __init__(self, sink: ReplySink) -> None:
        self._sink = sink
        self._lock = threading.Lock()
        self._answered = False

    @property
    def answered(self) -> bool:
        return self._answered

    def chunk(self, text: str, logprobs: tuple[TokenLogprob, ...] = (), token_ids: tuple[int, ...] = ()) -> bool:
        """Deliver `text`; False when the sink refused it (its request should stop: nobody reads it)."""
        if self._answered:
            return False
        try:
            if token_ids:
                self._sink.chunk(text, logprobs, token_ids=token_ids)
            elif logprobs:
                self._sink.chunk(text, logprobs)
            else:  # sinks that never asked for log-probabilities or ids need not take them
                self._sink.chunk(text)
        except Exception:
            log.exception("a reply sink refused a chunk; its request is cancelled")
            return False
        return True

    def finished(self, outcome: GenerationResult | DecodeError) -> None:
        with self._lock:
            if self._answered:
                return
            self._answered = True
        try:
            self._sink.finished(outcome)
        except Exception:
            log.exception("a reply sink refused its final event")
