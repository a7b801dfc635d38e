"""The worker thread: drain the channel and the abort inbox, schedule, run, update.

One daemon thread owns every in-flight request. Each turn of its loop:

1. block on the channel only when there is nothing at all to do;
2. take every request on the channel, and every abort id in the inbox;
3. `Scheduler.schedule()`: flush what finished, admit, plan the forward;
4. `ModelRunner.execute(plan)`: one forward holding every decoding
   request's next token and the planned prompt chunks, then one sampling
   call;
5. `Scheduler.update(plan, out.sampled, seconds, out.prompt_logprobs)`: apply
   the sampled tokens (and any prompt log-probabilities), stream text to each
   request's sink, flush what finished.

Divergence from the upstream tick, on purpose: the upstream runs the prefill
chunk as its own forward, then a second forward for the decodes. Our runtime
takes a mixed varlen batch, so both go in one forward: the weights are read
once per tick instead of twice. Every request's tokens are unchanged.

Faults: a forward that raises fails the requests in it (`InternalError`); a
sampler failure or a bad row fails those rows (the runner's outcomes). The
worker keeps serving in both cases. Anything else that escapes the loop is a
scheduler bug: the worker marks itself dead, answers every request it holds
and every request still on the channel with `WorkerDied` through their
sinks, and returns every block and queue slot. Nobody polls for that: each
waiter hears it from its own sink.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable, Protocol

from ferrox_batch.batch.counters import Counters
from ferrox_batch.batch.lifecycle import CLOSE, Lifecycle
from ferrox_batch.batch.queue import AbortInbox
from ferrox_batch.batch.worker_time import WorkerTime
from ferrox_batch.errors import InternalError, WorkerDied
from ferrox_batch.scheduler.plan import StepOutput, StepPlan
from ferrox_batch.scheduler.request import Request
from ferrox_batch.scheduler.scheduler import Scheduler

log = logging.getLogger("ferrox_batch.batch")


class Runner(Protocol):
    """What the worker runs plans on (`models.runner.ModelRunner`, or a fake in tests)."""

    def execute(self, plan: StepPlan) -> StepOutput: ...

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
        clock = time.perf_counter
        if self.scheduler.idle:
            if self.closing:
                return False
            self.time.begin_idle()
            self._take(self.jobs.get())  # idle: block until there is work
            self.time.end_idle()
        planning = clock()
        self._drain_channel()
        stopped = self.scheduler.abort(self.aborts.drain())
        if stopped:
            self.aborts.add_aborted(stopped)
        plan = self.scheduler.schedule()
        began = clock()
        self.time.add_scheduling(began - planning)
        if plan.empty:
            return True
        cpu = time.thread_time()
        try:
            out = self.runner.execute(plan)
        except Exception as bad:
            self.time.add_forward(clock() - began, time.thread_time() - cpu)
            log.exception("forward failed")
            self.scheduler.fail_step(plan, InternalError(f"forward failed: {type(bad).__name__}: {bad}"))
            return True
        ran = clock()
        self.time.add_forward(ran - began, time.thread_time() - cpu)
        self.scheduler.update(plan, out.sampled, ran - began, out.prompt_logprobs)
        self.time.add_scheduling(clock() - ran)
        return True

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
        self.scheduler.fail_all(error, self._safely)

    @staticmethod
    def _safely(action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:  # the state may be what broke; answering callers matters more
            log.exception("cleanup after a worker crash failed")
