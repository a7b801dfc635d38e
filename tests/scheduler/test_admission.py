"""Admission (upstream admission.rs; docs/upstream.md, Upstream tests): the block ledger, the two ceilings, and the admit pass.

Pins: blocks are counted in positions and round up; no budget admits
everything; a request that can never fit is refused on the caller's thread
(context ceiling first, then the whole block budget) without taking a queue
slot, while an output budget past the ceiling is clamped; in-flight work never
holds more blocks than the budget; every reservation comes back (finished or
refused at validation); admission is strict FIFO (a head that does not fit
holds the line) and the sequence cap and the block cap compose.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from batch_helpers import (
    budget_config,
    ceiling_config,
    greedy_params,
    identity_decode,
    sequential_ids,
    spawn,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from worker_helpers import Caller, drain_reply, make_request, make_worker, wait_for

from ferrox_batch.admission.block_budget import BlockBudget
from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.admission.kv import KvElem, KvShape
from ferrox_batch.checks import UNLIMITED
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    DEVICE_MEMORY_BUDGET_EXCEEDED,
    KvBudgetExceeded,
    KvPoolExhausted,
    TokenOutOfVocab,
)
from ferrox_batch.generation_types import FinishReason
from ferrox_batch.runtime.kv.paged_kv import PagedKvConfig

# The worked example of docs/upstream.md, KV pricing: 2 layers, 1 kv head, head_dim 4, f32 -> 64 bytes per position.
_WORKED_SHAPE = KvShape.from_config(SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4), KvElem.F32)


def _ceiling(limit: int | None = None) -> ContextCeiling:
    return ContextCeiling(limit, _WORKED_SHAPE)


def _shape(model) -> KvShape:
    return KvShape.from_config(model.decoder.config, KvElem.F32)


def test_blocks_are_counted_in_positions_and_always_round_up():
    budget = BlockBudget(4, 8, _ceiling())
    assert [budget.blocks_for(p) for p in (0, 1, 4, 5, 8, 9)] == [1, 1, 1, 2, 2, 3]


@settings(max_examples=50, deadline=None)
@given(positions=st.integers(0, 10_000), block=st.integers(1, 300))
def test_blocks_cover_every_position_and_waste_less_than_a_block(positions, block):
    blocks = BlockBudget(block, None, _ceiling()).blocks_for(positions)
    assert blocks >= 1 and blocks * block >= positions
    assert blocks == 1 or (blocks - 1) * block < positions


def test_an_unconfigured_budget_admits_everything():
    budget = BlockBudget(4, None, _ceiling())
    assert budget.immovable_refusal(UNLIMITED) is None
    assert budget.try_reserve(1_000_000)
    budget.release(1_000_000)
    assert budget.total is None and budget.free() == 0 and budget.rejected_too_large() == 0


def test_a_request_larger_than_the_whole_budget_is_refused_rather_than_queued(tiny_batch_model):
    with spawn(tiny_batch_model, budget_config(4, 2)) as batcher:
        with pytest.raises(KvBudgetExceeded) as info:
            batcher.generate(list(range(1, 7)), greedy_params(8))
        err = info.value
        shape = _shape(tiny_batch_model)
        assert err.binding == DEVICE_MEMORY_BUDGET_EXCEEDED
        assert (err.positions, err.positions_limit) == (14, 8)
        assert (err.estimated_bytes, err.limit_bytes) == (shape.kv_bytes_for_tokens(14), shape.kv_bytes_for_tokens(8))
        assert "14" in err.detail and err.retry_after_secs is None
        stats = batcher.stats()
        assert stats.kv_rejected_too_large == 1 and stats.kv_rejected_context_length == 0
        assert stats.queue_rejected == 0 and stats.queue_depth == 0 and stats.kv_blocks_free == 2

        params = greedy_params(4)
        result = batcher.generate([1, 2], params)  # 6 positions: 2 blocks, the whole budget
        assert result.finish_reason == FinishReason.LENGTH
        assert list(result.token_ids) == sequential_ids(tiny_batch_model, [1, 2], params)
        assert batcher.stats().kv_rejected_too_large == 1


def test_a_prompt_longer_than_the_context_ceiling_names_that_ceiling(tiny_batch_model):
    with spawn(tiny_batch_model, ceiling_config(6)) as batcher:
        with pytest.raises(KvBudgetExceeded) as info:
            batcher.generate(list(range(1, 9)), greedy_params(2))
        err = info.value
        assert err.binding == CONTEXT_LENGTH_EXCEEDED
        assert (err.positions, err.positions_limit) == (8, 6)
        assert "prompt is too long" in err.detail and err.retry_after_secs is None
        stats = batcher.stats()
        assert stats.kv_rejected_context_length == 1 and stats.kv_rejected_too_large == 0
        assert stats.queue_rejected == 0 and stats.queue_depth == 0

        params = greedy_params(2)
        result = batcher.generate([1, 2, 3, 4], params)  # 4 + 2 is exactly at the ceiling
        assert result.finish_reason == FinishReason.LENGTH
        assert list(result.token_ids) == sequential_ids(tiny_batch_model, [1, 2, 3, 4], params)
        assert batcher.stats().kv_rejected_context_length == 1


def test_an_output_budget_past_the_ceiling_is_clamped_rather_than_refused(tiny_batch_model):
    prompt = [5, 6, 7, 8]
    with spawn(tiny_batch_model, ceiling_config(6)) as batcher:
        result = batcher.generate(prompt, greedy_params(1_000_000))
        assert result.finish_reason == FinishReason.LENGTH
        assert len(result.token_ids) == 2 and result.usage.completion_tokens == 2
        assert list(result.token_ids) == sequential_ids(tiny_batch_model, prompt, greedy_params(2))
        stats = batcher.stats()
        assert stats.kv_rejected_context_length == 0 and stats.kv_rejected_too_large == 0


def test_the_context_ceiling_is_reported_before_the_device_ceiling(tiny_batch_model):
    config = BatcherConfig(prefill_chunk=1, kv_block_size=4, kv_blocks=1, max_context=6)
    with spawn(tiny_batch_model, config) as batcher:
        with pytest.raises(KvBudgetExceeded) as info:
            batcher.generate(list(range(1, 9)), greedy_params(4))  # past the ceiling and past 1 block
        assert info.value.binding == CONTEXT_LENGTH_EXCEEDED
        stats = batcher.stats()
        assert stats.kv_rejected_context_length == 1 and stats.kv_rejected_too_large == 0


def test_without_ceilings_nothing_is_refused_as_too_large(tiny_batch_model):
    prompt = list(range(1, 101))
    with spawn(tiny_batch_model, BatcherConfig(kv_block_size=4)) as batcher:
        result = batcher.generate(prompt, greedy_params(20))
        assert result.finish_reason == FinishReason.LENGTH and len(result.token_ids) == 20
        stats = batcher.stats()
        assert stats.kv_rejected_too_large == 0 and stats.kv_rejected_context_length == 0
        # No block count given: the budget comes from the machine's memory, and every block comes back.
        assert stats.kv_blocks_total > 0 and stats.kv_blocks_free == stats.kv_blocks_total
        assert stats.kv_blocks_peak == 30  # 120 positions / 4


def test_concurrent_requests_never_hold_more_blocks_than_the_budget(tiny_batch_model):
    params = greedy_params(5)
    prompts = [[i + 1, i + 2, i + 3] for i in range(6)]  # 8 positions each: 2 blocks of 4
    with spawn(tiny_batch_model, budget_config(4, 4)) as batcher:
        callers = [Caller(batcher, prompt, params) for prompt in prompts]
        results = [caller.join() for caller in callers]
        for prompt, result in zip(prompts, results):
            assert list(result.token_ids) == sequential_ids(tiny_batch_model, prompt, params)
        stats = batcher.stats()
        assert 0 < stats.kv_blocks_peak <= stats.kv_blocks_total == 4
        assert stats.kv_rejected_too_large == 0
        wait_for(lambda: batcher.stats().kv_blocks_free == 4, "every block back")


def test_every_admitted_request_gives_its_blocks_back(tiny_batch_model):
    with spawn(tiny_batch_model, budget_config(4, 8)) as batcher:
        for i in range(8):
            result = batcher.generate([i + 1, i + 2], greedy_params(3))
            assert result.finish_reason == FinishReason.LENGTH
        wait_for(lambda: batcher.stats().kv_blocks_free == 8, "every block back")
        stats = batcher.stats()
        assert stats.kv_blocks_peak > 0 and stats.queue_depth == 0
        assert batcher.store.blocks_held() == 0


def test_a_job_rejected_at_validation_gives_its_blocks_back(tiny_batch_model):
    vocab = tiny_batch_model.decoder.vocab_size
    with spawn(tiny_batch_model, budget_config(4, 4)) as batcher:
        with pytest.raises(TokenOutOfVocab) as info:
            batcher.generate([1, vocab + 1, 2], greedy_params(2))
        assert (info.value.token, info.value.vocab_size) == (vocab + 1, vocab)
        wait_for(lambda: batcher.stats().kv_blocks_free == 4, "the refused job's blocks back")
        assert batcher.stats().queue_depth == 0

        params = greedy_params(3)
        result = batcher.generate([1, 2], params)
        assert list(result.token_ids) == sequential_ids(tiny_batch_model, [1, 2], params)


def _prefill_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Prefill batch")]


def test_a_head_job_that_does_not_fit_holds_the_line(tiny_batch_model, caplog):
    caplog.set_level(logging.INFO, logger="ferrox_batch.scheduler")
    worker = make_worker(tiny_batch_model, budget_config(4, 4))
    scheduler = worker.scheduler
    head, _ = make_request(worker, [1, 2, 3, 4], greedy_params(8))  # 12 positions: 3 blocks
    small, _ = make_request(worker, [5, 6], greedy_params(2))  # 4 positions: 1 block
    assert (head.blocks, small.blocks) == (3, 1)
    scheduler.add(head)
    scheduler.add(small)
    assert scheduler.budget.try_reserve(2)  # someone else holds 2: only 2 free

    plan = scheduler.schedule()
    assert plan.empty and not scheduler.prefilling and _prefill_lines(caplog) == []
    assert list(scheduler.waiting) == [head, small], "the 1-block job behind must not jump the head"
    assert scheduler.queue_gate.depth() == 2 and scheduler.budget.free() == 2

    scheduler.budget.release(2)
    scheduler.schedule()
    [line] = _prefill_lines(caplog)
    assert line.startswith("Prefill batch, #new-seq: 2, ")
    assert [r.abort for r in scheduler.prefilling] == [head.abort, small.abort]
    assert not scheduler.waiting and scheduler.queue_gate.depth() == 0 and scheduler.budget.free() == 0


def test_the_sequence_cap_and_the_block_cap_compose(tiny_batch_model):
    worker = make_worker(tiny_batch_model, budget_config(4, 8, max_seqs=1))
    scheduler = worker.scheduler
    requests = [make_request(worker, [i + 1, i + 2], greedy_params(2))[0] for i in range(3)]
    scheduler.waiting.extend(requests)
    scheduler.schedule()
    assert [r.abort for r in scheduler.prefilling] == [requests[0].abort] and not scheduler.decoding
    assert scheduler.budget.free() == 7 and scheduler.queue_gate.depth() == 2 and len(scheduler.waiting) == 2

    # The block cap alone blocks too: with room for sequences but not blocks, nothing more enters.
    worker = make_worker(tiny_batch_model, budget_config(4, 2))
    scheduler = worker.scheduler
    requests = [make_request(worker, [i + 1, i + 2], greedy_params(2))[0] for i in range(3)]
    scheduler.waiting.extend(requests)
    scheduler.schedule()
    assert len(scheduler.prefilling) == 2 and scheduler.budget.free() == 0 and len(scheduler.waiting) == 1


def test_a_validation_refusal_through_the_worker_answers_once(tiny_batch_model):
    """The admit pass itself: the refused request is answered, its blocks come back, the next one still enters."""
    worker = make_worker(tiny_batch_model, budget_config(4, 4))
    scheduler = worker.scheduler
    vocab = scheduler.vocab_size
    bad, bad_reply = make_request(worker, [vocab], greedy_params(2))
    good, _ = make_request(worker, [1], greedy_params(2))
    scheduler.waiting.extend([bad, good])
    scheduler.schedule()
    assert [r.abort for r in scheduler.prefilling] == [good.abort]
    chunks, finished = drain_reply(bad_reply)
    assert chunks == [] and finished == [TokenOutOfVocab(vocab, vocab)]
    assert scheduler.budget.free() == 4 - good.blocks and scheduler.queue_gate.depth() == 0


def test_a_page_store_that_cannot_supply_pages_refuses_with_kv_pool_exhausted(tiny_batch_model):
    """The ledger says yes but a shared page store, partly held by someone else, says no (docs/upstream.md, Paged KV and held positions)."""
    decoder = tiny_batch_model.decoder
    store = decoder.new_store(4, num_blocks=16)
    store.add_sequence(0, 16)  # 4 of the 16 pages are someone else's, under an id the batcher might pick
    batcher = ContinuousBatcher.spawn_with_config_paged(decoder, identity_decode, budget_config(4, None),
                                                        PagedKvConfig(store))
    with batcher:
        params = greedy_params(4)
        result = batcher.generate([1, 2], params)  # fits in what is left: served as usual
        assert list(result.token_ids) == sequential_ids(tiny_batch_model, [1, 2], params)
        with pytest.raises(KvPoolExhausted):
            batcher.generate(list(range(1, 41)), greedy_params(12))  # 13 blocks: the ledger has 16, the store 12
        stats = batcher.stats()
        assert stats.worker_alive and stats.kv_blocks_free == 16 and stats.queue_depth == 0
        assert store.seq_ids() == [0] and store.num_free_blocks == 12
        assert batcher.generate([1, 2], params).token_ids == result.token_ids, "the batcher still serves"
