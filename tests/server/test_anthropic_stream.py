"""Anthropic streams against a worker the test holds: pings, refusals before the stream, failures in it, thinking.

A gated batcher (one letter per token, its detokenizer held at will) serves with the `deepseek_r1` reasoning
parser, so every answer is thinking. Pins: while the first token is held, `ping` events go out (the
interval shrunk for the test) after `message_start` and before any block; a busy server refuses with 529
`overloaded_error` and `Retry-After` before any stream begins, whether the request streams or not; a
failure after the stream began is an `error` event in Anthropic's shape, last, whether text went out
before it or only pings; thinking is a `thinking` block (`thinking_delta`s, then a `signature_delta`), the
same whole and streamed; a client that leaves while the first token is awaited (before the stream began,
or during its pings) cancels its request; `thinking` with a budget is accepted where a parser reads thinking, and
checked as Anthropic checks it.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import anthropic
import httpx
import pytest
from batch_helpers import identity_decode
from server_helpers import DEADLINE, MODEL_NAME, gated_batcher, poll, served, stats
from worker_helpers import Gate

from ferrox_batch.server.anthropic.answer import MessagesFormat

#: The ping interval the tests run with: short, so that a held first token shows several.
PING = 0.05
HELD = 0.4


class Faulty:
    """One letter per token, raising on the `at`-th call after `arm(at)`."""

    def __init__(self) -> None:
        self.countdown: int | None = None

    def arm(self, at: int) -> None:
        self.countdown = at

    def __call__(self, ids) -> bytes:
        if self.countdown is not None:
            self.countdown -= 1
            if self.countdown == 0:
                self.countdown = None
                raise RuntimeError("the detokenizer failed")
        return identity_decode(ids)


@pytest.fixture(scope="module")
def setup(tiny_batch_model):
    faulty = Faulty()
    gate = Gate(faulty, permits=None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MessagesFormat, "keepalive_interval", PING)
        with served(gated_batcher(tiny_batch_model, gate), reasoning_parser="deepseek_r1",
                    max_concurrent_requests=1) as (base_url, _app):
            yield base_url, gate, faulty, _app


def events_of(base_url: str, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", f"{base_url}/v1/messages", json={**body, "stream": True}, timeout=DEADLINE,
                      headers={"anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200
        raw = response.read().decode()
    pairs = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        pairs.append((lines["event"], json.loads(lines["data"])))
    return pairs


def body(max_tokens: int = 6, **extra) -> dict:
    return {"model": MODEL_NAME, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "Hi"}],
            "ignore_eos": True, "temperature": 0.0, **extra}


def held_stream(base_url: str, gate: Gate, request: dict) -> tuple[threading.Thread, list]:
    """A stream started while the worker is held at its next decode call (the first token)."""
    out: list = []
    calls = gate.calls
    gate.hold()
    thread = threading.Thread(target=lambda: out.extend(events_of(base_url, request)))
    thread.start()
    gate.wait_calls(calls + 1)
    return thread, out


def test_pings_go_out_while_the_first_token_is_held(setup):
    base_url, gate, *_ = setup
    thread, pairs = held_stream(base_url, gate, body())
    time.sleep(HELD)
    gate.open()
    thread.join(DEADLINE)
    names = [name for name, _ in pairs]
    first_block = names.index("content_block_start")
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert set(names[1:first_block]) == {"ping"} and first_block - 1 >= 2  # several intervals were held
    assert "ping" not in names[first_block:]
    assert pairs[first_block][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}


def test_busy_is_a_529_before_any_stream(setup):
    base_url, gate, *_ = setup
    thread, _pairs = held_stream(base_url, gate, body())
    try:
        with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0) as client:
            with pytest.raises(anthropic.OverloadedError) as busy:
                client.messages.create(model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert busy.value.status_code == 529 and busy.value.body["error"]["type"] == "overloaded_error"
        assert busy.value.response.headers["retry-after"] == "1"
        streamed = httpx.post(f"{base_url}/v1/messages", json=body(stream=True), timeout=DEADLINE)
        assert streamed.status_code == 529 and streamed.headers["content-type"] == "application/json"
        assert streamed.json()["error"]["type"] == "overloaded_error"
    finally:
        gate.open()
        thread.join(DEADLINE)


@pytest.mark.parametrize("held", [False, True])
def test_a_failure_once_streaming_is_an_error_event(setup, held):
    base_url, gate, faulty, _app = setup
    if held:  # only pings went out before the failure
        faulty.arm(1)
        thread, pairs = held_stream(base_url, gate, body())
        time.sleep(HELD)
        gate.open()
        thread.join(DEADLINE)
    else:  # text went out before it
        faulty.arm(3)
        pairs = events_of(base_url, body())
    names = [name for name, _ in pairs]
    assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names
    assert pairs[-1][1] == {"type": "error", "error": {"type": "api_error", "message": pairs[-1][1]["error"]["message"]}}
    if held:
        assert set(names[1:-1]) == {"ping"} and len(names) > 3
    else:
        assert "content_block_delta" in names
    again = events_of(base_url, body(max_tokens=2))  # the server serves on
    assert again[-1][0] == "message_stop"


def test_thinking_is_a_thinking_block_whole_and_streamed(setup):
    base_url, *_ = setup
    with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0) as client:
        whole = client.messages.create(model=MODEL_NAME, max_tokens=6, messages=[{"role": "user", "content": "Hi"}],
                                       thinking={"type": "adaptive"}, extra_body={"ignore_eos": True, "temperature": 0})
        with client.messages.stream(model=MODEL_NAME, max_tokens=6, messages=[{"role": "user", "content": "Hi"}],
                                    thinking={"type": "adaptive"},
                                    extra_body={"ignore_eos": True, "temperature": 0}) as stream:
            kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
        counted = client.messages.count_tokens(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                               thinking={"type": "enabled", "budget_tokens": 1024})
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model=MODEL_NAME, max_tokens=1024, messages=[{"role": "user", "content": "Hi"}],
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in whole.content] == ["thinking"] and whole.content[0].signature == ""
    assert len(whole.content[0].thinking) == 6  # one letter per token, all of it thinking
    assert final.content[0].thinking == whole.content[0].thinking
    assert set(kinds[:-1]) == {"thinking_delta"} and kinds[-1] == "signature_delta"
    assert counted.input_tokens > 0
    assert refused.value.body["error"]["message"].startswith("thinking.budget_tokens ")


def disconnects(app) -> float:
    return app.state.ferrox.generations.metrics.registry.get_sample_value("ferrox_batch_client_disconnects_total")


@pytest.mark.parametrize("streaming", [False, True])
def test_a_client_leaving_before_the_first_token_cancels_its_request(setup, monkeypatch, streaming):
    """`streaming`: it leaves during the pings; else within the first interval, before the stream began."""
    base_url, gate, _faulty, app = setup
    if not streaming:
        monkeypatch.setattr(MessagesFormat, "keepalive_interval", DEADLINE)
    before, gone = stats(base_url), disconnects(app)
    raw = json.dumps(body(max_tokens=50, stream=True)).encode()
    host, port = base_url.removeprefix("http://").split(":")
    calls = gate.calls
    gate.hold()
    try:
        with socket.create_connection((host, int(port)), timeout=DEADLINE) as sock:
            sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
            gate.wait_calls(calls + 1)  # admitted, its first token held
            if streaming:
                seen = b""
                while seen.count(b"event: ping") < 2:
                    seen += sock.recv(4096)
                assert b"event: message_start" in seen
        poll(lambda: disconnects(app) == gone + 1, "the server to cancel the abandoned request")
    finally:
        gate.open()
    poll(lambda: stats(base_url)["kv_blocks_free"] == before["kv_blocks_total"], "the blocks to come back")
    assert stats(base_url)["aborted"] == before["aborted"] + 1
