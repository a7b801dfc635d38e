"""The admission queue through the batcher (docs/upstream.md, QueueGate), and the batcher's lifetime.

Pins: a job holds a queue slot from submission until admission, so jobs the
held worker has not admitted yet count; past `max_queue` a submission is
refused at once on the caller's thread with `QueueFull{queued, cap}` (retry
after 1 s) and counted once; racing submitters never get more than `cap`
slots; a served request gives its slot back. (`tests/admission/test_queue_gate.py`
pins the `QueueGate` itself.) Port-specific: `close()` lets submitted requests finish,
refuses new ones at once with `BatcherClosed`, and the worker thread exits.
"""

from __future__ import annotations

import threading
import time

import pytest
from batch_helpers import budget_config, greedy_params, sequential_ids, spawn
from worker_helpers import DEADLINE, Caller, Gate, wait_for, wait_sent

from ferrox_batch.errors import BatcherClosed, QueueFull
from ferrox_batch.generation_types import FinishReason


def test_queue_gate_admits_up_to_its_cap_and_frees_slots_on_release(tiny_batch_model):
    gate = Gate()
    params = greedy_params(3)
    with spawn(tiny_batch_model, budget_config(4, 64, max_queue=2), decode=gate) as batcher:
        running = Caller(batcher, [1, 2], params)
        gate.wait_calls(1)  # admitted (its slot is back) and held mid-decode
        assert batcher.stats().queue_depth == 0
        queued = [Caller(batcher, [3, 4], params), Caller(batcher, [5, 6], params)]
        wait_sent(batcher, 2)
        assert batcher.stats().queue_depth == 2

        with pytest.raises(QueueFull) as info:
            batcher.generate([7, 8], params)
        assert (info.value.queued, info.value.cap) == (2, 2)
        stats = batcher.stats()
        assert stats.queue_rejected == 1 and stats.queue_depth == 2

        gate.open()
        for caller in [running, *queued]:
            assert caller.join().finish_reason == FinishReason.LENGTH
        assert batcher.stats().queue_depth == 0
        assert batcher.generate([7, 8], params).finish_reason == FinishReason.LENGTH  # room again
        assert batcher.stats().queue_rejected == 1


def _race(batcher, i: int, params, start: threading.Barrier, outcomes: list[object]) -> None:
    start.wait(DEADLINE)
    try:
        outcome: object = batcher.generate([i % 50 + 1, 2], params)
    except QueueFull as full:
        outcome = full
    outcomes.append(outcome)  # list.append is atomic


def test_queue_gate_never_exceeds_its_cap_under_concurrent_submitters(tiny_batch_model):
    gate = Gate()
    params = greedy_params(2)
    with spawn(tiny_batch_model, budget_config(4, 256, max_queue=4), decode=gate) as batcher:
        for round_ in range(3):
            gate.hold()
            calls = gate.calls
            plug = Caller(batcher, [1], params)
            gate.wait_calls(calls + 1)  # the worker is held: nothing queued now can be admitted
            start = threading.Barrier(32)
            outcomes: list[object] = []
            racers = [threading.Thread(target=_race, args=(batcher, i, params, start, outcomes), daemon=True)
                      for i in range(32)]
            for racer in racers:
                racer.start()
            wait_for(lambda outcomes=outcomes: len(outcomes) == 28, "28 refusals")
            stats = batcher.stats()
            assert stats.queue_depth == 4 and stats.queue_rejected == 28 * (round_ + 1)
            assert all(isinstance(o, QueueFull) and o.cap == 4 and o.queued == 4 for o in outcomes)
            gate.open()
            for racer in racers:
                racer.join(DEADLINE)
                assert not racer.is_alive()
            plug.join()
            served = [o for o in outcomes if not isinstance(o, QueueFull)]
            assert len(served) == 4 and all(r.finish_reason == FinishReason.LENGTH for r in served)
            assert batcher.stats().queue_depth == 0


def test_a_full_queue_refuses_new_jobs_with_queue_full(tiny_batch_model):
    with spawn(tiny_batch_model, budget_config(4, 8, max_queue=0)) as batcher:
        with pytest.raises(QueueFull) as info:
            batcher.generate([1, 2], greedy_params(2))
        assert (info.value.queued, info.value.cap) == (0, 0)
        assert info.value.retry_after_secs == 1
        stats = batcher.stats()
        assert stats.queue_rejected == 1 and stats.queue_depth == 0 and stats.kv_blocks_free == 8


def test_queue_depth_returns_to_zero_after_a_served_request(tiny_batch_model):
    with spawn(tiny_batch_model, budget_config(4, 8, max_queue=1)) as batcher:
        for i in range(3):
            assert batcher.generate([i + 1], greedy_params(2)).finish_reason == FinishReason.LENGTH
            assert batcher.stats().queue_depth == 0
        assert batcher.stats().queue_rejected == 0


def test_close_lets_in_flight_requests_finish_then_refuses_new_ones(tiny_batch_model):
    gate = Gate()
    params = greedy_params(6)
    batcher = spawn(tiny_batch_model, budget_config(4, 64), decode=gate)
    try:
        decoding = Caller(batcher, [1, 2, 3], params)
        gate.wait_calls(1)
        queued = Caller(batcher, [4, 5], params)  # submitted before close: still served
        wait_sent(batcher, 1)
        assert not batcher.close(timeout=0), "the worker cannot exit while it has work"

        began = time.monotonic()
        with pytest.raises(BatcherClosed):
            batcher.generate([6], params)
        # The worker is held by the gate, so a refusal that waited on it would not return at all.
        assert time.monotonic() - began < 5.0, "a closed batcher refuses at once"
        assert batcher.stats().worker_alive

        gate.open()
        assert list(decoding.join().token_ids) == sequential_ids(tiny_batch_model, [1, 2, 3], params)
        assert list(queued.join().token_ids) == sequential_ids(tiny_batch_model, [4, 5], params)
    finally:
        gate.open()
        assert batcher.close(timeout=DEADLINE), "the worker thread exits once idle"
    stats = batcher.stats()
    assert not stats.worker_alive and stats.queue_depth == 0 and stats.kv_blocks_free == 64
    with pytest.raises(BatcherClosed):
        batcher.generate([6], params)
