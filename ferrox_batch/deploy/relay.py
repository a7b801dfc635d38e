"""One HTTP request carried from an ingress to a replica and run through the replica's own app.

Why a relay: a router can only place a request by its prompt if it sees the body before it picks a replica,
and an HTTP proxy streams the body after. So the ingress reads the body, hands the whole request
(`RelayedRequest`) to a replica by a call the router inspects, and the replica runs it through the same
FastAPI app `ferrox-batch serve` runs (`InProcessApp`), streaming the ASGI messages back. The ingress
replays them to the client (`relayed_response`). No route, error or stream format lives here: they are
all the app's, so the replicated server answers byte for byte as one process does.

What it promises:

* the response's status, headers (with the replica's name added) and body are the app's own;
* a client that goes away is a disconnect to the app, which cancels its requests in the batcher;
* a replica that fails before answering is a 503 `replica_failed` with `Retry-After` (another replica
  can serve the retry); one that fails mid-stream ends an event stream with that error in-band, as the
  app reports its own failures mid-stream (a plain body cut short breaks the connection instead, since
  its length was promised). Nothing is left waiting either way;
* a request pinned to a replica is answered by that replica or refused (503 `replica_unavailable`).

Pure ASGI and Starlette; nothing here imports Ray.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message

from ferrox_batch.errors import DecodeError
from ferrox_batch.server.app import DEFAULT_MAX_BODY_BYTES
from ferrox_batch.server.http.body import DEFAULT_BODY_READ_TIMEOUT_SECS, read_body
from ferrox_batch.server.http.errors import error_response
from ferrox_batch.server.openai.wire_format import DONE, sse

log = logging.getLogger("ferrox_batch.deploy")

#: The response header naming the replica that answered; sent on a request, it asks the router for that
#: replica (an operator reading one replica's `/stats` or `/metrics` through the ingress).
REPLICA_HEADER = "x-ferrox-replica"
#: Seconds the app gets to finish a request whose client went away (it cancels the request in the batcher
#: at once; this only bounds how long a stuck handler is waited for before it is cancelled).
DISCONNECT_GRACE_SECS = 5.0


class PinnedReplicaUnavailable(DecodeError):
    """A request pinned to a replica (`REPLICA_HEADER`) was answered by another: that replica is not
    running, or the router does not know it yet, or the router is Serve's default, which ignores pins."""

    retry_after_secs = 1
    http_status = 503
    error_code = "replica_unavailable"
    _fields = ("replica", "answered_by")

    def __init__(self, replica: str, answered_by: str) -> None:
        self.replica = replica
        self.answered_by = answered_by
        super().__init__(f"replica {replica} did not take this request (replica {answered_by} did, and its "
                         f"answer was dropped): it is not running, the router does not know it yet, or the "
                         f"router ignores pins (only the affinity router honours them); retry shortly")


class ReplicaFailed(DecodeError):
    """The replica serving the request stopped before it answered: busy, not wrong (503, retry)."""

    retry_after_secs = 1
    http_status = 503
    error_code = "replica_failed"
    _fields = ("replica", "reason")

    def __init__(self, replica: str, reason: str) -> None:
        self.replica = replica
        self.reason = reason
        where = f"replica {replica}" if replica else "the replica serving this request"
        super().__init__(f"{where} stopped before it finished this request ({reason}); retry it")


@dataclass(frozen=True, slots=True)
class RelayedRequest:
    """What a replica needs to run one HTTP request: everything but the connection."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None
    #: The prefix-cache namespace of the request's tenant as the ingress knows it (its key's): the router
    #: keeps tenants' prompts apart. The replica derives its own from the key; None: no tenant.
    tenant: str | None = None

    @classmethod
    async def read(cls, request: Request, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                   timeout: float = DEFAULT_BODY_READ_TIMEOUT_SECS, tenant: str | None = None) -> RelayedRequest:
        """The request with its whole body, under the server's own cap and deadline (`RequestTooLarge`,
        `BodyReadTimedOut`): the ingress never holds more of a body than a replica would accept."""
        client = (request.client.host, request.client.port) if request.client else None
        return cls(request.method, request.url.path, request.scope.get("query_string", b""),
                   tuple(request.scope.get("headers", ())), await read_body(request, max_body_bytes, timeout), client,
                   tenant)

    def header(self, name: str) -> str | None:
        key = name.lower().encode("latin-1")
        return next((v.decode("latin-1") for k, v in self.headers if k.lower() == key), None)

    def scope(self) -> dict[str, Any]:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "root_path": "", "query_string": self.query_string, "headers": list(self.headers),
                "client": self.client, "server": None, "state": {}}


class InProcessApp:
    """Runs relayed requests through an ASGI app in this process, as an async stream of its messages."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.replica = replica
        self._running: set[asyncio.Task[None]] = set()  # held until done: the loop keeps only weak refs

    async def stream(self, request: RelayedRequest) -> AsyncIterator[Message]:
        """The app's `http.response.*` messages for `request`, the replica's name added to the start.

        Closing the stream early (the caller went away) is a disconnect to the app.
        """
        messages: asyncio.Queue[Message | None] = asyncio.Queue()
        gone = asyncio.Event()
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (REPLICA_HEADER.encode(), self.replica.encode())]
                message = {**message, "headers": headers}
            await messages.put(message)

        task = asyncio.get_running_loop().create_task(self.app(request.scope(), receive, send))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        task.add_done_callback(lambda _: messages.put_nowait(None))
        task.add_done_callback(_retrieve)
        finished = False
        try:
            while True:
                message = await messages.get()
                if message is None:  # the app returned (or raised) without finishing its response
                    task.result()
                    raise RuntimeError("the app ended without completing its response")
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    finished = True
                    return
        finally:
            if not finished:
                gone.set()
                task.get_loop().call_later(DISCONNECT_GRACE_SECS, task.cancel)


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a finished app task's error as seen: the app already answered it (a 500) or the stream raises it."""
    if not task.cancelled():
        task.exception()


async def relayed_response(messages: AsyncIterator[Message], is_replica_failure: Callable[[BaseException], bool],
                           cancel: Callable[[], None], drop_headers: frozenset[bytes] = frozenset(),
                           pinned: str | None = None) -> Response:
    """The client's response from a replica's `InProcessApp.stream` messages.

    `is_replica_failure` tells a lost replica from a bug; `cancel` stops the replica's stream when the
    client goes away first; `drop_headers` (lower-case) are the app's headers the front adds itself;
    `pinned`, the replica the request asked for: another replica's answer is refused.
    """
    try:
        start = await anext(messages)
    except asyncio.CancelledError:
        cancel()
        raise
    except Exception as error:
        cancel()
        if not is_replica_failure(error):
            raise
        log.warning("a replica failed before answering: %s", error)
        return error_response(ReplicaFailed("", type(error).__name__))
    if start.get("type") != "http.response.start":
        cancel()
        raise RuntimeError(f"a replica answered {start.get('type')!r} before http.response.start")
    headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", ()) if bytes(k).lower() not in drop_headers]
    event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
    replica = next((v.decode("latin-1") for k, v in headers if k.lower() == REPLICA_HEADER.encode()), "")
    if pinned and replica != pinned:
        cancel()
        return error_response(PinnedReplicaUnavailable(pinned, replica))

    async def body() -> AsyncIterator[bytes]:
        done = False
        try:
            async for message in messages:
                if message.get("type") != "http.response.body":
                    continue
                yield message.get("body", b"")
                if not message.get("more_body", False):
                    done = True
                    return
        except Exception as error:
            if not is_replica_failure(error):
                raise
            log.warning("replica %s failed mid-response: %s", replica, error)
            if not event_stream:  # a body cut short under its Content-Length: the connection breaks
                raise
            # Reported in-band, as the app reports its own failures mid-stream.
            yield sse(ReplicaFailed(replica, type(error).__name__).to_dict())
            yield DONE
            done = True
        finally:
            if not done:
                cancel()

    response = StreamingResponse(body(), status_code=start["status"])
    response.raw_headers = headers
    return response
