"""Counters (worker-written, read by anyone) and the BatcherStats snapshot."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferrox_batch.admission.counters import BatcherStats, Counters


def test_fresh_counters_are_zero():
    assert Counters().snapshot() == (0, 0, 0, 0)


def test_a_prefill_call_counts_one_chunk_and_its_tokens():
    c = Counters()
    c.add_prefill(3)
    c.add_prefill(3)
    c.add_prefill(1)
    c.add_prefill(0)
    assert c.prefill_chunks() == 4 and c.prefill_tokens() == 7


def test_decode_steps_count_forwards_not_rows():
    c = Counters()
    for _ in range(5):
        c.add_decode_step()
    assert c.decode_steps() == 5


def test_the_peak_is_a_high_water_mark():
    c = Counters()
    for blocks in (2, 5, 3, 0, 5, 4):
        c.record_peak(blocks)
    assert c.peak_blocks() == 5


@pytest.mark.parametrize("call", [
    lambda c: c.add_prefill(-1),
    lambda c: c.add_prefill(1.0),
    lambda c: c.add_prefill(True),
    lambda c: c.record_peak(-2),
    lambda c: c.record_peak("3"),
])
def test_counters_refuse_bad_amounts_and_change_nothing(call):
    c = Counters()
    with pytest.raises((TypeError, ValueError)):
        call(c)
    assert c.snapshot() == (0, 0, 0, 0)


def test_counters_are_exact_under_concurrent_writers():
    c = Counters()
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        barrier.wait()
        for n in range(1000):
            c.add_prefill(2)
            c.add_decode_step()
            c.record_peak(i * 1000 + n)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.snapshot() == (8000, 16000, 8000, 7999)


def stats(**overrides: object) -> BatcherStats:
    values: dict[str, object] = dict(
        prefill_chunks=1, prefill_tokens=2, decode_steps=3, queue_depth=0, queue_rejected=4,
        kv_blocks_total=8, kv_blocks_free=6, kv_block_size=4, kv_rejected_too_large=1,
        kv_rejected_context_length=2, kv_blocks_peak=3, aborted=1, max_seqs=0, prefill_chunk=128,
        max_batch_tokens=256, worker_alive=True,
    )
    values.update(overrides)
    return BatcherStats(**values)  # type: ignore[arg-type]


def test_stats_carry_every_upstream_field_plus_the_ports_own():
    names = {f.name for f in dataclasses.fields(BatcherStats)}
    assert names == {
        "prefill_chunks", "prefill_tokens", "decode_steps", "queue_depth", "queue_rejected",
        "kv_blocks_total", "kv_blocks_free", "kv_block_size", "kv_rejected_too_large",
        "kv_rejected_context_length", "kv_blocks_peak", "aborted", "max_seqs", "prefill_chunk",
        "max_batch_tokens", "worker_alive", "prefix_cache_queries", "prefix_cache_hits", "kv_blocks_cached",
        "worker_idle_ms", "worker_scheduling_ms", "worker_forward_ms", "worker_forward_off_cpu_ms",
        "kv_blocks_global", "kv_blocks_local", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
    }


def test_prefix_lookups_add_up_and_hits_never_exceed_queries():
    counters = Counters()
    counters.add_prefix_lookup(40, 32)
    counters.add_prefix_lookup(10, 0)
    assert counters.prefix_cache() == (50, 32)
    with pytest.raises(ValueError, match="hits"):
        counters.add_prefix_lookup(5, 6)


def test_stats_serialise_to_a_flat_json_object():
    s = stats(spec_decode_num_accepted_tokens_per_pos=(5, 2))
    body = s.to_dict()
    assert body["max_seqs"] == 0 and body["worker_alive"] is True and body["kv_blocks_free"] == 6
    assert body["spec_decode_num_accepted_tokens_per_pos"] == [5, 2]
    assert json.loads(json.dumps(body)) == body


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=30))
def test_drafts_count_their_accepted_prefix_position_by_position(drafts):
    counters = Counters()
    per_pos: list[int] = []
    for tokens, accepted in drafts:
        accepted = min(accepted, tokens)
        counters.add_draft(tokens, accepted)
        per_pos.extend([0] * (tokens - len(per_pos)))
        for position in range(accepted):
            per_pos[position] += 1
    n, tokens, accepted, by_position = counters.speculation()
    assert n == len(drafts) and tokens == sum(t for t, _ in drafts)
    assert accepted == sum(by_position) == sum(min(a, t) for t, a in drafts)
    assert list(by_position) == per_pos
    # A draft keeps a prefix: no position is accepted more often than the one before it.
    assert all(a >= b for a, b in zip(by_position, by_position[1:]))
    with pytest.raises(ValueError, match="accepted"):
        counters.add_draft(2, 3)


def test_stats_are_an_immutable_snapshot():
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats().decode_steps = 9  # type: ignore[misc]


@pytest.mark.parametrize(("field", "bad"), [("queue_depth", -1), ("decode_steps", 1.0), ("aborted", True), ("worker_alive", 1),
                                           ("spec_decode_num_accepted_tokens_per_pos", [1]),
                                           ("spec_decode_num_accepted_tokens_per_pos", (1, -1))])
def test_stats_refuse_values_that_are_not_counts(field, bad):
    with pytest.raises((TypeError, ValueError), match=field):
        stats(**{field: bad})
