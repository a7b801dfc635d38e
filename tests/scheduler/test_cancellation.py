"""Cancellation and stops: how a request ends early, and that nothing else moves.

See docs/upstream.md "Cancellation", I11 and D12. Pins: a cancel is applied
by the worker between forwards, at the top of the next tick, wherever the
request is (waiting, prefilling, decoding); a cancel that overtakes its own
request is kept until the request arrives, and one that raced its answer is
dropped after one more tick; a cancelled request leaves through the same flush
every request uses (one release, one reply, with its partial ids and text);
cancelling one request never changes another's output; token-level stops and
stop strings end a request with the right ids and text, and a stop that never
matches loses nothing. Port-specific: an `on_chunk` that raises cancels its
request and the error reaches the caller.
"""

from __future__ import annotations

import dataclasses

from batch_helpers import (
    budget_config,
    greedy_params,
    identity_text,
    sequential_ids,
    spawn,
)
from worker_helpers import (
    Caller,
    Gate,
    drain_reply,
    make_request,
    make_worker,
    wait_for,
    wait_sent,
)

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.cancel import CancelToken
from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.scheduler import exits
from ferrox_batch.scheduler.request import RequestStatus
from ferrox_batch.stop_tokens import StopTokens
from ferrox_batch.usage import Usage


def test_a_decoding_request_stops_when_it_is_cancelled(tiny_batch_model):
    gate = Gate()
    cancel = CancelToken()
    prompt = [4, 8, 15]
    with spawn(tiny_batch_model, budget_config(4, 64), decode=gate) as batcher:
        caller = Caller(batcher, prompt, greedy_params(50, cancel=cancel))
        gate.wait_calls(1)
        while batcher.stats().decode_steps < 3:
            gate.step()
        assert batcher.stats().decode_steps == 3  # held inside the 4th token's decode
        cancel.cancel()
        gate.open()
        result = caller.join()
        stats = batcher.stats()
        assert stats.aborted == 1
        wait_for(lambda: batcher.stats().kv_blocks_free == 64, "the cancelled row's blocks back")
    assert result.finish_reason == FinishReason.CANCELLED
    assert 0 < len(result.token_ids) < 50
    # Applied at the top of the next tick: the token being sampled when the cancel came is kept.
    assert list(result.token_ids) == sequential_ids(tiny_batch_model, prompt, greedy_params(4))
    assert result.usage.completion_tokens == len(result.token_ids) == 4
    assert result.text == identity_text(result.token_ids)


def test_a_cancelled_request_leaves_through_the_one_exit_every_request_uses(tiny_batch_model):
    worker = make_worker(tiny_batch_model, budget_config(4, 8))
    scheduler, store = worker.scheduler, worker.runner.store
    released: list[int] = []
    release = worker.runner.release

    def record_release(seq_id: int) -> int:
        released.append(seq_id)
        return release(seq_id)

    worker.runner.release = record_release  # the scheduler's KV leases are the runner
    victim, victim_reply = make_request(worker, [1, 2], greedy_params(8), abort=7)
    neighbour, neighbour_reply = make_request(worker, [3, 4], greedy_params(8), abort=8)
    assert (victim.blocks, neighbour.blocks) == (3, 3)
    worker.jobs.put(victim)
    worker.jobs.put(neighbour)
    while len(scheduler.decoding) < 2 or len(victim.output_ids) < 3:
        worker.tick()
    for reply in (victim_reply, neighbour_reply):
        drain_reply(reply)  # the streamed chunks
    ids, neighbour_ids = list(victim.output_ids), list(neighbour.output_ids)

    assert exits.cancel(scheduler, {7, 99}) == 1
    assert victim.finish == FinishReason.CANCELLED
    # Cancelling only marks: nothing released, nothing replied, the request is still in the batch.
    assert scheduler.decoding == [victim, neighbour] and store.has_sequence(victim.seq_id)
    assert scheduler.budget.free() == 2 and released == []
    assert drain_reply(victim_reply) == ([], [])
    assert exits.cancel(scheduler, {7}) == 0, "a request that already finished is not cancelled twice"

    assert exits.flush(scheduler) == 1
    assert released == [victim.seq_id] and scheduler.budget.free() == 5
    assert victim.status is RequestStatus.FINISHED and scheduler.decoding == [neighbour]
    chunks, finished = drain_reply(victim_reply)
    assert chunks == [] and len(finished) == 1
    result = finished[0]
    assert isinstance(result, GenerationResult)
    assert result.finish_reason == FinishReason.CANCELLED
    assert list(result.token_ids) == ids and result.text == identity_text(ids)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (2, len(ids))

    # The neighbour is untouched, and a second flush has nothing to do.
    assert neighbour.finish is None and neighbour.output_ids == neighbour_ids
    assert drain_reply(neighbour_reply) == ([], [])
    assert exits.flush(scheduler) == 0
    assert released == [victim.seq_id]
    exits.check_ledger(scheduler)


def test_a_cancel_that_arrives_before_its_request_is_not_lost(tiny_batch_model):
    worker = make_worker(tiny_batch_model, budget_config(4, 8))
    scheduler = worker.scheduler
    abort = worker.aborts.next_id()
    worker.aborts.enqueue(abort)
    # The worker drains the inbox before the channel has the request: nothing matches, the id is carried.
    assert exits.cancel(scheduler, worker.aborts.drain()) == 0
    assert scheduler.carried == {abort} and worker.aborts.aborted() == 0

    request, reply = make_request(worker, [1, 2], greedy_params(4), abort=abort)
    worker.jobs.put(request)
    worker.tick()
    chunks, finished = drain_reply(reply)
    assert chunks == [] and finished == [GenerationResult(FinishReason.CANCELLED, [], "", Usage.new(2, 0))]
    assert scheduler.queue_gate.depth() == 0 and worker.aborts.aborted() == 1
    assert scheduler.carried == set() and scheduler.idle
    assert scheduler.budget.free() == 8 and worker.runner.store.blocks_held() == 0


def test_a_cancel_that_raced_its_answer_is_dropped_after_one_more_tick(tiny_batch_model):
    worker = make_worker(tiny_batch_model, budget_config(4, 8))
    scheduler = worker.scheduler
    request, reply = make_request(worker, [1, 2], greedy_params(2))
    worker.jobs.put(request)
    finished: list[object] = []
    while not scheduler.idle or not finished:
        worker.tick()
        finished += drain_reply(reply)[1]
    worker.aborts.enqueue(request.abort)  # the caller cancelled just after its answer was sent
    assert exits.cancel(scheduler, worker.aborts.drain()) == 0
    assert scheduler.carried == {request.abort}, "carried once: its request might still be on the channel"
    assert exits.cancel(scheduler, worker.aborts.drain()) == 0
    assert scheduler.carried == set() and worker.aborts.aborted() == 0


def test_a_cancelled_prefill_is_abandoned_and_gives_its_blocks_back(tiny_batch_model):
    worker = make_worker(tiny_batch_model, BatcherConfig(prefill_chunk=16, kv_block_size=16, kv_blocks=4))
    scheduler, store = worker.scheduler, worker.runner.store
    request, reply = make_request(worker, list(range(1, 41)), greedy_params(4))  # 44 positions: 3 blocks of 16
    worker.jobs.put(request)
    worker.tick()  # admitted, first chunk of 16 run
    assert list(scheduler.prefilling) == [request] and request.num_computed_tokens == 16
    assert scheduler.budget.free() == 1 and store.blocks_held() == 3

    worker.aborts.enqueue(request.abort)
    worker.tick()
    assert not scheduler.prefilling and not scheduler.decoding
    assert scheduler.budget.free() == 4 and store.blocks_held() == 0
    assert worker.aborts.aborted() == 1 and worker.counters.prefill_tokens() == 16
    chunks, finished = drain_reply(reply)
    (result,) = finished
    assert result.usage.queue_duration_ms >= 0  # it was admitted: its wait is known, and nothing else is
    unqueued = dataclasses.replace(result, usage=dataclasses.replace(result.usage, queue_duration_ms=None))
    assert chunks == [] and unqueued == GenerationResult(FinishReason.CANCELLED, [], "", Usage.new(40, 0))


def test_cancelling_one_request_leaves_its_neighbours_running(tiny_batch_model):
    gate = Gate()
    cancel = CancelToken()
    survivor_prompt, victim_prompt = [1, 2, 3], [9, 9, 9, 9]
    with spawn(tiny_batch_model, budget_config(4, 64), decode=gate) as batcher:
        survivor = Caller(batcher, survivor_prompt, greedy_params(16))
        gate.wait_calls(1)
        victim = Caller(batcher, victim_prompt, greedy_params(40, cancel=cancel))
        wait_sent(batcher, 1)
        while batcher.stats().decode_steps < 4 or batcher.stats().prefill_tokens < 7:
            gate.step()  # until both are decoding side by side
        cancel.cancel()
        gate.open()
        survived, cancelled = survivor.join(), victim.join()
        assert batcher.stats().aborted == 1
    assert survived.finish_reason == FinishReason.LENGTH
    assert list(survived.token_ids) == sequential_ids(tiny_batch_model, survivor_prompt, greedy_params(16))
    assert cancelled.finish_reason == FinishReason.CANCELLED
    kept = len(cancelled.token_ids)
    assert 0 < kept < 40
    assert list(cancelled.token_ids) == sequential_ids(tiny_batch_model, victim_prompt, greedy_params(kept))


def test_a_token_level_stop_ends_a_batched_row(tiny_batch_model):
    prompt = [3, 3, 7]
    baseline = sequential_ids(tiny_batch_model, prompt, greedy_params(10))
    expected = baseline[:baseline.index(baseline[1])]
    with spawn(tiny_batch_model, budget_config(4, 64)) as batcher:
        result = batcher.generate(prompt, greedy_params(10, stop_token_ids=[baseline[1]]))
    assert result.finish_reason == FinishReason.STOP
    assert list(result.token_ids) == expected and result.usage.completion_tokens == len(expected)
    assert result.text == identity_text(expected)


def test_a_multi_token_stop_string_truncates_a_batched_row(tiny_batch_model):
    prompt = [11, 12, 13]
    baseline = sequential_ids(tiny_batch_model, prompt, greedy_params(10))
    full = identity_text(baseline)
    stop = full[1:3]  # the text of two tokens
    at = full.find(stop)
    chunks: list[str] = []
    with spawn(tiny_batch_model, budget_config(4, 64)) as batcher:
        result = batcher.generate_streaming(prompt, greedy_params(10, stop=[stop]), None, chunks.append)
    assert result.finish_reason == FinishReason.stop_sequence(stop)
    assert result.text == full[:at] and "".join(chunks) == result.text
    assert list(result.token_ids) == baseline[:at + 2]


def test_a_batched_row_that_never_matches_loses_no_output(tiny_batch_model):
    prompt = [20, 21]
    baseline = sequential_ids(tiny_batch_model, prompt, greedy_params(10))
    full = identity_text(baseline)
    # A stop whose first character ends the output: it is withheld until the end, then released.
    stop = full[-1] + "@"
    never = next(t for t in range(tiny_batch_model.decoder.vocab_size) if t not in baseline)
    chunks: list[str] = []
    with spawn(tiny_batch_model, budget_config(4, 64)) as batcher:
        result = batcher.generate_streaming(prompt, greedy_params(10, stop=[stop], stop_token_ids=[never]), None,
                                            chunks.append)
    assert result.finish_reason == FinishReason.LENGTH
    assert list(result.token_ids) == baseline and result.text == full
    assert "".join(chunks) == full and chunks[-1] == full[-1], "the withheld tail arrives as the last chunk"


def test_an_uncancelled_request_is_unaffected_by_the_abort_path(tiny_batch_model):
    prompt = [30, 31, 32]
    with spawn(tiny_batch_model, budget_config(4, 64)) as batcher:
        result = batcher.generate(prompt, greedy_params(12, cancel=CancelToken()))
        assert batcher.stats().aborted == 0
    assert result.finish_reason == FinishReason.LENGTH
    assert list(result.token_ids) == sequential_ids(tiny_batch_model, prompt, greedy_params(12))


class _ClientLeft(Exception):
    pass


def test_an_on_chunk_that_raises_cancels_the_request_and_the_error_propagates(tiny_batch_model):
    gate = Gate(permits=3)  # three tokens, then the worker is held inside the fourth's decode
    seen: list[str] = []

    def leave(text: str) -> None:
        seen.append(text)
        if len(seen) == 3:
            raise _ClientLeft("the client went away")

    with spawn(tiny_batch_model, budget_config(4, 64), decode=gate) as batcher:
        caller = Caller(batcher, [1, 2, 3], greedy_params(200), on_chunk=leave)
        wait_for(lambda: len(seen) == 3, "the third chunk")
        gate.open()
        assert isinstance(caller.join_error(), _ClientLeft)
        assert len(seen) == 3, "no chunk is delivered after the callback failed"
        assert gate.calls <= 4, "the request was stopped at the next tick, not run to its end"
        stats = batcher.stats()
        assert stats.aborted == 1 and stats.queue_depth == 0
        wait_for(lambda: batcher.stats().kv_blocks_free == 64, "the cancelled row's blocks back")
        assert batcher.store.blocks_held() == 0
        # The batcher still serves.
        params = greedy_params(5)
        assert list(batcher.generate([7, 7], params).token_ids) == sequential_ids(tiny_batch_model, [7, 7], params)


def test_a_request_cancelled_while_waiting_gives_its_queue_slot_back(tiny_batch_model):
    gate = Gate()
    cancel = CancelToken()
    with spawn(tiny_batch_model, budget_config(4, 64, max_seqs=1), decode=gate) as batcher:
        running = Caller(batcher, [1, 2, 3], greedy_params(6))
        gate.wait_calls(1)
        waiting = Caller(batcher, [4, 5], greedy_params(6, cancel=cancel))
        wait_sent(batcher, 1)
        gate.step()  # the next tick drains it into `waiting`: the sequence cap keeps it there
        assert batcher.stats().queue_depth == 1
        cancel.cancel()
        gate.open()
        result = waiting.join()
        assert result == GenerationResult(FinishReason.CANCELLED, [], "", Usage.new(2, 0))
        assert running.join().finish_reason == FinishReason.LENGTH
        stats = batcher.stats()
        assert stats.aborted == 1 and stats.queue_depth == 0 and stats.prefill_tokens == 3


def test_a_request_cancelled_before_it_is_submitted_never_runs(tiny_batch_model):
    cancel = CancelToken()
    cancel.cancel()
    with spawn(tiny_batch_model, budget_config(4, 64)) as batcher:
        result = batcher.generate([1, 2, 3], greedy_params(6, cancel=cancel))
        stats = batcher.stats()
    assert result == GenerationResult(FinishReason.CANCELLED, [], "", Usage.new(3, 0))
    assert stats.aborted == 1 and stats.prefill_tokens == 0 and stats.decode_steps == 0
    assert stats.queue_depth == 0 and stats.kv_blocks_free == 64


def test_ignore_eos_suppresses_only_the_models_stop_set(tiny_batch_model):
    prompt = [40, 41, 42]
    baseline = sequential_ids(tiny_batch_model, prompt, greedy_params(10))
    eos = StopTokens.of({baseline[2]})
    with spawn(tiny_batch_model, budget_config(4, 64)) as batcher:
        stopped = batcher.generate(prompt, greedy_params(10), eos)
        ignored = batcher.generate(prompt, greedy_params(10, ignore_eos=True), eos)
        caller_stop = batcher.generate(prompt, greedy_params(10, ignore_eos=True, stop_token_ids=[baseline[2]]), eos)
    assert stopped.finish_reason == FinishReason.STOP
    assert list(stopped.token_ids) == baseline[:baseline.index(baseline[2])]
    assert ignored.finish_reason == FinishReason.LENGTH and list(ignored.token_ids) == baseline
    assert caller_stop.finish_reason == FinishReason.STOP and caller_stop.token_ids == stopped.token_ids
