"""Priorities and queue deadlines in admission, with no model (a fake clock, fake KV and fake sampled ids).

Pins:
* admission goes by (priority, arrival): a more urgent request (lower value) that arrives later is admitted
  first; with one priority the order is arrival order, as before;
* a waiting request whose queue deadline passed is refused with `QueueTimeout` (503, Retry-After), gives its
  queue slot back and is never admitted; a request's own `max_queue_wait_ms` wins over the batcher's;
* the cache-aware pick never lets a less urgent request overtake the head;
* aging: a request that has waited `priority_aging_ms` goes ahead of every request that has not, whatever
  the priorities, so a stream of more urgent requests cannot starve it;
* property (hypothesis): under random arrivals, priorities, deadlines, aging, cancels and clock steps, after
  every tick nothing waits past its deadline and nothing was admitted at or past it, no request was admitted
  while one ahead of it in (aged first by arrival, then priority, then arrival) order still waits, and at the
  end every request got exactly one answer and nothing is held.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_fakes import Bench

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.errors import QueueTimeout
from ferrox_batch.generation_types import GenerationResult
from ferrox_batch.replies import Finished
from ferrox_batch.scheduler.request import RequestStatus


def admitted_order(bench: Bench, requests) -> list:
    order, seen = [], set()
    while not bench.scheduler.idle:
        bench.step()
        for r in requests:
            if r.seq_id is not None and r.abort not in seen:
                seen.add(r.abort)
                order.append(r)
    return order


def test_a_more_urgent_request_is_admitted_first_and_one_priority_is_fifo():
    bench = Bench(BatcherConfig(max_seqs=1, kv_block_size=4))
    busy = bench.submit([1, 2], 3)
    bench.step()  # `busy` holds the one row
    late = [bench.submit([3], 2, priority=p) for p in (5, 5, 0, 5, -1, 0)]
    assert [r.priority for r in bench.scheduler.waiting] == [-1, 0, 0, 5, 5, 5]
    order = admitted_order(bench, late)
    assert order == [late[4], late[2], late[5], late[0], late[1], late[3]]
    assert busy.status is RequestStatus.FINISHED
    bench.assert_nothing_held()


def test_a_request_past_its_queue_deadline_is_refused_and_never_admitted():
    bench = Bench(BatcherConfig(max_seqs=1, kv_block_size=4, max_queue_wait_ms=100))
    busy = bench.submit([1, 2], 50)
    bench.step()
    default = bench.submit([3], 2)  # the batcher's 100 ms
    longer = bench.submit([4], 2, max_queue_wait_ms=10_000)  # its own limit wins
    shorter = bench.submit([5], 2, max_queue_wait_ms=20)
    bench.now = 0.05
    bench.step()
    assert isinstance(bench.sink(shorter).result, QueueTimeout) and shorter.seq_id is None
    assert bench.scheduler.queue_gate.depth() == 2
    bench.now = 0.1
    bench.step()
    refused = bench.sink(default).result
    assert isinstance(refused, QueueTimeout) and default.seq_id is None
    assert (refused.waited_ms, refused.limit_ms, refused.http_status, refused.retry_after_secs) == (100, 100, 503, 1)
    bench.aborts.enqueue(busy.abort)  # free the row: `longer` is admitted well within its 10 s
    bench.run_until_idle()
    assert isinstance(bench.sink(longer).result, GenerationResult) and longer.seq_id is not None
    bench.assert_nothing_held()


def test_the_cache_aware_pick_stays_within_the_heads_priority():
    bench = Bench(BatcherConfig(max_seqs=1, kv_block_size=4, prefix_cache=True))
    depths = {}
    # Cached and unreferenced: the ledger still reserves every block, as the fake store leases them all.
    bench.kv.peek = lambda tokens, salt: (depths.get(tuple(tokens), 0),) * 2  # type: ignore[method-assign]
    busy = bench.submit([1], 3)
    bench.step()
    urgent_cold = bench.submit([7, 7], 2, priority=0)
    relaxed_warm = bench.submit([8, 8], 2, priority=1)
    depths[(8, 8)] = 1  # a deeper cached prefix, but less urgent
    order = admitted_order(bench, [urgent_cold, relaxed_warm])
    assert order == [urgent_cold, relaxed_warm] and relaxed_warm.skips == 0
    assert busy.status is RequestStatus.FINISHED


workload_st = st.lists(
    st.tuples(
        st.integers(0, 8),  # tick it arrives at
        st.integers(-1, 2),  # priority
        st.one_of(st.none(), st.integers(1, 400)),  # its own max_queue_wait_ms
        st.integers(1, 12),  # prompt length
        st.integers(1, 6),  # max_tokens
        st.one_of(st.none(), st.integers(0, 30)),  # tick it is cancelled at
    ),
    min_size=1, max_size=14,
)


def order_key(request, now: float, aging_ms: int | None) -> tuple:
    """Where admission puts a waiting request at `now`: aged ones first in arrival order, then by priority
    and arrival."""
    if aging_ms is not None and request.queued_at <= now - aging_ms / 1000:
        return (0, request.queued_at, request.abort)
    return (1, request.priority, request.abort)


@settings(max_examples=150, deadline=None)
@given(workload=workload_st, default_wait=st.one_of(st.none(), st.integers(1, 300)), max_seqs=st.integers(1, 3),
       kv_blocks=st.integers(6, 40), tick_ms=st.lists(st.integers(0, 60), min_size=1, max_size=8),
       aging_ms=st.one_of(st.none(), st.integers(1, 400)))
def test_no_wait_past_a_deadline_no_overtaking_and_fifo_within_a_priority(workload, default_wait, max_seqs,
                                                                          kv_blocks, tick_ms, aging_ms):
    bench = Bench(BatcherConfig(max_seqs=max_seqs, kv_block_size=4, kv_blocks=kv_blocks,
                                max_queue_wait_ms=default_wait, priority_aging_ms=aging_ms), kv_blocks=kv_blocks)
    submitted = []
    for tick in range(300):
        for arrives, priority, wait, length, max_tokens, cancel_at in workload:
            if arrives == tick and bench.scheduler.budget.blocks_for(length + max_tokens) <= kv_blocks:
                request = bench.submit(list(range(1, length + 1)), max_tokens, priority=priority,
                                       max_queue_wait_ms=wait)
                submitted.append((request, cancel_at, tick))
        for request, cancel_at, _ in submitted:
            if cancel_at == tick:
                bench.aborts.enqueue(request.abort)
        before = {r.abort for r, _, _ in submitted if r.seq_id is None}
        bench.now += tick_ms[tick % len(tick_ms)] / 1000
        bench.step()
        now = bench.now
        waiting = [r for r in bench.scheduler.waiting]
        fresh = [r for r, _, _ in submitted if r.abort in before and r.seq_id is not None]
        for r in waiting:
            assert r.deadline is None or r.deadline > now, "a request waits past its deadline"
        for r in fresh:
            assert r.deadline is None or r.deadline > now, "a request was admitted past its deadline"
            for w in waiting:
                # Without aging: never a more urgent one, nor an earlier one of the same priority. With it,
                # a request that waited `aging_ms` goes ahead of every one that has not.
                assert order_key(r, now, aging_ms) < order_key(w, now, aging_ms), "a request was overtaken"
        if tick > 8 and bench.scheduler.idle:
            break
    bench.assert_nothing_held()
    for request, _, _ in submitted:
        events = bench.sink(request).events
        assert sum(isinstance(e, Finished) for e in events) == 1
        outcome = events[-1].result
        if isinstance(outcome, QueueTimeout):
            assert request.seq_id is None and request.deadline is not None


def test_a_stream_of_urgent_requests_cannot_starve_a_less_urgent_one():
    bench = Bench(BatcherConfig(max_seqs=1, kv_block_size=4, priority_aging_ms=1000))
    bench.submit([9], 2)  # runs first: everything else waits for its row
    patient = bench.submit([1], 2, priority=5)
    admitted_at = None
    for tick in range(200):
        bench.submit([2], 2, priority=0)  # a more urgent request arrives every tick
        bench.now += 0.05
        bench.step()
        if patient.seq_id is not None:
            admitted_at = bench.now
            break
    assert admitted_at is not None, "the less urgent request starved"
    # It waited its aging time and then the rows ahead of it (each urgent request takes 3 ticks).
    assert 1.0 <= admitted_at - patient.queued_at <= 1.0 + 4 * 0.05


def test_without_aging_a_less_urgent_request_waits_behind_every_urgent_one():
    bench = Bench(BatcherConfig(max_seqs=1, kv_block_size=4, priority_aging_ms=None))
    bench.submit([9], 2)
    patient = bench.submit([1], 2, priority=5)
    for _ in range(200):
        bench.submit([2], 2, priority=0)
        bench.now += 0.05
        bench.step()
    assert patient.seq_id is None


def test_a_follower_waits_for_its_leaders_prompt_and_holds_nobody_up():
    bench = Bench(BatcherConfig(kv_block_size=4, prefill_chunk=4, max_batch_tokens=8))
    leader = bench.submit(list(range(1, 13)), 3)  # 12 prompt tokens: three 4-token chunks
    follower = bench.submit(list(range(1, 13)), 3, drained=False)
    follower.after = leader.abort  # as `submit(after=...)` sets it, before the worker drains it
    bench.scheduler.add(follower)
    other = bench.submit([7, 8], 2)
    bench.step()
    assert leader.seq_id is not None and other.seq_id is not None and follower.seq_id is None
    while leader.status is RequestStatus.PREFILLING:
        assert follower.seq_id is None, "admitted before its leader's prompt was through"
        bench.step()
    bench.step()
    assert follower.seq_id is not None
    bench.run_until_idle()
    assert all(isinstance(bench.sink(r).result, GenerationResult) for r in (leader, follower, other))
    bench.assert_nothing_held()


def test_a_follower_of_a_cancelled_leader_goes_on_its_own():
    bench = Bench(BatcherConfig(max_seqs=1, kv_block_size=4))
    busy = bench.submit([1], 4)
    bench.step()
    leader = bench.submit([2, 3], 2)
    follower = bench.submit([2, 3], 2, drained=False)
    follower.after = leader.abort
    bench.scheduler.add(follower)
    bench.aborts.enqueue(leader.abort)
    bench.run_until_idle()
    assert bench.sink(leader).result.finish_reason.kind == "cancelled"
    assert isinstance(bench.sink(follower).result, GenerationResult) and follower.seq_id is not None
    assert busy.status is RequestStatus.FINISHED
    bench.assert_nothing_held()


def test_requests_that_leave_the_queue_are_not_kept_by_the_deadline_heap():
    import gc

    from ferrox_batch.scheduler.request import Request

    bench = Bench(BatcherConfig(kv_block_size=4, max_queue_wait_ms=10**9))  # a deadline nobody reaches
    for _ in range(50):
        for k in range(20):
            bench.submit([1 + k], 1, cache_salt="deadline-heap")  # the salt marks this test's requests
        bench.run_until_idle()
        # Stale entries are dropped once they dominate: the heap stays within a constant of what waits.
        assert bench.scheduler.waiting.deadline_entries <= 2 * len(bench.scheduler.waiting) + 32 + 20
    bench.sinks.clear()  # the test's own references to the answered requests
    bench.plans.clear()
    gc.collect()
    alive = sum(type(o) is Request and o.params.cache_salt == "deadline-heap" for o in gc.get_objects())
    assert alive == 0, f"{alive} answered requests are still referenced"
    bench.assert_nothing_held()
