"""OpenAI fields the server cannot honour yet are a 400 naming them, unless their value asks for nothing.

Each field is tried on the endpoint(s) where OpenAI defines it: a value that asks for the feature is refused
in the server's error shape; null and the one value common clients send when they want nothing (`tools: []`
and `tool_choice: "none"` without tools, `suffix: ""`) are served as if the field were absent.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_helpers import DEADLINE, served, tiny_batcher

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.server.requests import parse_chat_request, parse_completion_request

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BASE = {
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    COMPLETIONS: {"prompt": "Hello", "max_tokens": 1},
}

REFUSED: list[tuple[str, str, Any]] = [
    (COMPLETIONS, "suffix", " and the end."),
]

ACCEPTED: list[tuple[str, str, Any]] = [
    (CHAT, "tools", []),
    (CHAT, "tool_choice", "none"),
    (CHAT, "logprobs", False),
    (COMPLETIONS, "logprobs", False),
    (CHAT, "top_logprobs", 0),
    (COMPLETIONS, "suffix", ""),
] + [(endpoint, field, None) for endpoint, field in
     sorted({(endpoint, field) for endpoint, field, _ in REFUSED})]


def _id(case: tuple[str, str, Any]) -> str:
    return f"{'chat' if case[0] == CHAT else 'completions'}-{case[1]}={case[2]!r}"


@pytest.fixture(scope="module")
def server(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model)) as (base_url, _app):
        yield base_url


@pytest.mark.parametrize("case", REFUSED, ids=_id)
def test_a_field_asking_for_what_the_server_cannot_do_is_400_naming_it(server, case):
    endpoint, field, value = case
    response = httpx.post(f"{server}{endpoint}", json={**BASE[endpoint], field: value}, timeout=DEADLINE)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
    assert error["param"] == field and error["message"].startswith(f"{field} is not supported by this server")


@pytest.mark.parametrize("case", ACCEPTED, ids=_id)
def test_a_value_that_asks_for_nothing_is_served(server, case):
    endpoint, field, value = case
    response = httpx.post(f"{server}{endpoint}", json={**BASE[endpoint], field: value}, timeout=DEADLINE)
    assert response.status_code == 200, response.text


def test_every_harmless_value_at_once_as_clients_send_them():
    harmless = [(endpoint, field, value) for endpoint, field, value in ACCEPTED if value is not None]
    chat = {**BASE[CHAT], **{field: value for endpoint, field, value in harmless if endpoint == CHAT}}
    completions = {**BASE[COMPLETIONS], **{field: value for endpoint, field, value in harmless
                                           if endpoint == COMPLETIONS}}
    assert parse_chat_request(chat, default_max_tokens=4).max_tokens == 1
    assert parse_completion_request(completions, default_max_tokens=4).max_tokens == 1
    with pytest.raises(InvalidRequest) as refused:  # the first refused field is named, the request goes no further
        parse_completion_request({**completions, "suffix": "x"}, default_max_tokens=4)
    assert refused.value.param == "suffix"
