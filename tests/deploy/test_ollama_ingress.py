"""The Ray ingress answers its refusals on Ollama's routes in Ollama's shape, as the replicas answer theirs.

Pins: a missing key under `/api/` is a 401 `{"error": "<message>"}`, unread; the OpenAI routes keep theirs;
a POST from no browser with curl's form type is relayed on Ollama's routes and refused on OpenAI's.
No Ray instance: the ingress is called with a stand-in for its replicas' handle.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray", reason="the ingress needs the test extra (ray[serve])")
from starlette.requests import Request  # noqa: E402
from test_ingress_guards import Replicas  # noqa: E402

from ferrox_batch.deploy.ray_serve import FerroxIngress  # noqa: E402


def call(ingress: FerroxIngress, path: str, headers: dict[str, str]) -> tuple[int, dict | None]:
    """The ingress's status and, for its own refusals, their body (a relayed answer's is the stand-in's)."""
    async def receive() -> dict:
        return {"type": "http.request", "body": b'{"model": "m", "prompt": "hi"}', "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "scheme": "http", "http_version": "1.1"}

    async def run():
        return await ingress(Request(scope, receive))

    response = asyncio.run(run())
    return response.status_code, json.loads(response.body) if hasattr(response, "body") else None


def test_refusals_on_ollamas_routes_are_in_ollamas_shape():
    ingress = FerroxIngress(Replicas(), {"api_key": "sk-1"})
    status, body = call(ingress, "/api/generate", {"Content-Type": "application/json"})
    assert status == 401 and list(body) == ["error"] and isinstance(body["error"], str)
    status, body = call(ingress, "/v1/completions", {"Content-Type": "application/json"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_a_form_typed_post_from_no_browser_is_relayed_only_on_ollamas_routes():
    replicas = Replicas()
    ingress = FerroxIngress(replicas)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert call(ingress, "/api/generate", form)[0] == 200 and len(replicas.forwarded) == 1
    assert call(ingress, "/api/generate", {**form, "Origin": "http://page.example"})[0] == 415
    assert call(ingress, "/v1/completions", form)[0] == 415 and len(replicas.forwarded) == 1
