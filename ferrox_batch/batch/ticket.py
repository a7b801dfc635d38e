"""`Ticket`: a submitted request, between the refusals (already passed) and its one answer.

`ContinuousBatcher.submit` returns one once the request is queued, so a
server can refuse a request with a proper status *before* it starts a
response stream, then wait for the answer on any thread. `wait` delivers
chunks to `on_chunk` on the waiting thread and returns the result (or
raises its typed error); `cancel` stops the request wherever it is.

A wait that ends without the answer (its timeout passed, or anything was
raised into it: a `KeyboardInterrupt`, a thread's async exception) cancels
its request: nobody is left to read what it would generate, and its KV
blocks should go to someone who is.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from ferrox_batch.batch.config import Chunk
from ferrox_batch.batch.lifecycle import Lifecycle
from ferrox_batch.batch.queue import AbortInbox
from ferrox_batch.checks import check_seconds
from ferrox_batch.errors import DecodeError, WaitTimedOut, WorkerDied
from ferrox_batch.generation_types import GenerationResult

#: How often a waiting caller re-checks that the worker is alive (a safety net; replies wake it at once).
LIVENESS_POLL_SECS = 0.5


class Ticket:
    __slots__ = ("prompt_tokens", "max_tokens", "_reply", "_abort", "_aborts", "_worker", "_lifecycle", "_done",
                 "_claimed", "_answered")

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
        self._answered = False  # the waiter took the worker's final event

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Ask the worker to stop this request (applied between forwards); a no-op once answered."""
        if not self._done.is_set():
            self._aborts.enqueue(self._abort)

    def wait(self, on_chunk: Callable[[str], None] | None = None, timeout: float | None = None) -> GenerationResult:
        """Block until the request finishes; raise its typed `DecodeError` if it failed.

        If `on_chunk` raises, the request is cancelled, the rest of its events are drained,
        and the callback's exception propagates (how a server stops work for a client that left).
        After `timeout` seconds without the answer the request is cancelled and `WaitTimedOut`
        raised; any other exception raised into the wait (a `KeyboardInterrupt`) cancels it too.
        A ticket has one answer for one waiter: a second `wait` raises `RuntimeError` instead of
        waiting for events that were already taken.
        """
        deadline = None if timeout is None else time.monotonic() + check_seconds("timeout", timeout)
        if not self._claimed.acquire(blocking=False):
            raise RuntimeError("this ticket is already waited on: a ticket has one answer, for one waiter")
        try:
            return self._wait(on_chunk, deadline, timeout)
        except BaseException:
            if not self._answered:  # abandoned: its tokens would go to nobody
                self._aborts.enqueue(self._abort)
            raise
        finally:
            self._done.set()

    def _wait(self, on_chunk: Callable[[str], None] | None, deadline: float | None,
              timeout: float | None) -> GenerationResult:
        callback_error: BaseException | None = None
        while True:
            poll = LIVENESS_POLL_SECS if deadline is None else min(LIVENESS_POLL_SECS, deadline - time.monotonic())
            try:
                event = self._reply.get(timeout=max(poll, 0.0))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline and callback_error is None:
                    raise WaitTimedOut(timeout) from None
                if self._worker.is_alive():
                    continue
                try:
                    event = self._reply.get_nowait()
                except queue.Empty:
                    raise WorkerDied(self._lifecycle.dead or "the worker thread is gone") from None
            if isinstance(event, Chunk):
                # An `on_chunk` slower than the worker never lets the queue run empty, so the
                # deadline is checked on every chunk too, not only when the queue is empty; a
                # final event is still taken (the answer arrived), and a callback that already
                # failed keeps draining so that its own error is the one raised.
                if deadline is not None and callback_error is None and time.monotonic() >= deadline:
                    raise WaitTimedOut(timeout)
                if on_chunk is not None and callback_error is None:
                    try:
                        on_chunk(event.text)
                    except BaseException as error:  # the caller stopped listening: cancel, keep draining
                        callback_error = error
                        self._aborts.enqueue(self._abort)
                continue
            self._answered = True
            if callback_error is not None:
                raise callback_error
            if isinstance(event.result, DecodeError):
                raise event.result
            return event.result
