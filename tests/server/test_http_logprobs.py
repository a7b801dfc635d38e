"""Log-probabilities over HTTP, through the official `openai` client, in OpenAI's shapes on both endpoints.

Pins: completions' `logprobs: k` gives `tokens`, `token_logprobs`, `top_logprobs` (k alternatives each) and
increasing `text_offset`, one entry per completion token; chat's `logprobs: true, top_logprobs: k` gives
`content` entries with `token`, `logprob`, `bytes` and k `top_logprobs`; the same request streamed carries
the same entries spread over its chunks; the numbers are the batcher's own; a request without the fields
gets `logprobs: null`; out-of-range values are 400s naming the field.
"""

from __future__ import annotations

import math

import openai
import pytest
from server_helpers import GREEDY, MODEL_NAME

from ferrox_batch.generation_types import GenerationParams
from ferrox_batch.logprobs import MAX_TOP_LOGPROBS

MESSAGES = [{"role": "user", "content": "Tell me about queues."}]


def test_completions_logprobs_in_the_legacy_shape(server, client):
    _, batcher = server
    reply = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=6, logprobs=3,
                                      **GREEDY)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == reply.usage.completion_tokens == 6
    assert all(len(top) <= 3 for top in lp.top_logprobs)  # token strings that coincide share a key
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    direct = batcher.generate(batcher.tokenizer.encode("The quick brown fox"),
                              GenerationParams(max_tokens=6, ignore_eos=True, logprobs=3))
    assert lp.token_logprobs == [e.logprob for e in direct.logprobs]
    assert lp.tokens == [batcher.tokenizer.decode_text([e.token]) for e in direct.logprobs]
    assert all(v <= 0 and math.isfinite(v) for v in lp.token_logprobs)
    plain = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None
    stream = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=6, logprobs=3,
                                       stream=True, **GREEDY)
    parts = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs is not None]
    assert [v for p in parts for v in p.token_logprobs] == lp.token_logprobs
    assert [o for p in parts for o in p.text_offset] == lp.text_offset  # offsets run on from chunk to chunk


def test_chat_logprobs_with_top_logprobs_streamed_and_whole(client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, logprobs=True,
                                           top_logprobs=2, **GREEDY)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, logprobs=True,
                                            top_logprobs=2, stream=True, **GREEDY)
    streamed = [e for chunk in stream for choice in chunk.choices if choice.logprobs is not None
                for e in choice.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    bare = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, logprobs=True,
                                          **GREEDY)
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[], []]


def test_bad_logprobs_fields_are_400s_naming_them(client):
    cases = [(client.completions.create, {"prompt": "hi", "logprobs": MAX_TOP_LOGPROBS + 1}, "logprobs"),
             (client.completions.create, {"prompt": "hi", "logprobs": -1}, "logprobs"),
             (client.chat.completions.create, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
              "top_logprobs"),
             (client.chat.completions.create, {"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
             (client.chat.completions.create, {"messages": MESSAGES, "logprobs": 1}, "logprobs")]
    for create, fields, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            create(model=MODEL_NAME, max_tokens=1, **fields)
        assert bad.value.param == param, fields


def test_echo_returns_the_prompt_with_its_logprobs_first(server, client):
    _, batcher = server
    prompt = "The capital of France is"
    ids = batcher.tokenizer.encode(prompt)
    scored = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                       **GREEDY)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) <= 1 for t in lp.top_logprobs[1:])
    direct = batcher.generate(ids, GenerationParams(max_tokens=0, prompt_logprobs=1))
    assert lp.token_logprobs[1:] == [e.logprob for e in direct.prompt_logprobs[1:]]
    both = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                     **GREEDY)
    assert both.choices[0].text.startswith(prompt) and len(both.choices[0].logprobs.tokens) == len(ids) + 3
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, echo=True, **GREEDY)
    assert plain.choices[0].text == both.choices[0].text and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, echo=True, stream=True)
    assert bad.value.param == "echo"
