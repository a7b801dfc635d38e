"""OpenAI's streams (Chat Completions and the Responses API) while their first token is slow to come: the
stream begins after the keep-alive interval with SSE comments, one per interval, which the official client
skips, and the answer follows as it would have; a refusal within the interval is still a status."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from server_helpers import DEADLINE, MODEL_NAME, gated_batcher, served
from worker_helpers import Gate

from ferrox_batch.server.openai.responses_format import ResponsesFormat
from ferrox_batch.server.openai.surfaces import SseAnswer
from ferrox_batch.server.openai.wire_format import KEEPALIVE_COMMENT

INTERVAL = 0.05
HELD = 0.4


@pytest.fixture(scope="module")
def setup(tiny_batch_model):
    gate = Gate(permits=None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SseAnswer, "keepalive_interval", INTERVAL)
        patch.setattr(ResponsesFormat, "keepalive_interval", INTERVAL)
        with served(gated_batcher(tiny_batch_model, gate), max_concurrent_requests=1) as (base_url, _app):
            yield base_url, gate


def held(gate: Gate, send) -> tuple[threading.Thread, list]:
    """`send()` run on a thread while the worker is held at its next decode call (the first token)."""
    out: list = []
    calls = gate.calls
    gate.hold()
    thread = threading.Thread(target=lambda: out.append(send()))
    thread.start()
    gate.wait_calls(calls + 1)
    return thread, out


def raw_stream(base_url: str, path: str, body: dict) -> bytes:
    with httpx.stream("POST", base_url + path, json={**body, "stream": True}, timeout=DEADLINE) as response:
        assert response.status_code == 200
        return response.read()


CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
        "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT),
                                        ("/v1/responses", {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 5,
                                                           "temperature": 0, "ignore_eos": True})])
def test_comments_go_out_while_the_first_token_is_held_then_the_same_answer(setup, path, body):
    base_url, gate = setup
    unheld = raw_stream(base_url, path, body)
    assert KEEPALIVE_COMMENT not in unheld
    thread, out = held(gate, lambda: raw_stream(base_url, path, body))
    time.sleep(HELD)
    gate.open()
    thread.join(DEADLINE)
    (got,) = out
    pieces = got.split(b"\n\n")
    comments = [p for p in pieces if p + b"\n\n" == KEEPALIVE_COMMENT]
    assert len(comments) >= 2 and pieces[:len(comments)] == comments  # several intervals, all before any event
    events = [p for p in pieces[len(comments):] if p]
    assert events and all(p.startswith((b"data: ", b"event: ")) for p in events)


def test_the_official_client_reads_a_kept_alive_stream(setup):
    base_url, gate = setup
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=DEADLINE) as client:
        def send() -> str:
            plain = {k: v for k, v in CHAT.items() if k != "ignore_eos"}
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                stream=True, extra_body={"ignore_eos": True}, **plain) if c.choices)

        alone = send()
        thread, out = held(gate, send)
        time.sleep(HELD)
        gate.open()
        thread.join(DEADLINE)
    assert out == [alone] and alone


def test_a_refusal_within_the_interval_is_still_a_status(setup):
    base_url, gate = setup
    thread, _out = held(gate, lambda: raw_stream(base_url, "/v1/chat/completions", CHAT))
    try:
        response = httpx.post(f"{base_url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=DEADLINE)
        assert response.status_code == 503 and response.json()["error"]["code"] == "server_busy"
    finally:
        gate.open()
        thread.join(DEADLINE)
