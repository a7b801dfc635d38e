"""Stopping drains: no new requests, the ones in flight finish within the drain timeout, the rest are cancelled.

A stop is what SIGTERM does to uvicorn (`server.should_exit`), on a server built as `serve` builds it
(`listener.server_config`, `listener.DrainingServer`). The batcher is held inside a decode call (`Gate`), so a
request stays in flight exactly as long as the test wants. A stream still open at the drain's deadline ends
with an error event naming the drain and `[DONE]`, and the log says it was a drain, with no traceback.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import json
import logging

import httpx
import pytest
import uvicorn
from server_helpers import DEADLINE, MODEL_NAME, gated_batcher, letter_gate, poll

from ferrox_batch.server import create_app
from ferrox_batch.server.http.listener import DEFAULT_DRAIN_TIMEOUT_SECS, DrainingServer, server_config

BODY = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@contextlib.contextmanager
def listening(app, **options) -> Iterator[tuple[str, uvicorn.Server, threading.Thread]]:
    config = server_config(app, host="127.0.0.1", port=0, log_level="warning", log_config=None, access_log=False,
                           **options)
    server = DrainingServer(config, on_deadline=app.state.ferrox.generations.end_in_flight)
    thread = threading.Thread(target=server.run, name="test-drain-uvicorn", daemon=True)
    thread.start()
    poll(lambda: server.started or not thread.is_alive(), "uvicorn to start")
    assert server.started
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server, thread
    finally:
        server.should_exit = True
        thread.join(DEADLINE)
        assert not thread.is_alive(), "uvicorn did not stop"


def refuses_connections(base_url: str) -> bool:
    host, port = base_url.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return False
    except OSError:
        return True


def test_a_request_in_flight_finishes_within_the_drain_timeout_and_new_ones_are_refused(tiny_batch_model):
    gate = letter_gate(permits=0)
    batcher = gated_batcher(tiny_batch_model, gate)
    try:
        app = create_app(batcher, model_name=MODEL_NAME)
        with listening(app, drain_timeout=DEADLINE) as (base_url, server, thread), \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(httpx.post, f"{base_url}/v1/completions", json=BODY, timeout=DEADLINE)
            gate.wait_calls(1)  # admitted, and held inside its first decode
            server.should_exit = True  # SIGTERM
            poll(lambda: refuses_connections(base_url), "the listener to close")
            with pytest.raises(httpx.TransportError):
                httpx.post(f"{base_url}/v1/completions", json=BODY, timeout=DEADLINE)
            assert thread.is_alive()  # still draining: the held request is not cancelled
            gate.open()
            reply = running.result(DEADLINE)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
            thread.join(DEADLINE)
            assert not thread.is_alive()
        assert batcher.stats().aborted == 0
    finally:
        gate.open()
        assert batcher.close(DEADLINE)


def test_a_request_past_the_drain_timeout_is_cancelled(tiny_batch_model):
    gate = letter_gate(permits=0)
    batcher = gated_batcher(tiny_batch_model, gate)
    drain = 0.5
    try:
        app = create_app(batcher, model_name=MODEL_NAME)
        with listening(app, drain_timeout=drain) as (base_url, server, thread), \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(httpx.post, f"{base_url}/v1/completions", json=BODY, timeout=DEADLINE)
            gate.wait_calls(1)
            stopped = time.monotonic()
            server.should_exit = True
            thread.join(DEADLINE)
            assert not thread.is_alive() and time.monotonic() - stopped >= drain  # it waited out the drain
            refused = running.result(DEADLINE)  # told why, with the error's own status
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            assert refused.headers["retry-after"] == "1"
        gate.open()  # the worker leaves its decode and sees the cancellation
        poll(lambda: batcher.stats().aborted == 1, "the request to be cancelled in the batcher")
        poll(lambda: batcher.stats().kv_blocks_free == batcher.stats().kv_blocks_total, "its blocks to be freed")
    finally:
        gate.open()
        assert batcher.close(DEADLINE)


def test_the_drain_timeout_must_be_a_non_negative_number_of_seconds(tiny_batch_model):
    app = object()
    for bad in (-1, float("nan"), float("inf"), "5", True):
        with pytest.raises(ValueError, match="drain_timeout"):
            server_config(app, host="127.0.0.1", port=0, drain_timeout=bad)
    assert server_config(app, host="127.0.0.1", port=0).timeout_graceful_shutdown == DEFAULT_DRAIN_TIMEOUT_SECS


def test_a_stream_open_at_the_drain_deadline_ends_with_an_error_event_and_done(tiny_batch_model, caplog):
    caplog.set_level(logging.INFO)
    gate = letter_gate(permits=1)  # the first token's text goes out, then the worker is held
    batcher = gated_batcher(tiny_batch_model, gate)
    drain = 0.5
    try:
        app = create_app(batcher, model_name=MODEL_NAME)
        with listening(app, drain_timeout=drain) as (base_url, server, thread), \
                concurrent.futures.ThreadPoolExecutor(1) as pool:

            def read() -> list[str]:
                with httpx.stream("POST", f"{base_url}/v1/completions", json={**BODY, "stream": True,
                                  "max_tokens": 8}, timeout=DEADLINE) as response:
                    assert response.status_code == 200
                    return [line for line in response.iter_lines() if line]

            reading = pool.submit(read)
            gate.wait_calls(2)  # its first token streamed, and the worker held in the next decode
            server.should_exit = True
            lines = reading.result(DEADLINE)
            thread.join(DEADLINE)
            assert not thread.is_alive()
        assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"]  # text went out first
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down" and f"{drain:g} s" in error["message"]
        gate.open()
        poll(lambda: batcher.stats().aborted == 1, "the request to be cancelled in the batcher")
        poll(lambda: batcher.stats().kv_blocks_free == batcher.stats().kv_blocks_total, "its blocks to be freed")
    finally:
        gate.open()
        assert batcher.close(DEADLINE)
    assert not [r for r in caplog.records if r.exc_info], "a drain is no failure: no traceback"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "nor an error"
    said = [r.getMessage() for r in caplog.records if r.name.startswith("ferrox_batch.server")]
    assert any("draining" in line for line in said) and any("drain timeout" in line for line in said), said
