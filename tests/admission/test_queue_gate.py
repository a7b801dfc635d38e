"""QueueGate (admission queue cap) and AbortInbox (deferred cancellation ids)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.admission.queue import AbortInbox, QueueGate
from ferrox_batch.errors import QueueFull


def test_queue_gate_admits_up_to_its_cap_and_frees_slots_on_release():
    gate = QueueGate(2)
    assert gate.try_reserve() is None
    assert gate.try_reserve() is None
    assert gate.try_reserve() == 2, "the refusal reports the depth that refused"
    assert gate.rejected() == 1 and gate.depth() == 2
    gate.release()
    assert gate.depth() == 1
    assert gate.try_reserve() is None
    assert gate.depth() == 2 and gate.rejected() == 1


def test_a_full_queue_refuses_new_jobs_with_queue_full():
    gate = QueueGate(0)
    with pytest.raises(QueueFull) as info:
        gate.reserve()
    err = info.value
    assert (err.queued, err.cap) == (0, 0)
    assert err == QueueFull(0, 0)
    assert err.retry_after_secs == 1
    assert gate.rejected() == 1 and gate.depth() == 0


def test_reserve_raises_with_the_depth_and_cap_and_counts_once():
    gate = QueueGate(1)
    gate.reserve()
    with pytest.raises(QueueFull) as info:
        gate.reserve()
    assert (info.value.queued, info.value.cap) == (1, 1)
    assert gate.rejected() == 1 and gate.cap == 1


def test_queue_depth_returns_to_zero_after_served_requests():
    gate = QueueGate(1)
    for _ in range(3):
        assert gate.try_reserve() is None
        gate.release()
    assert gate.depth() == 0 and gate.rejected() == 0


def test_releasing_an_empty_gate_is_an_underflow_error_and_changes_nothing():
    gate = QueueGate(3)
    with pytest.raises(ValueError, match="queue depth underflow"):
        gate.release()
    assert gate.depth() == 0
    assert gate.try_reserve() is None and gate.depth() == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, None, "4"])
def test_a_queue_cap_must_be_a_non_negative_integer(bad):
    with pytest.raises((TypeError, ValueError), match="max_queue"):
        QueueGate(bad)


def race(cap: int, submitters: int) -> tuple[QueueGate, int]:
    gate = QueueGate(cap)
    barrier = threading.Barrier(submitters)
    admitted: list[bool] = []
    lock = threading.Lock()

    def submit() -> None:
        barrier.wait()
        ok = gate.try_reserve() is None
        with lock:
            admitted.append(ok)

    threads = [threading.Thread(target=submit) for _ in range(submitters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return gate, sum(admitted)


def test_queue_gate_never_exceeds_its_cap_under_concurrent_submitters():
    for _ in range(64):
        gate, admitted = race(4, 32)
        assert admitted == 4
        assert gate.depth() == 4
        assert gate.rejected() == 28


@settings(max_examples=15, deadline=None)
@given(cap=st.integers(0, 40), rounds=st.integers(1, 3))
def test_a_gate_never_admits_more_than_its_cap_and_drains_to_zero(cap, rounds):
    gate = QueueGate(cap)
    for round_index in range(rounds):
        barrier = threading.Barrier(32)
        held = [0] * 32
        peak: list[int] = []

        def submit(i: int) -> None:
            barrier.wait()
            for _ in range(3):
                if gate.try_reserve() is None:
                    held[i] += 1
                peak.append(gate.depth())

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(held) == min(cap, 32 * 3)
        assert max(peak) <= cap
        assert gate.rejected() == (round_index + 1) * (32 * 3) - (round_index + 1) * sum(held)
        for n in held:
            for _ in range(n):
                gate.release()
        assert gate.depth() == 0


# --- AbortInbox ------------------------------------------------------------------------------


def test_abort_ids_are_sequential_and_never_reused():
    inbox = AbortInbox()
    assert [inbox.next_id() for _ in range(4)] == [0, 1, 2, 3]


def test_abort_ids_are_unique_across_threads():
    inbox = AbortInbox()
    ids: list[int] = []
    lock = threading.Lock()

    def take() -> None:
        mine = [inbox.next_id() for _ in range(200)]
        with lock:
            ids.extend(mine)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(ids) == list(range(1600))


def test_cancelling_twice_is_one_pending_entry_and_drain_takes_everything_once():
    inbox = AbortInbox()
    inbox.enqueue(3)
    inbox.enqueue(3)
    inbox.enqueue(1)
    assert inbox.drain() == {1, 3}
    assert inbox.drain() == set()


def test_enqueue_does_not_count_an_abort_only_the_worker_does():
    inbox = AbortInbox()
    inbox.enqueue(0)
    assert inbox.aborted() == 0
    inbox.add_aborted()
    inbox.add_aborted(2)
    assert inbox.aborted() == 3


def test_an_id_enqueued_before_its_job_exists_waits_in_the_inbox():
    inbox = AbortInbox()
    inbox.enqueue(5)
    assert inbox.next_id() == 0
    assert 5 in inbox.drain()


def test_the_inbox_refuses_bad_ids_and_counts():
    inbox = AbortInbox()
    with pytest.raises(ValueError, match="abort_id"):
        inbox.enqueue(-1)
    with pytest.raises(TypeError, match="abort_id"):
        inbox.enqueue("3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n"):
        inbox.add_aborted(-1)
    assert inbox.drain() == set() and inbox.aborted() == 0


def test_concurrent_enqueues_and_drains_lose_no_id():
    inbox = AbortInbox()
    drained: set[int] = set()
    done = threading.Event()

    def produce(base: int) -> None:
        for i in range(500):
            inbox.enqueue(base + i)

    def consume() -> None:
        while not done.is_set():
            drained.update(inbox.drain())

    consumer = threading.Thread(target=consume)
    consumer.start()
    producers = [threading.Thread(target=produce, args=(k * 1000,)) for k in range(4)]
    for t in producers:
        t.start()
    for t in producers:
        t.join()
    done.set()
    consumer.join()
    drained.update(inbox.drain())
    assert drained == {k * 1000 + i for k in range(4) for i in range(500)}
