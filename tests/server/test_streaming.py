"""Server-sent events on the wire, refusals before any stream, and client disconnects that free their blocks.

The wire tests read raw SSE with httpx (not the openai client, which would
hide framing mistakes). The disconnect tests use a batcher whose detokenizer
is a `Gate` (one letter per token): the test holds the worker inside a decode
call, disconnects, waits until the server has cancelled the request, then
lets the worker go, so the outcome never depends on timing.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from server_helpers import DEADLINE, MODEL_NAME, gated_batcher, letter_gate, poll, served, stats, tiny_batcher

DISCONNECTS = "ferrox_batch_client_disconnects_total"


@pytest.fixture(scope="module")
def server(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model, max_context=64)) as (base_url, _app):
        yield base_url


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a whole SSE body, checking the framing as it goes."""
    events = []
    for block in response.text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        events.append(block[len("data: "):])
    assert response.text.endswith("\n\n")
    return events


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=DEADLINE)


def test_completion_stream_framing(server):
    response = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 6,
                                                "temperature": 0, "ignore_eos": True, "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    *texts, final, usage = chunks
    assert all(c["choices"][0]["finish_reason"] is None and c["choices"][0]["text"] for c in texts)
    assert final["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 6


def test_chat_stream_framing(server):
    response = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                                                     "temperature": 0, "ignore_eos": True, "stream": True})
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert all("usage" not in c for c in chunks)  # include_usage not set


def test_a_stream_that_ends_at_once_still_has_its_shape(server):
    events = sse_events(post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 0, "stream": True,
                                                         "stream_options": {"include_usage": True}}))
    final, usage = json.loads(events[0]), json.loads(events[1])
    assert final["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens"] == 0
    assert events[2:] == ["[DONE]"]


@pytest.mark.parametrize("body, code", [
    ({"prompt": "word " * 200, "max_tokens": 4}, "context_length_exceeded"),  # refused by submit
    ({"prompt": [1, 2, 100_000], "max_tokens": 4}, "token_out_of_vocab"),  # refused by the worker
])
def test_refusals_come_before_any_stream(server, body, code):
    response = post(server, "/v1/completions", {**body, "stream": True})
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == code


def disconnects(app) -> float:
    return app.state.ferrox.generations.metrics.registry.get_sample_value(DISCONNECTS)


def test_a_client_leaving_mid_stream_frees_its_blocks(tiny_batch_model):
    gate = letter_gate()
    with served(gated_batcher(tiny_batch_model, gate)) as (base_url, app):
        before = stats(base_url)
        gate.hold()
        gate.release(3)  # three tokens go out; the worker then holds inside the fourth decode
        body = {"prompt": "The quick brown fox", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=DEADLINE) as http:
            with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
                assert response.status_code == 200
                # Keep the iterator: dropping it mid-body makes httpcore close the connection.
                lines = response.iter_lines()
                data: list[dict] = []
                while len(data) < 2:
                    line = next(lines)
                    if line.startswith("data: "):
                        data.append(json.loads(line[len("data: "):]))
                assert all(len(d["choices"][0]["text"]) == 1 for d in data)  # one letter per token
                held = stats(base_url)
                assert held["kv_blocks_free"] < held["kv_blocks_total"] and held["aborted"] == before["aborted"]
                assert disconnects(app) == 0
        # The connection is closed: the server notices and cancels the request.
        poll(lambda: disconnects(app) == 1, "the server to cancel the abandoned stream")
        gate.open()
        poll(lambda: stats(base_url)["kv_blocks_free"] == before["kv_blocks_total"], "the blocks to come back")
        after = stats(base_url)
        assert after["aborted"] == before["aborted"] + 1
        metrics = app.state.ferrox.generations.metrics.registry
        # The answer reaches the loop a moment after the worker freed the blocks.
        poll(lambda: metrics.get_sample_value("ferrox_batch_requests_total", {"finish_reason": "cancelled"}) == 1,
             "the cancelled request to be counted")
        assert metrics.get_sample_value("ferrox_batch_generation_tokens_total") < 400


def test_a_client_leaving_a_plain_request_frees_its_blocks(tiny_batch_model):
    gate = letter_gate(permits=0)  # the first decode call holds the worker
    with served(gated_batcher(tiny_batch_model, gate)) as (base_url, app):
        before = stats(base_url)
        body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 400, "ignore_eos": True}).encode()
        host, port = base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=DEADLINE) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            gate.wait_calls(1)  # the request is admitted and generating
        poll(lambda: disconnects(app) == 1, "the server to cancel the abandoned request")
        gate.open()
        poll(lambda: stats(base_url)["kv_blocks_free"] == before["kv_blocks_total"], "the blocks to come back")
        assert stats(base_url)["aborted"] == before["aborted"] + 1


def test_two_hundred_concurrent_streams_run_on_a_bounded_number_of_threads(tiny_batch_model):
    # The worker is held inside its first detokenizer call until all 200 streams are in flight, so the
    # thread count is read while every one of them is open; then each must finish whole.
    import asyncio
    import threading

    from ferrox_batch.server.app import DEFAULT_PREPARE_THREADS

    streams = 200
    gate = letter_gate(permits=0)
    batcher = gated_batcher(tiny_batch_model, gate, kv_blocks=1024, max_batch_tokens=8192,
                            max_prefills_per_tick=256, prefill_chunk=64)
    with served(batcher) as (base_url, app):
        generations = app.state.ferrox.generations
        before = threading.active_count()
        bodies: dict[int, str] = {}

        async def one(client: httpx.AsyncClient, i: int) -> None:
            body = {"model": MODEL_NAME, "prompt": f"request {i}", "max_tokens": 3, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
                assert response.status_code == 200
                bodies[i] = (await response.aread()).decode()

        async def load() -> int:
            limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
            async with httpx.AsyncClient(timeout=6 * DEADLINE, limits=limits) as client:
                tasks = [asyncio.create_task(one(client, i)) for i in range(streams)]
                deadline = asyncio.get_running_loop().time() + 3 * DEADLINE
                while len(generations.in_flight) < streams:
                    assert asyncio.get_running_loop().time() < deadline, "the streams never all got in flight"
                    await asyncio.sleep(0.02)
                peak = threading.active_count()
                gate.open()
                await asyncio.gather(*tasks)
                return peak

        peak = asyncio.run(load())
        # No thread per request: the prepare pool, and a few that neither depends on the load (the
        # client's own resolver threads included).
        assert peak - before <= DEFAULT_PREPARE_THREADS + 8, (before, peak)
        assert sorted(bodies) == list(range(streams))
        for text in bodies.values():
            events = [block[len("data: "):] for block in text.split("\n\n") if block]
            assert events[-1] == "[DONE]"
            texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
            assert len("".join(texts)) == 3  # one letter a token, three tokens
        poll(lambda: stats(base_url)["kv_blocks_free"] == 1024, "every block back")
