"""Small unauthenticated requests that once stopped the worker for good are a 400, and the server serves on.

Each body is sent to a server with the prefix cache on (the serving default), where the worker hashes a
prompt's full blocks with its `cache_salt`: a lone surrogate in the salt, or a prompt id that does not fit
64 bits, raised there and took the worker down (every later request got 500 `worker_died`). Now each is
refused on the caller's side with the OpenAI error shape, and `/health` stays 200.
"""

from __future__ import annotations

import httpx
import pytest
from server_helpers import DEADLINE, served, tiny_batcher

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # several full 16-token blocks

BODIES = {
    "lone surrogate salt": (b'{"model": "tiny", "prompt": "' + PROMPT.encode() +
                            b'", "max_tokens": 1, "cache_salt": "\\ud800"}', "cache_salt"),
    "2**64 prompt id": (b'{"prompt": [18446744073709551616' + b", 5" * 20 + b'], "max_tokens": 1}', "prompt"),
    "2**63 prompt id": (b'{"prompt": [9223372036854775808' + b", 5" * 20 + b'], "max_tokens": 1}', "prompt"),
    "lone surrogate stop": (b'{"prompt": "' + PROMPT.encode() + b'", "max_tokens": 1, "stop": ["\\udc00"]}',
                            "stop"),
}


@pytest.fixture(scope="module")
def cached_server(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model, prefix_cache=True)) as (base_url, _app):
        yield base_url


@pytest.mark.parametrize("name", list(BODIES))
def test_a_body_that_stopped_the_worker_is_a_400_and_the_server_serves_on(cached_server, name):
    body, field = BODIES[name]
    with httpx.Client(base_url=cached_server, timeout=DEADLINE) as http:
        reply = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert field in error["message"] or error.get("param") == field, error
        assert http.get("/health").status_code == 200
        again = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "cache_salt": "fine"})
        assert again.status_code == 200, again.text
        assert http.get("/stats").json()["worker_alive"] is True


@pytest.mark.parametrize("route, body, where", [
    ("/v1/completions", b'{"prompt": "hi \\ud800 there", "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}',
     "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", b'{"prompt": "hi", "\\ud800": 1}', "body"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    # A surrogate written as raw UTF-8 bytes (not valid UTF-8, which `json.loads` still reads as one).
    ("/v1/completions", b'{"prompt": "hi \xed\xa0\x80 there", "max_tokens": 1}', "prompt"),
    ("/tokenize", b'{"prompt": "\xed\xb0\x80"}', "prompt"),
])
def test_a_lone_surrogate_anywhere_in_a_body_is_a_400_naming_where(cached_server, route, body, where):
    with httpx.Client(base_url=cached_server, timeout=DEADLINE) as http:
        reply = http.post(route, content=body, headers={"Content-Type": "application/json"})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == where
        # A valid pair (an emoji written as two escapes) is text like any other.
        fine = http.post("/v1/completions", content=b'{"prompt": "hi \\ud83d\\ude80", "max_tokens": 1}',
                         headers={"Content-Type": "application/json"})
        assert fine.status_code == 200, fine.text
        assert http.get("/health").status_code == 200
