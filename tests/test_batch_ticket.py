"""`submit` refuses before queueing and returns a `Ticket`; the ticket waits, streams and cancels."""

from __future__ import annotations

import threading

import pytest

from ferrox_batch.errors import KvBudgetExceeded
from ferrox_batch.generate import FinishReason

from batch_helpers import ceiling_config, greedy_params, sequential_ids, spawn


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
