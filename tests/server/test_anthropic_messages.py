"""Anthropic's Messages API through the official `anthropic` SDK: `messages.create`, `messages.stream`,
`count_tokens`, tools, structured output, and Anthropic's errors.

Pins: a text answer is the chat endpoint's answer to the same conversation (`system` as the system
message), whole and streamed, its usage the chat answer's and `count_tokens`'s prompt; a stream is
Anthropic's event grammar (message_start first, each block started, its deltas, stopped, one after another,
message_delta then message_stop last), its deltas adding up to the final message; `stop_sequences`
stop the answer with the matched string reported; a forced tool call comes back as a `tool_use` block
(`toolu_` id, its input valid against the schema) with stop reason `tool_use`, and the round trip with a
`tool_result` is served; `output_config.format` and `output_format` constrain the output to the schema;
everything that cannot be honoured is a 400 in Anthropic's shape naming the field; a wrong key is a 401,
an unknown model a 404, an unknown route of the API a 404, all in Anthropic's shape; random bodies are
never a 5xx.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import MODEL_NAME, openai_client, served, tiny_batcher
from tiny_checkpoint import TOOLS_TEMPLATE, write_tiny_checkpoint

from ferrox_batch.runtime.loading.loader import load_model

KEY = "secret-key"
#: Sampling the SDK no longer sends as arguments: greedy, and past EOS (a random checkpoint may pick it).
GREEDY = {"extra_body": {"temperature": 0.0, "ignore_eos": True}}
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
ERROR_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
               "request_too_large", "rate_limit_error", "api_error", "overloaded_error", "timeout_error"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-anthropic"), tie=False, std=0.15, seed=5,
                                   chat_template=TOOLS_TEMPLATE, max_positions=4096)
    model = load_model(folder, device="cpu", dtype="float32")
    with served(tiny_batcher(model), api_key=KEY) as (base_url, _app):
        yield base_url


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def events_of(base_url: str, body: dict) -> list[tuple[str, dict]]:
    """The raw (event, data) pairs of one streamed request."""
    with httpx.stream("POST", f"{base_url}/v1/messages", json={**body, "stream": True}, timeout=60,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    pairs = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        pairs.append((lines["event"], data))
    return pairs


def assert_grammar(pairs: list[tuple[str, dict]]) -> None:
    """Anthropic's event order: message_start first; each block started, its deltas, stopped, in index order;
    message_delta then message_stop last; pings only before the first block."""
    names = [name for name, _ in pairs]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    open_block, next_index = None, 0
    for name, data in pairs[1:-2]:
        if name == "ping":
            assert open_block is None and next_index == 0
        elif name == "content_block_start":
            assert open_block is None and data["index"] == next_index
            open_block = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_block
        else:
            assert name == "content_block_stop" and data["index"] == open_block
            open_block, next_index = None, next_index + 1
    assert open_block is None


def test_a_text_answer_is_the_chat_answer(server, client):
    reply = client.messages.create(model=MODEL_NAME, max_tokens=10, system="Be brief.",
                                   messages=[{"role": "user", "content": "Hello there"}], **GREEDY)
    with openai_client(server) as oc:
        chat = oc.with_options(api_key=KEY).chat.completions.create(
            model=MODEL_NAME, max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True},
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert text_of(reply) == chat.choices[0].message.content and reply.stop_reason == "max_tokens"
    assert reply.stop_sequence is None and reply.model == MODEL_NAME
    usage = reply.usage
    assert usage.output_tokens == 10
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(model=MODEL_NAME, system="Be brief.",
                                           messages=[{"role": "user", "content": "Hello there"}])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_a_stream_is_anthropics_event_grammar(server, client):
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "Hello there"}],
            "temperature": 0.0, "ignore_eos": True}
    whole = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=body["messages"], **GREEDY)
    pairs = events_of(server, body)
    assert_grammar(pairs)
    start = pairs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    text = "".join(d["delta"]["text"] for n, d in pairs if n == "content_block_delta")
    assert text == text_of(whole)
    delta = pairs[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 8
    with client.messages.stream(model=MODEL_NAME, max_tokens=8, messages=body["messages"], **GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text_of(whole) and final.stop_reason == "max_tokens"


def test_beta_path_and_version_headers_are_served(client):
    reply = client.beta.messages.create(model=MODEL_NAME, max_tokens=3, messages=[{"role": "user", "content": "Hi"}],
                                        betas=["structured-outputs-2025-11-13"], **GREEDY)
    assert reply.usage.output_tokens == 3 and reply.content[0].type == "text"


def test_a_stop_sequence_stops_the_answer_and_is_reported(client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    text = text_of(client.messages.create(model=MODEL_NAME, max_tokens=12, messages=messages, **GREEDY))
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2])
    reply = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=messages, stop_sequences=[stop],
                                   **GREEDY)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert text_of(reply) == text[:text.find(stop)]


def test_a_forced_tool_call_whole_streamed_and_round_tripped(server, client):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    reply = client.messages.create(model=MODEL_NAME, max_tokens=200, messages=messages, tools=[WEATHER],
                                   tool_choice={"type": "any"}, extra_body={"temperature": 0.0})
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert calls and reply.stop_reason == "tool_use"
    for call in calls:
        assert call.id.startswith("toolu_") and call.name == "get_weather"
        jsonschema.validate(call.input, WEATHER["input_schema"])
    body = {"model": MODEL_NAME, "max_tokens": 200, "messages": messages, "tools": [WEATHER], "temperature": 0.0,
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}}
    pairs = events_of(server, body)
    assert_grammar(pairs)
    starts = [d["content_block"] for n, d in pairs if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["tool_use"] and starts[0]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in pairs if n == "content_block_delta")
    jsonschema.validate(json.loads(partial), WEATHER["input_schema"])
    assert pairs[-2][1]["delta"]["stop_reason"] == "tool_use"
    call = calls[0]
    history = messages + [{"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                           {"type": "tool_use", "id": call.id, "name": call.name,
                                                            "input": call.input}]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                        "content": [{"type": "text", "text": "3 degrees"}]},
                                                       {"type": "text", "text": "Thanks"}]}]
    after = client.messages.create(model=MODEL_NAME, max_tokens=3, messages=history, tools=[WEATHER], **GREEDY)
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=history, tools=[WEATHER])
    assert after.stop_reason == "max_tokens"
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens == counted.input_tokens
    failed = history[:-1] + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                           "content": "no such city", "is_error": True}]}]
    assert client.messages.count_tokens(model=MODEL_NAME, messages=failed, tools=[WEATHER]).input_tokens > 0


def test_tool_choice_none_offers_the_tools_and_reads_no_calls(client):
    reply = client.messages.create(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                                   tools=[WEATHER], tool_choice={"type": "none"}, **GREEDY)
    assert [b.type for b in reply.content] == ["text"] and reply.stop_reason == "max_tokens"


@pytest.mark.parametrize("how", ["output_config", "output_format"])
def test_a_json_schema_output_format_constrains_the_output(server, client, how):
    fmt = {"type": "json_schema", "schema": SCHEMA}
    extra = {"output_config": {"format": fmt}} if how == "output_config" else {"output_format": fmt}
    reply = client.messages.create(model=MODEL_NAME, max_tokens=30, messages=[{"role": "user", "content": "Ok?"}],
                                   extra_body={"temperature": 0.0, **extra})
    jsonschema.validate(json.loads(text_of(reply)), SCHEMA)


def test_a_prefilled_answer_is_continued(client):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    reply = client.messages.create(model=MODEL_NAME, max_tokens=4, messages=messages, **GREEDY)
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=messages)
    plain = client.messages.count_tokens(model=MODEL_NAME, messages=messages[:1])
    assert reply.usage.output_tokens == 4 and counted.input_tokens > plain.input_tokens


@pytest.mark.parametrize("extra, field", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "text", "text": "b"}, {"type": "document", "source": {}}]}]}, "messages[1].content[1].type"),
    ({"messages": [{"role": "system", "content": "a"}]}, "messages[0].role"),
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"container": "c1"}, "container"), ({"mcp_servers": [{"type": "url"}]}, "mcp_servers"),
    ({"context_management": {"edits": []}}, "context_management"), ({"service_tier": "standard_only"}, "service_tier"),
    ({"unknown_field": 1}, "unknown_field"), ({"metadata": {"user_id": "u", "other": 1}}, "metadata.other"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"output_format": {"type": "xml"}}, "output_format.type"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"system": [{"type": "image"}]}, "system[0].type"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(client, extra, field):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], **extra}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.post("/v1/messages", body=body, cast_to=object)
    error = refused.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(field + " ")


def test_auth_model_and_route_errors_are_anthropics(server, client):
    with anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            wrong.messages.create(model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert denied.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-nope", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error" and "claude-nope" in missing.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope", messages=[{"role": "user", "content": "Hi"}])
    routed = httpx.post(f"{server}/v1/messages/nothing-here", headers={"x-api-key": KEY}, json={})
    assert routed.status_code == 404 and routed.json()["type"] == "error"
    bearer = httpx.post(f"{server}/v1/messages/count_tokens", headers={"authorization": f"Bearer {KEY}"},
                        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]})
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    big = httpx.post(f"{server}/v1/messages", headers={"x-api-key": KEY, "content-type": "application/json"},
                     content=b'{"pad": "' + b"x" * (5 * 1024 * 1024) + b'"}', timeout=60)
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"


def test_openai_paths_keep_openais_error_shape(server):
    refused = httpx.post(f"{server}/v1/chat/completions", headers={"x-api-key": KEY}, json={"messages": []})
    assert refused.status_code == 400 and "type" not in refused.json() and refused.json()["error"]["param"]


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 5) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
BLOCK = st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "x"])},
                              optional={"text": JSON, "id": JSON, "name": JSON, "input": JSON, "tool_use_id": JSON,
                                        "content": JSON, "is_error": JSON})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "assistant", "system", 3]),
                                 "content": st.one_of(st.text(min_size=1, max_size=8), st.lists(BLOCK, max_size=3), JSON)})
#: Per field, values that are mostly near-valid (so that bodies get past the first check) and sometimes anything.
FIELD_VALUES = {
    "model": st.sampled_from([MODEL_NAME, "other", None, 1]),
    "messages": st.lists(MESSAGE, min_size=1, max_size=3) | JSON, "max_tokens": st.integers(-1, 3) | JSON,
    "system": st.text(max_size=5) | st.lists(BLOCK, max_size=2) | JSON,
    "stop_sequences": st.lists(st.text(max_size=3), max_size=2) | JSON,
    "temperature": st.floats(-1, 3) | JSON, "top_p": st.floats(-1, 2) | JSON, "top_k": st.integers(-2, 50) | JSON,
    "metadata": st.fixed_dictionaries({}, optional={"user_id": JSON, "x": JSON}) | JSON,
    "stream": st.booleans() | JSON, "tools": st.lists(st.just(WEATHER), max_size=1) | JSON,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                         optional={"name": st.just("get_weather") | JSON,
                                                   "disable_parallel_tool_use": JSON}) | JSON,
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive", "x"])},
                                      optional={"budget_tokens": st.integers(0, 3000) | JSON}) | JSON,
    "output_format": st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "x"])},
                                           optional={"schema": st.just(SCHEMA) | JSON}) | JSON,
    "output_config": st.fixed_dictionaries({}, optional={"format": JSON, "effort": JSON}) | JSON,
    "service_tier": st.sampled_from(["auto", "standard_only"]) | JSON, "container": JSON, "cache_control": JSON,
}
BODY = st.lists(st.one_of([st.tuples(st.just(k), v) for k, v in FIELD_VALUES.items()]), max_size=3).map(
    lambda pairs: {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], **dict(pairs)})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(body=BODY, counting=st.booleans())
def test_random_bodies_are_never_a_5xx_and_always_anthropics_shape(server, body, counting):
    path = "/v1/messages/count_tokens" if counting else "/v1/messages"
    reply = httpx.post(f"{server}{path}", headers={"x-api-key": KEY}, json=body, timeout=60)
    assert reply.status_code < 500
    if reply.status_code != 200:
        error = reply.json()
        assert error["type"] == "error" and error["error"]["type"] in ERROR_TYPES
        assert isinstance(error["error"]["message"], str)


def test_the_sdk_reads_the_exchange_s_request_id(client):
    """Anthropic's SDK takes a response's id from `request-id`: the exchange's `X-Request-Id`, on answers
    and errors alike."""
    raw = client.messages.with_raw_response.create(model=MODEL_NAME, max_tokens=2,
                                                   messages=[{"role": "user", "content": "Hi"}])
    assert raw.headers["request-id"] == raw.headers["x-request-id"] and raw.parse()._request_id == raw.headers["request-id"]
    with pytest.raises(anthropic.NotFoundError) as refused:
        client.messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.request_id == refused.value.response.headers["x-request-id"]
