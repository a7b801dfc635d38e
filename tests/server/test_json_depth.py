"""Request bodies nest at most `MAX_JSON_DEPTH` levels: deeper is a 400 naming the body, never a hang or a 500.

Pins the shared parser (`ferrox_batch.bounded_json`): a document exactly `MAX_JSON_DEPTH` deep parses as
`json.loads` parses it, one level more is `JsonTooDeep` (a ValueError), whatever the depth (a 100,000-level
body included, which would overflow a recursive walk), and brackets inside strings do not count. The
server's `parse_json_object` answers it as a 400 that says so. JSON held in a string field and parsed again
(an earlier call's `tool_calls[].function.arguments`, a Responses `function_call`'s `arguments`) is bound
the same way: deeper is a 400 naming that field, on the chat endpoint, `/tokenize` and `/v1/responses`; and so
is a JSON schema sent as text (`structured_outputs.json`, `guided_json`).
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


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_deep_arguments_of_an_earlier_call_are_a_400_naming_them(tiny_batch_model, depth):
    arguments = nested(depth - 1, "{}")  # the leaf `{}` is a level
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    responses_input = [{"type": "message", "role": "user", "content": "hi"},
                       {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
                       {"type": "function_call_output", "call_id": "c1", "output": "done"}]
    with served(tiny_batcher(tiny_batch_model)) as (base_url, _app):
        in_messages = "messages[1].tool_calls[0].function.arguments"
        for path, body, param in (
                ("/v1/chat/completions", {"messages": history, "max_tokens": 1}, in_messages),
                ("/tokenize", {"messages": history}, in_messages),
                ("/v1/responses", {"input": responses_input, "max_output_tokens": 1}, "input[1].arguments")):
            response = httpx.post(base_url + path, json=body, timeout=DEADLINE)
            assert response.status_code == 400, (path, response.text)
            error = response.json()["error"]
            assert error["param"] == param, (path, error)
            assert f"deeper than {MAX_JSON_DEPTH} levels" in error["message"]
        shallow = [history[0], {**history[1], "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": nested(MAX_JSON_DEPTH - 1, "{}")}}]},
                   history[2]]
        assert httpx.post(base_url + "/tokenize", json={"messages": shallow}, timeout=DEADLINE).status_code == 200


@pytest.mark.parametrize("field, param", [({"structured_outputs": {"json": "SCHEMA"}}, "structured_outputs.json"),
                                          ({"guided_json": "SCHEMA"}, "guided_json")])
def test_a_schema_sent_as_deep_json_text_is_a_400_naming_it(server, field, param):
    base_url, _batcher = server
    schema = json.dumps(field).replace('"SCHEMA"', json.dumps(nested(100_000)))
    for path, rest in (("/v1/completions", '"prompt": "x"'), ("/v1/chat/completions",
                                                             '"messages": [{"role": "user", "content": "x"}]')):
        raw = "{" + rest + ', "max_tokens": 1, ' + schema[1:]
        response = httpx.post(base_url + path, content=raw.encode(), headers={"Content-Type": "application/json"},
                              timeout=DEADLINE)
        assert response.status_code == 400, (path, response.text[:300])
        error = response.json()["error"]
        assert error["param"] == param and "deeper than" in error["message"], error


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet='[{]}"ab\\', max_size=80), most=st.integers(0, 12), as_bytes=st.booleans())
def test_more_brackets_is_the_count_of_opening_brackets_past_most(text, most, as_bytes):
    from ferrox_batch.bounded_json import _more_brackets

    raw = text.encode() if as_bytes else text
    assert _more_brackets(raw, most) == (text.count("[") + text.count("{") > most)
