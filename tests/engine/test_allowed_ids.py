"""`allowed_token_ids` on the caller's thread: bounded, collapsed, and built once per request.

Pins:
* duplicates collapse, as vLLM treats them (the ids form a set): `[5, 5, 3]` allows exactly 3 and 5, and
  every id sent three times samples as no list does; an id outside the vocabulary is refused before anything
  is queued (the server bounds the list's length as sent: `server.request_caps`);
* the row's bias (allowed ids, `logit_bias`, one-token bad words) is compacted, and its ids checked
  against the vocabulary, on the caller's thread, once for a request's choices (`submit(after=...)` with
  the same sampling settings), into a form no bigger than the lists, and never on the worker, which serves
  everyone: the worker only scatters it into each admitted row's dense vector, in one write.
"""

from __future__ import annotations

import threading

import pytest
from batch_helpers import greedy_params, spawn

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import WORKER_THREAD_NAME
from ferrox_batch.errors import InvalidRequest
from ferrox_batch.generation_types import GenerationParams, SamplingParams
from ferrox_batch.runtime.sampling import sampler_rows

CONFIG = BatcherConfig(kv_block_size=4, kv_blocks=256, prefix_cache=True)


def test_duplicates_collapse_as_vllm_reads_them():
    assert SamplingParams(allowed_token_ids=[5, 5, 3, 5]).allowed_token_ids == (3, 5)


def test_repeated_ids_collapse_to_the_set_they_name(tiny_model):
    vocab = tiny_model.config.vocab_size
    with spawn(tiny_model, CONFIG) as batcher:
        thrice = GenerationParams(max_tokens=3, sampling=SamplingParams(allowed_token_ids=list(range(vocab)) * 3))
        assert len(thrice.sampling.allowed_token_ids) == vocab
        assert batcher.generate([1, 2, 3], thrice).token_ids == batcher.generate([1, 2, 3], greedy_params(3)).token_ids
        with pytest.raises(InvalidRequest) as refused:
            batcher.submit([1, 2, 3], GenerationParams(max_tokens=2, sampling=SamplingParams(
                allowed_token_ids=[1, vocab, 1])))
        assert refused.value.param == "allowed_token_ids"
        assert batcher.stats().queue_depth == 0


def test_the_bias_is_built_once_on_the_callers_thread_for_every_choice(tiny_model, monkeypatch):
    built: list[str] = []
    real = sampler_rows.compact_bias

    def spy(params, vocab_size):
        if params.allowed_token_ids is not None:
            built.append(threading.current_thread().name)
        return real(params, vocab_size)

    monkeypatch.setattr(sampler_rows, "compact_bias", spy)
    read: list[str] = []  # who walks the lists' ids (the vocabulary check)
    named = SamplingParams.token_ids_named

    def spy_named(params):
        read.append(threading.current_thread().name)
        return named.fget(params)

    monkeypatch.setattr(SamplingParams, "token_ids_named", property(spy_named))
    vocab = tiny_model.config.vocab_size
    sampling = SamplingParams(temperature=1.0, allowed_token_ids=range(0, vocab, 2), logit_bias={4: 3.0})
    with spawn(tiny_model, CONFIG) as batcher:
        first = batcher.submit([1, 2, 3, 4, 5], GenerationParams(max_tokens=3, sampling=sampling, seed=1))
        others = [batcher.submit([1, 2, 3, 4, 5], GenerationParams(max_tokens=3, sampling=sampling, seed=2 + i),
                                 after=first) for i in range(3)]
        # What the queued choices share is the lists' compact form (an int32 id and a float32 value each),
        # never a [vocab] tensor.
        assert first.bias.ids.nbytes + first.bias.values.nbytes <= 8 * len(sampling.allowed_token_ids)
        assert all(t.bias is first.bias for t in others)
        results = [t.wait(timeout=60) for t in (first, *others)]
        plain = batcher.generate([1, 2, 3], greedy_params(2))
    assert built == [threading.current_thread().name], built
    assert WORKER_THREAD_NAME not in built
    assert read and WORKER_THREAD_NAME not in read, read
    assert all(t % 2 == 0 for r in results for t in r.token_ids)
    assert len(plain.token_ids) == 2
