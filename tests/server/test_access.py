"""Operating the server: the API key, CORS, X-Request-Id, and /tokenize and /detokenize.

Pins, through the official `openai` client where it has a call for it and httpx elsewhere:

* with a key, every route but /health and /metrics answers 401 in OpenAI's error shape (code
  `invalid_api_key`, `WWW-Authenticate: Bearer`) to a missing, malformed or wrong key, and serves the
  right one; without a key nothing is asked for;
* CORS is off by default (a preflight is a 405); with allowed origins a preflight from one of them gets
  200 and the allow headers without any key, one from elsewhere gets no allow header, and a 401 still
  carries the CORS headers a browser needs to read it;
* every response carries X-Request-Id: the client's when usable (and then the completion's id is
  `cmpl-<id>` / `chatcmpl-<id>`), a fresh one otherwise;
* /tokenize gives the ids the generation endpoints submit (prompt and messages), its count and the
  context ceiling, token strings on request; /detokenize reads them back; bad input is a 400 naming
  the field.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import GREEDY, MODEL_NAME, served, tiny_batcher

from ferrox_batch.server.http.access import MAX_REQUEST_ID_CHARS, usable_request_id

KEY = "sk-test-5f2c"


@pytest.fixture(scope="module")
def keyed(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model), api_key=KEY, allowed_origins=["https://ui.example"]) as (url, _app):
        yield url


@pytest.fixture(scope="module")
def open_server(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model)) as (url, _app):
        yield url


def test_the_key_guards_every_route_but_health_and_metrics(keyed):
    body = {"prompt": "hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": KEY}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer"},
                    {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Bearer {KEY}x"}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/stats"),
                             ("POST", "/tokenize"), ("GET", "/nowhere")):
            response = httpx.request(method, keyed + path, json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (headers, path, response.text)
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
    for path in ("/health", "/metrics"):
        assert httpx.get(keyed + path, timeout=30).status_code == 200
    with openai.OpenAI(base_url=f"{keyed}/v1", api_key="sk-wrong", max_retries=0, timeout=30) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    with openai.OpenAI(base_url=f"{keyed}/v1", api_key=KEY, max_retries=0, timeout=30) as right:
        assert [m.id for m in right.models.list().data] == [MODEL_NAME]
        reply = right.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, **GREEDY)
        assert reply.usage.completion_tokens == 3


def test_an_open_server_asks_for_no_key_and_has_no_cors(open_server):
    assert httpx.get(open_server + "/v1/models", timeout=30).status_code == 200
    preflight = httpx.options(open_server + "/v1/chat/completions", timeout=30, headers={
        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers


def test_cors_answers_preflights_from_allowed_origins_without_a_key(keyed):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(keyed + "/v1/chat/completions", headers={"Origin": "https://ui.example", **ask},
                            timeout=30)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://ui.example"
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    other = httpx.options(keyed + "/v1/chat/completions", headers={"Origin": "https://evil.example", **ask},
                          timeout=30)
    assert "access-control-allow-origin" not in other.headers
    refused = httpx.get(keyed + "/v1/models", headers={"Origin": "https://ui.example"}, timeout=30)
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == "https://ui.example"
    assert "x-request-id" in refused.headers["access-control-expose-headers"].lower()


def test_request_ids_are_echoed_and_name_the_completion(open_server):
    with openai.OpenAI(base_url=f"{open_server}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        raw = client.completions.with_raw_response.create(
            model=MODEL_NAME, prompt="hello", max_tokens=2, extra_headers={"X-Request-Id": "trace-42"}, **GREEDY)
        assert raw.headers["x-request-id"] == "trace-42" and raw.parse().id == "cmpl-trace-42"
        chat = client.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_headers={"X-Request-Id": "trace-43"}, **GREEDY)
        assert chat.headers["x-request-id"] == "trace-43" and chat.parse().id == "chatcmpl-trace-43"
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
            extra_headers={"X-Request-Id": "trace-44"}, **GREEDY)
        assert {chunk.id for chunk in stream} == {"chatcmpl-trace-44"}
    fresh = httpx.get(open_server + "/v1/models", timeout=30).headers["x-request-id"]
    again = httpx.get(open_server + "/v1/models", timeout=30).headers["x-request-id"]
    assert usable_request_id(fresh) and fresh != again
    for bad in ("x" * (MAX_REQUEST_ID_CHARS + 1), "has space", "tab\tid"):
        replaced = httpx.get(open_server + "/health", headers={"X-Request-Id": bad}, timeout=30)
        assert replaced.headers["x-request-id"] != bad and usable_request_id(replaced.headers["x-request-id"])
    refused = httpx.post(open_server + "/v1/completions", json={"prompt": "hi", "max_tokens": -1},
                         headers={"X-Request-Id": "bad-1"}, timeout=30)
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-1"


def test_tokenize_gives_the_ids_generation_submits_and_detokenize_reads_them_back(open_server, tiny_batch_model):
    tokenizer = tiny_batch_model.tokenizer
    text = "The quick brown fox"
    got = httpx.post(open_server + "/tokenize", json={"prompt": text}, timeout=30).json()
    assert got["tokens"] == tokenizer.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == tiny_batch_model.config.max_position_embeddings and got["token_strs"] is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = httpx.post(open_server + "/tokenize", json={"messages": messages, "return_token_strs": True},
                      timeout=30).json()
    assert chat["tokens"] == tokenizer.encode_chat(messages)
    assert "".join(chat["token_strs"]) == tokenizer.decode_text(chat["tokens"])
    reply = httpx.post(open_server + "/v1/chat/completions", timeout=30,
                       json={"messages": messages, "max_tokens": 1, "temperature": 0}).json()
    assert reply["usage"]["prompt_tokens"] == chat["count"]  # what chat submits is what /tokenize says
    bare = httpx.post(open_server + "/tokenize", json={"messages": messages, "add_generation_prompt": False},
                      timeout=30).json()
    assert chat["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
    back = httpx.post(open_server + "/detokenize", json={"tokens": got["tokens"]}, timeout=30).json()
    assert back == {"prompt": tokenizer.decode_text(got["tokens"])}
    for path, body, field in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 3}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/tokenize", {"messages": "hi"}, "messages"),
                              ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
                              ("/tokenize", {"messages": messages, "continue_final_message": True},
                               "continue_final_message"),
                              ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"), ("/detokenize", [], "body")):
        response = httpx.post(open_server + path, json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (path, body)


def test_the_key_may_come_as_x_api_key(keyed):
    """Anthropic's SDKs send the key as `x-api-key`: it is taken as a bearer token is, and checked alike."""
    body = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
    assert httpx.post(keyed + "/v1/completions", json=body, headers={"x-api-key": KEY}, timeout=30).status_code == 200
    for headers in ({"x-api-key": ""}, {"x-api-key": "sk-wrong"}, {"x-api-key": f"{KEY}x"}):
        response = httpx.post(keyed + "/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 401, (headers, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
