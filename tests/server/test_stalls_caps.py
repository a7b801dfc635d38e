"""No request priced by a per-request cap stalls the others (`stall_probe.assert_no_stall`): beside each
hostile request below, a small greedy completion's latency stays within a bound derived from its latency
alone, the hostile request gets the answer it should, and every block comes back.

Each hostile request is sent at the most its cap allows (a 200: legal, and its cost bounded) and just past it
(a 400 naming the field and the limit), with the server's default caps. The bound for each
is stated from the rows it keeps in flight (`n`, or its prompt's tokens: `stall_probe.bound`):

* `allowed_token_ids` of 800,000 ids with `n: 16` (refused), and of the whole vocabulary with `n: 16`;
* the worst stop list the caps allow (64 strings of 32 characters, sharing no prefix: 2,048 characters),
  one string more, one character more, and 100,000 stop strings (all refused);
* prompt log-probabilities with 20 alternatives over a prompt of `PROMPT_ROWS` tokens, and one row more
  (refused): this module's server sets the cap to that prompt's entries, so that the request at the cap
  is one whose prefill adds no more rows to the probe's steps than the bound counts (the default cap is
  far past the tiny model's context);
* a body nested 5,000 levels deep, `n: 16` with 20 alternatives per token over 200 tokens,
  and four clients at once each sending 1 MB of text to `/tokenize`.

Not here, because they do not stay within the bound yet: a client sending bodies of the server's largest size
back to back (a 4 MiB prompt, or a `/detokenize` of 2^18 ids). Each is bounded (refused by its cap, or
answered within it), but receiving 4 MiB on the event loop and `json.loads` of it in one call that holds the
interpreter put the probe at 4-6x its latency alone on a loaded two-core machine, against the bound of 4.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from server_helpers import served, tiny_batcher
from stall_probe import assert_no_stall

from ferrox_batch.request_caps import DEFAULT_MAX_STOP_CHARS, DEFAULT_MAX_TOKENIZATION_IDS, RequestCaps
from ferrox_batch.stop_limits import MAX_STOPS


PROBE = ("/v1/completions", {"prompt": "hello", "max_tokens": 16, "temperature": 0, "ignore_eos": True})
#: A body just inside the server's 4 MiB limit.
BODY_BYTES = 4 * 1024 * 1024 - 1024
WORDS = "lorem ipsum dolor sit amet " * (BODY_BYTES // 27)


#: The tiny model's context.
CONTEXT = 512
#: The prompt of the prompt log-probabilities request: as many tokens as the rows its prefill step may add to
#: the probe's (`stall_probe.bound`), and the module server's cap, its entries with 20 alternatives.
PROMPT_ROWS = 16
MAX_PROMPT_LOGPROBS = (PROMPT_ROWS - 1) * 21


@pytest.fixture(scope="module")
def http(tiny_batch_model):
    assert tiny_batch_model.config.max_position_embeddings == CONTEXT
    with served(tiny_batcher(tiny_batch_model), request_caps=RequestCaps(max_prompt_logprobs=MAX_PROMPT_LOGPROBS)) as (base_url, _app):
        with httpx.Client(base_url=base_url, timeout=120) as client:
            yield client


def encoded(route: str, body: dict) -> tuple[str, bytes]:
    """A hostile call encoded once (`stall_probe`: a big body is not encoded on every send)."""
    return route, json.dumps(body, separators=(",", ":")).encode()


def sent(answer: httpx.Response) -> dict:
    return json.loads(answer.request.content)


def refused(answer: httpx.Response, field: str, limit: str) -> None:
    """A 400 naming `field`, whose message names `limit`."""
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and limit in error["message"], answer.text


def answered(answer: httpx.Response) -> None:
    assert answer.status_code == 200, answer.text


def both(answers: list[httpx.Response], past: Callable[[httpx.Response], bool]) -> None:
    """Each answer checked: `past(answer)` says whether it was sent past its cap (and checks it); both kinds came."""
    kinds: set[bool] = set()
    for answer in answers:
        kinds.add(past(answer))
    assert kinds == {True, False}, "the attack sent only one kind of request"


def test_allowed_token_ids_with_n_16_stall_no_one(http, tiny_batch_model):
    vocab = tiny_batch_model.config.vocab_size

    forms = [encoded("/v1/completions", {"prompt": "x", "max_tokens": 16, "n": 16, "ignore_eos": True,
                                         "allowed_token_ids": ids})
             for ids in (list(range(vocab)), [k % vocab for k in range(800_000)])]

    def past(answer: httpx.Response) -> bool:
        if len(sent(answer)["allowed_token_ids"]) > vocab:
            refused(answer, "allowed_token_ids", f"{vocab:,}")
            return True
        answered(answer)
        return False

    both(assert_no_stall(http, PROBE, lambda i: forms[i % 2], rows=16), past)


def stops(count: int, chars: int) -> list[str]:
    """`count` stop strings of `chars` characters in all, sharing no prefix (the matcher's worst case), of
    characters the model never writes (so each request runs to its `max_tokens`)."""
    lengths = [chars // count + (k < chars % count) for k in range(count)]
    return ["".join(chr(0x4E00 + 64 * k + j % 64) for j in range(length)) for k, length in enumerate(lengths)]


def test_the_worst_stop_lists_stall_no_one(http):
    lists = [stops(MAX_STOPS, DEFAULT_MAX_STOP_CHARS), stops(MAX_STOPS + 1, MAX_STOPS + 1),
             stops(MAX_STOPS, DEFAULT_MAX_STOP_CHARS + 1), [f"stop{i}" for i in range(100_000)]]

    forms = [encoded("/v1/completions", {"prompt": "count to ten", "max_tokens": 32, "n": 16, "ignore_eos": True,
                                         "stop": strings}) for strings in lists]

    def past(answer: httpx.Response) -> bool:
        strings = sent(answer)["stop"]
        if sum(map(len, strings)) > DEFAULT_MAX_STOP_CHARS:  # checked first: its total is known unread
            refused(answer, "stop", f"{DEFAULT_MAX_STOP_CHARS:,}")
        elif len(strings) > MAX_STOPS:
            refused(answer, "stop", f"{MAX_STOPS}")
        else:
            answered(answer)
            return False
        return True

    both(assert_no_stall(http, PROBE, lambda i: forms[i % len(forms)], rows=16), past)


def test_the_most_prompt_logprobs_stall_no_one(http):
    prompt = [20 + k % 300 for k in range(PROMPT_ROWS)]

    forms = [encoded("/v1/completions", {"prompt": prompt, "n": n, "max_tokens": 1, "prompt_logprobs": 20})
             for n in (1, 2)]

    def past(answer: httpx.Response) -> bool:
        if sent(answer)["n"] > 1:
            refused(answer, "prompt_logprobs", f"{MAX_PROMPT_LOGPROBS:,}")
            return True
        answered(answer)
        entries = answer.json()["choices"][0]["prompt_logprobs"]
        assert len(entries) == len(prompt) and all(len(e) >= 20 for e in entries[1:])
        return False

    both(assert_no_stall(http, PROBE, lambda i: forms[i % 2], rows=PROMPT_ROWS), past)


def test_a_deeply_nested_body_stalls_no_one(http):
    deep = ('{"prompt": "x", "max_tokens": 1, "nested": ' + "[" * 5000 + "]" * 5000 + "}").encode()
    for answer in assert_no_stall(http, PROBE, ("/v1/completions", deep)):
        assert answer.status_code == 400, answer.text


def test_n_16_with_20_alternatives_per_token_stalls_no_one(http):
    body = {"prompt": "tell me", "max_tokens": 200, "n": 16, "logprobs": 20, "ignore_eos": True}
    for answer in assert_no_stall(http, PROBE, encoded("/v1/completions", body), rows=16):
        answered(answer)
        assert [len(c["logprobs"]["top_logprobs"]) for c in answer.json()["choices"]] == [200] * 16


def test_a_flood_of_tokenize_calls_stalls_no_one(http):
    for answer in assert_no_stall(http, PROBE, encoded("/tokenize", {"prompt": WORDS[:1_000_000]}), copies=4):
        if answer.status_code != 503:  # past the open tokenizations: busy
            refused(answer, "prompt", f"{DEFAULT_MAX_TOKENIZATION_IDS:,}")
