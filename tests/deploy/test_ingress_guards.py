"""The Ray ingress refuses what the server would refuse before it reads a body, and the router never chokes on one.

Pins: the ingress answers a missing or wrong key (401), a Host outside the allowed list (400) and a POST
that is not JSON (415) without reading the body or reaching a replica; with the right key it relays. The
router's prompt reader (`affinity.prompt_units`) reads a body nested past `MAX_JSON_DEPTH` as "no prompt"
instead of raising (a RecursionError there left the request hanging), so the replica answers it 400. A
relayed request names its key's tenant (never the key) for the router, which keeps tenants' prompts apart.
No Ray instance: the ingress is called with a stand-in for its replicas' handle.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from ferrox_batch.bounded_json import MAX_JSON_DEPTH
from ferrox_batch.deploy.affinity import prompt_units

pytest.importorskip("ray", reason="the ingress needs the test extra (ray[serve])")
from starlette.requests import Request  # noqa: E402

from ferrox_batch.deploy.ray_serve import FerroxIngress  # noqa: E402
from ferrox_batch.deploy.relay import RelayedRequest  # noqa: E402

KEY = "sk-ingress-1"


def test_a_deeply_nested_body_is_no_prompt_to_the_router():
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert prompt_units("/v1/completions", deep) is None
    chat = b'{"messages": [{"role": "user", "content": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}]}"
    assert prompt_units("/v1/chat/completions", chat) is None
    just_past = json.dumps({"prompt": "hi", "x": json.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)})
    assert prompt_units("/v1/completions", just_past.encode()) is None
    assert prompt_units("/v1/completions", json.dumps({"prompt": "hi", "x": [[1]]}).encode()) == "hi"


class Replicas:
    """A stand-in for the replicas' handle: records what was forwarded and answers 200."""

    def __init__(self) -> None:
        self.forwarded: list[RelayedRequest] = []

    def options(self, **_kwargs) -> Replicas:
        return self

    @property
    def forward(self) -> Replicas:
        return self

    def remote(self, relayed: RelayedRequest) -> Stream:
        self.forwarded.append(relayed)
        return Stream()


class Stream:
    def __init__(self) -> None:
        self.messages = iter([{"type": "http.response.start", "status": 200, "headers": []},
                              {"type": "http.response.body", "body": b"{}", "more_body": False}])

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> dict:
        try:
            return next(self.messages)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        pass


def call(ingress: FerroxIngress, headers: dict[str, str], body: bytes = b'{"prompt": "hi"}') -> tuple[int, bool]:
    """The ingress's status for a POST with `headers`, and whether it read the body."""
    read = False

    async def receive() -> dict:
        nonlocal read
        read = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "scheme": "http", "http_version": "1.1"}

    async def run() -> int:
        return (await ingress(Request(scope, receive))).status_code

    return asyncio.run(run()), read


JSON = {"Content-Type": "application/json", "Host": "127.0.0.1:8000"}


def test_the_key_is_checked_before_the_body_is_read():
    replicas = Replicas()
    ingress = FerroxIngress(replicas, {"api_key": KEY, "max_concurrent_requests": 8})
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}):
        assert call(ingress, {**JSON, **headers}) == (401, False), headers
    assert replicas.forwarded == []
    assert call(ingress, {**JSON, "Authorization": f"Bearer {KEY}"}) == (200, True)
    assert len(replicas.forwarded) == 1


def test_a_foreign_host_and_a_body_that_is_not_json_are_refused_unread():
    replicas = Replicas()
    ingress = FerroxIngress(replicas, {"allowed_hosts": ("localhost", "127.0.0.1")})
    assert call(ingress, {**JSON, "Host": "evil.example:8000"}) == (400, False)
    assert call(ingress, {"Content-Type": "text/plain", "Host": "localhost:8000"}) == (415, False)
    assert call(ingress, {"Host": "localhost"}) == (415, False)
    assert replicas.forwarded == []
    assert call(ingress, JSON) == (200, True)


def test_an_ingress_without_settings_relays_as_before():
    replicas = Replicas()
    ingress = FerroxIngress(replicas)
    assert call(ingress, {"Content-Type": "application/json", "Host": "anything.example"}) == (200, True)


def test_the_relayed_request_names_its_tenant_for_the_router():
    replicas = Replicas()
    ingress = FerroxIngress(replicas, {"api_key": ("sk-a", "sk-b")})
    for key in ("sk-a", "sk-b", "sk-a"):
        assert call(ingress, {**JSON, "Authorization": f"Bearer {key}"}) == (200, True)
    first, second, third = (relayed.tenant for relayed in replicas.forwarded)
    assert first is not None and first == third and first != second and "sk-a" not in first
    shared = Replicas()
    ingress = FerroxIngress(shared, {"api_key": ("sk-a", "sk-b"), "shared_prefix_cache": True})
    assert call(ingress, {**JSON, "Authorization": "Bearer sk-a"}) == (200, True)
    assert shared.forwarded[0].tenant is None
