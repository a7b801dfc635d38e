"""`stall_probe.assert_no_stall` can fail: against a fake server whose hostile route holds, while it sleeps, a
lock that the probe's route needs (a real stall), it raises; against one whose hostile route sleeps without
the lock, it passes and returns the hostile answers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from stall_probe import assert_no_stall

#: What the fake probe's work takes, and what a hostile request holds the lock for (ten times as long).
PROBE_S = 0.02
HOSTILE_S = 0.2


def fake_server(hostile_holds_lock: bool) -> ThreadingHTTPServer:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/probe":
                with lock:
                    time.sleep(PROBE_S)
            elif hostile_holds_lock:
                with lock:
                    time.sleep(HOSTILE_S)
            else:
                time.sleep(HOSTILE_S)
            self._answer({"ok": True})

        def do_GET(self) -> None:  # noqa: N802
            self._answer({"kv_blocks_free": 8, "kv_blocks_total": 8, "queue_depth": 0})

        def _answer(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_args: object) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def serving(hostile_holds_lock: bool) -> Iterator[httpx.Client]:
    server = fake_server(hostile_holds_lock)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.server_address[1]}", timeout=30) as client:
            yield client
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture
def stalling() -> Iterator[httpx.Client]:
    yield from serving(True)


@pytest.fixture
def sharing() -> Iterator[httpx.Client]:
    yield from serving(False)


def test_a_hostile_request_that_holds_what_the_probe_needs_fails_the_bound(stalling):
    with pytest.raises(AssertionError, match="probe alone"):
        assert_no_stall(stalling, ("/probe", {}), ("/hostile", {}))


def test_a_hostile_request_that_holds_nothing_the_probe_needs_passes(sharing):
    answers = assert_no_stall(sharing, ("/probe", {}), ("/hostile", {}), copies=2)
    assert len(answers) >= 5 and all(a.status_code == 200 for a in answers)
