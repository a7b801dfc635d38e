"""Nothing a request carries can stop the worker: it is refused on the caller's thread, or it fails alone.

Pins:
* what the worker would hash, look up or index with is checked at submit, on the caller's thread: prompt ids
  in `[0, vocab)` (a 2**64 id once stopped the worker from the prefix cache's hashing), `logit_bias` ids,
  strings that encode to UTF-8 (a lone surrogate in `cache_salt` once stopped it), and floats that keep
  their meaning in float32; a refused request takes no queue slot;
* on the worker, a step of one request's service that raises (its prefix lookup, its lease, its sampler
  state) fails that request alone: the others get the answers they get alone, every block comes back, and
  the worker serves on.
"""

from __future__ import annotations

import math

import pytest
from batch_helpers import greedy_params, identity_decode, sequential_ids, spawn

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.errors import InternalError, InvalidRequest, TokenOutOfVocab
from ferrox_batch.generation_types import FLOAT32_MAX, FLOAT32_TINY, GenerationParams, SamplingParams
from ferrox_batch.runtime.sampling.sampler import BatchSampler

CACHED = BatcherConfig(kv_block_size=4, kv_blocks=256, prefix_cache=True, max_prefills_per_tick=4)


def assert_serves(batcher, model) -> None:
    prompt = [5, 6, 7, 8, 9]
    assert list(batcher.generate(prompt, greedy_params(4)).token_ids) == sequential_ids(model, prompt,
                                                                                       greedy_params(4))
    stats = batcher.stats()
    assert stats.worker_alive and stats.queue_depth == 0


@pytest.mark.parametrize("field, params", [
    ("cache_salt", {"cache_salt": "\ud800"}),
    ("cache_salt", {"cache_salt": "tenant-\udfff"}),
    ("stop", {"stop": ["ok", "\ud83d"]}),
])
def test_a_lone_surrogate_is_refused_when_the_params_are_built(field, params):
    with pytest.raises(InvalidRequest) as refused:
        GenerationParams(max_tokens=1, **params)
    assert refused.value.param == field


@pytest.mark.parametrize("field, value", [
    ("temperature", FLOAT32_MAX * 2),  # overflows to inf in float32
    ("temperature", FLOAT32_TINY / 4),  # below float32's normal range: a divisor that overflows
    ("repetition_penalty", 1e-45),
    ("repetition_penalty", 1e39),
    ("top_p", 1e-40),
    ("min_p", 5e-324),
])
def test_floats_that_lose_their_meaning_in_float32_are_refused(field, value):
    with pytest.raises(InvalidRequest) as refused:
        SamplingParams(**{field: value})
    assert refused.value.param == field


def test_floats_within_float32_are_accepted():
    SamplingParams(temperature=0.0, top_p=FLOAT32_TINY, min_p=0.0, repetition_penalty=FLOAT32_MAX)
    SamplingParams(temperature=FLOAT32_MAX, repetition_penalty=FLOAT32_TINY)
    assert not math.isinf(SamplingParams(temperature=1e38).temperature)


@pytest.mark.parametrize("prompt", [[2**64, 5, 5], [2**63, 1], [-1, 3], [None, 3]])
def test_prompt_ids_outside_the_vocabulary_are_refused_at_submit(tiny_batch_model, prompt):
    model = tiny_batch_model
    batcher = spawn(model, CACHED)
    with batcher:
        vocab = model.decoder.vocab_size
        bad = [*prompt, *([5] * 20)] if prompt[0] is not None else prompt
        with pytest.raises((TokenOutOfVocab, InvalidRequest)):
            batcher.submit(bad, greedy_params(1))
        with pytest.raises(TokenOutOfVocab):
            batcher.submit([1, 2, vocab] + [5] * 20, greedy_params(1))
        assert batcher.stats().queue_depth == 0
        assert_serves(batcher, model)


def test_a_logit_bias_id_outside_the_vocabulary_is_refused_at_submit(tiny_batch_model):
    model = tiny_batch_model
    batcher = spawn(model, CACHED)
    with batcher:
        params = GenerationParams(max_tokens=1, sampling=SamplingParams(logit_bias={2**70: 1.0}))
        with pytest.raises(InvalidRequest) as refused:
            batcher.submit([1, 2, 3], params)
        assert refused.value.param == "logit_bias"
        assert_serves(batcher, model)


def test_a_prefix_lookup_that_raises_fails_that_request_alone(tiny_batch_model):
    model = tiny_batch_model
    batcher = spawn(model, CACHED)
    victim = [40, 41, 42, 43, 44, 45, 46, 47, 48]
    store = batcher.store
    peek = store.peek

    def peek_or_raise(tokens, salt):
        if list(tokens[:len(victim)]) == victim:
            raise OverflowError("int too big to convert")
        return peek(tokens, salt)

    store.peek = peek_or_raise
    with batcher:
        others = [[10 + k, 11, 12, 13, 14, 15] for k in range(3)]
        tickets = [batcher.submit(p, greedy_params(6)) for p in others[:2]]
        failing = batcher.submit(victim, greedy_params(6))
        tickets.append(batcher.submit(others[2], greedy_params(6)))
        with pytest.raises(InternalError) as failed:
            failing.wait()
        assert "OverflowError" in str(failed.value)
        for prompt, ticket in zip(others, tickets):
            assert list(ticket.wait().token_ids) == sequential_ids(model, prompt, greedy_params(6))
        store.peek = peek
        assert_serves(batcher, model)
        stats = batcher.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total


class RowStateFails(BatchSampler):
    """A sampler whose per-request state cannot be made for one prompt (a bug, not a typed refusal)."""

    def new_row(self, params, seed, prompt_ids, *rest):
        if list(prompt_ids)[:1] == [77]:
            raise ValueError("a bug in the row's state")
        return super().new_row(params, seed, prompt_ids, *rest)


def test_a_sampler_row_that_cannot_be_made_fails_that_request_alone(tiny_batch_model, monkeypatch):
    from ferrox_batch.engine import wiring

    model = tiny_batch_model
    monkeypatch.setattr(wiring, "BatchSampler", RowStateFails)
    batcher = spawn(model, BatcherConfig(kv_block_size=4, kv_blocks=256, max_prefills_per_tick=4))
    monkeypatch.undo()
    with batcher:
        good = [[30 + k, 2, 3] for k in range(3)]
        tickets = [batcher.submit(p, greedy_params(5)) for p in good]
        bad = batcher.submit([77, 2, 3], greedy_params(5))
        with pytest.raises(InternalError) as failed:
            bad.wait()
        assert "ValueError" in str(failed.value)
        for prompt, ticket in zip(good, tickets):
            assert list(ticket.wait().token_ids) == sequential_ids(model, prompt, greedy_params(5))
        assert_serves(batcher, model)
        stats = batcher.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total


def test_a_detokenizer_that_raises_on_the_reply_fails_that_request_alone(tiny_batch_model):
    model = tiny_batch_model

    def decode(ids):
        if 13 in ids:
            raise RuntimeError("cannot decode 13")
        return identity_decode(ids)

    batcher = spawn(model, BatcherConfig(kv_block_size=4, kv_blocks=256), decode=decode)
    with batcher:
        params = GenerationParams(max_tokens=3, sampling=SamplingParams(logit_bias={13: 100.0}))
        with pytest.raises(InternalError):
            batcher.generate([1, 2, 3], params)
        assert_serves(batcher, model)
