"""Request bodies nest at most `MAX_JSON_DEPTH` levels: deeper is a 400 naming the body, never a hang or a 500.

Pins the shared parser (`ferrox_batch.bounded_json`): a document exactly `MAX_JSON_DEPTH` deep parses as
`json.loads` parses it, one level more is `JsonTooDeep` (a ValueError), whatever the depth (a 100,000-level
body included, which would overflow a recursive walk), and brackets inside strings do not count. The
server's `parse_json_object` answers it as a 400 that says so.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import DEADLINE, served, tiny_batcher

from ferrox_batch.bounded_json import MAX_JSON_DEPTH, JsonTooDeep, loads, nesting_depth
from ferrox_batch.errors import InvalidRequest
from ferrox_batch.server.requests import parse_json_object


def nested(depth: int, leaf: str = "1") -> str:
    """`depth` levels, alternating arrays and objects, around `leaf`."""
    text = leaf
    for level in range(depth):
        text = f"[{text}]" if level % 2 == 0 else f'{{"k": {text}}}'
    return text


def test_the_limit_is_exact():
    assert loads(nested(MAX_JSON_DEPTH)) == json.loads(nested(MAX_JSON_DEPTH))
    assert nesting_depth(json.loads(nested(MAX_JSON_DEPTH))) == MAX_JSON_DEPTH
    for depth in (MAX_JSON_DEPTH + 1, 200, 900):
        with pytest.raises(JsonTooDeep, match=f"deeper than {MAX_JSON_DEPTH} levels"):
            loads(nested(depth))
    with pytest.raises(JsonTooDeep):
        loads(nested(5), max_depth=4)
    assert loads(nested(4), max_depth=4) == json.loads(nested(4))


@pytest.mark.parametrize("raw", [b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000,
                                 b'{"a":' * 50_000 + b"1" + b"}" * 50_000])
def test_any_depth_is_refused_without_a_recursion_error(raw):
    with pytest.raises(ValueError) as refused:
        loads(raw)
    assert not isinstance(refused.value, RecursionError)


def test_brackets_inside_strings_do_not_count():
    text = json.dumps({"prompt": "[" * 10_000 + "{" * 10_000, "stop": ["]]]", "}}}"]})
    assert loads(text) == json.loads(text)
    assert loads(text.encode("utf-16")) == json.loads(text)  # what json.loads accepts, this does too


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ax\n'),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=40)


@given(json_values)
def test_shallow_documents_parse_as_json_loads_parses_them(value):
    text = json.dumps(value)
    assert nesting_depth(value) <= MAX_JSON_DEPTH  # 40 leaves nest far less than the limit
    assert loads(text) == value
    assert loads(text.encode()) == value


def test_parse_json_object_refuses_a_deep_body_as_a_400_naming_it():
    with pytest.raises(InvalidRequest) as refused:
        parse_json_object(json.dumps({"prompt": "x", "tools": json.loads(nested(MAX_JSON_DEPTH))}).encode())
    assert refused.value.param == "body" and "deeper than" in str(refused.value)
    assert parse_json_object(json.dumps({"prompt": "x", "n": json.loads(nested(MAX_JSON_DEPTH - 1))}).encode())


def test_a_deep_body_is_a_400_over_http(tiny_batch_model):
    raw = ('{"prompt": "x", "response_format": ' + nested(MAX_JSON_DEPTH + 1, "{}") + "}").encode()
    assert len(raw) < 2048
    with served(tiny_batcher(tiny_batch_model)) as (base_url, _app):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            response = httpx.post(base_url + path, content=raw, headers={"Content-Type": "application/json"},
                                  timeout=DEADLINE)
            assert response.status_code == 400, (path, response.text)
            assert response.json()["error"]["param"] == "body" and "deeper than" in response.json()["error"]["message"]


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet='[{]}"ab\\', max_size=80), most=st.integers(0, 12), as_bytes=st.booleans())
def test_more_brackets_is_the_count_of_opening_brackets_past_most(text, most, as_bytes):
    from ferrox_batch.bounded_json import _more_brackets

    raw = text.encode() if as_bytes else text
    assert _more_brackets(raw, most) == (text.count("[") + text.count("{") > most)
