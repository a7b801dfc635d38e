"""Speculative decoding by prompt lookup: the same answers in fewer steps.

Pins, on a tiny checkpoint in float32 (whose continuations repeat, so drafts are found and accepted):
every request answers exactly what it answers without speculation, token for token and text for text,
greedy and sampled with a seed, with penalties, `logit_bias`, bad words, `min_tokens`, log-probabilities,
a grammar, stop strings and stop ids, and `max_tokens` falling anywhere inside a draft; drafts are
counted and accepted, and the steps are fewer; streamed chunks still add up to the text; a request
cancelled while it drafts gives every block back; a model with sliding-window layers decodes without
drafts. (The 64-thread storm runs with speculation on too: `scheduler/test_invariants`.)
"""

from __future__ import annotations

import threading

import pytest
import torch
from numerics import logits_tolerance
from tiny_checkpoint import write_tiny_checkpoint

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.generation_types import GenerationParams, SamplingParams
from ferrox_batch.runtime.loading.loader import load_model
from ferrox_batch.structured import StructuredOutput

#: A bound on the tiny checkpoint's logits' magnitude (checked below), which scales their rounding.
LOGIT_SCALE = 50.0
PROMPTS = ["abc abc abc abc abc abc abc abc", "The cat sat on the mat. The cat sat on the", "x y z"]


def batcher(model, k: int, **config) -> ContinuousBatcher:
    return ContinuousBatcher.from_model(model, BatcherConfig(kv_block_size=8, kv_blocks=256, speculative_tokens=k,
                                                             speculative_ngram_min=1, **config))


def answers(model, k: int, params: list[GenerationParams]) -> tuple[list, object]:
    with batcher(model, k) as b:
        out = []
        for prompt in PROMPTS:
            ids = model.tokenizer.encode(prompt)
            out += [b.generate(ids, p) for p in params]
        stats = b.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total and b.store.seq_ids() == []
    return out, stats


PARAMS = [
    GenerationParams(max_tokens=40, ignore_eos=True),
    GenerationParams(max_tokens=30, ignore_eos=True, sampling=SamplingParams(temperature=0.9, top_k=20), seed=4),
    GenerationParams(max_tokens=30, ignore_eos=True, sampling=SamplingParams(repetition_penalty=1.2,
                                                                             logit_bias=((8, 3.0),))),
    GenerationParams(max_tokens=30, ignore_eos=True, logprobs=2, min_tokens=5, stop_token_ids=(8,)),
    GenerationParams(max_tokens=30, ignore_eos=True, sampling=SamplingParams(bad_words_ids=((8, 8),))),
    GenerationParams(max_tokens=30, stop=("ab", "at")),
]


def test_answers_are_the_same_with_and_without_drafts_in_fewer_steps(tiny_batch_model):
    plain, plain_stats = answers(tiny_batch_model, 0, PARAMS)
    drafted, stats = answers(tiny_batch_model, 4, PARAMS)
    for a, b in zip(plain, drafted):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.usage.completion_tokens == b.usage.completion_tokens
        if a.logprobs is not None:  # a drafted position's logits come from a chunk: two float32 forwards
            tolerance = 2 * logits_tolerance(tiny_batch_model.config, 64, torch.tensor([LOGIT_SCALE]))
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.token == y.token and [t for t, _ in x.top] == [t for t, _ in y.top]
                assert abs(x.logprob - y.logprob) <= tolerance
    assert stats.spec_decode_num_drafts > 0 and 0 < stats.spec_decode_num_accepted_tokens
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.decode_steps + stats.spec_decode_num_accepted_tokens == plain_stats.decode_steps


@pytest.mark.parametrize("max_tokens", range(1, 14))
def test_max_tokens_anywhere_inside_a_draft(tiny_batch_model, max_tokens):
    ids = tiny_batch_model.tokenizer.encode(PROMPTS[0])
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True)
    with batcher(tiny_batch_model, 0) as plain, batcher(tiny_batch_model, 6) as drafted:
        assert plain.generate(ids, params).token_ids == drafted.generate(ids, params).token_ids


def test_a_grammar_row_and_concurrent_rows_answer_the_same(tiny_batch_model):
    spec = StructuredOutput.regex("(ab ){2,6}c")
    requests = [(p, GenerationParams(max_tokens=24, ignore_eos=i != 0, structured=spec if i == 0 else None))
                for i, p in enumerate(PROMPTS)]
    results = {}
    for k in (0, 4):
        with batcher(tiny_batch_model, k) as b:
            out: list = [None] * len(requests)

            def one(i: int) -> None:
                prompt, params = requests[i]
                out[i] = b.generate(tiny_batch_model.tokenizer.encode(prompt), params)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            results[k] = [(r.token_ids, r.text) for r in out]
    assert results[0] == results[4]


def test_streamed_chunks_add_up_and_a_cancel_mid_draft_frees_every_block(tiny_batch_model):
    from ferrox_batch.cancel import CancelToken

    ids = tiny_batch_model.tokenizer.encode(PROMPTS[0])
    with batcher(tiny_batch_model, 4) as b:
        pieces: list[str] = []
        result = b.generate_streaming(ids, GenerationParams(max_tokens=40, ignore_eos=True),
                                      b.tokenizer.stop_tokens, pieces.append)
        assert "".join(pieces) == result.text
        token = CancelToken()
        seen: list[str] = []

        def cancel_on_third(text: str) -> None:
            seen.append(text)
            if len(seen) == 3:
                token.cancel()

        cancelled = b.generate_streaming(ids, GenerationParams(max_tokens=200, ignore_eos=True, cancel=token),
                                         b.tokenizer.stop_tokens, cancel_on_third)
        assert cancelled.finish_reason.kind == "cancelled"
        stats = b.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total and b.store.seq_ids() == []
        assert stats.spec_decode_num_drafts > 0


def test_a_sliding_window_model_decodes_without_drafts(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "window", arch="mistral", tie=False, std=0.15, seed=9,
                                   sliding_window=8)
    model = load_model(folder, device="cpu", dtype="float32")
    with batcher(model, 4) as b:
        b.generate(model.tokenizer.encode(PROMPTS[0]), GenerationParams(max_tokens=20, ignore_eos=True))
        assert b.stats().spec_decode_num_drafts == 0


def test_the_logit_scale_bound_holds(tiny_batch_model):
    from ferrox_batch.runtime.kv.batch_inputs import SeqChunk

    for prompt in PROMPTS:
        ids = tiny_batch_model.tokenizer.encode(prompt)
        store = tiny_batch_model.decoder.new_store(8, num_blocks=16)
        store.add_sequence(0, len(ids))
        _, (every,) = tiny_batch_model.decoder.forward_every([SeqChunk(0, ids)], store, [0])
        assert float(every.abs().max()) <= LOGIT_SCALE


@pytest.mark.real_model
def test_the_real_model_answers_the_same_with_drafts(real_model_dir, device):
    """The default model in float32: a code edit that copies its input, a prompt that does not, and a raw
    continuation, with stop strings and `max_tokens` that land inside drafts, greedy, token for token,
    except where two tokens tie to float32's rounding (a drafted position's logits come from a chunk's
    forward, which rounds in another order than a single token's): there the answers may part, and the
    tie is checked to be one."""
    import dataclasses

    from ferrox_batch.runtime.kv.batch_inputs import SeqChunk

    model = load_model(real_model_dir, device=device, dtype="float32")
    code = ("def total(items):\n    result = 0\n    for item in items:\n        result += item.price * item.count\n"
            "    return result\n")
    prompts = [model.tokenizer.encode_chat([{"role": "user", "content": "Rename result to acc and reply with the "
                                             "full code only:\n\n" + code}]),
               model.tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}]),
               model.tokenizer.encode(code + code[:40])]
    params = [GenerationParams(max_tokens=96), GenerationParams(max_tokens=17),
              GenerationParams(max_tokens=60, stop=("count",))]
    jobs = [(p, q) for p in prompts for q in params]
    results = {}
    for k in (0, 6):
        config = dataclasses.replace(BatcherConfig.serving(), speculative_tokens=k, kv_blocks=256)
        with ContinuousBatcher.from_model(model, config) as b:
            results[k] = [b.generate(p, q) for p, q in jobs]
            if k:
                assert b.stats().spec_decode_num_accepted_tokens > 0
    for (prompt, _), plain, drafted in zip(jobs, results[0], results[6]):
        if plain.token_ids == drafted.token_ids:
            assert (plain.text, plain.finish_reason) == (drafted.text, drafted.finish_reason)
            continue
        at = next(i for i, (x, y) in enumerate(zip(plain.token_ids, drafted.token_ids)) if x != y)
        ids = prompt + list(plain.token_ids[:at])
        store = model.decoder.new_store(16, num_blocks=64)
        store.add_sequence(0, len(ids))
        logits = model.decoder.forward([SeqChunk(0, ids)], store)[0]
        top = logits.topk(2).values
        assert float(top[0] - top[1]) <= 2 * logits_tolerance(model.config, len(ids), logits), (at, plain.text)
