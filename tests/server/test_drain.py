"""Stopping drains: no new requests, the ones in flight finish within the drain timeout, the rest are cancelled.

A stop is what SIGTERM does to uvicorn (`server.should_exit`), on a server built as `serve` builds it
(`listener.server_config`). The batcher is held inside a decode call (`Gate`), so a request stays in
flight exactly as long as the test wants.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from server_helpers import DEADLINE, MODEL_NAME, gated_batcher, letter_gate, poll

from ferrox_batch.server import create_app
from ferrox_batch.server.listener import DEFAULT_DRAIN_TIMEOUT_SECS, server_config

BODY = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@contextlib.contextmanager
def listening(app, **options) -> Iterator[tuple[str, uvicorn.Server, threading.Thread]]:
    config = server_config(app, host="127.0.0.1", port=0, log_level="warning", log_config=None, access_log=False,
                           **options)
    server = uvicorn.Server(config)
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
            with contextlib.suppress(httpx.TransportError):  # cut off, or a 500: never a completion
                assert running.result(DEADLINE).status_code != 200
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
