"""`Ticket`: a submitted request, between the refusals (already passed) and its one answer.

`ContinuousBatcher.submit` returns one once the request is queued, so a
server can refuse a request with a proper status *before* it starts a
response stream, then wait for the answer on any thread. `wait` delivers
chunks to `on_chunk` on the waiting thread and returns the result (or
raises its typed error); `cancel` stops the request wherever it is.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from ferrox_batch.batch.config import Chunk
from ferrox_batch.batch.lifecycle import Lifecycle
from ferrox_batch.batch.queue import AbortInbox
from ferrox_batch.errors import DecodeError, WorkerDied
from ferrox_batch.generate import GenerationResult

#: How often a waiting caller re-checks that the worker is alive (a safety net; replies wake it at once).
LIVENESS_POLL_SECS = 0.5


class Ticket:
    __slots__ = ("prompt_tokens", "max_tokens", "_reply", "_abort", "_aborts", "_worker", "_lifecycle", "_done",
                 "_claimed")

    def __init__(
        self,
        *,
        prompt_tokens: int,
        max_tokens: int,
        reply: queue.SimpleQueue,
        abort: int,
        aborts: AbortInbox,
        worker: threading.Thread,
        lifecycle: Lifecycle,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens  # after the context-ceiling clamp
        self._reply = reply
        self._abort = abort
        self._aborts = aborts
        self._worker = worker
        self._lifecycle = lifecycle
        self._done = threading.Event()
        self._claimed = threading.Lock()  # held by the one `wait`: its events go to one waiter only

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Ask the worker to stop this request (applied between forwards); a no-op once answered."""
        if not self._done.is_set():
            self._aborts.enqueue(self._abort)

    def wait(self, on_chunk: Callable[[str], None] | None = None) -> GenerationResult:
        """Block until the request finishes; raise its typed `DecodeError` if it failed.

        If `on_chunk` raises, the request is cancelled, the rest of its events are drained,
        and the callback's exception propagates (how a server stops work for a client that left).
        A ticket has one answer for one waiter: a second `wait` raises `RuntimeError` instead of
        waiting for events that were already taken.
        """
        if not self._claimed.acquire(blocking=False):
            raise RuntimeError("this ticket is already waited on: a ticket has one answer, for one waiter")
        try:
            return self._wait(on_chunk)
        finally:
            self._done.set()

    def _wait(self, on_chunk: Callable[[str], None] | None) -> GenerationResult:
        callback_error: BaseException | None = None
        while True:
            try:
                event = self._reply.get(timeout=LIVENESS_POLL_SECS)
            except queue.Empty:
                if self._worker.is_alive():
                    continue
                try:
                    event = self._reply.get_nowait()
                except queue.Empty:
                    raise WorkerDied(self._lifecycle.dead or "the worker thread is gone") from None
            if isinstance(event, Chunk):
                if on_chunk is not None and callback_error is None:
                    try:
                        on_chunk(event.text)
                    except BaseException as error:  # the caller stopped listening: cancel, keep draining
                        callback_error = error
                        self._aborts.enqueue(self._abort)
                continue
            if callback_error is not None:
                raise callback_error
            if isinstance(event.result, DecodeError):
                raise event.result
            return event.result
