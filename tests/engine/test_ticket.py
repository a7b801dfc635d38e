"""`submit` refuses before queueing and returns a `Ticket`; the ticket waits, streams and cancels.

A wait that ends without its answer (a timeout, Ctrl-C, an exception raised
into the waiting thread) cancels the request: the worker frees its blocks, counts it
aborted, and keeps serving everyone else.
"""

from __future__ import annotations

import ctypes
import pickle
import signal
import threading
import time

import pytest
from batch_helpers import budget_config, ceiling_config, greedy_params, sequential_ids, spawn
from worker_helpers import DEADLINE, Caller, Gate, wait_for

from ferrox_batch.errors import KvBudgetExceeded, WaitTimedOut
from ferrox_batch.generation_types import FinishReason


def test_submit_refuses_on_the_callers_thread_and_queues_nothing(tiny_batch_model):
    with spawn(tiny_batch_model, ceiling_config(8)) as batcher:
        with pytest.raises(KvBudgetExceeded) as err:
            batcher.submit([1] * 9, greedy_params(4))
        assert err.value.binding == "context_length_exceeded"
        assert batcher.stats().queue_depth == 0


def test_a_ticket_reports_the_clamped_budget_and_waits_for_the_answer(tiny_batch_model):
    prompt = [5, 6, 7, 8]
    with spawn(tiny_batch_model, ceiling_config(10)) as batcher:
        ticket = batcher.submit(prompt, greedy_params(100, ignore_eos=True))
        assert ticket.prompt_tokens == 4 and ticket.max_tokens == 6
        chunks: list[str] = []
        result = ticket.wait(chunks.append)
        assert ticket.done
        assert list(result.token_ids) == sequential_ids(tiny_batch_model, prompt, greedy_params(6, ignore_eos=True))
        assert "".join(chunks) == result.text
        with pytest.raises(RuntimeError, match="already waited on"):
            ticket.wait()  # the answer was taken: never a wait that cannot end


def test_a_ticket_cancels_from_another_thread(tiny_batch_model):
    with spawn(tiny_batch_model, ceiling_config(400)) as batcher:
        ticket = batcher.submit([1, 2, 3], greedy_params(300, ignore_eos=True))
        first = threading.Event()
        result_box: list = []
        waiter = threading.Thread(target=lambda: result_box.append(ticket.wait(lambda _: first.set())))
        waiter.start()
        assert first.wait(10)
        ticket.cancel()
        waiter.join(10)
        assert not waiter.is_alive()
        result = result_box[0]
        assert result.finish_reason == FinishReason.CANCELLED and 0 < len(result.token_ids) < 300
        stats = batcher.stats()
        assert stats.aborted == 1 and stats.kv_blocks_free == stats.kv_blocks_total
        ticket.cancel()  # after the answer: nothing happens
        assert batcher.stats().aborted == 1


# ---- a wait that ends without the answer cancels its request -----------------------------

def _held_batcher(model):
    """A batcher whose worker is held inside its first decode call (one letter per token)."""
    gate = Gate()
    return gate, spawn(model, budget_config(4, 64), decode=gate)


def _assert_cancelled_and_still_serving(batcher, gate: Gate, other: Caller, model, abandoned: int) -> None:
    """Once the worker runs again: the abandoned requests are cancelled, and everyone else is served."""
    assert batcher.stats().aborted == 0  # cancels are applied by the worker, which is still held
    gate.open()
    wait_for(lambda: batcher.stats().aborted == abandoned, "the abandoned requests to be cancelled")
    wait_for(lambda: batcher.stats().kv_blocks_free == 64, "the abandoned requests' blocks back")
    params = greedy_params(6, ignore_eos=True)
    assert list(other.join().token_ids) == sequential_ids(model, [9, 10, 11], params)
    assert list(batcher.generate([4, 5], params).token_ids) == sequential_ids(model, [4, 5], params)
    assert batcher.stats().aborted == abandoned and batcher.stats().worker_alive


def test_a_wait_timeout_cancels_the_request_and_raises_wait_timed_out(tiny_batch_model):
    gate, batcher = _held_batcher(tiny_batch_model)
    with batcher:
        ticket = batcher.submit([1, 2, 3], greedy_params(100, ignore_eos=True))
        gate.wait_calls(1)
        other = Caller(batcher, [9, 10, 11], greedy_params(6, ignore_eos=True))
        started = time.monotonic()
        with pytest.raises(WaitTimedOut) as timed_out:
            ticket.wait(timeout=0.2)
        assert 0.2 <= time.monotonic() - started < DEADLINE and ticket.done
        assert timed_out.value.timeout_secs == 0.2 and timed_out.value.http_status == 504
        with pytest.raises(WaitTimedOut):  # the same through generate, with a request of its own
            batcher.generate([6, 7], greedy_params(100, ignore_eos=True), timeout=0)
        _assert_cancelled_and_still_serving(batcher, gate, other, tiny_batch_model, abandoned=2)


def test_a_wait_timeout_fires_while_a_slow_on_chunk_keeps_the_queue_full(tiny_batch_model):
    # The consumer paces the worker: each chunk it takes lets the worker make two more, so the
    # reply queue only grows (it is never empty, where the deadline used to be checked) while
    # the worker stays far from the end of the request (it is still running when the wait times out).
    gate = Gate(permits=4)
    taken: list[str] = []

    def slow_consumer(text: str) -> None:
        taken.append(text)
        gate.release(2)
        time.sleep(0.05)

    with spawn(tiny_batch_model, budget_config(4, 64), decode=gate) as batcher:
        started = time.monotonic()
        with pytest.raises(WaitTimedOut) as timed_out:  # 150 chunks at 0.05 s would take 7.5 s
            batcher.generate_streaming([1, 2, 3], greedy_params(150, ignore_eos=True), None, slow_consumer,
                                       timeout=0.5)
        elapsed = time.monotonic() - started
        assert 0.5 <= elapsed < 5.0, elapsed
        assert timed_out.value.timeout_secs == 0.5 and 0 < len(taken) < 100
        gate.open()
        wait_for(lambda: batcher.stats().aborted == 1, "the timed-out request to be cancelled")
        wait_for(lambda: batcher.stats().kv_blocks_free == 64, "the timed-out request's blocks back")
        params = greedy_params(6, ignore_eos=True)
        assert list(batcher.generate([4, 5], params).token_ids) == sequential_ids(tiny_batch_model, [4, 5], params)
        assert batcher.stats().aborted == 1 and batcher.stats().worker_alive


def test_an_interrupted_wait_cancels_its_request(tiny_batch_model):
    # Ctrl-C as the main thread sees it: SIGINT while it waits on its reply queue.
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    gate, batcher = _held_batcher(tiny_batch_model)
    with batcher:
        ticket = batcher.submit([1, 2, 3], greedy_params(100, ignore_eos=True))
        gate.wait_calls(1)
        other = Caller(batcher, [9, 10, 11], greedy_params(6, ignore_eos=True))
        main = threading.main_thread().ident

        def interrupt() -> None:
            wait_for(lambda: ticket._claimed.locked(), "the main thread to be inside wait")
            time.sleep(0.05)  # blocked on the reply queue, not on its way in
            signal.pthread_kill(main, signal.SIGINT)

        interrupter = threading.Thread(target=interrupt, name="test-interrupter", daemon=True)
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            interrupter.start()
            with pytest.raises(KeyboardInterrupt):
                ticket.wait()
        finally:
            signal.signal(signal.SIGINT, previous)
        interrupter.join(DEADLINE)
        assert not interrupter.is_alive() and ticket.done
        _assert_cancelled_and_still_serving(batcher, gate, other, tiny_batch_model, abandoned=1)


def test_an_exception_raised_into_a_waiting_thread_cancels_its_request(tiny_batch_model):
    # A thread's async exception runs only once the thread runs Python again: the wait does not
    # poll, so it lands when the next event wakes the waiter, and still cancels the request.
    gate, batcher = _held_batcher(tiny_batch_model)
    with batcher:
        ticket = batcher.submit([1, 2, 3], greedy_params(200, ignore_eos=True))
        gate.wait_calls(1)
        other = Caller(batcher, [9, 10, 11], greedy_params(6, ignore_eos=True))
        raised: list[BaseException] = []

        def wait() -> None:
            try:
                ticket.wait()
            except BaseException as error:  # noqa: BLE001 - kept for the test to assert on
                raised.append(error)

        waiter = threading.Thread(target=wait, name="test-interrupted-waiter", daemon=True)
        waiter.start()
        wait_for(lambda: ticket._claimed.locked(), "the waiter to be inside wait")
        time.sleep(0.05)  # blocked on the reply queue, not on its way in
        assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(waiter.ident),
                                                          ctypes.py_object(KeyboardInterrupt)) == 1
        assert batcher.stats().aborted == 0  # cancels are applied by the worker, which is still held
        gate.open()
        waiter.join(DEADLINE)
        assert not waiter.is_alive() and len(raised) == 1 and isinstance(raised[0], KeyboardInterrupt)
        assert ticket.done
        wait_for(lambda: batcher.stats().aborted == 1, "the abandoned request to be cancelled")
        wait_for(lambda: batcher.stats().kv_blocks_free == 64, "the abandoned request's blocks back")
        params = greedy_params(6, ignore_eos=True)
        assert list(other.join().token_ids) == sequential_ids(tiny_batch_model, [9, 10, 11], params)
        assert list(batcher.generate([4, 5], params).token_ids) == sequential_ids(tiny_batch_model, [4, 5], params)
        assert batcher.stats().aborted == 1 and batcher.stats().worker_alive


def test_a_bad_timeout_is_refused_before_anything_is_queued(tiny_batch_model):
    with spawn(tiny_batch_model, budget_config(4, 64)) as batcher:
        for bad, error in ((-1, ValueError), (float("nan"), ValueError), ("5", TypeError), (True, TypeError)):
            with pytest.raises(error, match="timeout"):
                batcher.generate([1, 2], greedy_params(3), timeout=bad)
        assert batcher.stats().queue_depth == 0 and batcher.stats().prefill_tokens == 0
        ticket = batcher.submit([1, 2], greedy_params(3, ignore_eos=True))
        with pytest.raises(ValueError, match="timeout"):
            ticket.wait(timeout=-1)
        assert len(ticket.wait(timeout=DEADLINE).token_ids) == 3  # still unclaimed: waitable once


def test_wait_timed_out_is_a_typed_error_like_the_others():
    error = WaitTimedOut(1.5)
    assert pickle.loads(pickle.dumps(error)) == error and repr(error) == "WaitTimedOut(timeout_secs=1.5)"
    assert error.to_dict() == {"error": {"type": "server_error", "code": "wait_timed_out",
                                         "message": "no answer within the wait timeout of 1.5 s; "
                                                    "the request was cancelled"}}
    assert (error.http_status, error.retry_after_secs) == (504, None)
