"""Cancellation with no model, in every state a request can be in: waiting, prefilling, decoding, already
finished, and an abort id drained before its request (carried one tick, then dropped)."""

from __future__ import annotations

from scheduler_fakes import Bench

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.generation_types import FinishReason
from ferrox_batch.scheduler import exits
from ferrox_batch.scheduler.request import RequestStatus


def cancelled(bench: Bench, request) -> bool:
    return bench.sink(request).result.finish_reason == FinishReason.CANCELLED


def test_a_waiting_request_is_cancelled_and_gives_back_its_queue_slot():
    bench = Bench(BatcherConfig(kv_block_size=4), kv_blocks=2)
    running = bench.submit([1] * 4, 4)  # takes both blocks
    bench.step()
    waiting = bench.submit([1] * 4, 4)
    bench.step()
    assert waiting.status is RequestStatus.WAITING
    bench.aborts.enqueue(waiting.abort)
    bench.step()
    assert cancelled(bench, waiting)
    assert bench.sink(waiting).result.usage.prompt_tokens == 4
    assert bench.scheduler.queue_gate.depth() == 0
    assert bench.aborts.aborted() == 1
    bench.run_until_idle()
    assert bench.sink(running).result.finish_reason == FinishReason.LENGTH
    bench.assert_nothing_held()


def test_a_prefilling_request_is_cancelled_and_frees_its_blocks():
    bench = Bench(BatcherConfig(prefill_chunk=16, max_batch_tokens=16))
    request = bench.submit([1] * 60, 4)
    bench.step()
    assert request.status is RequestStatus.PREFILLING
    bench.aborts.enqueue(request.abort)
    bench.step()
    assert cancelled(bench, request)
    assert bench.sink(request).result.token_ids == ()
    bench.assert_nothing_held()


def test_a_decoding_request_is_cancelled_with_what_it_generated():
    bench = Bench(BatcherConfig())
    request = bench.submit([1], 100)
    for _ in range(4):
        bench.step(lambda r: 2)
    bench.aborts.enqueue(request.abort)
    bench.step()
    result = bench.sink(request).result
    assert result.finish_reason == FinishReason.CANCELLED and result.token_ids == (2, 2, 2, 2)
    assert result.text == "CCCC"
    bench.assert_nothing_held()


def test_a_cancel_never_touches_other_requests():
    bench = Bench(BatcherConfig(max_prefills_per_tick=8))
    requests = [bench.submit([i + 1], 6) for i in range(6)]
    bench.step()
    bench.step()
    for victim in requests[::2]:
        bench.aborts.enqueue(victim.abort)
    bench.run_until_idle()
    for i, request in enumerate(requests):
        assert cancelled(bench, request) == (i % 2 == 0)
    assert all(len(bench.sink(r).result.token_ids) == 6 for r in requests[1::2])
    bench.assert_nothing_held()


def test_an_abort_drained_before_its_request_is_carried_one_tick():
    bench = Bench(BatcherConfig())
    request = bench.submit([1], 5, drained=False)
    assert exits.cancel(bench.scheduler, {request.abort}) == 0  # the id is drained first ...
    assert bench.scheduler.carried == {request.abort}
    bench.scheduler.add(request)  # ... its request one tick later
    assert exits.cancel(bench.scheduler, set()) == 1
    bench.step()
    assert cancelled(bench, request)
    assert bench.scheduler.carried == set()
    bench.assert_nothing_held()


def test_an_unmatched_abort_is_dropped_after_one_tick():
    bench = Bench(BatcherConfig())
    exits.cancel(bench.scheduler, {12345})
    exits.cancel(bench.scheduler, set())
    assert bench.scheduler.carried == set()
    request = bench.submit([1], 3)
    bench.run_until_idle()
    assert bench.sink(request).result.finish_reason == FinishReason.LENGTH


def test_cancelling_a_finished_request_changes_nothing():
    bench = Bench(BatcherConfig())
    request = bench.submit([1], 2)
    bench.run_until_idle()
    bench.aborts.enqueue(request.abort)
    bench.step()
    bench.step()
    assert bench.sink(request).result.finish_reason == FinishReason.LENGTH
    assert len(bench.sink(request).finals) == 1
    assert bench.scheduler.carried == set()
