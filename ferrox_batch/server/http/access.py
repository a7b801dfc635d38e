"""Who may call the API and which exchange is which: the access checks and the `X-Request-Id` header.

`AccessMiddleware` wraps the whole app (inside CORS, so a browser's preflight is answered before any key
is asked for, and a refusal still carries the CORS headers a browser needs to read it). It promises:

* **Request ids.** Every HTTP response carries `X-Request-Id` (and, for Anthropic's SDKs, `request-id`): the client's own when it sent a usable one
  (1 to `MAX_REQUEST_ID_CHARS` visible ASCII characters), else a fresh random one. The endpoints read it
  from `request_id(request)`: generation responses use it as their `id` after the OpenAI prefix
  (`chatcmpl-<id>`), and the server's log lines name it. An unusable header is replaced, never refused:
  a tracing header is not worth failing a request over.
* **The access checks** of `access_policy.AccessPolicy` (an allowed Host, the API key, a JSON body on a
  POST), each refusal in the error shape of the API its path belongs to, before the body is read, logged as one line whose client
  text (method, path, header values) is escaped (`log_text.loggable`).
* **The tenant.** A request carrying one of several keys belongs to that key's tenant: `cache_namespace`
  gives the prefix-cache namespace its generation requests use (None without keys or with a shared cache),
  and `client_identity` the client its per-client budgets are priced to: the tenant, shared cache or not,
  else the client's address (an IPv6 one by its /64, which one host usually holds whole).
"""

from __future__ import annotations

import ipaddress
import logging
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ferrox_batch.server.http.access_policy import OPEN_PATHS, AccessPolicy
from ferrox_batch.server.http.error_shapes import ErrorShapes
from ferrox_batch.server.http.log_text import loggable

log = logging.getLogger("ferrox_batch.server.http")

REQUEST_ID_HEADER = "X-Request-Id"
ANTHROPIC_REQUEST_ID_HEADER = "request-id"
#: Longer ids are replaced: they end up in every log line and response id of the request.
MAX_REQUEST_ID_CHARS = 128
#: Where the middleware puts a request's tenant namespace, and its tenant's name, in its scope's state.
NAMESPACE_STATE = "cache_namespace"
TENANT_STATE = "tenant"
#: The prefix length an IPv6 client is known by: a host (or a home's network) is usually given a whole /64.
IPV6_CLIENT_PREFIX = 64

__all__ = ["IPV6_CLIENT_PREFIX", "MAX_REQUEST_ID_CHARS", "NAMESPACE_STATE", "OPEN_PATHS", "REQUEST_ID_HEADER",
           "TENANT_STATE", "AccessMiddleware", "cache_namespace", "client_identity", "request_id",
           "usable_request_id"]


def usable_request_id(value: str | None) -> bool:
    """Whether a client's `X-Request-Id` can be echoed and logged as it is (visible ASCII, bounded)."""
    return (value is not None and 0 < len(value) <= MAX_REQUEST_ID_CHARS
            and all("!" <= ch <= "~" for ch in value))


def request_id(connection: HTTPConnection) -> str:
    """The id `AccessMiddleware` gave this exchange (a fresh one for an app built without it)."""
    rid = connection.scope.get("state", {}).get("request_id")
    return rid if isinstance(rid, str) else uuid.uuid4().hex


def cache_namespace(connection: HTTPConnection) -> str | None:
    """The prefix-cache namespace of the tenant whose key this exchange carried (None: no tenant)."""
    namespace = connection.scope.get("state", {}).get(NAMESPACE_STATE)
    return namespace if isinstance(namespace, str) else None


def client_identity(connection: HTTPConnection) -> str:
    """Who sent this exchange, as per-client budgets price it: its API key's tenant (whether or not tenants
    share the prefix cache), else its address, an IPv6 one by its /64 (every client of a keyless server
    behind one proxy is one client)."""
    tenant = connection.scope.get("state", {}).get(TENANT_STATE)
    if isinstance(tenant, str):
        return f"tenant:{tenant}"
    host = connection.client.host if connection.client is not None else None
    return f"address:{'unknown' if host is None else _address_client(host)}"


def _address_client(host: str) -> str:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # not an address (a test client's name, a Unix socket): as it is
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_CLIENT_PREFIX), strict=False))
    return str(address)


class AccessMiddleware:
    """A pure ASGI middleware (streams pass through untouched): request ids, then the access checks."""

    def __init__(self, app: ASGIApp, *, policy: AccessPolicy, error_shapes: ErrorShapes = ErrorShapes()) -> None:
        self.app = app
        self.policy = policy
        self.error_shapes = error_shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given = headers.get(REQUEST_ID_HEADER)
        rid = given if usable_request_id(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers[REQUEST_ID_HEADER] = rid
                # Anthropic's SDKs read a response's id from `request-id` (`message._request_id`, errors'
                # `request_id`): the same id under that name too.
                headers[ANTHROPIC_REQUEST_ID_HEADER] = rid
            await send(message)

        refusal, tenant = self.policy.check(scope["method"], scope["path"], headers)
        if refusal is not None:
            log.info("request %s: %d on %s %s (%s)", rid, refusal.status, loggable(scope["method"]),
                     loggable(scope["path"]), refusal.logged)
            await refusal.response(self.error_shapes.for_path(scope["path"]))(scope, receive, send_with_id)
            return
        if tenant is not None:
            state[NAMESPACE_STATE], state[TENANT_STATE] = tenant.namespace, tenant.name
        await self.app(scope, receive, send_with_id)
