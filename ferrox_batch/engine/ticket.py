"""`Ticket`: a submitted request, between the refusals (already passed) and its one answer.

`ContinuousBatcher.submit` returns one once the request is queued, so a
server can refuse a request with a proper status *before* it starts a
response stream. `cancel` stops the request wherever it is. A request
submitted with the default sink (`QueueSink`) is waited on with `wait`,
on any thread: it delivers chunks to `on_chunk` on the waiting thread and
returns the result (or raises its typed error). A request submitted with a
sink of the caller's own gets its events there, and its ticket only cancels.

Nothing polls: a worker that dies answers every request it holds through its
sink (`WorkerDied`), so a waiter always hears the end from its own queue.
Ctrl-C interrupts a wait on the main thread at once. An exception raised into
another waiting thread (`PyThreadState_SetAsyncExc`) lands only when that
thread runs again, that is when the next event or the wait's timeout wakes it.

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

from ferrox_batch.admission.queue import AbortInbox
from ferrox_batch.checks import check_seconds
from ferrox_batch.errors import DecodeError, WaitTimedOut
from ferrox_batch.generation_types import GenerationResult, SamplingParams
from ferrox_batch.replies import Chunk, Reply


class Ticket:
    __slots__ = ("prompt_tokens", "max_tokens", "_reply", "_abort", "_aborts", "_done", "_claimed", "_answered",
                 "sampling", "bias")

    def __init__(
        self,
        *,
        prompt_tokens: int,
        max_tokens: int,
        reply: queue.SimpleQueue[Reply] | None,
        abort: int,
        aborts: AbortInbox,
        sampling: SamplingParams | None = None,
        bias: object = None,
    ) -> None:
        """`reply`: the `QueueSink`'s queue the worker answers on, or None for a sink of the caller's own.
        `sampling`, `bias`: the request's sampling settings and the bias prepared for them at submit, which a
        later choice of the same prompt with the same settings shares (`submit(after=...)`)."""
        self.sampling = sampling
        self.bias = bias
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens  # after the context-ceiling clamp
        self._reply = reply
        self._abort = abort
        self._aborts = aborts
        self._done = threading.Event()
        self._claimed = threading.Lock()  # held by the one `wait`: its events go to one waiter only
        self._answered = False  # the waiter took the worker's final event

    @property
    def abort_id(self) -> int:
        """The id the worker knows the request by (what `ContinuousBatcher.submit(after=...)` refers to)."""
        return self._abort

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
        if self._reply is None:
            raise RuntimeError("this request answers through the sink it was submitted with, not through wait()")
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
        reply = self._reply
        assert reply is not None
        while True:
            # A callback that failed has cancelled the request and drains until the answer, however long.
            timed = deadline is not None and callback_error is None
            try:
                event = reply.get(timeout=max(deadline - time.monotonic(), 0.0) if timed else None)
            except queue.Empty:
                raise WaitTimedOut(timeout) from None
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
