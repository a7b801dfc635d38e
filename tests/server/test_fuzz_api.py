"""Fuzzing every route of the server: no body, however malformed, gets a 5xx or leaves anything held.

Generated bodies go to a real server on the tiny checkpoint (prefix cache on, as when serving). They mix
plausible requests with wrong types, integers at and past every limit (2**63, 2**64, negative ids),
floats at float32's edges, NaN and infinities written as JSON numbers (`NaN`, `Infinity`, `1e999`), lone
surrogates and NUL in strings, deep nesting, large arrays and unknown fields, in the top-level fields and
in the nested ones (messages and their parts, tools and their schemas, `response_format`, `logit_bias`,
`stream_options`). After every example:

* the status is 2xx or 4xx, never 5xx, and every 4xx carries the error shape of its route's API;
* `/health` answers 200 (the worker lives);
* once the server is idle, every KV block is free and nothing waits.

The server runs with small per-request caps (`fuzz_helpers.CAPS`, `server.request_caps`); `test_fuzz_caps`
sends values around and past each of them.

The example budget is fixed per test; under the `ci` profile the draw is derandomized, so a commit's result
is reproducible, and a plain `make test` explores new examples each run.
"""

from __future__ import annotations

import pytest
from fuzz_bodies import CHAT, COMPLETION, DETOKENIZE, EMBEDDINGS, RESPONSES, TOKENIZE, bodies, content_types, post
from fuzz_helpers import FUZZ_SETTINGS, check, fuzzed_server
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def fuzzed(tiny_batch_model):
    with fuzzed_server(tiny_batch_model) as http:
        yield http


#: Bodies that once stopped the worker, always tried first.
KNOWN = [b'{"model": "tiny", "prompt": "' + b"hi " * 40 + b'", "max_tokens": 1, "cache_salt": "\\ud800"}',
         b'{"prompt": [18446744073709551616' + b", 5" * 20 + b'], "max_tokens": 1}']


@FUZZ_SETTINGS
@example(body=KNOWN[0], content_type="application/json")
@example(body=KNOWN[1], content_type="application/json")
@given(body=bodies(COMPLETION, "prompt"), content_type=content_types)
def test_completions_never_answer_5xx_and_hold_nothing(fuzzed, body, content_type):
    post(fuzzed, "/v1/completions", body, content_type)


@FUZZ_SETTINGS
@given(body=bodies(CHAT, "messages"), content_type=content_types)
def test_chat_completions_never_answer_5xx_and_hold_nothing(fuzzed, body, content_type):
    post(fuzzed, "/v1/chat/completions", body, content_type)


@FUZZ_SETTINGS
@given(body=bodies(EMBEDDINGS, "input"), content_type=content_types)
def test_embeddings_never_answer_5xx_and_hold_nothing(fuzzed, body, content_type):
    post(fuzzed, "/v1/embeddings", body, content_type)


@FUZZ_SETTINGS
@given(body=bodies(RESPONSES, "input"), content_type=content_types)
def test_responses_never_answer_5xx_and_hold_nothing(fuzzed, body, content_type):
    post(fuzzed, "/v1/responses", body, content_type)


@FUZZ_SETTINGS
@given(route=st.sampled_from(["/tokenize", "/detokenize"]), tokenize=bodies(TOKENIZE),
       detokenize=bodies(DETOKENIZE, "tokens"), content_type=content_types)
def test_tokenization_never_answers_5xx(fuzzed, route, tokenize, detokenize, content_type):
    post(fuzzed, route, tokenize if route == "/tokenize" else detokenize, content_type)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
       path=st.one_of(st.sampled_from(["/v1/models", "/health", "/metrics", "/stats", "/v1/completions",
                                       "/v1/embeddings", "/v1/responses", "/tokenize", "/nope", "/v1/x%0aFAKE", "/%00", "/v1/models/../stats",
                                       "/v1/messages", "/v1/messages/count_tokens", "/v1/messages/x", "/api/chat",
                                       "/api/generate", "/api/tags", "/api/show", "/api/pull", "/api/nope", "/api"]),
                      st.text(alphabet="abc/%0123456789.", max_size=20).map(lambda p: "/" + p)),
       query=st.one_of(st.just(""), st.text(alphabet="ab=&%0", max_size=10)))
def test_every_route_and_method_answers_without_a_5xx(fuzzed, method, path, query):
    reply = fuzzed.request(method, path + ("?" + query if query else ""), content=b"{}",
                           headers={"Content-Type": "application/json"})
    check(fuzzed, reply)
