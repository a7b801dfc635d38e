"""The relay: a request run through the server's own app in process, and its answer replayed to the client.

No Ray here: the app is the real `create_app` over a tiny batcher, the "replica failure" a stand-in error.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from server_helpers import DEADLINE, MODEL_NAME, gated_batcher, letter_gate, tiny_batcher

from ferrox_batch.deploy.relay import REPLICA_HEADER, InProcessApp, RelayedRequest, relayed_response
from ferrox_batch.server import create_app


class ReplicaGone(Exception):
    """Stands in for Ray's error when a replica's process dies."""


def gone(error: BaseException) -> bool:
    return isinstance(error, ReplicaGone)


def post(path: str, **fields) -> RelayedRequest:
    return RelayedRequest("POST", path, b"", ((b"content-type", b"application/json"),),
                          json.dumps(fields).encode(), ("127.0.0.1", 5000))


async def drive(response, scope_extra: dict | None = None, receive=None) -> tuple[int, dict[str, str], bytes]:
    """Run a Starlette response as a server would; its status, headers and body."""
    sent: list[dict] = []

    async def quiet() -> dict:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, **(scope_extra or {})}
    await response(scope, receive or quiet, send)
    start = sent[0]
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


async def through_relay(app, request: RelayedRequest, replica: str = "r1"):
    relay = InProcessApp(app, replica)
    stream = relay.stream(request)
    return await drive(await relayed_response(stream, gone, lambda: None))


@pytest.fixture
def batcher(tiny_batch_model):
    batcher = tiny_batcher(tiny_batch_model)
    yield batcher
    assert batcher.close(DEADLINE)


def test_the_apps_answer_passes_through_with_the_replica_named(batcher):
    app = create_app(batcher, model_name=MODEL_NAME)
    status, headers, body = asyncio.run(through_relay(
        app, post("/v1/completions", model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0)))
    assert status == 200 and headers[REPLICA_HEADER] == "r1"
    assert json.loads(body)["usage"]["completion_tokens"] <= 4
    assert int(headers["content-length"]) == len(body)


def test_a_stream_passes_through_to_its_done(batcher):
    app = create_app(batcher, model_name=MODEL_NAME)
    status, headers, body = asyncio.run(through_relay(
        app, post("/v1/completions", model=MODEL_NAME, prompt="Hi", max_tokens=3, stream=True,
                  ignore_eos=True, temperature=0)))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) >= 4


def test_the_apps_refusals_keep_their_status_and_retry_after(tiny_batch_model):
    gate = letter_gate(1)  # the first token's text goes out, the second decode is held
    batcher = gated_batcher(tiny_batch_model, gate)
    app = create_app(batcher, model_name=MODEL_NAME, max_concurrent_requests=1)

    async def scenario():
        relay = InProcessApp(app, "r1")
        held = relay.stream(post("/v1/completions", model=MODEL_NAME, prompt="Hi", max_tokens=2, stream=True))
        assert (await anext(held))["status"] == 200  # open, its worker held at the gate
        busy = await through_relay(app, post("/v1/completions", model=MODEL_NAME, prompt="Hi", max_tokens=2))
        gate.open()
        rest = [m async for m in held]
        bad = await through_relay(app, post("/v1/completions", model="other", prompt="Hi"))
        return busy, bad, rest

    try:
        (status, headers, body), bad, rest = asyncio.run(scenario())
        assert status == 503 and headers["retry-after"] == "1", (status, body[:300], rest[:3])
        assert json.loads(body)["error"]["code"] == "server_busy"
        assert bad[0] == 404 and json.loads(bad[2])["error"]["code"] == "model_not_found"
        assert rest[-1]["type"] == "http.response.body" and not rest[-1].get("more_body")
    finally:
        gate.open()
        assert batcher.close(DEADLINE)


def test_closing_the_stream_early_is_a_disconnect_that_frees_the_request(tiny_batch_model):
    gate = letter_gate()
    batcher = gated_batcher(tiny_batch_model, gate)
    app = create_app(batcher, model_name=MODEL_NAME)

    async def scenario():
        stream = InProcessApp(app, "r1").stream(
            post("/v1/completions", model=MODEL_NAME, prompt="Hello", max_tokens=50, stream=True, ignore_eos=True))
        assert (await anext(stream))["status"] == 200
        await stream.aclose()
        gate.open()
        deadline = asyncio.get_running_loop().time() + DEADLINE
        while batcher.stats().aborted < 1 or batcher.stats().kv_blocks_free != batcher.stats().kv_blocks_total:
            assert asyncio.get_running_loop().time() < deadline, batcher.stats()
            await asyncio.sleep(0.02)

    try:
        asyncio.run(scenario())
    finally:
        gate.open()
        assert batcher.close(DEADLINE)


async def _messages(*items) -> AsyncIterator[dict]:
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield item


def _start(content_type: bytes) -> dict:
    return {"type": "http.response.start", "status": 200,
            "headers": [(b"content-type", content_type), (REPLICA_HEADER.encode(), b"r2")]}


def test_a_replica_lost_before_answering_is_a_retryable_503():
    status, headers, body = asyncio.run(drive_relayed(_messages(ReplicaGone("died"))))
    assert status == 503 and headers["retry-after"] == "1"
    assert json.loads(body)["error"]["code"] == "replica_failed"


def test_a_replica_lost_mid_stream_ends_the_event_stream_with_the_error_in_band():
    chunk = {"type": "http.response.body", "body": b'data: {"x":1}\n\n', "more_body": True}
    status, _, body = asyncio.run(drive_relayed(_messages(_start(b"text/event-stream"), chunk, ReplicaGone())))
    events = [e for e in body.decode().split("\n\n") if e]
    assert status == 200 and events[0] == 'data: {"x":1}' and events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "replica_failed" and "r2" in error["message"]


def test_other_errors_are_not_taken_for_a_lost_replica():
    with pytest.raises(ValueError):
        asyncio.run(drive_relayed(_messages(ValueError("a bug"))))


def test_a_client_that_goes_away_cancels_the_replicas_stream():
    cancelled = []

    async def endless() -> AsyncIterator[dict]:
        yield _start(b"text/event-stream")
        await asyncio.Event().wait()
        yield {}

    async def disconnect() -> dict:
        return {"type": "http.disconnect"}

    async def scenario():
        response = await relayed_response(endless(), gone, lambda: cancelled.append(True))
        sent = []

        async def send(message):
            sent.append(message)

        await response({"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}, disconnect, send)

    asyncio.run(asyncio.wait_for(scenario(), DEADLINE))
    assert cancelled == [True]


async def drive_relayed(messages):
    return await drive(await relayed_response(messages, gone, lambda: None))


def test_the_ingress_reads_no_more_of_a_body_than_a_replica_would_accept():
    from starlette.requests import Request

    from ferrox_batch.server.http.errors import RequestTooLarge

    parts = [{"type": "http.request", "body": b"x" * 600, "more_body": True},
             {"type": "http.request", "body": b"y" * 600, "more_body": False}]

    async def receive() -> dict:
        return parts.pop(0)

    async def scenario() -> None:
        scope = post("/v1/completions").scope()
        small = await RelayedRequest.read(Request(dict(scope), receive), max_body_bytes=2000)
        assert small.body == b"x" * 600 + b"y" * 600 and small.path == "/v1/completions"
        parts.extend([{"type": "http.request", "body": b"z" * 1200, "more_body": False}])
        with pytest.raises(RequestTooLarge):
            await RelayedRequest.read(Request(dict(scope), receive), max_body_bytes=1000)

    asyncio.run(scenario())


def test_a_pinned_request_answered_by_another_replica_is_refused():
    messages = _messages(_start(b"application/json"), {"type": "http.response.body", "body": b"{}"})
    cancelled = []

    async def scenario():
        return await drive(await relayed_response(messages, gone, lambda: cancelled.append(True), pinned="r1"))

    status, headers, body = asyncio.run(scenario())
    assert status == 503 and headers["retry-after"] == "1" and cancelled == [True]
    assert json.loads(body)["error"]["code"] == "replica_unavailable"
    assert asyncio.run(drive(asyncio.run(relayed_response(  # the pinned replica's own answer passes
        _messages(_start(b"application/json"), {"type": "http.response.body", "body": b"{}"}), gone,
        lambda: None, pinned="r2"))))[0] == 200


def test_a_plain_body_cut_short_breaks_the_connection_rather_than_ending_normally():
    chunk = {"type": "http.response.body", "body": b'{"partial', "more_body": True}
    with pytest.raises(ReplicaGone):
        asyncio.run(drive_relayed(_messages(_start(b"application/json"), chunk, ReplicaGone())))
