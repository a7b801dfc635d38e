"""Helpers for the scheduler tests that drive the worker by hand or hold it at a known point.

* `make_worker` builds a `Worker` exactly as `ContinuousBatcher.spawn_with_ceiling`
  does, without a thread, so a test can call `tick` itself (a `tick` with work
  in hand never blocks) or drive `worker.scheduler` directly.
* `make_request` prices a `Request` as the handle would (queue slot taken,
  abort id allocated, a `QueueSink`) and returns it with its reply channel;
  `worker.jobs.put(request)` sends it.
* `Gate` is a detokenizer that can hold the worker inside a decode call. The
  worker calls it once per sampled token, mid-tick, so while it is held the
  scheduler's state (and `stats()`) cannot move: tests step the worker one
  token at a time instead of sleeping and hoping.
* `Caller` runs one `generate*` call on its own thread; `join()` always uses a
  timeout and asserts the thread finished.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

from batch_helpers import identity_decode

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.wiring import build_worker, config_ceiling
from ferrox_batch.engine.worker import Worker
from ferrox_batch.generation_types import GenerationParams
from ferrox_batch.replies import Chunk, Finished
from ferrox_batch.scheduler.request import Request
from ferrox_batch.scheduler.sink import OnceSink, QueueSink
from ferrox_batch.stop_tokens import StopTokens

#: How long any test waits for the scheduler to reach a state before failing.
DEADLINE = 10.0


def make_worker(model, config: BatcherConfig, decode=identity_decode) -> Worker:
    """A worker wired as `spawn_with_config` wires it, driven tick by tick on the test's thread."""
    return build_worker(model.decoder, decode, config, config_ceiling(model.decoder, config), log_interval=40)


def make_request(
    worker: Worker, prompt: Sequence[int], params: GenerationParams, *, abort: int | None = None,
    stop_tokens: StopTokens | None = None,
) -> tuple[Request, queue.SimpleQueue]:
    """A request priced as `generate_streaming` prices it (its queue slot is taken), with its reply channel."""
    assert worker.scheduler.queue_gate.try_reserve() is None, "the test's queue is full"
    positions = len(prompt) + params.max_tokens
    sink = QueueSink()
    request = Request(list(prompt), params, stop_tokens or StopTokens.default(), OnceSink(sink),
                      worker.aborts.next_id() if abort is None else abort,
                      worker.scheduler.budget.blocks_for(positions), positions)
    request.queued(worker.scheduler.clock(), worker.scheduler.config.max_queue_wait_ms)
    return request, sink.events


def priced(worker: Worker, prompt: list[int], max_tokens: int) -> tuple[Request, queue.SimpleQueue]:
    """A greedy request priced as `ContinuousBatcher.submit` prices it (its window and KV groups included),
    holding a queue slot, and the queue its reply arrives on: for tests that drive the worker tick by tick."""
    from batch_helpers import greedy_params

    from ferrox_batch.engine.intake import size_request

    assert worker.scheduler.queue_gate.try_reserve() is None
    sized = size_request(prompt, greedy_params(max_tokens), worker.scheduler.budget, None, worker.runner.window,
                         groups=worker.runner.pricing)
    sink = QueueSink()
    request = Request(prompt, sized.params, StopTokens.default(), OnceSink(sink), worker.aborts.next_id(),
                      sized.blocks, sized.positions, window=sized.window)
    request.queued(worker.scheduler.clock(), None)
    return request, sink.events


def drain_reply(reply: queue.SimpleQueue) -> tuple[list[str], list[object]]:
    """Everything on a reply channel now: (chunk texts, finished results)."""
    chunks, finished = [], []
    while True:
        try:
            event = reply.get_nowait()
        except queue.Empty:
            return chunks, finished
        if isinstance(event, Chunk):
            assert not finished, "a chunk arrived after the job's Finished"
            chunks.append(event.text)
        else:
            assert isinstance(event, Finished)
            finished.append(event.result)


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.001)


class Gate:
    """A detokenizer (`identity_decode` by default) that lets through only as many calls as it has permits.

    `calls` counts calls *entered*: after `wait_calls(n)` the worker is inside
    its n-th decode call and, with no permit left, held there mid-tick.
    `open()` lets everything through from then on.
    """

    def __init__(self, decode=identity_decode, permits: int | None = 0) -> None:
        self._decode = decode
        self._permits = permits
        self._cond = threading.Condition()
        self.calls = 0

    def __call__(self, ids: Sequence[int]) -> bytes:
        with self._cond:
            self.calls += 1
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._permits is None or self._permits > 0, timeout=DEADLINE):
                raise RuntimeError("the test never let the worker past its decode gate")
            if self._permits is not None:
                self._permits -= 1
        return self._decode(ids)

    def release(self, n: int = 1) -> None:
        with self._cond:
            assert self._permits is not None, "the gate is open"
            self._permits += n
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._permits = None
            self._cond.notify_all()

    def hold(self) -> None:
        with self._cond:
            self._permits = 0

    def wait_calls(self, n: int, timeout: float = DEADLINE) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.calls >= n, timeout=timeout):
                raise AssertionError(f"the worker made {self.calls} decode calls, expected {n}")

    def step(self) -> None:
        """Let the held call finish and wait until the worker is held at the next one."""
        with self._cond:
            target = self.calls + 1
        self.release()
        self.wait_calls(target)


class Caller:
    """One `generate_streaming` call on its own thread; the result or the raised error is kept."""

    def __init__(self, batcher, prompt, params, stop_tokens=None, on_chunk=None) -> None:
        self.result = None
        self.error: BaseException | None = None
        self.chunks: list[str] = []
        self._on_chunk = on_chunk

        def collect(text: str) -> None:
            self.chunks.append(text)
            if self._on_chunk is not None:
                self._on_chunk(text)

        def run() -> None:
            try:
                self.result = batcher.generate_streaming(prompt, params, stop_tokens, collect)
            except BaseException as error:  # noqa: BLE001 - kept for the test to assert on
                self.error = error

        self.thread = threading.Thread(target=run, name="test-caller", daemon=True)
        self.thread.start()

    def join(self, timeout: float = DEADLINE):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "a caller thread did not finish in time"
        if self.error is not None:
            raise self.error
        return self.result

    def join_error(self, timeout: float = DEADLINE) -> BaseException:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "a caller thread did not finish in time"
        assert self.error is not None, f"expected an error, got {self.result!r}"
        return self.error


def wait_sent(batcher, n: int, timeout: float = DEADLINE) -> None:
    """Wait until `n` jobs sit on the batcher's channel (sent, not yet drained by the held worker).

    `stats().queue_depth` counts a job from its reservation, a moment before it
    is sent; this looks at the channel itself so the next tick surely drains it.
    """
    wait_for(lambda: batcher._jobs.qsize() >= n, f"{n} jobs on the channel", timeout)
