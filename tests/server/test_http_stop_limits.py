"""The stop limits over HTTP: a `stop` list longer than `MAX_STOPS`, or a stop string longer than
`MAX_STOP_CHARS`, is a 400 in OpenAI's error shape naming `stop`, on both generation endpoints, and the
server keeps serving; a request at both limits is served."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import DEADLINE

from ferrox_batch.stop_limits import MAX_STOP_CHARS, MAX_STOPS

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BASE = {
    COMPLETIONS: {"prompt": "The quick brown fox", "max_tokens": 3, "temperature": 0},
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0},
}

TOO_MANY = [f"never{i}" for i in range(100_000)]
TOO_LONG = "q" * (MAX_STOP_CHARS + 1)


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stop", [TOO_MANY, [f"x{i}" for i in range(MAX_STOPS + 1)], TOO_LONG, ["ok", TOO_LONG]],
                         ids=["100000-stops", "one-too-many", "long-string", "long-entry"])
def test_a_stop_past_the_limits_is_400_naming_stop(server, endpoint, stop):
    base_url, _batcher = server
    response = httpx.post(base_url + endpoint, json={**BASE[endpoint], "stop": stop}, timeout=DEADLINE)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "stop", error
    assert len(response.content) < 1000, "the error quotes the value shortened"


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_a_request_at_the_limits_is_served(server, endpoint):
    base_url, _batcher = server
    stop = ["\u2603" * MAX_STOP_CHARS] + [f"never{i}" for i in range(MAX_STOPS - 1)]
    response = httpx.post(base_url + endpoint, json={**BASE[endpoint], "stop": stop}, timeout=DEADLINE)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
