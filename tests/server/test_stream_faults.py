"""A stream that fails after its headers went out ends in-band: an error event, then `[DONE]`, never a cut body.

Once a stream's headers are sent, its status is 200 for good, so a failure can only be told in the body, as
OpenAI's streams tell it: `data: {"error": {...}}` then `data: [DONE]` on the completions and chat endpoints,
an `error` event on the Responses API (whose streams have no `[DONE]`). That holds whether the failure is
the worker's (a detokenizer that raises mid-answer fails that request) or the server's own while it writes
the events (a fault injected into the wire format), on every endpoint and with several choices; the
request is then cancelled, every block comes back and the queue empties, and the server serves on.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import httpx
import pytest
from batch_helpers import identity_decode
from server_helpers import DEADLINE, MODEL_NAME, poll, served, stats

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.server.openai.chat_format import ChatFormat
from ferrox_batch.server.openai.wire_format import CompletionFormat
from ferrox_batch.server.openai.responses_format import ResponseBuilder

#: The token at which the faulty detokenizer raises, counted over the server's life.
FAULTY_TOKEN = 3


class FaultyDecode:
    """One letter per token (`identity_decode`), raising on the `FAULTY_TOKEN`-th token, the first time."""

    def __init__(self) -> None:
        self._count = itertools.count(1)

    def __call__(self, ids: list[int]) -> bytes:
        if next(self._count) == FAULTY_TOKEN:
            raise RuntimeError("the detokenizer failed")
        return identity_decode(ids)


@pytest.fixture(scope="module")
def fault_server(tiny_batch_model):
    batcher = ContinuousBatcher.spawn_with_config(tiny_batch_model.decoder, FaultyDecode(),
                                                  BatcherConfig(kv_block_size=16, kv_blocks=64))
    batcher.tokenizer = tiny_batch_model.tokenizer
    with served(batcher) as (base_url, _app):
        yield base_url


BODIES = {
    "/v1/completions": {"prompt": "The quick brown fox"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say something."}]},
}


def stream(base_url: str, path: str, **fields) -> list[str]:
    """The raw SSE blocks of one streamed request (its status checked: 200, the headers went out)."""
    body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
            **BODIES.get(path, {}), **fields}
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=DEADLINE) as reply:
        assert reply.status_code == 200
        text = reply.read().decode()
    assert text.endswith("\n\n"), text[-200:]
    return [block for block in text.split("\n\n") if block]


def assert_ends_with_an_error_and_done(blocks: list[str]) -> dict:
    assert blocks[-1] == "data: [DONE]", blocks[-3:]
    error = json.loads(blocks[-2].removeprefix("data: "))
    assert set(error) == {"error"} and error["error"]["type"] == "server_error", error
    texts = [json.loads(b.removeprefix("data: ")) for b in blocks[:-2]]
    assert texts and all("choices" in t for t in texts)  # the answer had begun
    return error["error"]


def assert_idle_and_serving(base_url: str) -> None:
    poll(lambda: (s := stats(base_url))["kv_blocks_free"] == s["kv_blocks_total"] and s["queue_depth"] == 0,
         "every block back and the queue empty")
    again = stream(base_url, "/v1/completions", max_tokens=3)
    assert again[-1] == "data: [DONE]" and "error" not in again[-2]


def test_a_worker_fault_mid_stream_ends_with_an_error_event_and_done(fault_server):
    blocks = stream(fault_server, "/v1/completions")
    assert_ends_with_an_error_and_done(blocks)
    assert_idle_and_serving(fault_server)


def fail_on_call(monkeypatch, cls: type, method: str, call: int) -> None:
    """`cls.method` raises on its `call`-th call (over every request while the patch holds)."""
    original = getattr(cls, method)
    count = itertools.count(1)

    def faulty(self, *args, **kwargs):
        if next(count) == call:
            raise RuntimeError(f"{method} failed")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, faulty)


@pytest.mark.parametrize("path, cls, method", [
    ("/v1/completions", CompletionFormat, "stream_chunks"),
    ("/v1/completions", CompletionFormat, "final_chunk"),
    ("/v1/chat/completions", ChatFormat, "stream_chunks"),
    ("/v1/chat/completions", ChatFormat, "closing_chunks"),
])
@pytest.mark.parametrize("n", [1, 2])
def test_a_fault_while_writing_the_events_ends_with_an_error_event_and_done(server, monkeypatch, path, cls,
                                                                            method, n):
    base_url, _batcher = server
    fail_on_call(monkeypatch, cls, method, 2 if method == "stream_chunks" else 1)
    blocks = stream(base_url, path, n=n)
    monkeypatch.undo()
    error = assert_ends_with_an_error_and_done(blocks)
    assert "RuntimeError" in error["message"]
    assert_idle_and_serving(base_url)


def responses_events(base_url: str) -> Iterator[tuple[str, dict]]:
    body = {"model": MODEL_NAME, "input": "Say something.", "max_output_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, timeout=DEADLINE) as reply:
        assert reply.status_code == 200
        text = reply.read().decode()
    for block in text.split("\n\n"):
        if block:
            kind, data = block.split("\n", 1)
            yield kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))


@pytest.mark.parametrize("method", ["feed", "finish"])
def test_a_fault_while_writing_a_responses_stream_ends_with_an_error_event(server, monkeypatch, method):
    base_url, _batcher = server
    fail_on_call(monkeypatch, ResponseBuilder, method, 2 if method == "feed" else 1)
    events = list(responses_events(base_url))
    monkeypatch.undo()
    kind, last = events[-1]
    assert kind == "error" and last["type"] == "error" and "RuntimeError" in last["message"], events[-3:]
    assert last["code"] == "internal_error"  # OpenAI's error event: its type is the event's, `error`
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert events[0][0] == "response.created" and not any(k == "response.completed" for k, _ in events)
    assert_idle_and_serving(base_url)
