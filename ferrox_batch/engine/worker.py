"""The worker thread: drain the channel and the abort inbox, schedule, run, update.

One daemon thread owns every in-flight request. Each turn of its loop:

1. block on the channel only when there is nothing at all to do;
2. take every request on the channel, and every abort id in the inbox;
3. `Scheduler.schedule()`: flush what finished, admit, plan the forward;
4. `ModelRunner.execute(plan)`: one forward holding every decoding
   request's next token and the planned prompt chunks, then one sampling
   call;
5. `Scheduler.update(plan, out.sampled, seconds, out.prompt_logprobs, out.pooled)`: apply
   the sampled tokens (and any prompt log-probabilities), stream text to each
   request's sink, flush what finished.

Divergence from the upstream tick, on purpose: the upstream runs the prefill
chunk as its own forward, then a second forward for the decodes. Our runtime
takes a mixed varlen batch, so both go in one forward: the weights are read
once per tick instead of twice. Every request's tokens are unchanged.

Faults, from the narrowest to the widest:

* whatever one request carries that makes a step of the scheduler raise
  (its prefix lookup, admission, lease, stop matching, detokenising, its
  sink) fails that request alone (`scheduler.isolation`);
* a sampler failure or a bad row fails those rows (the runner's outcomes);
* a forward that raises fails the requests in it (`InternalError`);
* any other exception out of a tick cannot be pinned on one request: every
  admitted request fails with `InternalError`, the waiting ones stay
  queued, the block ledger is brought back in line with the store, and the
  worker goes on. Only `MAX_FAILED_TICKS` such ticks in a row (the state is
  broken, not one request), a ledger that cannot be reconciled, or a
  `BaseException` that is not an `Exception` (an interpreter exit) stop it.

A worker that stops marks itself dead, answers every request it holds and
every request still on the channel with `WorkerDied` through their sinks,
and returns every block and queue slot. Nobody polls for that: each waiter
hears it from its own sink.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable, Protocol

from ferrox_batch.admission.counters import Counters
from ferrox_batch.admission.queue import AbortInbox
from ferrox_batch.engine.lifecycle import CLOSE, Lifecycle
from ferrox_batch.engine.worker_time import WorkerTime
from ferrox_batch.errors import InternalError, WorkerDied
from ferrox_batch.forward import ForwardPlan, StepOutput
from ferrox_batch.scheduler import exits
from ferrox_batch.scheduler.request import Request
from ferrox_batch.scheduler.scheduler import Scheduler

log = logging.getLogger("ferrox_batch.engine")

#: Ticks in a row that may fail outside any one request before the worker gives up on its state.
MAX_FAILED_TICKS = 3


class Runner(Protocol):
    """What the worker runs plans on (`runtime.runner.ModelRunner`, or a fake in tests)."""

    def execute(self, plan: ForwardPlan) -> StepOutput: ...

    def close(self) -> None:
        """Stop whatever helper threads it started (the worker is exiting)."""
        ...


class Worker:
    def __init__(
        self,
        *,
        scheduler: Scheduler,
        runner: Runner,
        jobs: queue.SimpleQueue,
        lifecycle: Lifecycle,
        aborts: AbortInbox,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.jobs = jobs
        self.lifecycle = lifecycle
        self.aborts = aborts
        self.closing = False
        self.time = WorkerTime()
        self.failed_ticks = 0  # ticks in a row that failed outside any one request

    @property
    def config(self):
        return self.scheduler.config

    @property
    def counters(self) -> Counters:
        return self.scheduler.counters

    def run(self) -> None:
        try:
            while self.tick():
                pass
        except BaseException as crash:  # a scheduler bug: answer everyone, then stop
            log.exception("continuous-batch worker crashed")
            self.fail_everything(f"{type(crash).__name__}: {crash}")
        finally:
            self.runner.close()

    def tick(self) -> bool:
        """One turn of the loop; False once the batcher is closed and idle."""
        if self.scheduler.idle:
            if self.closing:
                return False
            self.time.begin_idle()
            self._take(self.jobs.get())  # idle: block until there is work
            self.time.end_idle()
        self._drain_channel()
        try:
            self._step()
        except Exception as bad:
            self._step_failed(bad)
        else:
            self.failed_ticks = 0
        return True

    def _step(self) -> None:
        """Aborts, schedule, forward and sampling, update: the body of a tick."""
        clock = time.perf_counter
        planning = clock()
        stopped = exits.cancel(self.scheduler, self.aborts.drain())
        if stopped:
            self.aborts.add_aborted(stopped)
        plan = self.scheduler.schedule()
        began = clock()
        self.time.add_scheduling(began - planning)
        if plan.empty:
            return
        cpu = time.thread_time()
        try:
            out = self.runner.execute(plan.forward())
        except Exception as bad:
            self.time.add_forward(clock() - began, time.thread_time() - cpu)
            log.exception("forward failed")
            exits.fail_step(self.scheduler, plan, InternalError(f"forward failed: {type(bad).__name__}: {bad}"))
            return
        ran = clock()
        self.time.add_forward(ran - began, time.thread_time() - cpu)
        self.scheduler.update(plan, out.sampled, ran - began, out.prompt_logprobs, out.pooled)
        self.time.add_scheduling(clock() - ran)

    def _step_failed(self, bad: Exception) -> None:
        """A tick raised outside any one request: fail the admitted requests and go on, unless it keeps
        happening (then the state itself is broken, and the exception ends the worker)."""
        self.failed_ticks += 1
        if self.failed_ticks >= MAX_FAILED_TICKS:
            raise bad
        log.error("a batch step failed outside any one request; the requests running fail, the worker goes on",
                  exc_info=bad)
        exits.fail_admitted(self.scheduler, InternalError(f"the batch step failed: {type(bad).__name__}: {bad}"))

    def _take(self, item: object) -> None:
        if item is CLOSE:
            self.closing = True
        else:
            assert isinstance(item, Request)
            self.scheduler.add(item)

    def _drain_channel(self) -> None:
        while True:
            try:
                self._take(self.jobs.get_nowait())
            except queue.Empty:
                return

    def fail_everything(self, cause: str) -> None:
        """Answer every request this worker holds, and every one still on the channel, with `WorkerDied`."""
        error = WorkerDied(cause)
        for item in self.lifecycle.mark_dead(cause, self.jobs):
            if isinstance(item, Request):
                self.scheduler.waiting.add(item)
        exits.fail_all(self.scheduler, error, self._safely)

    @staticmethod
    def _safely(action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:  # the state may be what broke; answering callers matters more
            log.exception("cleanup after a worker crash failed")
