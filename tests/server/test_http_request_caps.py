"""Every per-request cost the server's flags price: `allowed_token_ids`' length, the stop list's characters,
the prompt log-probabilities a request asks for, and what `/tokenize` and `/detokenize` answer.

Served here with small caps (`create_app`'s keywords, `serve`'s flags). Pins, for each cap:
* a request past it is a 400 in OpenAI's shape naming the field, whose message states the limit;
* a request at it is served;
* after each refused request the server serves on, and `/stats` shows every block free and nothing queued.
"""

from __future__ import annotations

import httpx
import pytest
from server_helpers import DEADLINE, poll, served, stats, tiny_batcher

from ferrox_batch.request_caps import RequestCaps

CAPS = {"max_allowed_token_ids": 40, "max_stop_chars": 24, "max_prompt_logprobs": 120,
        "max_tokenization_ids": 30, "max_detokenize_bytes": 60}
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BASE = {
    COMPLETIONS: {"prompt": "The quick brown fox", "max_tokens": 2, "temperature": 0},
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0},
}


@pytest.fixture(scope="module")
def server(tiny_batch_model):
    batcher = tiny_batcher(tiny_batch_model)
    with served(batcher, request_caps=RequestCaps(**CAPS)) as (base_url, _app):
        yield base_url, batcher


def refused(base_url: str, route: str, body: dict, field: str, limit: int) -> None:
    response = httpx.post(base_url + route, json=body, timeout=DEADLINE)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert f"{limit:,}" in error["message"] or str(limit) in error["message"], error
    assert len(response.content) < 2000, "the error quotes the value shortened"
    still_serving(base_url)


def still_serving(base_url: str) -> None:
    probe = httpx.post(base_url + COMPLETIONS, json=BASE[COMPLETIONS], timeout=DEADLINE)
    assert probe.status_code == 200, probe.text

    def idle() -> bool:
        now = stats(base_url)
        return now["queue_depth"] == 0 and now["kv_blocks_free"] == now["kv_blocks_total"]

    poll(idle, "every block free and nothing queued")


def served_ok(base_url: str, route: str, body: dict) -> dict:
    response = httpx.post(base_url + route, json=body, timeout=DEADLINE)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_allowed_token_ids_past_the_cap_is_400(server, endpoint):
    base_url, _ = server
    limit = CAPS["max_allowed_token_ids"]
    # Counted as sent: repeats of one id count too, so a list's cost is known before it is read.
    for ids in (list(range(limit + 1)), [7] * (limit + 1), [7] * 800_000):
        refused(base_url, endpoint, {**BASE[endpoint], "allowed_token_ids": ids, "n": 4}, "allowed_token_ids", limit)
    served_ok(base_url, endpoint, {**BASE[endpoint], "allowed_token_ids": list(range(limit)), "n": 4})


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_stop_lists_are_priced_by_their_total_characters(server, endpoint):
    base_url, _ = server
    limit = CAPS["max_stop_chars"]
    refused(base_url, endpoint, {**BASE[endpoint], "stop": ["x" * 13, "y" * 12]}, "stop", limit)
    refused(base_url, endpoint, {**BASE[endpoint], "stop": "z" * (limit + 1)}, "stop", limit)
    served_ok(base_url, endpoint, {**BASE[endpoint], "stop": ["x" * 12, "\u2603" * 12]})


def test_prompt_logprobs_past_the_cap_are_refused_before_any_work(server, tiny_batch_model):
    base_url, batcher = server
    probe = len(tiny_batch_model.tokenizer.encode(BASE[COMPLETIONS]["prompt"]))
    limit = CAPS["max_prompt_logprobs"]
    prompt = list(range(1, 21))  # 19 scored tokens
    before = batcher.stats().prefill_tokens
    # 19 tokens x (5 + 1) = 114 entries fit; with 6 alternatives, 133 do not; two choices, 228 do not.
    refused(base_url, COMPLETIONS, {**BASE[COMPLETIONS], "prompt": prompt, "prompt_logprobs": 6},
            "prompt_logprobs", limit)
    refused(base_url, COMPLETIONS, {**BASE[COMPLETIONS], "prompt": prompt, "prompt_logprobs": 5, "n": 2},
            "prompt_logprobs", limit)
    refused(base_url, COMPLETIONS, {**BASE[COMPLETIONS], "prompt": prompt, "echo": True, "logprobs": 6},
            "logprobs", limit)
    assert batcher.stats().prefill_tokens - before == 3 * probe, "only the probes' prompts ran"
    body = served_ok(base_url, COMPLETIONS, {**BASE[COMPLETIONS], "prompt": prompt, "prompt_logprobs": 5})
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)


def test_detokenize_is_bounded_in_ids_and_in_text(server, tiny_batch_model):
    base_url, _ = server
    tokenizer = tiny_batch_model.tokenizer
    limit = CAPS["max_tokenization_ids"]
    refused(base_url, "/detokenize", {"tokens": [5] * (limit + 1)}, "tokens", limit)
    refused(base_url, "/detokenize", {"tokens": [5] * 1_000_000}, "tokens", limit)
    longest = max(range(tokenizer.vocab_size), key=lambda i: len(tokenizer.decode([i])))
    size = len(tokenizer.decode([longest]))
    many = CAPS["max_detokenize_bytes"] // size + 1
    assert many <= limit
    refused(base_url, "/detokenize", {"tokens": [longest] * many}, "tokens", CAPS["max_detokenize_bytes"])
    fits = [longest] * (CAPS["max_detokenize_bytes"] // size)
    assert served_ok(base_url, "/detokenize", {"tokens": fits})["prompt"] == tokenizer.decode_text(fits)


def test_tokenize_answers_at_most_the_cap(server, tiny_batch_model):
    base_url, _ = server
    limit = CAPS["max_tokenization_ids"]
    tokenizer = tiny_batch_model.tokenizer
    words = "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 4
    assert len(tokenizer.encode(words)) > limit
    refused(base_url, "/tokenize", {"prompt": words, "return_token_strs": True}, "prompt", limit)
    refused(base_url, "/tokenize", {"messages": [{"role": "user", "content": words}]}, "messages", limit)
    short = "a b c"
    assert served_ok(base_url, "/tokenize", {"prompt": short})["count"] == len(tokenizer.encode(short))


@pytest.mark.parametrize("keyword", sorted(CAPS))
def test_a_cap_must_be_a_positive_integer(tiny_batch_model, keyword):
    from ferrox_batch.server import create_app

    batcher = tiny_batcher(tiny_batch_model)
    try:
        for bad in (0, -1, 1.5, True, *(() if keyword == "max_allowed_token_ids" else (None,))):
            with pytest.raises(ValueError, match=keyword):
                RequestCaps(**{keyword: bad})
        with pytest.raises(ValueError, match="request_caps"):
            create_app(batcher, model_name="tiny", request_caps={keyword: 1})
    finally:
        batcher.close(DEADLINE)


def test_a_raised_stop_cap_serves_stop_lists_past_the_library_default(tiny_batch_model):
    from ferrox_batch.stop_limits import DEFAULT_MAX_STOP_CHARS, MAX_STOP_STRING_CHARS

    limit = 2 * DEFAULT_MAX_STOP_CHARS
    count = DEFAULT_MAX_STOP_CHARS // MAX_STOP_STRING_CHARS + 1  # past the default in all, within the raised cap
    stops = [chr(0x4E00 + i) * MAX_STOP_STRING_CHARS for i in range(count)]
    with served(tiny_batcher(tiny_batch_model), request_caps=RequestCaps(max_stop_chars=limit)) as (base_url, _app):
        served_ok(base_url, COMPLETIONS, {**BASE[COMPLETIONS], "stop": stops})
        refused(base_url, COMPLETIONS, {**BASE[COMPLETIONS], "stop": stops * 2}, "stop", limit)
