"""What one connection may cost the server: a bounded request head, sent in bounded time, under a connection cap.

Pins, for both HTTP parsers uvicorn may run (httptools when installed, else h11), over raw sockets:

* a connection that sends nothing, or part of a request head, is closed once the head timeout passes
  (with a 408), never before it; a head that arrives in time is served, and so is the next one on the same
  keep-alive connection, whose own head is timed from its first byte;
* a head larger than `MAX_HEAD_BYTES` is refused (431 with httptools, h11's 400) and the connection closed,
  while one just under it is served;
* the connection cap is above the app's own `max_concurrent_requests`, so the app's 503 `server_busy`
  stays the usual refusal, and keep-alive connections idle out.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from server_helpers import DEADLINE, poll

from ferrox_batch.server.http.listener import KEEP_ALIVE_SECS, MAX_HEAD_BYTES, PROTOCOLS, server_config

HEAD_TIMEOUT = 0.5


async def hello(scope, receive, send) -> None:
    assert scope["type"] == "http"
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.contextmanager
def listening(protocol: str) -> Iterator[tuple[str, int]]:
    config = server_config(hello, host="127.0.0.1", port=0, log_level="warning", log_config=None,
                           access_log=False, lifespan="off", head_timeout=HEAD_TIMEOUT, protocol=protocol)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-limits-uvicorn", daemon=True)
    thread.start()
    poll(lambda: server.started or not thread.is_alive(), "uvicorn to start")
    try:
        yield server.servers[0].sockets[0].getsockname()[:2]
    finally:
        server.should_exit = True
        thread.join(DEADLINE)
        assert not thread.is_alive()


def read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(DEADLINE)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def request(path: str = "/", extra: bytes = b"") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode() + extra + b"\r\n"


@pytest.fixture(params=sorted(PROTOCOLS))
def address(request):
    with listening(request.param) as address:
        yield address


def test_a_head_that_does_not_arrive_in_time_closes_the_connection(address):
    for partial in (b"", b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"GE"):
        with socket.create_connection(address, timeout=DEADLINE) as sock:
            opened = time.monotonic()
            sock.sendall(partial)
            answer = read_until_closed(sock)
            assert time.monotonic() - opened >= HEAD_TIMEOUT * 0.9  # timers never fire early
            assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer


def test_a_head_in_time_is_served_and_the_next_heads_clock_starts_at_its_first_byte(address):
    with socket.create_connection(address, timeout=DEADLINE) as sock:
        head = request()
        sock.sendall(head[:10])
        time.sleep(HEAD_TIMEOUT / 4)
        sock.sendall(head[10:])
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(HEAD_TIMEOUT * 1.5)  # idle between requests: the keep-alive timeout's, not the head's
        sock.sendall(request()[:5])
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408")


def test_a_head_past_the_size_cap_is_refused(address):
    with socket.create_connection(address, timeout=DEADLINE) as sock:
        sock.sendall(request(extra=b"X-Big: " + b"a" * (MAX_HEAD_BYTES - 1024) + b"\r\n"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    with socket.create_connection(address, timeout=DEADLINE) as sock:
        big = request(extra=b"X-Big: " + b"a" * (2 * MAX_HEAD_BYTES) + b"\r\n")
        try:
            # In pieces, stopping once the server answers: bytes sent after it closed would reset the
            # connection and drop its answer.
            for start in range(0, len(big), 8192):
                sock.sendall(big[start:start + 8192])
                if select.select([sock], [], [], 0.05)[0]:
                    break
            answer = read_until_closed(sock)
        except ConnectionResetError:  # closed on us all the same: refused, if unread
            answer = b"reset"
        assert answer.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")) or answer == b"reset", answer[:100]
        assert start < len(big) - 8192  # refused before the whole head was sent


def test_the_connection_cap_is_above_the_apps_own_and_keep_alives_idle_out():
    config = server_config(hello, host="127.0.0.1", port=0, max_concurrent_requests=100)
    assert config.limit_concurrency is not None and config.limit_concurrency > 100
    assert config.timeout_keep_alive == KEEP_ALIVE_SECS
    assert server_config(hello, host="127.0.0.1", port=0).limit_concurrency > 1024
