"""`n` and `best_of` over HTTP, through the official `openai` client.

Pins: `n` choices come back with indices 0..n-1 on both endpoints, whole and streamed (each chunk names its
choice, every choice gets its finish reason, the stream's usage counts every choice's tokens and the
prompt once); a seeded request's choices differ from each other and repeat exactly with the same seed;
the choices after the first adopt the first one's prompt blocks from the prefix cache (one prompt
prefill); `best_of` returns the `n` candidates with the highest cumulative log-probability, without
log-probabilities unless asked; bad combinations are 400s naming the field.
"""

from __future__ import annotations

import openai
import pytest
from server_helpers import MODEL_NAME, served, stats, tiny_batcher

from ferrox_batch.server.choices import MAX_CHOICES

PROMPT = "Once upon a time in a land far away, there lived a curious engineer who"
SAMPLED = {"temperature": 1.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_batch_model):
    batcher = tiny_batcher(tiny_batch_model, prefix_cache=True)
    with served(batcher) as (base_url, _app):
        yield base_url, batcher


def test_n_choices_share_one_prompt_prefill_and_are_seeded_per_choice(server, client):
    base_url, batcher = server
    before = stats(base_url)
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=4, seed=7, **SAMPLED)
    after = stats(base_url)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    texts = [c.text for c in reply.choices]
    assert len(set(texts)) > 1, texts  # seeds 7, 8, 9, 10
    prompt_tokens = len(batcher.tokenizer.encode(PROMPT))
    assert reply.usage.prompt_tokens == prompt_tokens and reply.usage.completion_tokens == 4 * 8
    # The three followers each adopted the first choice's full prompt blocks.
    full = (prompt_tokens - 1) // 16 * 16
    assert full > 0 and after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 3 * full
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=4, seed=7, **SAMPLED)
    assert [c.text for c in again.choices] == texts
    alone = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, seed=9, **SAMPLED)
    assert alone.choices[0].text == texts[2]  # choice i draws from seed + i


def test_chat_n_choices_streamed(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, n=3, stream=True, stream_options={"include_usage": True},
                                            seed=1, **SAMPLED)
    text = {0: "", 1: "", 2: ""}
    finished, usage = set(), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1, 2} and all(text.values())
    assert usage is not None and usage.completion_tokens == 3 * 5


def test_best_of_returns_the_likeliest_candidates(client):
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=2, best_of=5, seed=3,
                                      logprobs=0, **SAMPLED)
    candidates = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=5, seed=3,
                                           logprobs=0, **SAMPLED)
    scores = sorted((sum(c.logprobs.token_logprobs) for c in candidates.choices), reverse=True)
    assert [sum(c.logprobs.token_logprobs) for c in reply.choices] == scores[:2]
    assert reply.usage.completion_tokens == 5 * 6  # every candidate generated counts
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=1, best_of=3, **SAMPLED)
    assert len(plain.choices) == 1 and plain.choices[0].logprobs is None


@pytest.mark.parametrize("fields, param", [
    ({"n": 0}, "n"), ({"n": MAX_CHOICES + 1}, "n"), ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": MAX_CHOICES + 1}, "best_of"), ({"best_of": 3, "stream": True}, "best_of"),
])
def test_bad_choice_counts_are_400s_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1, **fields)
    assert bad.value.param == param
