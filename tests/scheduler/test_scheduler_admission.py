"""Admission with no model: first come first served, a head that does not fit holds the line, `max_seqs`,
and the requests answered at admission (out-of-vocabulary prompt, `max_tokens = 0`, a KV store that says no)."""

from __future__ import annotations

from scheduler_fakes import VOCAB, Bench

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.admission.window import WindowPolicy
from ferrox_batch.errors import KvAllocationFailed, KvPoolExhausted, TokenOutOfVocab
from ferrox_batch.generation_types import FinishReason
from ferrox_batch.scheduler.request import RequestStatus


def test_requests_are_admitted_in_arrival_order():
    bench = Bench(BatcherConfig(max_prefills_per_tick=8, max_batch_tokens=1024))
    first, second, third = (bench.submit([1] * n) for n in (3, 5, 2))
    plan = bench.step()
    assert [chunk.request for chunk in plan.prompts] == [first, second, third]


def test_a_head_that_does_not_fit_holds_the_line():
    # 4 blocks of 4 positions: the head needs 3 blocks (8 + 4 positions) while 2 are taken.
    bench = Bench(BatcherConfig(kv_block_size=4), kv_blocks=4)
    running = bench.submit([1] * 4, 4)  # 2 blocks
    bench.step()
    big = bench.submit([1] * 8, 4)  # 3 blocks: does not fit beside `running`
    small = bench.submit([1], 1)  # 1 block: would fit, but must not pass the head
    bench.step()
    assert big.status is RequestStatus.WAITING and small.status is RequestStatus.WAITING
    assert list(bench.scheduler.waiting) == [big, small]
    bench.run_until_idle()
    assert bench.sink(running).result.finish_reason == FinishReason.LENGTH
    assert bench.sink(big).result.finish_reason == FinishReason.LENGTH
    assert bench.sink(small).result.finish_reason == FinishReason.LENGTH
    bench.assert_nothing_held()


def test_the_head_is_admitted_as_soon_as_blocks_come_back():
    bench = Bench(BatcherConfig(kv_block_size=4), kv_blocks=3)
    first = bench.submit([1] * 4, 4)  # 2 blocks
    second = bench.submit([1] * 4, 4)  # 2 more: waits
    while first.status is not RequestStatus.FINISHED:
        bench.step()
        if first.status is not RequestStatus.FINISHED:
            assert second.status is RequestStatus.WAITING
    bench.step()
    assert second.status is not RequestStatus.WAITING


def test_max_seqs_caps_admitted_requests():
    bench = Bench(BatcherConfig(max_seqs=2, max_prefills_per_tick=8))
    requests = [bench.submit([1, 2], 3) for _ in range(5)]
    for _ in range(3):
        bench.step()
        admitted = bench.scheduler.admitted()
        assert len(admitted) <= 2
    assert requests[0] in bench.scheduler.admitted() or requests[0].status is RequestStatus.FINISHED
    bench.run_until_idle()
    assert all(bench.sink(r).result.finish_reason == FinishReason.LENGTH for r in requests)
    bench.assert_nothing_held()


def test_admission_releases_the_queue_slot():
    bench = Bench(BatcherConfig(max_queue=2))
    bench.submit([1])
    bench.submit([2])
    assert bench.scheduler.queue_gate.try_reserve() is not None  # full
    bench.step()
    assert bench.scheduler.queue_gate.depth() == 0


def test_a_prompt_token_outside_the_vocabulary_is_answered_at_admission():
    bench = Bench(BatcherConfig())
    bad = bench.submit([1, VOCAB + 3, 2])
    good = bench.submit([1, 2])
    bench.run_until_idle()
    assert bench.sink(bad).result == TokenOutOfVocab(VOCAB + 3, VOCAB)
    assert bench.sink(good).result.finish_reason == FinishReason.LENGTH
    bench.assert_nothing_held()


def test_max_tokens_zero_finishes_at_once_without_running():
    bench = Bench(BatcherConfig())
    request = bench.submit([1, 2, 3], 0)
    plan = bench.step()
    assert plan.empty
    result = bench.sink(request).result
    assert result.finish_reason == FinishReason.LENGTH and result.token_ids == () and result.text == ""
    assert result.usage.prompt_tokens == 3 and result.usage.completion_tokens == 0
    bench.assert_nothing_held()


def test_a_kv_store_that_says_no_refuses_only_that_request():
    bench = Bench(BatcherConfig())
    bench.kv.fail_next = KvAllocationFailed("MemoryError: test")
    refused = bench.submit([1, 2])
    served = bench.submit([3, 4])
    bench.run_until_idle()
    assert isinstance(bench.sink(refused).result, KvAllocationFailed)
    assert bench.sink(served).result.finish_reason == FinishReason.LENGTH
    bench.assert_nothing_held()


def test_a_pool_exhausted_store_is_a_retryable_refusal():
    bench = Bench(BatcherConfig())
    bench.kv.fail_next = KvPoolExhausted()
    refused = bench.submit([1, 2])
    bench.run_until_idle()
    assert bench.sink(refused).result == KvPoolExhausted()
    assert bench.sink(refused).result.retry_after_secs == 1
    bench.assert_nothing_held()


def test_peak_blocks_are_recorded_at_admission():
    bench = Bench(BatcherConfig(kv_block_size=4, max_prefills_per_tick=4))
    bench.submit([1] * 4, 4)  # 2 blocks
    bench.submit([1] * 8, 4)  # 3 blocks
    bench.step()
    assert bench.scheduler.counters.peak_blocks() == 5
    bench.run_until_idle()
    assert bench.scheduler.counters.peak_blocks() == 5


def test_a_sliding_request_leases_with_its_window_and_looks_up_no_cached_prefix():
    """A row priced at the hold bound (`admission.window`) slides; its lease adopts nothing (D8)."""
    bench = Bench(BatcherConfig(kv_block_size=4, prefix_cache=True), kv_blocks=100)
    policy = WindowPolicy(8, 4, 128)
    sliding = bench.submit([1, 2, 3], 400, drained=False)
    sliding.window, sliding.positions, sliding.blocks = policy, 191, 48
    bench.scheduler.add(sliding)
    plain = bench.submit([1, 2, 3], 4)
    bench.step()
    assert sliding.cacheable_tokens == [] and plain.cacheable_tokens == [1, 2, 3]
    assert bench.kv.leased[sliding.seq_id] == ([], policy)
    assert bench.kv.leased[plain.seq_id] == ([1, 2, 3], None)
    assert bench.scheduler.budget.free() == 100 - 48 - 2
    bench.run_until_idle()
    bench.assert_nothing_held()
