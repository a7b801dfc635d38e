"""Log-probabilities from the batcher on a tiny checkpoint: the model's own, per token, only when asked.

Pins:
* a request with `logprobs=k` gets one `TokenLogprob` per generated id: the id itself, `log_softmax` of the
  raw logits at that step (a forward of prompt + earlier tokens computed alone, within the float32
  tolerance of two forwards), and the k most likely tokens under that same distribution, most likely first;
* they are taken before every sampling transform: with a repetition penalty and a temperature the
  reported values are still the raw model's;
* streamed chunks carry the entries of the tokens generated since the previous chunk, in order, and
  together with what the final result holds past them they are the result's entries;
* the sampler computes them for the rows that asked only (a batch of both kinds), and a request that did
  not ask gets `None`.
"""

from __future__ import annotations

import threading

import torch
from batch_helpers import greedy_params, spawn
from numerics import logits_tolerance

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.generation_types import GenerationParams, SamplingParams
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.replies import Chunk, Finished
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.sampling.logprobs import prompt_logprobs
from ferrox_batch.runtime.sampling.sampler import BatchSampler
from ferrox_batch.scheduler.sink import QueueSink

PROMPT = [5, 17, 42, 8, 99, 3, 61]


def reference(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The raw logits before each of `tokens`, from one sequence computed alone."""
    decoder = model.decoder
    store = decoder.new_store(16, num_blocks=8)
    store.add_sequence(0, len(prompt) + len(tokens) + 1)
    logits = decoder.forward([SeqChunk(0, prompt)], store)[0]
    out = []
    for token in tokens:
        out.append(logits[: model.config.vocab_size].detach().clone())
        logits = decoder.forward([SeqChunk(0, [token])], store)[0]
    return out


def assert_matches(entries, tokens, want, model, k: int) -> None:
    assert [e.token for e in entries] == list(tokens)
    for i, (entry, logits) in enumerate(zip(entries, want)):
        lp = logits.double().log_softmax(-1)
        # A log-probability is a logit less the log-sum-exp, which moves by at most the logits' largest
        # move: within two logits' tolerance of the reference.
        tolerance = 2 * logits_tolerance(model.config, len(PROMPT) + i, logits)
        assert abs(entry.logprob - float(lp[entry.token])) <= tolerance, (i, entry.logprob, float(lp[entry.token]))
        assert len(entry.top) == k
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        best = lp.topk(k).values.tolist()
        assert all(abs(v - w) <= tolerance for v, w in zip(values, best))
        assert all(abs(v - float(lp[t])) <= tolerance for t, v in entry.top)


def test_a_greedy_request_gets_the_models_logprobs_with_its_top_k(tiny_batch_model):
    params = greedy_params(6, ignore_eos=True, logprobs=4)
    with spawn(tiny_batch_model, BatcherConfig(kv_block_size=16, kv_blocks=32)) as batcher:
        result = batcher.generate(PROMPT, params)
    assert len(result.logprobs) == len(result.token_ids) == 6
    assert_matches(result.logprobs, result.token_ids, reference(tiny_batch_model, PROMPT, list(result.token_ids)),
                   tiny_batch_model, 4)
    assert all(e.top[0][0] == e.token for e in result.logprobs)  # greedy: the sampled token is the likeliest


def test_logprobs_are_taken_before_penalties_and_temperature(tiny_batch_model):
    sampling = SamplingParams(temperature=1.7, repetition_penalty=1.8, presence_penalty=0.5)
    params = GenerationParams(max_tokens=6, sampling=sampling, seed=11, ignore_eos=True, logprobs=2)
    with spawn(tiny_batch_model, BatcherConfig(kv_block_size=16, kv_blocks=32)) as batcher:
        result = batcher.generate(PROMPT, params)
    assert_matches(result.logprobs, result.token_ids, reference(tiny_batch_model, PROMPT, list(result.token_ids)),
                   tiny_batch_model, 2)


def test_streamed_chunks_carry_each_tokens_entry_once_in_order(tiny_batch_model):
    params = greedy_params(8, ignore_eos=True, logprobs=1)
    sink = QueueSink()
    events: list = []
    with spawn(tiny_batch_model, BatcherConfig(kv_block_size=16, kv_blocks=32)) as batcher:
        batcher.submit(PROMPT, params, sink=sink)
        while not events or not isinstance(events[-1], Finished):
            events.append(sink.events.get(timeout=30))
    result = events[-1].result
    streamed = [e for event in events if isinstance(event, Chunk) for e in event.logprobs]
    assert len(result.logprobs) == len(result.token_ids) == 8
    assert streamed and streamed == list(result.logprobs[:len(streamed)])


def test_only_the_rows_that_asked_get_logprobs(tiny_batch_model):
    sampler = BatchSampler(tiny_batch_model.config.vocab_size, "cpu")
    asked = sampler.new_row(SamplingParams(), None, [1, 2], logprobs=3)
    plain = sampler.new_row(SamplingParams(), None, [1, 2])
    logits = torch.randn(3, tiny_batch_model.config.vocab_size, generator=torch.Generator().manual_seed(0))
    out = sampler.sample(logits, [plain, asked, plain])
    assert isinstance(out[0], int) and isinstance(out[2], int)
    assert isinstance(out[1], TokenLogprob) and out[1].token == int(logits[1].argmax()) and len(out[1].top) == 3
    params = greedy_params(3, ignore_eos=True)
    with spawn(tiny_batch_model, BatcherConfig(kv_block_size=16, kv_blocks=32)) as batcher:
        results = {}

        def go(name, p):
            results[name] = batcher.generate(PROMPT, p)

        threads = [threading.Thread(target=go, args=(n, p)) for n, p in
                   (("plain", params), ("asked", greedy_params(3, ignore_eos=True, logprobs=0)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert results["plain"].logprobs is None
    assert [e.top for e in results["asked"].logprobs] == [()] * 3
    assert results["plain"].token_ids == results["asked"].token_ids


def test_prompt_logprobs_are_the_prompts_own_whatever_the_chunking_and_the_cache(tiny_batch_model):
    prompt = [(7 * i + 3) % 300 + 2 for i in range(37)]
    decoder = tiny_batch_model.decoder
    store = decoder.new_store(16, num_blocks=8)
    store.add_sequence(0, len(prompt))
    _, (rows,) = decoder.forward_every([SeqChunk(0, prompt)], store, [0])
    want = [None] + [(t, rows[i].double().log_softmax(-1)[t].item()) for i, t in enumerate(prompt[1:])]
    params = GenerationParams(max_tokens=0, prompt_logprobs=2)
    for config in (BatcherConfig(kv_block_size=16, kv_blocks=32, prefill_chunk=64),
                   BatcherConfig(kv_block_size=16, kv_blocks=32, prefill_chunk=5, prefix_cache=True)):
        with spawn(tiny_batch_model, config) as batcher:
            batcher.generate(prompt, greedy_params(2))  # with the cache on, the prompt is cached now
            result = batcher.generate(prompt, params)
        assert result.token_ids == () and result.finish_reason.kind == "length"
        assert not result.usage.cached_tokens  # a scored prompt is computed whole
        got = result.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for i, (entry, (token, value)) in enumerate(zip(got[1:], want[1:])):
            tolerance = 2 * logits_tolerance(tiny_batch_model.config, i + 1, rows[i])
            assert entry.token == token and abs(entry.logprob - value) <= tolerance
            assert len(entry.top) == 2


def test_a_prompt_token_and_a_sampled_token_get_the_same_entry_from_the_same_logits():
    """Both read one computation (`logprobs.ranked_tensors`): the same logits and token give the same
    log-probability, rank and alternatives, bit for bit, whichever path asked (ties included)."""
    vocab = 50
    logits = torch.randn(4, vocab + 3, generator=torch.Generator().manual_seed(3))  # the lm head's padding past vocab
    logits[2, :vocab] = logits[2, 0]  # every token tied
    logits[3, 7] = logits[3, 11] = logits[3, :vocab].max()  # two tied best
    sampler = BatchSampler(vocab, "cpu")
    for k in (0, 1, 5):
        rows = [sampler.new_row(SamplingParams(), None, [], logprobs=k) for _ in range(4)]
        sampled = sampler.sample(logits, rows)
        targets = [entry.token for entry in sampled]
        scored = prompt_logprobs(logits, targets, k, vocab)
        assert list(scored) == sampled, (k, list(scored), sampled)
