"""Faults with no model: a forward that fails fails only the requests in it; a worker that dies answers every
request it holds, wherever it is, and returns every block and queue slot."""

from __future__ import annotations

from scheduler_fakes import Bench

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.errors import InternalError, WorkerDied
from ferrox_batch.generation_types import FinishReason
from ferrox_batch.scheduler import exits
from ferrox_batch.scheduler.request import RequestStatus


def test_a_failed_forward_fails_the_requests_in_it_and_the_rest_go_on():
    bench = Bench(BatcherConfig(kv_block_size=4, max_prefills_per_tick=1), kv_blocks=64)
    decoding = bench.submit([1], 10)
    bench.step()
    prompt = bench.submit([2] * 5, 3)
    plan = bench.scheduler.schedule()
    assert set(plan.requests) == {decoding, prompt}
    later = bench.submit([3], 2)  # queued while the forward ran: not in it
    error = InternalError("forward failed: RuntimeError: boom")
    exits.fail_step(bench.scheduler, plan, error)
    assert bench.sink(decoding).result == error and bench.sink(prompt).result == error
    bench.run_until_idle()
    assert bench.sink(later).result.finish_reason == FinishReason.LENGTH
    bench.assert_nothing_held()


def test_a_dying_worker_answers_every_request_wherever_it_is():
    bench = Bench(BatcherConfig(kv_block_size=4, prefill_chunk=16, max_batch_tokens=16), kv_blocks=24)
    decoding = bench.submit([1], 30)
    bench.step()
    bench.step()
    prefilling = bench.submit([2] * 40, 4)
    bench.step()
    waiting = bench.submit([3] * 30, 10)  # does not fit yet
    bench.step()
    assert (decoding.status, prefilling.status, waiting.status) == (
        RequestStatus.DECODING, RequestStatus.PREFILLING, RequestStatus.WAITING)
    error = WorkerDied("RuntimeError: a scheduler bug")
    exits.fail_all(bench.scheduler, error)
    for request in (decoding, prefilling, waiting):
        assert bench.sink(request).finals == [error]
    bench.assert_nothing_held()


def test_a_dying_worker_answers_everyone_even_when_releasing_fails():
    bench = Bench(BatcherConfig())
    first = bench.submit([1], 30)
    second = bench.submit([2], 30)
    bench.step()

    def broken(seq_id: int) -> None:
        raise KeyError(seq_id)

    bench.kv.release = broken
    skipped: list[BaseException] = []

    def safely(action) -> None:
        try:
            action()
        except Exception as failure:
            skipped.append(failure)

    error = WorkerDied("the state is what broke")
    exits.fail_all(bench.scheduler, error, safely)
    assert bench.sink(first).finals == [error] and bench.sink(second).finals == [error]
    assert len(skipped) == 2
    assert bench.scheduler.idle


def test_a_request_is_answered_once_even_if_answered_twice():
    bench = Bench(BatcherConfig())
    request = bench.submit([1], 3)
    bench.run_until_idle()
    request.answer(WorkerDied("late"))
    assert len(bench.sink(request).finals) == 1
