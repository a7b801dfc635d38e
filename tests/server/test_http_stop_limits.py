"""The stop limits over HTTP: a `stop` list longer than `MAX_STOPS`, or a stop string longer than
`MAX_STOP_STRING_CHARS`, is a 400 in OpenAI's error shape naming `stop`, on both generation endpoints, and the
server keeps serving; a request at both limits is served; a list past the total (`--max-stop-chars`) is
refused by the same check a library caller's `GenerationParams` is held to, in the same words."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import DEADLINE

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.stop_limits import DEFAULT_MAX_STOP_CHARS, MAX_STOP_STRING_CHARS, MAX_STOPS, check_stop_chars

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BASE = {
    COMPLETIONS: {"prompt": "The quick brown fox", "max_tokens": 3, "temperature": 0},
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0},
}

TOO_MANY = [f"never{i}" for i in range(100_000)]
TOO_LONG = "q" * (MAX_STOP_STRING_CHARS + 1)


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
    stop = ["\u2603" * MAX_STOP_STRING_CHARS] + [f"never{i}" for i in range(MAX_STOPS - 1)]
    response = httpx.post(base_url + endpoint, json={**BASE[endpoint], "stop": stop}, timeout=DEADLINE)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_a_stop_list_past_the_total_is_refused_by_the_shared_check(server, endpoint):
    base_url, _batcher = server
    stop = ["\u2603" * MAX_STOP_STRING_CHARS] * (DEFAULT_MAX_STOP_CHARS // MAX_STOP_STRING_CHARS + 1)
    response = httpx.post(base_url + endpoint, json={**BASE[endpoint], "stop": stop}, timeout=DEADLINE)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    with pytest.raises(InvalidRequest) as shared:
        check_stop_chars(stop, DEFAULT_MAX_STOP_CHARS, "--max-stop-chars")
    assert error["param"] == "stop" and error["message"] == str(shared.value), error
