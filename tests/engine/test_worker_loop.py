"""The worker's loop with no model: a fake runner answers plans with fake sampled ids, so the loop's own
promises are pinned alone: a forward that raises fails only the requests in it and the loop goes on; a
KV call that raises for one request fails that request alone; a tick that fails outside any one request
fails the running requests and the loop goes on, until it keeps failing; and a crash (a `BaseException`,
or failures that keep coming) answers every request, the ones still on the channel too, through their
sinks, and later sends are refused with the cause."""

from __future__ import annotations

import queue

import pytest
from scheduler_fakes import Bench

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.lifecycle import CLOSE, Lifecycle
from ferrox_batch.engine.worker import Worker
from ferrox_batch.errors import InternalError, WorkerDied
from ferrox_batch.forward import ForwardPlan, StepOutput
from ferrox_batch.generation_types import FinishReason


class FakeRunner:
    """Samples token 1 for every request; runs `fault` instead on the forward numbered `fail_at`."""

    def __init__(self, bench: Bench, fail_at: int | None = None, fault: BaseException | None = None,
                 before_fault=lambda: None) -> None:
        self.bench = bench
        self.fail_at = fail_at
        self.fault = fault
        self.before_fault = before_fault
        self.forwards = 0
        self.closed = False

    def execute(self, plan: ForwardPlan):
        self.forwards += 1
        if self.forwards == self.fail_at:
            assert self.fault is not None
            self.before_fault()
            raise self.fault
        self.bench.kv.run(plan)
        return StepOutput([1] * len(plan.sampling))

    def close(self) -> None:
        self.closed = True


def make_loop(bench: Bench, runner: FakeRunner) -> Worker:
    return Worker(scheduler=bench.scheduler, runner=runner, jobs=queue.SimpleQueue(), lifecycle=Lifecycle(),
                  aborts=bench.aborts)


def test_the_loop_runs_requests_to_their_answers_and_exits_once_closed_and_idle():
    bench = Bench(BatcherConfig(max_prefills_per_tick=4))
    worker = make_loop(bench, FakeRunner(bench))
    requests = [bench.submit([i + 1], 3, drained=False) for i in range(3)]
    for request in requests:
        worker.jobs.put(request)
    worker.lifecycle.close(worker.jobs)
    worker.run()  # returns: closed, and everything answered
    assert all(bench.sink(r).result.token_ids == (1, 1, 1) for r in requests)
    bench.assert_nothing_held()


def test_a_forward_that_raises_fails_only_its_requests_and_the_loop_goes_on():
    bench = Bench(BatcherConfig(max_prefills_per_tick=1))
    runner = FakeRunner(bench, fail_at=2, fault=RuntimeError("device lost"))
    worker = make_loop(bench, runner)
    first = bench.submit([1], 5, drained=False)
    worker.jobs.put(first)
    worker.tick()  # forward 1: first's prompt
    second = bench.submit([2], 2, drained=False)
    worker.jobs.put(second)
    worker.tick()  # forward 2 raises: first's decode and second's prompt were in it
    assert isinstance(bench.sink(first).result, InternalError)
    assert isinstance(bench.sink(second).result, InternalError)
    assert "device lost" in str(bench.sink(first).result)
    third = bench.submit([3], 2, drained=False)
    worker.jobs.put(third)
    worker.jobs.put(CLOSE)
    worker.run()
    assert bench.sink(third).result.finish_reason == FinishReason.LENGTH
    bench.assert_nothing_held()


class SchedulerBug(BaseException):
    """Not an `Exception`: nothing on the per-request fault paths catches it."""


def test_a_scheduler_bug_answers_everyone_through_their_sinks_and_refuses_later_sends():
    bench = Bench(BatcherConfig(max_prefills_per_tick=1, kv_block_size=4), kv_blocks=8)
    on_channel = bench.submit([3], 2, drained=False)
    runner = FakeRunner(bench, fail_at=3, fault=SchedulerBug("broken invariant"))
    worker = make_loop(bench, runner)
    runner.before_fault = lambda: worker.jobs.put(on_channel)  # sent while the failing forward runs
    decoding = bench.submit([1], 10, drained=False)
    worker.jobs.put(decoding)
    worker.tick()
    worker.tick()
    waiting = bench.submit([2] * 8, 20, drained=False)  # 7 blocks: does not fit beside `decoding`
    worker.jobs.put(waiting)
    worker.run()  # forward 3 raises the bug: the loop answers everyone and returns
    died = WorkerDied("SchedulerBug: broken invariant")
    for request in (decoding, waiting, on_channel):
        assert bench.sink(request).finals == [died]
    assert bench.scheduler.idle and bench.scheduler.budget.free() == 8 and bench.kv.seqs == {}
    assert bench.scheduler.queue_gate.depth() == 0
    with pytest.raises(WorkerDied):
        worker.lifecycle.send(worker.jobs, bench.submit([4], 1, drained=False))


def test_a_kv_lease_that_cannot_be_made_fails_that_request_alone_and_the_loop_goes_on():
    bench = Bench(BatcherConfig(max_prefills_per_tick=4))
    worker = make_loop(bench, FakeRunner(bench))
    allocate = bench.kv.allocate

    def allocate_unless_victim(positions, tokens=(), salt=None, window=None, every=None):
        if list(tokens) == [1]:
            raise TypeError("a bug in allocate")
        return allocate(positions, tokens, salt, window, every)

    bench.kv.allocate = allocate_unless_victim
    victim = bench.submit([1], 2, drained=False)
    other = bench.submit([2], 2, drained=False)
    worker.jobs.put(victim)
    worker.jobs.put(other)
    worker.lifecycle.close(worker.jobs)
    worker.run()
    error = bench.sink(victim).result
    assert isinstance(error, InternalError) and "a bug in allocate" in str(error)
    assert bench.sink(other).result.token_ids == (1, 1)
    assert worker.lifecycle.dead is None
    bench.assert_nothing_held()


def test_a_lease_that_cannot_be_ended_keeps_its_answer_and_the_ledger_is_brought_back_in_line():
    bench = Bench(BatcherConfig(max_prefills_per_tick=4))
    worker = make_loop(bench, FakeRunner(bench))
    release = bench.kv.release

    def broken(seq_id):
        release(seq_id)  # the store ends the lease, then the call raises anyway
        raise TypeError("a bug in release")

    bench.kv.release = broken
    requests = [bench.submit([k + 1], 2, drained=False) for k in range(3)]
    for request in requests:
        worker.jobs.put(request)
    worker.lifecycle.close(worker.jobs)
    worker.run()
    assert all(bench.sink(r).result.token_ids == (1, 1) for r in requests)
    assert worker.lifecycle.dead is None
    bench.assert_nothing_held()


def test_a_lease_the_store_still_holds_stays_counted_until_it_can_be_ended():
    bench = Bench(BatcherConfig(kv_block_size=4), kv_blocks=8)
    worker = make_loop(bench, FakeRunner(bench))
    release = bench.kv.release
    failures = [TypeError("a bug in release, before the lease ended")]

    def flaky(seq_id):
        if failures:
            raise failures.pop()
        return release(seq_id)

    bench.kv.release = flaky
    first = bench.submit([1] * 5, 2, drained=False)  # 7 positions: 2 blocks
    worker.jobs.put(first)
    while not bench.sink(first).finals:
        worker.tick()
    assert bench.sink(first).result.token_ids == (1, 1)  # its answer stands
    held = len(bench.kv.blocks_of(first.seq_id))
    assert held == 2 and bench.scheduler.budget.free() == 8 - held  # never promised while the store holds them
    whole = bench.submit([2] * 30, 2, drained=False)  # 32 positions: every block
    worker.jobs.put(whole)
    worker.lifecycle.close(worker.jobs)
    worker.run()  # the next flush ends the orphaned lease, and the whole pool is free for `whole`
    assert bench.sink(whole).result.token_ids == (1, 1)
    assert worker.lifecycle.dead is None
    bench.assert_nothing_held()


def test_a_tick_that_fails_outside_any_request_fails_the_running_ones_and_the_loop_goes_on():
    bench = Bench(BatcherConfig(max_prefills_per_tick=1, max_seqs=1))  # the second request waits
    worker = make_loop(bench, FakeRunner(bench))
    running = bench.submit([1], 5, drained=False)
    worker.jobs.put(running)
    worker.tick()  # its prompt
    plan = bench.scheduler._prompt_chunks
    bench.scheduler._prompt_chunks = lambda *a: (_ for _ in ()).throw(RuntimeError("a planning bug"))
    waiting = bench.submit([2] * 3, 2, drained=False)
    worker.jobs.put(waiting)
    worker.tick()  # planning raises: the running request fails, the waiting one stays queued
    error = bench.sink(running).result
    assert isinstance(error, InternalError) and "a planning bug" in str(error)
    assert bench.sink(waiting).finals == []
    bench.scheduler._prompt_chunks = plan
    worker.lifecycle.close(worker.jobs)
    worker.run()
    assert bench.sink(waiting).result.token_ids == (1, 1)
    assert worker.lifecycle.dead is None
    bench.assert_nothing_held()


def test_ticks_that_keep_failing_outside_any_request_stop_the_worker():
    bench = Bench(BatcherConfig())
    worker = make_loop(bench, FakeRunner(bench))
    bench.scheduler._admit = lambda: (_ for _ in ()).throw(RuntimeError("broken state"))
    waiting = bench.submit([1], 2, drained=False)
    worker.jobs.put(waiting)
    worker.run()  # the same failure every tick: after MAX_FAILED_TICKS the worker gives up and answers
    assert bench.sink(waiting).finals == [WorkerDied("RuntimeError: broken state")]
    assert worker.lifecycle.dead == "RuntimeError: broken state"


class SleepingRunner(FakeRunner):
    """Each forward sleeps (off the CPU) for `sleep` seconds, then burns `spin` seconds of CPU."""

    def __init__(self, bench: Bench, sleep: float, spin: float) -> None:
        super().__init__(bench)
        self.sleep, self.spin = sleep, spin

    def execute(self, plan: ForwardPlan):
        import time

        time.sleep(self.sleep)
        until = time.thread_time() + self.spin
        while time.thread_time() < until:
            pass
        return super().execute(plan)


def test_the_worker_accounts_its_time_idle_scheduling_and_forwarding_off_and_on_cpu():
    import threading
    import time

    bench = Bench(BatcherConfig(max_prefills_per_tick=4))
    runner = SleepingRunner(bench, sleep=0.02, spin=0.01)
    worker = make_loop(bench, runner)
    thread = threading.Thread(target=worker.run)
    thread.start()
    before = worker.time.snapshot()
    time.sleep(0.1)  # idle (or about to be): nothing submitted yet
    # A wait still in progress counts up to the snapshot: all 0.1 s are idle once the worker is waiting.
    while worker.time.snapshot().idle_s == before.idle_s:
        time.sleep(0.01)
    request = bench.submit([1], 3, drained=False)
    worker.jobs.put(request)
    worker.lifecycle.close(worker.jobs)
    thread.join(10)
    assert not thread.is_alive()
    times = worker.time.snapshot()
    forwards = runner.forwards
    assert forwards >= 3
    assert times.idle_s > 0
    # Every forward's wall time counts, its sleep as off-CPU time and its spin as on-CPU time.
    assert times.forward_s >= forwards * 0.03 * 0.99
    assert times.forward_off_cpu_s >= forwards * 0.02 * 0.99
    assert times.forward_s - times.forward_off_cpu_s >= forwards * 0.01 * 0.99
    assert times.scheduling_s > 0


def test_an_idle_wait_in_progress_counts_up_to_each_snapshot():
    from ferrox_batch.engine.worker_time import WorkerTime

    now = [10.0]
    clock = WorkerTime(clock=lambda: now[0])
    clock.begin_idle()
    now[0] = 12.5
    assert clock.snapshot().idle_s == 2.5  # still waiting: counted to now
    now[0] = 13.0
    clock.end_idle()
    now[0] = 20.0
    assert clock.snapshot().idle_s == 3.0  # the wait ended at 13
    clock.add_forward(1.0, 0.25)
    clock.add_scheduling(0.5)
    assert clock.snapshot() == type(clock.snapshot())(3.0, 0.5, 1.0, 0.75)
