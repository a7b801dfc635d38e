"""Who may call the API and which exchange is which: the bearer-key check and the `X-Request-Id` header.

`AccessMiddleware` wraps the whole app (inside CORS, so a browser's preflight is answered before any key
is asked for, and a 401 still carries the CORS headers a browser needs to read it). It promises:

* **Request ids.** Every HTTP response carries `X-Request-Id`: the client's own when it sent a usable one
  (1 to `MAX_REQUEST_ID_CHARS` visible ASCII characters), else a fresh random one. The endpoints read it
  from `request_id(request)`: generation responses use it as their `id` after the OpenAI prefix
  (`chatcmpl-<id>`), and the server's log lines name it. An unusable header is replaced, never refused:
  a tracing header is not worth failing a request over.
* **The API key.** With a key set, every route but `OPEN_PATHS` (liveness and scraping stay open, as in
  vLLM) needs `Authorization: Bearer <key>`; anything else is a 401 in OpenAI's error shape with
  `WWW-Authenticate: Bearer`, before the body is read. The comparison is `hmac.compare_digest` on bytes,
  whose time does not depend on where the first difference is.
"""

from __future__ import annotations

import hmac
import logging
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("ferrox_batch.server")

REQUEST_ID_HEADER = "X-Request-Id"
#: Longer ids are replaced: they end up in every log line and response id of the request.
MAX_REQUEST_ID_CHARS = 128
#: Routes a key never guards: health checks and Prometheus scrapes come from infrastructure, not clients.
OPEN_PATHS = ("/health", "/metrics")


def usable_request_id(value: str | None) -> bool:
    """Whether a client's `X-Request-Id` can be echoed and logged as it is (visible ASCII, bounded)."""
    return (value is not None and 0 < len(value) <= MAX_REQUEST_ID_CHARS
            and all("!" <= ch <= "~" for ch in value))


def request_id(connection: HTTPConnection) -> str:
    """The id `AccessMiddleware` gave this exchange (a fresh one for an app built without it)."""
    rid = connection.scope.get("state", {}).get("request_id")
    return rid if isinstance(rid, str) else uuid.uuid4().hex


def unauthorised_body(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "invalid_api_key"}}


class AccessMiddleware:
    """A pure ASGI middleware (streams pass through untouched): request ids, then the key check."""

    def __init__(self, app: ASGIApp, *, api_key: str | None) -> None:
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty string or None")
        self.app = app
        self._key = None if api_key is None else api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given = headers.get(REQUEST_ID_HEADER)
        rid = given if usable_request_id(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        refusal = self._refusal(scope, headers)
        if refusal is not None:
            log.info("request %s: 401 on %s %s (%s)", rid, scope["method"], scope["path"], refusal)
            response = JSONResponse(unauthorised_body(refusal), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)

    def _refusal(self, scope: Scope, headers: Headers) -> str | None:
        """Why this request may not pass (None: it may)."""
        if self._key is None or scope["path"] in OPEN_PATHS:
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "this server needs an API key: send it as 'Authorization: Bearer <key>'"
        if not hmac.compare_digest(token.strip().encode("utf-8"), self._key):
            return "the API key is not valid"
        return None
