"""`AccessPolicy`: what a request must show before anything of it is read, and the tenant it then belongs to.

Three checks, in this order, each from the request line and headers alone (the body is never read for a
refusal), each refusal in the error shape of the API its path belongs to (`error_shapes`):

1. **Host** (`host_check`): with an allowed list, a request naming another host is a 400
   `host_not_allowed`, on every route but the liveness probe. It comes first: a DNS-rebinding page learns
   nothing else about the server.
2. **The API key** (`api_keys`): with keys set, a missing, malformed or unknown key (a bearer token, or
   `x-api-key` as Anthropic's SDKs send it) is a 401
   `invalid_api_key` with `WWW-Authenticate: Bearer`. A known key names the request's tenant, which the
   policy hands back (`Tenant`: its name and its prefix-cache namespace).
3. **A JSON body.** A POST must say `Content-Type: application/json` (parameters such as charset allowed),
   else 415 `unsupported_media_type`. Every POST this API has takes JSON, and a browser sends a cross-origin
   POST without asking first (no CORS preflight) only with a "simple" type (text/plain, a form, or none):
   refusing those leaves a web page no way to make the user's browser drive the API. Under
   `ANY_TYPE_PREFIXES` (Ollama's API, whose clients and `curl -d` post JSON as a form or untyped) a POST
   that carries no `Origin` may have any type: browsers send `Origin` with every POST and a page cannot
   remove it, so such a request comes from no browser. One with `Origin` must still say JSON.

`OPEN_PATHS` (liveness, readiness and scraping) skip the key check: probes and scrapers carry no key.
Only `PROBE_PATHS` (the liveness probe, which tells a caller nothing but that the server is up) skip the
Host check too, since a kubelet names the pod's address: the metrics say how busy the server is and how
long each answer took, which a DNS-rebinding page on a loopback-bound server must not read, so a scraper
of a server with an allowed list names a listed host.
`PAGE_PATHS` (the chat page, static bytes a browser loads by navigating, so with no key) skip the key
check only: the page asks for the key, and the API it calls checks it.
The server's `AccessMiddleware` and the Ray ingress apply the same policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from ferrox_batch.server.http.api_keys import ApiKeys
from ferrox_batch.server.http.error_shapes import OPENAI_ERRORS, ErrorShape, shaped_response
from ferrox_batch.server.http.host_check import check_allowed_hosts, host_allowed
from ferrox_batch.server.http.log_text import loggable

#: Routes neither a Host list nor a key guards: health checks and Prometheus scrapes come from
#: infrastructure, not clients (vLLM leaves them open to keys too).
OPEN_PATHS = ("/health", "/metrics")
#: Routes the Host list does not guard either: the liveness probe.
PROBE_PATHS = ("/health",)
#: Routes the Host list guards but no key does: the chat page (`chat_page`).
PAGE_PATHS = ("/",)
#: The media type every POST body of this API is.
JSON_MEDIA_TYPE = "application/json"
#: Path prefixes whose POSTs need no JSON type when they come from no browser (no `Origin`): Ollama's API,
#: whose server reads the body as JSON whatever its type, so its clients (and `curl -d`) often say another.
ANY_TYPE_PREFIXES = ("/api/",)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request refused before its body was read: its status, OpenAI error code and message."""

    status: int
    code: str
    message: str
    #: What the server's log line says (client text escaped, as in `message`).
    logged: str
    headers: Mapping[str, str] | None = None

    def response(self, shape: ErrorShape = OPENAI_ERRORS) -> JSONResponse:
        """The refusal in the API's `shape` (OpenAI's by default)."""
        body = {"error": {"message": self.message, "type": "invalid_request_error", "param": None,
                          "code": self.code}}
        return shaped_response(shape, self.status, body, self.headers)


@dataclass(frozen=True, slots=True)
class Tenant:
    """Whose key a request carried: the tenant's name (`ApiKeys.tenant_of`) and its prefix-cache namespace
    (None with a shared cache)."""

    name: str
    namespace: str | None


class AccessPolicy:
    """The three checks of one server (see the module docstring); immutable once built."""

    __slots__ = ("keys", "allowed_hosts")

    def __init__(self, *, api_key: str | Sequence[str] | None = None, allowed_hosts: Sequence[str] | None = None,
                 shared_prefix_cache: bool = False) -> None:
        if not isinstance(shared_prefix_cache, bool):
            raise ValueError(f"shared_prefix_cache must be true or false, got {shared_prefix_cache!r}")
        self.keys = ApiKeys.of(api_key, shared_prefix_cache=shared_prefix_cache)
        self.allowed_hosts = check_allowed_hosts(allowed_hosts)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> AccessPolicy:
        """The policy of `create_app` keywords (`api_key`, `allowed_hosts`, `shared_prefix_cache`); other
        keys are ignored."""
        return cls(api_key=settings.get("api_key"), allowed_hosts=settings.get("allowed_hosts"),
                   shared_prefix_cache=settings.get("shared_prefix_cache", False))

    def check(self, method: str, path: str, headers: Headers) -> tuple[Refusal | None, Tenant | None]:
        """(the refusal, None), or (None, the request's tenant: None without keys or on an open route)."""
        tenant = None
        host = headers.get("host")
        if path not in PROBE_PATHS and self.allowed_hosts is not None and not host_allowed(host, self.allowed_hosts):
            shown = "no Host header" if host is None else f"Host '{loggable(host)}'"
            return Refusal(400, "host_not_allowed",
                           f"this server does not answer to {shown}: it allows {', '.join(self.allowed_hosts)} "
                           f"(its --allowed-hosts)",
                           f"{shown} is not allowed"), None
        if self.keys is not None and path not in OPEN_PATHS and path not in PAGE_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                # Anthropic's SDKs send the key as `x-api-key`: either header carries it.
                token = headers.get("x-api-key", "")
            if not token.strip():
                return _unauthorised("this server needs an API key: send it as 'Authorization: Bearer <key>' "
                                     "or 'x-api-key: <key>'"), None
            index = self.keys.match(token.strip())
            if index is None:
                return _unauthorised("the API key is not valid"), None
            tenant = Tenant(self.keys.tenant_of(index), self.keys.namespace_of(index))
        if method == "POST" and not (path.startswith(ANY_TYPE_PREFIXES) and "origin" not in headers):
            given = headers.get("content-type")
            if given is None or given.partition(";")[0].strip().lower() != JSON_MEDIA_TYPE:
                shown = "no Content-Type" if given is None else f"Content-Type '{loggable(given)}'"
                return Refusal(415, "unsupported_media_type",
                               f"a POST body must be JSON: send 'Content-Type: {JSON_MEDIA_TYPE}' (got {shown})",
                               f"{shown}, not JSON"), None
        return None, tenant


def _unauthorised(message: str) -> Refusal:
    return Refusal(401, "invalid_api_key", message, message, {"WWW-Authenticate": "Bearer"})
