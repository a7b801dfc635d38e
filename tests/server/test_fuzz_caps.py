"""Fuzzing the per-request caps: values around and past each, each a 200 at or under its cap and a 400
naming its field past it, never a 5xx.

The server is the API fuzz's (`fuzz_helpers`: small `CAPS`, `server.request_caps`). Each example is a body
around one cap and within every other: `allowed_token_ids`' length, the stop list's characters, prompt
log-probability entries, `/tokenize`'s and `/detokenize`'s ids and text. After each, the answer passes the
fuzz's `check` (the worker alive, nothing held once idle).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from fuzz_helpers import CAPS, FUZZ_SETTINGS, VOCAB, check, fuzzed_server
from hypothesis import given
from hypothesis import strategies as st

from ferrox_batch.server.request_caps import RequestCaps
from ferrox_batch.server.openai.tokenization import tokenize


@pytest.fixture(scope="module")
def fuzzed(tiny_batch_model):
    with fuzzed_server(tiny_batch_model) as http:
        yield http


def _ids(draw: st.DrawFn, length: int, low: int = 0) -> list[int]:
    """`length` ids in `[low, VOCAB)`: a short drawn pattern repeated (a long list drawn id by id would be
    more data than hypothesis draws for one example)."""
    pattern = draw(st.lists(st.integers(low, VOCAB - 1), min_size=1, max_size=8))
    return (pattern * (length // len(pattern) + 1))[:length]


def _near(cap: int) -> st.SearchStrategy[int]:
    """A count at the cap, just past it, or anywhere from 1 to twice it (each side about as often)."""
    return st.one_of(st.integers(cap - 2, cap), st.integers(cap + 1, cap + 2), st.integers(1, cap),
                     st.integers(cap + 1, 2 * cap))


@st.composite
def around_caps(draw: st.DrawFn) -> tuple[str, dict[str, Any], str, int | None]:
    """(route, body, the field a cap names, what that cap counts for the body (None: to be tokenized)), for
    a body around one cap and within every other."""
    cap = draw(st.sampled_from(["allowed_token_ids", "stop", "prompt_logprobs", "tokenize", "detokenize"]))
    route = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    base: dict[str, Any] = ({"prompt": "The quick brown fox"} if route == "/v1/completions"
                            else {"messages": [{"role": "user", "content": "hi"}]})
    base.update(max_tokens=draw(st.integers(1, 2)), temperature=0)
    if cap == "allowed_token_ids":
        length = draw(_near(CAPS["max_allowed_token_ids"]))
        ids = _ids(draw, length)  # repeats count too
        return route, {**base, "allowed_token_ids": ids, "n": draw(st.integers(1, 3))}, cap, length
    if cap == "stop":
        total = draw(_near(CAPS["max_stop_chars"]))
        count = draw(st.integers(1, 8))
        lengths = [total // count + (i < total % count) for i in range(count)]
        stops = [draw(st.sampled_from(["\u2603", "q", "\ud83d\ude80"])) * n for n in lengths if n]
        return route, {**base, "stop": stops}, cap, total
    if cap == "prompt_logprobs":
        top = draw(st.integers(1, 20))
        rows = draw(st.integers(1, 3))
        scored = min(-(-draw(_near(CAPS["max_prompt_logprobs"])) // ((top + 1) * rows)), 500)  # rounded up
        prompt = _ids(draw, scored + 1)
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "n": rows}
        if draw(st.booleans()):
            return ("/v1/completions", {**body, "prompt_logprobs": top}, "prompt_logprobs",
                    (len(prompt) - 1) * (top + 1) * rows)
        # `echo` scores the prompt with `logprobs`' alternatives (at most 5 here): fewer tokens, more rows.
        prompt = _ids(draw, min(-(-draw(_near(CAPS["max_prompt_logprobs"])) // ((min(top, 5) + 1) * rows)), 500) + 1)
        return ("/v1/completions", {**body, "prompt": prompt, "echo": True, "logprobs": min(top, 5)}, "logprobs",
                (len(prompt) - 1) * (min(top, 5) + 1) * rows)
    if cap == "tokenize":
        words = max(1, draw(_near(CAPS["max_tokenization_ids"])) // 2)  # about two tokens a word
        text = " ".join(draw(st.sampled_from(["a", "bc", "fox", "\u2603"])) for _ in range(words))
        key = draw(st.sampled_from(["prompt", "messages"]))
        body = {"prompt": text} if key == "prompt" else {"messages": [{"role": "user", "content": text}]}
        return "/tokenize", {**body, "return_token_strs": draw(st.booleans())}, key, None
    if draw(st.booleans()):  # around the ids' cap
        length, low = draw(_near(CAPS["max_tokenization_ids"])), 0
    else:  # around the text's: merged tokens, of a few bytes each
        length, low = draw(st.integers(100, 300)), VOCAB - 128
    ids = _ids(draw, length, low)
    return "/detokenize", {"tokens": ids}, "tokens", None


LIMITS = {"allowed_token_ids": "max_allowed_token_ids", "stop": "max_stop_chars", "prompt_logprobs": "max_prompt_logprobs",
          "logprobs": "max_prompt_logprobs"}


@FUZZ_SETTINGS
@given(case=around_caps())
def test_values_around_each_cap_are_served_or_refused_naming_it(fuzzed, tiny_batch_model, case):
    route, body, field, counted = case
    tokenizer = tiny_batch_model.tokenizer
    if route == "/tokenize":  # counted as the endpoint counts, with no cap
        unbounded = RequestCaps(max_tokenization_ids=10**9)
        counted = tokenize(body, tokenizer, SimpleNamespace(limit=lambda: 0), unbounded)["count"]
        over = counted > CAPS["max_tokenization_ids"]
    elif route == "/detokenize":
        over = (len(body["tokens"]) > CAPS["max_tokenization_ids"]
                or tokenizer.decoded_size(body["tokens"]) > CAPS["max_detokenize_bytes"])
    else:
        over = counted > CAPS[LIMITS[field]]
    reply = fuzzed.post(route, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    if over:
        assert reply.status_code == 400, (field, counted, reply.text[:300])
        assert reply.json()["error"]["param"] == field, reply.text[:300]
    else:
        assert reply.status_code == 200, (field, counted, reply.text[:300])
    check(fuzzed, reply)
