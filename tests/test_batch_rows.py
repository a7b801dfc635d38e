"""Rows (upstream tests/rows.rs): the keyed table of decoding requests and the one exit every row takes.

Pins: rows are keyed by uids that are never reused, so removing one row
never hands its state to another, and insertion order (the batch order) is
kept; `ready` skips finished rows and `flush_finished` replies on each row's
own channel with its own ids, text and usage (rates and time to first token
included); a row leaving mid-batch does not shift its neighbours' output.
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
    decode_into,
    drain_reply,
    make_slot,
    make_worker,
    wait_for,
    wait_sent,
)

from ferrox_batch.batch.row import Rows
from ferrox_batch.generation_types import FinishReason, GenerationResult


def test_removing_a_row_never_reassigns_another_rows_state():
    rows = Rows()
    slots = [make_slot(i, abort=i, blocks=1) for i in range(3)]
    uids = [rows.insert(slot) for slot in slots]
    assert rows.remove(uids[1]) is slots[1]
    assert rows.get(uids[1]) is None and rows.remove(uids[1]) is None, "a stale uid finds nothing"
    assert rows.get(uids[0]) is slots[0] and rows.get(uids[2]) is slots[2]
    assert rows.order == [uids[0], uids[2]] and len(rows) == 2
    late = make_slot(3, abort=3, blocks=1)
    new_uid = rows.insert(late)
    assert new_uid not in uids and rows.get(uids[1]) is None, "the freed uid is not handed to the newcomer"
    assert rows.order == [uids[0], uids[2], new_uid] and rows.blocks_held() == 3


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.one_of(st.just("insert"), st.integers(0, 30)), max_size=40))
def test_uids_are_unique_and_insertion_does_not_disturb_existing_rows(ops):
    rows = Rows()
    model: dict[int, object] = {}  # uid -> slot, in insertion order
    issued: list[int] = []
    for n, op in enumerate(ops):
        if op == "insert":
            slot = make_slot(n, abort=n, blocks=1)
            uid = rows.insert(slot)
            assert uid not in issued, "a uid was reused"
            issued.append(uid)
            model[uid] = slot
        else:
            uid = issued[op] if op < len(issued) else op + 1000  # sometimes one that was never issued
            assert rows.remove(uid) is model.pop(uid, None)
        assert rows.order == list(model)
        assert all(rows.get(uid) is slot for uid, slot in model.items())
        assert len(rows) == len(model) and rows.is_empty() == (not model)
    assert issued == sorted(issued)


def test_flush_replies_on_each_rows_own_channel(tiny_batch_model):
    worker = make_worker(tiny_batch_model, budget_config(4, 8))
    done, running = make_slot(1, abort=1, blocks=2, max_tokens=3), make_slot(2, abort=2, blocks=2)
    for slot in (done, running):
        assert worker.budget.try_reserve(slot.blocks)
    done_uid, running_uid = worker.rows.insert(done), worker.rows.insert(running)
    decode_into(done, [0, 1, 2])
    decode_into(running, [3])
    done.finish = FinishReason.LENGTH
    assert worker.rows.ready() == [running_uid], "a finished row is never sampled again"

    released = []
    assert worker.rows.flush_finished(worker.budget, released.append) == 1
    assert released == [done] and worker.budget.free() == 6
    assert worker.rows.order == [running_uid] and worker.rows.get(done_uid) is None
    chunks, finished = drain_reply(done.reply)
    assert chunks == ["A", "B", "C"] and len(finished) == 1
    result = finished[0]
    assert isinstance(result, GenerationResult)
    assert (result.finish_reason, result.token_ids, result.text) == (FinishReason.LENGTH, (0, 1, 2), "ABC")
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (2, 3)
    assert result.usage.time_to_first_token_ms is not None
    chunks, finished = drain_reply(running.reply)
    assert chunks == ["D"] and finished == [], "the other row's channel got nothing but its own chunk"


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
