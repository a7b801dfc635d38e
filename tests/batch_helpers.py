"""Fixtures of the upstream batch tests (docs/upstream.md, Upstream tests), for the tiny models.

`sequential_ids` is the reference every batching test compares against: the
same request decoded alone, token by token, straight on the decoder and the
sampler, with no scheduler in between.
"""

from __future__ import annotations

from typing import Sequence

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.generation_types import GenerationParams, SamplingParams
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.kv.paged_kv import model_groups
from ferrox_batch.runtime.sampling.sampler import BatchSampler
from ferrox_batch.stop_tokens import StopTokens


def greedy_params(max_tokens: int, seed: int | None = None, **kw) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, sampling=SamplingParams(), seed=seed, **kw)


def greedy_ids(model, ids: list[int], n: int, *, block_size: int = 4) -> list[int]:
    """`n` greedy ids after `ids`, straight on the model's decoder (no batcher, no sampler): one forward
    for the prompt, then one per token."""
    store = model.decoder.new_store(block_size, num_blocks=256)
    store.add_sequence(0, len(ids) + n)
    logits = model.decoder.forward([SeqChunk(0, ids)], store)
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[0].argmax()))
        logits = model.decoder.forward([SeqChunk(0, [out[-1]])], store)
    return out


def identity_decode(ids: Sequence[int]) -> bytes:
    """Upstream's test detokenizer: id -> one letter `'A' + id % 26`."""
    return bytes(ord("A") + i % 26 for i in ids)


def identity_text(ids: Sequence[int]) -> str:
    """The text `identity_decode` gives for `ids`."""
    return identity_decode(list(ids)).decode()


def budget_config(block: int, blocks: int | None, **kw) -> BatcherConfig:
    return BatcherConfig(prefill_chunk=1, kv_block_size=block, kv_blocks=blocks, **kw)


def ceiling_config(max_context: int, **kw) -> BatcherConfig:
    return BatcherConfig(prefill_chunk=1, kv_block_size=4, kv_blocks=1024, max_context=max_context, **kw)


def spawn(model, config: BatcherConfig, decode=identity_decode) -> ContinuousBatcher:
    return ContinuousBatcher.spawn_with_config(model.decoder, decode, config)


def sequential_ids(
    model, prompt: Sequence[int], params: GenerationParams, stop_tokens: StopTokens | None = None
) -> list[int]:
    """Decode one request alone: prefill, then sample and feed one token at a time."""
    decoder = model.decoder
    groups = len(model_groups(decoder.config).layers)  # a block holds one KV group's layers
    store = decoder.new_store(16, num_blocks=groups * max(1, (len(prompt) + params.max_tokens) // 16 + 2))
    store.add_sequence(0, len(prompt) + params.max_tokens + 1)
    sampler = BatchSampler(decoder.vocab_size, decoder.device)
    tokens = list(prompt) or [0]
    row = sampler.new_row(params.sampling, params.seed, tokens)
    logits = decoder.forward([SeqChunk(0, tokens)], store)
    out: list[int] = []
    stops = stop_tokens or StopTokens.default()
    while len(out) < params.max_tokens:
        token = sampler.sample(logits, [row])[0]
        assert isinstance(token, int)
        if (not params.ignore_eos and token in stops) or token in params.all_stop_ids:
            break
        out.append(token)
        logits = decoder.forward([SeqChunk(0, [token])], store)
    return out
