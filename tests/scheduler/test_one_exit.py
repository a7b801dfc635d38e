"""Requests in the batch and the one exit every request takes (docs/upstream.md "Rows and the one exit", I5).

Pins: the scheduler keeps each request's own record and the batch order (the
order prompts finished prefilling): flushing one finished request never
touches another's output, sink, KV lease or blocks, newcomers join at the end,
and a KV sequence id is never handed to a newcomer; a finished request is
never sampled again, and the flush replies on each request's own channel with
its own ids, text and usage (rates and time to first token included); a
request leaving mid-batch does not shift its neighbours' output.
Port-specific divergences (docs/upstream.md D1, D2): `max_tokens == 0` finishes at once
with `Length` and no output; a character left incomplete at the end surfaces
as exactly one U+FFFD (upstream drops it), while one split across two tokens
is never replaced.
"""

from __future__ import annotations

import pytest
from batch_helpers import (
    budget_config,
    greedy_params,
    identity_decode,
    identity_text,
    sequential_ids,
    spawn,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from worker_helpers import (
    Caller,
    Gate,
    drain_reply,
    make_request,
    make_worker,
    wait_for,
    wait_sent,
)

from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.scheduler import exits
from ferrox_batch.scheduler.request import RequestStatus


def _tick_until(worker, done, what: str, limit: int = 200) -> None:
    """Tick the worker (never idle while this runs) until `done()`."""
    for _ in range(limit):
        if done():
            return
        worker.tick()
    raise AssertionError(f"{what} did not happen within {limit} ticks")


def test_flushing_one_request_never_touches_another_requests_state(tiny_batch_model):
    worker = make_worker(tiny_batch_model, budget_config(4, 16))
    scheduler, store = worker.scheduler, worker.runner.store
    sent = [make_request(worker, prompt, greedy_params(8)) for prompt in ([1, 2], [3, 4], [5, 6])]
    for request, _ in sent:
        assert request.blocks == 3  # 10 positions of 4
        worker.jobs.put(request)
    _tick_until(worker, lambda: len(scheduler.decoding) == 3, "all three decoding")
    replies = {id(request): reply for request, reply in sent}
    order = list(scheduler.decoding)
    first, middle, last = order
    before = {id(r): (list(r.output_ids), r.seq_id, r.blocks, store.seq_len(r.seq_id), r.num_computed_tokens)
              for r in order}
    for request in order:
        assert request.output_ids and request.going
        drain_reply(replies[id(request)])  # the streamed chunks
    assert scheduler.budget.free() == 16 - 9

    middle.cancel()
    assert exits.flush(scheduler) == 1
    assert scheduler.decoding == [first, last], "the batch order is kept"
    assert middle.status is RequestStatus.FINISHED and not store.has_sequence(middle.seq_id)
    assert scheduler.budget.free() == 16 - 6
    exits.check_ledger(scheduler)
    for neighbour in (first, last):
        now = (list(neighbour.output_ids), neighbour.seq_id, neighbour.blocks, store.seq_len(neighbour.seq_id),
               neighbour.num_computed_tokens)
        assert now == before[id(neighbour)] and neighbour.going
        assert drain_reply(replies[id(neighbour)]) == ([], []), "the flush sent nothing on another's channel"
    chunks, finished = drain_reply(replies[id(middle)])
    assert chunks == [] and len(finished) == 1
    assert finished[0].finish_reason == FinishReason.CANCELLED
    assert finished[0].token_ids == tuple(before[id(middle)][0])
    assert exits.flush(scheduler) == 0, "a second flush has nothing to do"

    late, late_reply = make_request(worker, [7, 8], greedy_params(8))
    worker.jobs.put(late)
    _tick_until(worker, lambda: late.status is RequestStatus.DECODING, "the newcomer decoding")
    assert scheduler.decoding == [first, last, late], "a newcomer joins at the end"
    assert late.seq_id not in (first.seq_id, middle.seq_id, last.seq_id), "the freed sequence id is not reused"
    assert not store.has_sequence(middle.seq_id)
    for request in (first, last, late):
        assert request.going and store.seq_len(request.seq_id) == request.num_computed_tokens
    assert drain_reply(replies[id(middle)]) == ([], []), "nothing more reaches a request that left"
    exits.check_ledger(scheduler)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.one_of(st.tuples(st.integers(1, 3), st.integers(1, 12)), st.integers(0, 20)), max_size=30))
def test_sequence_ids_are_unique_and_newcomers_do_not_disturb_the_batch(tiny_batch_model, ops):
    """Random submits (prompt length, max_tokens) and cancels (index of a submitted request), a tick after each."""
    worker = make_worker(tiny_batch_model, budget_config(4, 256, max_prefills_per_tick=2))
    scheduler, store = worker.scheduler, worker.runner.store
    submitted: list[tuple[object, object]] = []
    leased: dict[int, object] = {}  # seq id -> the request it was issued to
    for n, op in enumerate(ops):
        if isinstance(op, tuple):
            length, max_tokens = op
            request, reply = make_request(worker, [(n + i) % 50 + 1 for i in range(length)], greedy_params(max_tokens))
            worker.jobs.put(request)
            submitted.append((request, reply))
        elif op < len(submitted):
            worker.aborts.enqueue(submitted[op][0].abort)  # perhaps one already answered
        if scheduler.idle and worker.jobs.empty():
            continue  # a tick with nothing to do would block on the channel
        before = list(scheduler.decoding)
        worker.tick()
        after = scheduler.decoding
        stayed = [r for r in before if r in after]
        assert after[:len(stayed)] == stayed, "requests already decoding keep their order"
        assert all(r.status is RequestStatus.DECODING for r in after)
        for request in scheduler.admitted():
            assert leased.setdefault(request.seq_id, request) is request, "a sequence id was issued twice"
            assert store.seq_len(request.seq_id) == request.num_computed_tokens, "a request's KV moved"
        assert sorted(store.seq_ids()) == sorted(r.seq_id for r in scheduler.admitted())
        exits.check_ledger(scheduler)
    while not (scheduler.idle and worker.jobs.empty()):
        worker.tick()
    for request, reply in submitted:
        chunks, finished = drain_reply(reply)
        assert len(finished) == 1, "one reply per request, on its own channel"
        result = finished[0]
        assert isinstance(result, GenerationResult)
        assert result.token_ids == tuple(request.output_ids) and "".join(chunks) == result.text
        assert result.text == identity_text(result.token_ids)
    assert store.seq_ids() == [] and scheduler.budget.free() == 256 and scheduler.queue_gate.depth() == 0


def test_flush_replies_on_each_requests_own_channel(tiny_batch_model):
    worker = make_worker(tiny_batch_model, budget_config(4, 8))
    scheduler, store = worker.scheduler, worker.runner.store
    done, done_reply = make_request(worker, [1, 2], greedy_params(3))
    running, running_reply = make_request(worker, [3, 4], greedy_params(8))
    assert (done.blocks, running.blocks) == (2, 3)
    worker.jobs.put(done)
    worker.jobs.put(running)
    _tick_until(worker, lambda: done.status is RequestStatus.DECODING and running.status is RequestStatus.DECODING,
                "both decoding")
    assert scheduler.budget.free() == 3
    seq_id = done.seq_id
    _tick_until(worker, lambda: not done.going, "the short request at its length")
    # It finished in the update of the tick that sampled its last token, and left through that tick's flush.
    assert done.status is RequestStatus.FINISHED and scheduler.decoding == [running]
    assert not store.has_sequence(seq_id) and store.has_sequence(running.seq_id)
    assert scheduler.budget.free() == 5
    plan = scheduler.schedule()
    assert done not in plan.sampling and plan.sampling == (running,), "a finished request is never sampled again"

    ids = sequential_ids(tiny_batch_model, [1, 2], greedy_params(3))
    chunks, finished = drain_reply(done_reply)
    assert chunks == list(identity_text(ids)) and len(finished) == 1
    result = finished[0]
    assert isinstance(result, GenerationResult)
    assert (result.finish_reason, result.token_ids, result.text) == (FinishReason.LENGTH, tuple(ids),
                                                                     identity_text(ids))
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (2, 3)
    assert result.usage.time_to_first_token_ms is not None
    chunks, finished = drain_reply(running_reply)
    assert running.going and 0 < len(running.output_ids) < 8
    assert chunks == list(identity_text(running.output_ids)) and finished == [], \
        "the other request's channel got nothing but its own chunks"


def test_a_finished_batched_row_reports_its_rates(tiny_batch_model):
    with spawn(tiny_batch_model, budget_config(4, 64)) as batcher:
        result = batcher.generate([1, 2, 3, 4, 5], greedy_params(8))
    usage = result.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 8, 13)
    assert usage.prompt_per_second > 0 and usage.predicted_per_second > 0
    assert usage.prompt_eval_duration_ms > 0 and usage.generation_duration_ms > 0
    assert 0 < usage.time_to_first_token_ms
    assert "cached_tokens" not in usage.to_dict()  # no prefix cache
    assert {"prompt_per_second", "predicted_per_second", "time_to_first_token_ms"} <= set(usage.to_dict())


def test_a_row_leaving_mid_batch_does_not_shift_its_neighbours_output(tiny_batch_model):
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    references = [sequential_ids(tiny_batch_model, prompt, greedy_params(12)) for prompt in prompts]
    middle_text = identity_text(references[1])
    stop = middle_text[3:5]
    at = middle_text.find(stop)
    gate = Gate()
    with spawn(tiny_batch_model, budget_config(4, 64), decode=gate) as batcher:
        first = Caller(batcher, prompts[0], greedy_params(12))
        gate.wait_calls(1)
        middle = Caller(batcher, prompts[1], greedy_params(12, stop=[stop]))
        last = Caller(batcher, prompts[2], greedy_params(12))
        wait_sent(batcher, 2)
        gate.open()
        results = [first.join(), middle.join(), last.join()]
    assert list(results[0].token_ids) == references[0]
    assert list(results[2].token_ids) == references[2]
    assert results[1].finish_reason == FinishReason.stop_sequence(stop)
    kept = list(results[1].token_ids)
    assert kept == references[1][:at + 2] and len(kept) < len(references[1])
    assert results[1].text == middle_text[:at]


def test_max_tokens_zero_finishes_at_once_with_length_and_no_output(tiny_batch_model):
    chunks: list[str] = []
    with spawn(tiny_batch_model, budget_config(4, 8)) as batcher:
        result = batcher.generate_streaming([1, 2, 3], greedy_params(0), None, chunks.append)
        stats = batcher.stats()
        wait_for(lambda: batcher.stats().kv_blocks_free == 8, "the job's block back")
        # The batcher still serves afterwards.
        assert batcher.generate([1, 2, 3], greedy_params(2)).finish_reason == FinishReason.LENGTH
    assert result.finish_reason == FinishReason.LENGTH
    assert result.token_ids == () and result.text == "" and chunks == []
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, 0)
    assert stats.decode_steps == 0 and stats.prefill_tokens == 0 and stats.queue_depth == 0


def _decode_with(replacements: dict[int, bytes]):
    """`identity_decode`, except that the n-th call (1-based) returns `replacements[n]`."""
    calls = [0]

    def decode(ids) -> bytes:
        calls[0] += 1
        return replacements.get(calls[0], identity_decode(ids))

    return decode


@pytest.mark.parametrize("stop", [(), ("@@",)], ids=["no-stops", "with-stop-strings"])
def test_a_character_never_completed_surfaces_as_one_replacement_character_at_the_end(tiny_batch_model, stop):
    prompt, n = [5, 6, 7], 6
    baseline = sequential_ids(tiny_batch_model, prompt, greedy_params(n))
    chunks: list[str] = []
    decode = _decode_with({n: "\u65e5".encode()[:2]})  # the last token yields 2 of the 3 bytes of a CJK char
    with spawn(tiny_batch_model, budget_config(4, 64), decode=decode) as batcher:
        result = batcher.generate_streaming(prompt, greedy_params(n, stop=stop), None, chunks.append)
    assert result.finish_reason == FinishReason.LENGTH and list(result.token_ids) == baseline
    assert result.text == identity_text(baseline[:-1]) + "\ufffd"
    assert result.text.count("\ufffd") == 1 and chunks[-1] == "\ufffd" and "".join(chunks) == result.text


def test_a_character_split_across_tokens_is_never_a_replacement_character_mid_stream(tiny_batch_model):
    prompt, n = [5, 6, 7], 6
    baseline = sequential_ids(tiny_batch_model, prompt, greedy_params(n))
    char = "\U0001f680".encode()  # 4 bytes, split 1 + 3 over the 2nd and 3rd tokens
    chunks: list[str] = []
    decode = _decode_with({2: char[:1], 3: char[1:]})
    with spawn(tiny_batch_model, budget_config(4, 64), decode=decode) as batcher:
        result = batcher.generate_streaming(prompt, greedy_params(n), None, chunks.append)
    expected = identity_text(baseline[:1]) + "\U0001f680" + identity_text(baseline[3:])
    assert result.text == expected and "".join(chunks) == expected
    assert "\U0001f680" in chunks and not any("\ufffd" in chunk for chunk in chunks)
