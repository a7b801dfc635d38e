"""A web page the user visits cannot drive a server on their machine: POST bodies must be JSON, Hosts listed.

Pins:

* every POST needs `Content-Type: application/json` (parameters such as charset allowed, any case): a
  browser's "simple" request (text/plain, a form, or no type at all) is a 415 in OpenAI's error shape,
  before the body is read, so a page cannot post to the API without a CORS preflight;
* with `allowed_hosts`, a request whose `Host` (any port) is not listed is a 400 `host_not_allowed` (what a
  DNS-rebinding page sends), on every route but the liveness probe `/health` (`/metrics` included);
  without it any Host passes, as before;
* `serve`'s default list: the loopback names when bound to a loopback address, no check otherwise, and
  `--allowed-hosts` to say;
* the official client and httpx send what passes.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import DEADLINE, GREEDY, MODEL_NAME, served, tiny_batcher

from ferrox_batch.cli import build_parser
from ferrox_batch.server.http.host_check import LOOPBACK_HOSTS, default_allowed_hosts

BODY = b'{"prompt": "hi", "max_tokens": 1, "temperature": 0}'


@pytest.fixture(scope="module")
def local_server(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model), allowed_hosts=LOOPBACK_HOSTS) as (base_url, _app):
        yield base_url


def post(base_url: str, path: str = "/v1/completions", **headers: str) -> httpx.Response:
    return httpx.post(base_url + path, content=BODY, headers=headers, timeout=DEADLINE)


def test_a_post_that_is_not_json_is_415(local_server):
    for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", "application/jsonp", "application/json-seq", ""):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/nowhere"):
            refused = post(local_server, path, **({"Content-Type": content_type} if content_type else {}))
            assert refused.status_code == 415, (content_type, path)
            error = refused.json()["error"]
            assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        assert post(local_server, **{"Content-Type": content_type}).status_code == 200, content_type
    assert httpx.get(local_server + "/v1/models", timeout=DEADLINE).status_code == 200  # GETs carry no body


def test_a_host_outside_the_list_is_refused_but_the_liveness_probe_passes(local_server):
    port = local_server.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.", "[::2]:80", ""):
        refused = post(local_server, Host=host, **{"Content-Type": "application/json"})
        assert refused.status_code == 400, host
        error = refused.json()["error"]
        assert error["code"] == "host_not_allowed" and "--allowed-hosts" in error["message"]
        assert httpx.get(local_server + "/v1/models", headers={"Host": host}, timeout=DEADLINE).status_code == 400
        # A rebinding page could read the server's traffic off its metrics: the scrape is guarded as every
        # route is; only the liveness probe takes any Host.
        assert httpx.get(local_server + "/metrics", headers={"Host": host}, timeout=DEADLINE).status_code == 400
        assert httpx.get(local_server + "/health", headers={"Host": host}, timeout=DEADLINE).status_code == 200
    for host in ("localhost", f"localhost:{port}", "LOCALHOST:1", "127.0.0.1", f"127.0.0.1:{port}", "[::1]",
                 f"[::1]:{port}"):
        assert post(local_server, Host=host, **{"Content-Type": "application/json"}).status_code == 200, host
        assert httpx.get(local_server + "/metrics", headers={"Host": host}, timeout=DEADLINE).status_code == 200


def test_clients_send_what_passes(local_server):
    with openai.OpenAI(base_url=f"{local_server}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, **GREEDY).usage
        assert client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, **GREEDY).usage
    assert httpx.post(local_server + "/tokenize", json={"prompt": "hi"}, timeout=DEADLINE).status_code == 200


def test_without_a_list_any_host_passes(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model)) as (base_url, _app):
        assert post(base_url, Host="anything.example", **{"Content-Type": "application/json"}).status_code == 200


def test_the_key_is_asked_for_before_the_content_type(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model), api_key="sk-1") as (base_url, _app):
        assert post(base_url, **{"Content-Type": "text/plain"}).status_code == 401
        assert post(base_url, Authorization="Bearer sk-1", **{"Content-Type": "text/plain"}).status_code == 415


def test_serve_defaults_to_the_loopback_names_when_bound_to_loopback():
    for bind in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        assert default_allowed_hosts(bind) == LOOPBACK_HOSTS, bind
    for bind in ("0.0.0.0", "::", "192.168.1.5", "10.0.0.1", "example.internal"):
        assert default_allowed_hosts(bind) is None, bind
    assert set(LOOPBACK_HOSTS) == {"localhost", "127.0.0.1", "[::1]"}


def test_the_allowed_hosts_flag():
    parse = build_parser().parse_args
    assert parse(["serve"]).allowed_hosts is None
    assert parse(["serve", "--allowed-hosts", "api.example.com, localhost"]).allowed_hosts == (
        "api.example.com", "localhost")
    assert parse(["serve", "--allowed-hosts", "*"]).allowed_hosts == ("*",)
    with pytest.raises(SystemExit):
        parse(["serve", "--allowed-hosts", " , "])
