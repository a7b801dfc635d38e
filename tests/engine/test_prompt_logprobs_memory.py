"""Prompt log-probabilities are held compactly, from the chunk that computes them to the answer.

A request that scores its prompt holds an entry per prompt token until its answer is written. Pinned with
tracemalloc over a real batcher: what the finished result holds for its prompt's entries, per scored token,
is within twice the numbers' own bytes (`12 + 8 * top`: a 32-bit token, log-probability and rank, and `top`
32-bit id and log-probability pairs; twice leaves room for the arrays' growth and their headers), where
Python objects took about 2.5 KB. And the entries read back as the same `TokenLogprob`s a sequential
computation gives.
"""

from __future__ import annotations

import gc
import tracemalloc

from batch_helpers import spawn

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.generation_types import GenerationParams
from ferrox_batch.logprobs import MAX_TOP_LOGPROBS

CONFIG = BatcherConfig(kv_block_size=16, kv_blocks=128, prefill_chunk=64, max_batch_tokens=256)


def test_prompt_logprobs_are_held_in_their_numbers_bytes(tiny_batch_model):
    top = MAX_TOP_LOGPROBS
    prompt = [(7 * i + 3) % 300 for i in range(400)]
    params = GenerationParams(max_tokens=1, prompt_logprobs=top)
    with spawn(tiny_batch_model, CONFIG) as batcher:
        batcher.generate(prompt[:20], params)  # warm: first-use allocations are not the result's
        gc.collect()
        tracemalloc.start()
        try:
            result = batcher.generate(prompt, params)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0]
            entries = result.prompt_logprobs
            assert entries is not None and len(entries) == len(prompt) and entries[0] is None
            assert all(len(e.top) == top and e.rank >= 1 for e in entries[1:])
            del result, entries
            gc.collect()
            freed = held - tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    per_token = freed / (len(prompt) - 1)
    assert per_token <= 2 * (12 + 8 * top), f"{per_token:.0f} bytes per scored prompt token"


def test_the_entries_are_the_ones_computed_chunk_by_chunk(tiny_batch_model):
    prompt = [(5 * i + 1) % 300 for i in range(150)]
    with spawn(tiny_batch_model, CONFIG) as batcher:
        whole = batcher.generate(prompt, GenerationParams(max_tokens=1, prompt_logprobs=3)).prompt_logprobs
    chunked_config = BatcherConfig(kv_block_size=16, kv_blocks=128, prefill_chunk=16, max_batch_tokens=16)
    with spawn(tiny_batch_model, chunked_config) as batcher:
        chunked = batcher.generate(prompt, GenerationParams(max_tokens=1, prompt_logprobs=3)).prompt_logprobs
    assert len(whole) == len(chunked) == len(prompt)
    for a, b in zip(whole[1:], chunked[1:]):
        assert a.token == b.token and a.rank == b.rank and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert abs(a.logprob - b.logprob) <= 1e-4 * max(1.0, abs(a.logprob))
