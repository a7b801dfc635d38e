"""Prompt log-probabilities are held compactly, from the chunk that computes them to the answer.

A request that scores its prompt holds an entry per prompt token until its answer is written. Pinned with
tracemalloc over a real batcher: what the finished result holds for its prompt's entries, per scored token,
is within twice the numbers' own bytes (`12 + 8 * top`: a 32-bit token, log-probability and rank, and `top`
32-bit id and log-probability pairs; twice leaves room for the arrays' growth and their headers), where
Python objects took about 2.5 KB. And the entries read back as the same `TokenLogprob`s, up to the
arithmetic, whether the prompt is scored in one chunk or several, and as a reference forward says.
"""

from __future__ import annotations

import gc
import tracemalloc

import torch
from batch_helpers import spawn
from numerics import TORCH_SOFTMAX_EXP_ULPS, log_softmax_error, logits_tolerance

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.generation_types import GenerationParams
from ferrox_batch.logprobs import MAX_TOP_LOGPROBS
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.kv.paged_kv import model_groups

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


def reference_log_softmax(model, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's raw logits (float32) and their log-softmax (float64), from one forward of the whole
    prompt computed alone."""
    decoder = model.decoder
    groups = len(model_groups(decoder.config).layers)
    store = decoder.new_store(16, num_blocks=groups * (len(prompt) // 16 + 2))
    store.add_sequence(0, len(prompt) + 1)
    _, (logits,) = decoder.forward_every([SeqChunk(0, prompt)], store, [0])
    logits = logits[:, :model.config.vocab_size].detach().float()
    return logits, logits.double().log_softmax(-1)


def test_the_entries_are_the_ones_computed_chunk_by_chunk(tiny_batch_model):
    """Scored whole (one chunk) and 16 tokens at a time, a prompt gets the same entries up to the arithmetic.

    Each side's logits are within `logits_tolerance` of a reference forward's (two float32 forwards that
    round in other places and orders), so its log-probabilities are within twice that (a logit less the
    log-sum-exp, which moves by at most the largest logit's move) plus its own float32 log-softmax's error
    (`log_softmax_error`): `bound` per token. Two sides differ by at most twice `bound`. A rank or a top id may
    differ only where tokens' reference log-probabilities lie within that of each other (a near tie)."""
    prompt = [(5 * i + 1) % 300 for i in range(150)]
    with spawn(tiny_batch_model, CONFIG) as batcher:
        whole = batcher.generate(prompt, GenerationParams(max_tokens=1, prompt_logprobs=3)).prompt_logprobs
    chunked_config = BatcherConfig(kv_block_size=16, kv_blocks=128, prefill_chunk=16, max_batch_tokens=16)
    with spawn(tiny_batch_model, chunked_config) as batcher:
        chunked = batcher.generate(prompt, GenerationParams(max_tokens=1, prompt_logprobs=3)).prompt_logprobs
    assert len(whole) == len(chunked) == len(prompt)
    logits, ref = reference_log_softmax(tiny_batch_model, prompt)
    for i, (a, b) in enumerate(zip(whole[1:], chunked[1:])):
        row, lp, target = logits[i], ref[i], prompt[i + 1]
        scale = float(row.abs().max())
        own = log_softmax_error(lp, scale, exp_ulps=TORCH_SOFTMAX_EXP_ULPS)
        bound = 2 * logits_tolerance(tiny_batch_model.config, i + 1, row) + own  # one side to the reference
        assert a.token == b.token == target
        assert abs(a.logprob - b.logprob) <= float(bound[target]) * 2, (i, a.logprob, b.logprob)
        gap = 2 * float(bound.max())  # how far two tokens' order may move on one side
        ordered = lp.sort(descending=True).values
        for side in (a, b):
            assert abs(side.logprob - float(lp[target])) <= float(bound[target]), (i, side.logprob)
            # The rank counts the tokens likelier than the target: those clearly likelier, and any near tie.
            clearly = int((lp - lp[target] > gap).sum())
            maybe = int((lp - lp[target] >= -gap).sum()) - 1  # less the target itself
            assert 1 + clearly <= side.rank <= 1 + maybe, (i, side.rank, clearly, maybe)
            ids = [t for t, _ in side.top]
            assert len(set(ids)) == len(ids) == 3
            assert all(abs(v - float(lp[t])) <= float(bound[t]) for t, v in side.top), (i, side.top)
            # Each is among the top 3 but for near ties with the third, and every clearly-top-3 token is there.
            assert all(float(lp[t]) >= float(ordered[2]) - gap for t in ids), (i, ids)
            assert set(int(t) for t in (lp > ordered[3] + gap).nonzero().flatten()) <= set(ids), (i, ids)
        if bool((ordered[:3] - ordered[1:4] > gap).all()):  # no near tie among the top: one order
            assert [t for t, _ in a.top] == [t for t, _ in b.top], i
