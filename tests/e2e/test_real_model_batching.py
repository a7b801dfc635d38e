"""The batcher on the real default model (SmolLM2-135M-Instruct): batching leaves greedy answers unchanged.

What this file pins:

* eight chat prompts of different lengths, submitted together from eight
  threads, get token for token the greedy answers each gets when run alone
  through the batcher, and those equal `transformers`' greedy `generate`
  (EOS ignored on both sides so every answer has the same length); the
  prompts are ones whose every greedy step wins by more than float32's
  rounding could move it (checked against `transformers`' logits), so any
  two float32 runs, on any machine, pick the same tokens;
* the streamed chunks of each concurrent answer concatenate to its text;
* a stop string taken from the middle of a known answer cuts the text just
  before its first occurrence, never shows up in the text or the stream,
  and finishes with `FinishReason.stop_sequence(stop)`;
* the model's EOS (`<|im_end|>`) ends a chat answer with `Stop` when EOS is
  not ignored: the answer is the ignore-EOS answer up to that token,
  without it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from batch_helpers import greedy_params, spawn
from numerics import assert_decisive

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.runtime.loading.loader import load_model

pytestmark = pytest.mark.real_model

NEW_TOKENS = 16
JOIN_TIMEOUT = 120.0
QUESTIONS = [
    "What is 2+2?",
    "Write a short poem about autumn leaves.",
    "Explain continuous batching in one sentence.",
    "List three fruits.",
    "Translate 'good morning' into French and Spanish, please, and explain the difference in formality.",
    "hi",
    "Why is the sea salty? Give a short answer that a child could understand, with an example.",
    "Name a prime number larger than 10.",
]


@pytest.fixture(scope="module")
def model(real_model_dir, device):
    return load_model(real_model_dir, device=device, dtype="float32")


@pytest.fixture(scope="module")
def prompts(model):
    out = [model.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len({len(p) for p in out}) >= 6  # varied lengths
    return out


@pytest.fixture(scope="module")
def batcher(model):
    config = BatcherConfig(kv_block_size=16, kv_blocks=256, max_seqs=8)
    with spawn(model, config, decode=model.tokenizer.decode) as b:
        yield b
    assert not b.stats().worker_alive


@pytest.fixture(scope="module")
def alone(batcher, model, prompts):
    """Each prompt run by itself through the batcher, one after another (EOS ignored)."""
    return [batcher.generate(p, greedy_params(NEW_TOKENS, ignore_eos=True), model.tokenizer.stop_tokens) for p in prompts]


def test_eight_concurrent_chat_prompts_get_their_alone_answers(batcher, model, prompts, alone):
    results: dict[int, object] = {}
    chunks: dict[int, list[str]] = {k: [] for k in range(len(prompts))}
    start = threading.Barrier(len(prompts))

    def go(k: int) -> None:
        start.wait(JOIN_TIMEOUT)
        try:
            results[k] = batcher.generate_streaming(
                prompts[k], greedy_params(NEW_TOKENS, ignore_eos=True), model.tokenizer.stop_tokens, chunks[k].append
            )
        except BaseException as error:  # judged below
            results[k] = error

    threads = [threading.Thread(target=go, args=(k,), daemon=True) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
        assert not t.is_alive()
    for k, want in enumerate(alone):
        got = results[k]
        assert isinstance(got, GenerationResult), got
        assert got.finish_reason == FinishReason.LENGTH and len(got.token_ids) == NEW_TOKENS
        assert got.token_ids == want.token_ids, (QUESTIONS[k], got.text, want.text)
        assert got.text == want.text
        assert "".join(chunks[k]) == got.text
    stats = batcher.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.queue_depth == 0


def test_the_alone_answers_equal_transformers_greedy_generate(real_model_dir, model, prompts, alone):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    for k, prompt in enumerate(prompts):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )
        # What makes token-for-token equality (here and between batched and alone runs) a fact of the
        # arithmetic rather than of this machine's rounding.
        assert_decisive([step[0] for step in out.logits], model.config, len(prompt), note=QUESTIONS[k])
        assert tuple(out.sequences[0, len(prompt):].tolist()) == alone[k].token_ids, QUESTIONS[k]


def test_a_stop_string_from_the_middle_of_an_answer_cuts_it_there(batcher, model, prompts, alone):
    k = 2
    full = alone[k].text
    mid = len(full) // 2
    stop = full[mid:mid + 5]
    assert stop.strip(), full
    chunks: list[str] = []
    got = batcher.generate_streaming(
        prompts[k], greedy_params(NEW_TOKENS, stop=[stop], ignore_eos=True), model.tokenizer.stop_tokens, chunks.append
    )
    assert got.finish_reason == FinishReason.stop_sequence(stop)
    assert got.text == full[:full.index(stop)]
    assert stop not in got.text and stop not in "".join(chunks)
    assert "".join(chunks) == got.text
    # The ids run up to (and include) the token whose text completed the stop.
    n = len(got.token_ids)
    assert got.token_ids == alone[k].token_ids[:n]
    assert stop in model.tokenizer.decode_text(got.token_ids)
    assert stop not in model.tokenizer.decode_text(got.token_ids[:-1])


def test_the_models_eos_ends_a_chat_answer_with_stop(batcher, model, prompts, alone):
    stop_tokens = model.tokenizer.stop_tokens
    im_end = model.tokenizer.token_to_id("<|im_end|>")
    assert im_end is not None and im_end in stop_tokens
    k = 0
    ignored = alone[k].token_ids
    end = next(i for i, t in enumerate(ignored) if t in stop_tokens)  # where the ignore-EOS answer ran past EOS
    assert ignored[end] == im_end
    chunks: list[str] = []
    got = batcher.generate_streaming(prompts[k], greedy_params(NEW_TOKENS), stop_tokens, chunks.append)
    assert got.finish_reason == FinishReason.STOP
    assert got.token_ids == ignored[:end]
    assert im_end not in got.token_ids
    assert got.text == model.tokenizer.decode_text(got.token_ids)
    assert "".join(chunks) == got.text
    assert got.usage.completion_tokens == end
