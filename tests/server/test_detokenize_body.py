"""A `/detokenize` body is refused unparsed when its size alone shows it is not a list the id cap takes
(`tokenization.detokenize_body_limit`): every list within the cap, as a JSON writer writes it, fits the
limit; a body past it, padded or long, is a 400 naming `tokens` and the cap, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import DEADLINE, served, tiny_batcher

from ferrox_batch.server.request_caps import RequestCaps
from ferrox_batch.server.openai.tokenization import DETOKENIZE_BODY_SLACK, check_detokenize_body, detokenize_body_limit

CAP = 30


@pytest.fixture(scope="module")
def server(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model), request_caps=RequestCaps(max_tokenization_ids=CAP)) as (base_url, _app):
        yield base_url


@settings(max_examples=50, deadline=None)
@given(cap=st.integers(1, 300), data=st.data())
def test_every_list_within_the_cap_fits_the_body_limit(tiny_batch_model, cap, data):
    tokenizer = tiny_batch_model.tokenizer
    ids = data.draw(st.lists(st.integers(0, tokenizer.decodable_ids - 1), max_size=cap))
    body = json.dumps({"model": "m" * 64, "tokens": ids}).encode()  # Python's default separators: ", "
    check_detokenize_body(len(body), tokenizer, RequestCaps(max_tokenization_ids=cap))


def test_the_limit_is_the_caps_longest_list_and_the_slack(tiny_batch_model):
    tokenizer = tiny_batch_model.tokenizer
    largest = tokenizer.decodable_ids - 1
    longest = len(json.dumps([largest] * CAP)) - 2 + len(", ")  # the brackets out, one separator in
    assert detokenize_body_limit(tokenizer, RequestCaps(max_tokenization_ids=CAP)) == longest + DETOKENIZE_BODY_SLACK


def test_a_body_past_the_limit_is_refused_unparsed(server, tiny_batch_model):
    limit = detokenize_body_limit(tiny_batch_model.tokenizer, RequestCaps(max_tokenization_ids=CAP))
    padded = b'{"tokens": [1, 2, 3]' + b" " * limit + b"}"  # three ids: only its size is past the limit
    long = json.dumps({"tokens": [5] * 1_000_000}).encode()
    for body in (padded, long):
        answer = httpx.post(server + "/detokenize", content=body, headers={"Content-Type": "application/json"},
                            timeout=DEADLINE)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "tokens" and f"{CAP:,}" in error["message"], error
    fits = httpx.post(server + "/detokenize", json={"tokens": [1, 2, 3]}, timeout=DEADLINE)
    assert fits.status_code == 200, fits.text
