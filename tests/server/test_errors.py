"""Errors keep their meaning over HTTP, bad input is a 4xx that names the problem, and the server keeps serving.

The context ceiling here is 64 positions, so "too long" is cheap to build.
Queue-full uses a batcher held inside a decode call (`Gate`) with one row and
a one-slot queue, so the third request is refused deterministically.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx
import openai
import pytest
from server_helpers import (
    DEADLINE,
    MODEL_NAME,
    gated_batcher,
    letter_gate,
    openai_client,
    poll,
    served,
    stats,
    tiny_batcher,
)

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.server.app import create_app
from ferrox_batch.server.requests import parse_chat_request, parse_completion_request

CONTEXT = 64
MAX_BODY = 1_500_000
OK_BODY = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model, max_context=CONTEXT), max_body_bytes=MAX_BODY) as (base_url, _app):
        yield base_url


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def post(base_url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", timeout=DEADLINE, **kwargs)


def assert_still_serving(base_url: str) -> None:
    response = post(base_url, "/v1/completions", json=OK_BODY)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


#: A 3-token completion for the gated tests: the worker holds it inside its first decode.
HELD_REQUEST = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0,
                "extra_body": {"ignore_eos": True}}

def test_a_prompt_past_the_context_is_400_context_length_exceeded(client):
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 10
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=4, stream=stream)
        assert refused.value.status_code == 400
        assert refused.value.code == "context_length_exceeded"
        assert refused.value.body["positions_limit"] == CONTEXT
        assert refused.value.body["positions"] > CONTEXT
        assert "context_length_exceeded" in refused.value.message


def test_max_tokens_past_the_context_is_clamped(client):
    reply = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=10_000, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == CONTEXT - reply.usage.prompt_tokens
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_completion_tokens": -5}, "max_completion_tokens"),
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -3}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": "a lot"}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "seed": "7"}, "seed"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": ["ok", 1]}, "stop"),
    ({"prompt": "x", "ignore_eos": "no"}, "ignore_eos"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream": True, "stream_options": 5}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": "1"}, "n"),
    ({"prompt": "x", "model": 5}, "model"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", 3]}, "prompt"),
    ({"prompt": [[1], "b"]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": [[1, -1]]}, "prompt[0]"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": "x", "stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ({"prompt": "x", "bad_words": "word"}, "bad_words"),
    ({"prompt": "x", "bad_words": [""]}, "bad_words"),
    ({"prompt": "x", "bad_words": ["w"] * 65}, "bad_words"),
    ({"prompt": "x", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"prompt": "x", "skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"prompt": "x", "spaces_between_special_tokens": 0}, "spaces_between_special_tokens"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "return_token_ids": "yes"}, "return_token_ids"),
    ({"prompt": ["x"] * 33, "best_of": 2}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, 2.5]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
])
def test_bad_completion_fields_are_400_naming_the_field(server, body, param):
    response = post(server, "/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
    assert error["param"] == param and error["message"].startswith(param)


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    (None, "messages"),
    ("hello", "messages"),
    (["hello"], "messages[0]"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": 1, "content": "hi"}], "messages[0].role"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi"}, {"role": "User", "content": "hi"}], "messages[1].role"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
])
def test_bad_messages_are_400_naming_the_field(server, messages, param):
    response = post(server, "/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_unknown_chat_role_is_400_naming_it_and_openais_roles_are_served(server):
    response = post(server, "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages[0].role"
    assert error["message"] == ("messages[0].role must be one of system, developer, user, assistant, tool, "
                                "got 'wizard'")
    for role in ("system", "developer", "user", "assistant", "tool"):
        reply = post(server, "/v1/chat/completions", json={"messages": [{"role": role, "content": "hi"}],
                                                            "max_tokens": 2})
        assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("raw", [b"{", b"", b"[1, 2]", b'"text"', b'{"prompt": "x", "temperature": NaN}',
                                 b"\xff\xfe{}", b"[" * 100_000])
def test_malformed_json_is_400(server, raw):
    response = post(server, "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "body"
    assert len(response.text) < 1000  # the message quotes a short excerpt, never the body


def test_unknown_fields_are_ignored(server):
    body = {**OK_BODY, "user": "me", "frobnicate": [1, 2], "stream_options": None}
    assert post(server, "/v1/completions", json=body).status_code == 200


def test_an_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.code == "model_not_found" and "gpt-4o" in missing.value.message


def test_a_1mb_prompt_is_refused_and_the_server_keeps_serving(server):
    response = post(server, "/v1/completions", json={"prompt": "hello world " * 87_382, "max_tokens": 4})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["positions_limit"] == CONTEXT
    assert len(response.text) < 2000
    assert_still_serving(server)


def test_a_body_over_the_cap_is_413_and_the_server_keeps_serving(server):
    response = post(server, "/v1/completions", json={"prompt": "x" * (MAX_BODY + 10)})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert_still_serving(server)


def test_routing_errors_are_in_the_openai_shape(server):
    missing = httpx.get(f"{server}/v1/nothing", timeout=DEADLINE)
    assert missing.status_code == 404 and "message" in missing.json()["error"]
    wrong_method = httpx.get(f"{server}/v1/completions", timeout=DEADLINE)
    assert wrong_method.status_code == 405 and "message" in wrong_method.json()["error"]
    assert_still_serving(server)


def test_a_full_queue_is_503_with_retry_after(tiny_batch_model):
    gate = letter_gate(permits=0)
    batcher = gated_batcher(tiny_batch_model, gate, max_seqs=1, max_queue=1)
    request = HELD_REQUEST
    with served(batcher) as (base_url, _app), openai_client(base_url) as client, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(client.completions.create, **request)
        gate.wait_calls(1)  # admitted, and holding the worker inside its first decode
        queued = pool.submit(client.completions.create, **request)
        poll(lambda: stats(base_url)["queue_depth"] == 1, "the second request to wait in the queue")
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as busy:
                client.completions.create(**request, stream=stream)
            assert busy.value.status_code == 503 and busy.value.code == "queue_full"
            assert busy.value.response.headers["retry-after"] == "1"
        gate.open()
        assert running.result(DEADLINE).usage.completion_tokens == 3
        assert queued.result(DEADLINE).usage.completion_tokens == 3
        assert stats(base_url)["queue_rejected"] == 2


def test_past_max_concurrent_requests_is_503_server_busy(tiny_batch_model):
    gate = letter_gate(permits=0)
    batcher = gated_batcher(tiny_batch_model, gate)
    request = HELD_REQUEST
    with served(batcher, max_concurrent_requests=2) as (base_url, app), openai_client(base_url) as client, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        open_requests = [pool.submit(client.completions.create, **request) for _ in range(2)]
        gate.wait_calls(1)  # the worker is held inside its first decode
        generations = app.state.ferrox.generations
        poll(lambda: len(generations.in_flight) == 2, "both requests to be submitted")
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as busy:
                client.completions.create(**request, stream=stream)
            assert busy.value.status_code == 503 and busy.value.code == "server_busy"
            assert busy.value.response.headers["retry-after"] == "1"
            assert "2 generation requests are already open (limit 2)" in busy.value.message
        assert stats(base_url)["queue_rejected"] == 0, "refused by the server, never offered to the batcher"
        gate.open()
        assert [f.result(DEADLINE).usage.completion_tokens for f in open_requests] == [3, 3]
        # Answered requests leave the count: the next one is served.
        assert client.completions.create(**request).usage.completion_tokens == 3


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP response from a raw socket: its head and its Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        assert part, f"the server closed the connection after {data!r}"
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        part = sock.recv(65536)
        assert part, "the server closed the connection mid-body"
        body += part
    return head + b"\r\n\r\n" + body


def test_a_busy_server_refuses_before_reading_the_body(tiny_batch_model):
    gate = letter_gate(permits=0)
    batcher = gated_batcher(tiny_batch_model, gate)
    request = HELD_REQUEST
    with served(batcher, max_concurrent_requests=1) as (base_url, app), openai_client(base_url) as client, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.completions.create, **request)
        gate.wait_calls(1)  # the one allowed request is held inside its first decode
        poll(lambda: len(app.state.ferrox.generations.in_flight) == 1, "the request to be in flight")
        host, port = base_url.removeprefix("http://").split(":")
        for path in ("/v1/completions", "/v1/chat/completions"):
            with socket.create_connection((host, int(port)), timeout=DEADLINE) as sock:
                # Headers announce 1,000 bytes; only the first few ever come.
                sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                             "Content-Length: 1000\r\n\r\n{\"prompt\": ".encode())
                response = _read_response(sock)  # a socket timeout here means the server waited for the body
            head, _, body = response.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503"), head
            assert b"retry-after: 1" in head.lower()
            assert json.loads(body)["error"]["code"] == "server_busy"
        gate.open()
        assert running.result(DEADLINE).usage.completion_tokens == 3
        assert client.completions.create(**request).usage.completion_tokens == 3


def test_a_body_that_does_not_arrive_in_time_is_408_and_frees_its_slot(tiny_batch_model):
    timeout = 5.0  # the window in which the busy check below must run, on a loaded machine too
    with served(tiny_batcher(tiny_batch_model), max_concurrent_requests=1, body_read_timeout=timeout) \
            as (base_url, app):
        generations = app.state.ferrox.generations
        host, port = base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=DEADLINE) as sock:
            started = time.monotonic()
            # Headers announce 1,000 bytes; only the first few ever come.
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         "Content-Length: 1000\r\n\r\n{\"prompt\": ".encode())
            poll(lambda: generations._preparing == 1, "the upload to be counted")
            # Meanwhile the upload holds the one slot: everyone else is told the server is busy.
            assert post(base_url, "/v1/completions", json=OK_BODY).status_code == 503
            response = _read_response(sock)  # a socket timeout here means the server kept waiting for the body
            elapsed = time.monotonic() - started
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"] == {"type": "invalid_request_error", "code": "request_timeout",
                                             "message": f"the request body did not arrive within {timeout:g} s"}
        assert timeout <= elapsed < timeout + DEADLINE, elapsed
        assert generations._preparing == 0 and not generations.in_flight
        assert_still_serving(base_url)  # the slot came back
        assert 'reason="request_timeout"' in httpx.get(f"{base_url}/metrics", timeout=DEADLINE).text


def test_the_body_read_timeout_must_be_a_positive_number_of_seconds(tiny_batch_model):
    batcher = tiny_batcher(tiny_batch_model)
    try:
        for bad in (0, -1.5, float("nan"), float("inf"), "5", True, None):
            with pytest.raises(ValueError, match="body_read_timeout must be a positive, finite number of seconds"):
                create_app(batcher, model_name=MODEL_NAME, body_read_timeout=bad)
    finally:
        assert batcher.close(DEADLINE)


class SchedulerBug(BaseException):
    """Escapes every `except Exception` in the worker: stands in for a bug that kills it."""


def test_a_dead_worker_is_500_and_health_says_503(tiny_batch_model):
    def broken_decode(ids):
        raise SchedulerBug("detokenizer exploded")

    batcher = ContinuousBatcher.spawn_with_config(tiny_batch_model.decoder, broken_decode,
                                                  BatcherConfig(kv_block_size=16, kv_blocks=64))
    batcher.tokenizer = tiny_batch_model.tokenizer
    with served(batcher) as (base_url, _app):
        assert httpx.get(f"{base_url}/health", timeout=DEADLINE).status_code == 200
        for _ in range(2):  # the request that met the crash, then one refused at once
            response = post(base_url, "/v1/completions", json={**OK_BODY, "stream": True})
            assert response.status_code == 500 and response.json()["error"]["code"] == "worker_died"
        health = httpx.get(f"{base_url}/health", timeout=DEADLINE)
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert stats(base_url)["worker_alive"] is False


def test_a_failure_outside_the_decode_errors_is_a_500_logged_once(tiny_batch_model, monkeypatch, caplog):
    from ferrox_batch.replies import Finished
    from ferrox_batch.server.http.streaming import ReplyBridge

    def broken_finished(self, outcome):
        # A bug at the seam: no text gets through, and the request's final event reaches the loop as
        # something outside the DecodeError family.
        self._post(self._finish, Finished(RuntimeError("a bug between the batcher and the server")))

    batcher = tiny_batcher(tiny_batch_model)
    with served(batcher) as (base_url, _app):
        monkeypatch.setattr(ReplyBridge, "chunk", lambda self, text: None)
        monkeypatch.setattr(ReplyBridge, "finished", broken_finished)
        for stream in (False, True):
            response = post(base_url, "/v1/completions", json={**OK_BODY, "stream": stream})
            assert response.status_code == 500
            assert response.json()["error"] == {"type": "server_error", "code": "internal_error",
                                                "message": "internal server error (RuntimeError)"}
        monkeypatch.undo()
        assert_still_serving(base_url)
    logged = [r for r in caplog.records if r.exc_info and "a bug between" in str(r.exc_info[1])]
    assert len(logged) == 2, [r.getMessage() for r in logged]  # once per request


def test_a_closed_batcher_is_503_batcher_closed(tiny_batch_model):
    batcher = tiny_batcher(tiny_batch_model)
    with served(batcher) as (base_url, _app):
        assert batcher.close(DEADLINE)
        response = post(base_url, "/v1/completions", json=OK_BODY)
        assert response.status_code == 503 and response.json()["error"]["code"] == "batcher_closed"
        assert httpx.get(f"{base_url}/health", timeout=DEADLINE).status_code == 503


def test_parser_defaults_and_leniencies():
    chat = parse_chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}],
                               "temperature": None, "top_k": -1}, default_max_tokens=1024)
    assert chat.max_tokens == 1024 and chat.messages[0].content == "ab"
    assert chat.options.sampling.temperature == 1.0 and chat.options.sampling.top_k == 0
    completion = parse_completion_request({"prompt": "x", "max_tokens": 5, "max_completion_tokens": 7, "stop": "s",
                                           "stream": True, "stream_options": {"include_usage": True}},
                                          default_max_tokens=16)
    assert completion.max_tokens == 7 and completion.options.stop == ("s",)
    assert completion.stream and completion.include_usage
    assert parse_completion_request({"prompt": [3, 4]}, default_max_tokens=16).max_tokens == 16
