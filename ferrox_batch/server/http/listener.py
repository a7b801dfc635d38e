"""How `serve` listens: the uvicorn settings that bound what one connection may cost, and the drain on stop.

uvicorn's defaults leave a connection's cost open: a request head may be megabytes (its httptools parser
has no cap), may take forever to arrive (slowloris: a connection that sends a byte now and then holds its
socket and its parser state for good), and connections are not capped. `server_config` builds the
`uvicorn.Config` that `serve` runs with, and promises:

* **A head is at most `MAX_HEAD_BYTES`** (request line and headers), else 431 (h11: 400) and the connection
  closes.
* **A head arrives within `head_timeout` seconds**, timed from the connection's start or, on a keep-alive
  connection, from the next request's first byte; else 408 and the connection closes. A connection that
  sends nothing at all is closed the same way. Between requests, `KEEP_ALIVE_SECS` of idleness closes it.
* **Connections are capped** at `connection_cap(max_concurrent_requests)`, above the app's own cap on open
  generation requests, so the app's 503 `server_busy` (OpenAI-shaped, with `Retry-After`) stays the usual
  refusal and uvicorn's plain 503 only meets a flood of connections.
* **Stopping drains** (`DrainingServer`). On SIGTERM, SIGINT or `should_exit`, uvicorn stops listening
  (new connections are refused), closes idle keep-alive connections, and lets requests in flight finish
  for up to `drain_timeout` seconds. Then the app ends what is left itself (`on_deadline`): each request is
  cancelled in the batcher, and its client told why, a stream with a `server_shutting_down` error event and
  `[DONE]`, a plain request with that error's 503. A client that takes nothing of that for `CUT_GRACE_SECS`
  has its connection closed; then the app's shutdown runs. The log says each step as a drain: no request
  task is cancelled under the app, which uvicorn would log as a failure with a traceback.

Both parsers uvicorn may run get the same limits (`PROTOCOLS`): httptools, the faster, when installed, else
h11. Ray Serve's HTTP proxy runs its own uvicorn, which none of this reaches (see docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ferrox_batch.errors import DecodeError
from ferrox_batch.server.http.errors import ServerShuttingDown

log = logging.getLogger("ferrox_batch.server.http")

#: Bytes of request line and headers one request may send.
MAX_HEAD_BYTES = 64 * 1024
#: Seconds a request head may take to arrive whole. Any honest client sends it in one packet; a proxy in
#: front that buffers may take longer, but not this long.
DEFAULT_HEAD_TIMEOUT_SECS = 10.0
#: Seconds an idle keep-alive connection is kept (uvicorn's own default, stated).
KEEP_ALIVE_SECS = 5
#: Seconds a stop lets requests in flight finish before it cancels them. A stream of thousands of tokens
#: must not hold a Ctrl-C for minutes; a deployment that wants in-flight requests to finish sets more
#: (`--drain-timeout`).
DEFAULT_DRAIN_TIMEOUT_SECS = 5.0
#: Seconds the requests ended at the drain's deadline get to send their last event before their connections
#: are closed: a few hundred bytes that any client still reading takes at once.
CUT_GRACE_SECS = 2.0


def _plain_answer(status: bytes, text: bytes) -> bytes:
    """A whole HTTP response that closes its connection (written by the protocol, not the app)."""
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: "
            + str(len(text)).encode() + b"\r\nconnection: close\r\n\r\n" + text)


_TIMED_OUT = _plain_answer(b"408 Request Timeout", b"the request head did not arrive in time")
_TOO_LARGE = _plain_answer(b"431 Request Header Fields Too Large", b"the request head is too large")


def connection_cap(max_concurrent_requests: int) -> int:
    """Connections (and requests of any route) uvicorn serves at once before its own plain 503: twice the
    app's open generation requests, at least 64 more, so that every open request has its connection and
    probes, scrapes and idle keep-alive connections still fit beside them."""
    return max(2 * max_concurrent_requests, max_concurrent_requests + 64)


class _HeadDeadline:
    """What both parsers' protocols share: the timer that closes a connection whose head is late.

    The timer is armed while a request head is due (from the connection's start, then from the first byte
    of each next request) and cancelled once the head is complete.
    """

    head_timeout: float = DEFAULT_HEAD_TIMEOUT_SECS
    max_head_bytes: int = MAX_HEAD_BYTES
    _head_timer: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._head_due()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)  # type: ignore[misc]

    def _head_due(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_late)

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            self._head_due()  # a pipelined head behind a response still being sent: its time starts after
            return
        self._refuse(_TIMED_OUT)

    def _refuse(self, answer: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(answer)
            self.transport.close()


def _httptools_protocol() -> type[asyncio.Protocol] | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools is not installed: uvicorn runs h11
        return None

    class HeadLimitedHttpTools(_HeadDeadline, HttpToolsProtocol):
        """httptools with a head deadline and a head size cap (httptools itself has neither)."""

        _head_bytes = 0

        def data_received(self, data: bytes) -> None:
            pending = self._head_timer is not None
            super().data_received(data)
            if self._head_timer is None:
                self._head_bytes = 0
                return
            # The head is still incomplete after this chunk: all of it was head (or began one).
            self._head_bytes = (self._head_bytes if pending else 0) + len(data)
            if self._head_bytes > self.max_head_bytes:
                self._head_arrived()
                self._refuse(_TOO_LARGE)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_due()

        def on_headers_complete(self) -> None:
            self._head_arrived()
            super().on_headers_complete()

    return HeadLimitedHttpTools


class HeadLimitedH11(_HeadDeadline, H11Protocol):
    """h11 with a head deadline (h11 caps the head's size itself: `h11_max_incomplete_event_size`)."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._head_arrived()  # the head is through (or the connection failed and is closing)
        elif self.conn.trailing_data[0]:
            self._head_due()  # part of a head is buffered


def _protocols() -> Mapping[str, type[asyncio.Protocol]]:
    httptools = _httptools_protocol()
    found: dict[str, type[asyncio.Protocol]] = {"h11": HeadLimitedH11}
    if httptools is not None:
        found["httptools"] = httptools
    return MappingProxyType(found)


#: The protocol classes by parser name (read-only); `server_config` picks httptools when it is installed.
PROTOCOLS = _protocols()


def server_config(app: Any, *, host: str, port: int, log_level: str | None = "info",
                  drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_SECS, max_concurrent_requests: int | None = None,
                  head_timeout: float = DEFAULT_HEAD_TIMEOUT_SECS, max_head_bytes: int = MAX_HEAD_BYTES,
                  protocol: str | None = None, **options: Any) -> uvicorn.Config:
    """The `uvicorn.Config` for `app` on `host:port` with the limits above; `options` are more of uvicorn's
    (`lifespan` defaults to "on"). `max_concurrent_requests` is the app's own cap (None: its default)."""
    if isinstance(drain_timeout, bool) or not isinstance(drain_timeout, (int, float)) or \
            not 0 <= drain_timeout < math.inf:
        raise ValueError(f"drain_timeout must be a non-negative, finite number of seconds, got {drain_timeout!r}")
    if isinstance(head_timeout, bool) or not isinstance(head_timeout, (int, float)) or \
            not 0 < head_timeout < math.inf:
        raise ValueError(f"head_timeout must be a positive, finite number of seconds, got {head_timeout!r}")
    if protocol is not None and protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(sorted(PROTOCOLS))}, got {protocol!r}")
    if max_concurrent_requests is None:
        from ferrox_batch.server.app import DEFAULT_MAX_CONCURRENT_REQUESTS

        max_concurrent_requests = DEFAULT_MAX_CONCURRENT_REQUESTS
    base = PROTOCOLS[protocol or ("httptools" if "httptools" in PROTOCOLS else "h11")]
    limited = type(base.__name__, (base,), {"head_timeout": float(head_timeout), "max_head_bytes": max_head_bytes})
    options.setdefault("lifespan", "on")
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=limited,
                          timeout_graceful_shutdown=drain_timeout, timeout_keep_alive=KEEP_ALIVE_SECS,
                          limit_concurrency=connection_cap(max_concurrent_requests),
                          h11_max_incomplete_event_size=max_head_bytes, **options)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose stop ends what the drain timeout leaves with a reason (module docstring).

    `on_deadline(error)` runs on the loop once the drain timeout (the config's `timeout_graceful_shutdown`)
    ran out: it ends every request still in flight with `error` and says how many it ended
    (`Generations.end_in_flight`).
    """

    def __init__(self, config: uvicorn.Config, *, on_deadline: Callable[[DecodeError], int]) -> None:
        super().__init__(config)
        self.on_deadline = on_deadline

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = self.config.timeout_graceful_shutdown
        if drain is None:  # no deadline: uvicorn waits for everything
            await super().shutdown(sockets)
            return
        log.info("draining: %d requests in flight get up to %g s to finish; new connections are refused",
                 len(self.server_state.tasks), drain)
        loop = asyncio.get_running_loop()
        timers = (loop.call_later(drain, self._deadline, drain),
                  loop.call_later(drain + CUT_GRACE_SECS, self._close_connections))
        # uvicorn's own deadline, which cancels request tasks under the app, only past both steps.
        self.config.timeout_graceful_shutdown = drain + 2 * CUT_GRACE_SECS
        try:
            await super().shutdown(sockets)
        finally:
            self.config.timeout_graceful_shutdown = drain
            for timer in timers:
                timer.cancel()

    def _deadline(self, drain: float) -> None:
        ended = self.on_deadline(ServerShuttingDown(drain))
        if ended:
            log.warning("drain timeout of %g s ran out: %d requests still running were cancelled, their clients "
                        "told so", drain, ended)

    def _close_connections(self) -> None:
        connections = list(self.server_state.connections)
        if connections:
            log.warning("drain: closing %d connections whose clients did not take their last event within "
                        "%g s", len(connections), CUT_GRACE_SECS)
        for connection in connections:
            connection.transport.close()
