"""The access checks on Ollama's routes: any body type from no browser, JSON from a browser, keys as elsewhere.

Pins: under `/api/`, a POST without `Origin` passes whatever its Content-Type (curl's form type, none), and
one with `Origin` must say JSON, as every POST elsewhere must whoever sends it; a missing or wrong key is a
401 in Ollama's shape with `WWW-Authenticate`; `HEAD /` needs no key.
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from starlette.datastructures import Headers

from ferrox_batch.server.http.access_policy import AccessPolicy
from ferrox_batch.server.ollama.errors import OLLAMA_ERRORS

TYPES = st.one_of(st.none(), st.sampled_from(["application/json", "application/json; charset=utf-8",
                                              "application/x-www-form-urlencoded", "text/plain",
                                              "multipart/form-data; boundary=x", "application/x-ndjson", ""]))
PATHS = st.sampled_from(["/api/chat", "/api/generate", "/api/embed", "/api/show", "/api/pull", "/v1/completions",
                         "/v1/chat/completions", "/tokenize", "/api", "/apis/chat"])


def headers(content_type: str | None, origin: str | None, **more: str) -> Headers:
    raw = {**({"content-type": content_type} if content_type is not None else {}),
           **({"origin": origin} if origin is not None else {}), **more}
    return Headers(raw)


@given(PATHS, TYPES, st.sampled_from([None, "http://page.example", "null"]))
def test_only_a_post_to_ollamas_routes_from_no_browser_may_have_any_type(path, content_type, origin):
    refusal, _tenant = AccessPolicy().check("POST", path, headers(content_type, origin))
    is_json = content_type is not None and content_type.split(";")[0].strip() == "application/json"
    lenient = path.startswith("/api/") and origin is None
    assert (refusal is None) == (is_json or lenient)
    if refusal is not None:
        assert refusal.status == 415


def test_a_missing_key_is_a_401_in_ollamas_shape_and_head_root_needs_none():
    policy = AccessPolicy(api_key="secret")
    refusal, _ = policy.check("POST", "/api/chat", headers("application/json", None))
    assert refusal is not None
    response = refusal.response(OLLAMA_ERRORS)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert list(json.loads(response.body)) == ["error"]
    assert policy.check("POST", "/api/chat", headers("application/json", None, authorization="Bearer secret"))[0] is None
    assert policy.check("HEAD", "/", headers(None, None))[0] is None
