"""The chat page over HTTP (`server.chat_page`; the browser tests are `e2e/test_chat_page_browser`).

Pins: `GET /` is the packaged page, as HTML, under a Content-Security-Policy that lets it talk to this
server only and never be framed, and it names no other origin; it loads without the API key the API
needs, but the Host check and the CORS rules apply to it as to the API; `ui=False` (`--no-ui`) serves
none; `serve` has the flag and the page ships in the package.
"""

from __future__ import annotations

import re
from importlib import resources

import httpx
import pytest
from server_helpers import DEADLINE, served, tiny_batcher

from ferrox_batch.cli import build_parser


@pytest.fixture(scope="module")
def page_server(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model), api_key="k", allowed_hosts=["localhost", "127.0.0.1"],
                allowed_origins=["https://app.example"]) as (base_url, _app):
        yield base_url


def test_the_page_is_served_as_html_under_a_strict_policy(page_server):
    reply = httpx.get(page_server + "/", timeout=DEADLINE)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
    policy = reply.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert reply.headers["x-frame-options"] == "DENY"
    assert reply.content == resources.files("ferrox_batch.server").joinpath("ui/chat.html").read_bytes()
    # Nothing is fetched from elsewhere: no URL with a scheme, no protocol-relative one.
    assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", reply.text), "the page names another origin"
    for needed in ('id="send"', 'id="stop"', 'id="system"', 'id="temperature"', 'id="max-tokens"', 'id="api-key"',
                   "/v1/chat/completions", "include_usage"):
        assert needed in reply.text


def test_it_needs_no_key_but_the_api_it_calls_does(page_server):
    assert httpx.get(page_server + "/", timeout=DEADLINE).status_code == 200
    assert httpx.get(page_server + "/v1/models", timeout=DEADLINE).status_code == 401
    assert httpx.get(page_server + "/v1/models", headers={"Authorization": "Bearer k"}, timeout=DEADLINE).status_code == 200


def test_the_host_check_and_cors_apply_to_it(page_server):
    refused = httpx.get(page_server + "/", headers={"Host": "attacker.example"}, timeout=DEADLINE)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "host_not_allowed"
    allowed = httpx.get(page_server + "/", headers={"Origin": "https://app.example"}, timeout=DEADLINE)
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.get(page_server + "/", headers={"Origin": "https://other.example"}, timeout=DEADLINE)
    assert "access-control-allow-origin" not in other.headers


def test_no_ui_serves_no_page(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model), ui=False) as (base_url, _app):
        reply = httpx.get(base_url + "/", timeout=DEADLINE)
        assert reply.status_code == 404 and reply.json()["error"]["type"] == "invalid_request_error"


def test_serve_has_the_switch():
    parser = build_parser()
    assert parser.parse_args(["serve"]).ui is True
    assert parser.parse_args(["serve", "--no-ui"]).ui is False
