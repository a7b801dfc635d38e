"""Tool calling over HTTP through the official `openai` client's tools API, on a tiny checkpoint whose chat
template renders tools the Hermes/Qwen way (`tiny_checkpoint.TOOLS_TEMPLATE`).

Pins: `tool_choice: "required"` gets `tool_calls` (finish reason `tool_calls`) naming offered functions
with arguments valid against their schemas, though the random model's free text is never a call; a named
function gets exactly one call of it; the round trip (the assistant's calls and the tool's answer sent back
in the history) is served, and `/tokenize` shows the template rendered both; on a model whose template does
not render tools they are described in a system message and a required or named call is forced in the
generic JSON format; a streamed call's name comes in its first delta and its arguments in the deltas after,
as they are written, before the finish reason `tool_calls`; `parallel_tool_calls: false` makes one call;
bad tools, unknown names and a forced call with another output form are 400s naming the field.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_helpers import MODEL_NAME, openai_client, served, tiny_batcher
from tiny_checkpoint import TOOLS_TEMPLATE, write_tiny_checkpoint

from ferrox_batch.runtime.loading.loader import load_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    # The tiny tokenizer spends a token on most characters of JSON: room for the tool definitions.
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tools"), tie=False, std=0.15, seed=5,
                                   chat_template=TOOLS_TEMPLATE, max_positions=4096)
    model = load_model(folder, device="cpu", dtype="float32")
    assert model.tokenizer.supports_tools
    with served(tiny_batcher(model)) as (base_url, _app):
        yield base_url


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    """A tiny checkpoint whose ChatML template does not render tools, with room for their description."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-plain"), tie=False, std=0.15, seed=5,
                                   max_positions=4096)
    model = load_model(folder, device="cpu", dtype="float32")
    assert not model.tokenizer.supports_tools
    with served(tiny_batcher(model)) as (base_url, _app):
        yield base_url


@pytest.fixture(scope="module")
def plain_client(plain_server):
    with openai_client(plain_server, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tools_client(tools_server):
    with openai_client(tools_server, timeout=60) as c:
        yield c


def assert_valid_calls(message) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_required_call_is_made_with_valid_arguments(tools_client):
    for temperature in (0.0, 1.0):
        reply = tools_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                                     tool_choice="required", max_tokens=120,
                                                     temperature=temperature, seed=3)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert_valid_calls(choice.message)


def streamed_calls(stream) -> tuple[dict[int, dict], list[str], str, int]:
    """A stream's calls assembled from their deltas (index -> id, name, arguments), its finish reasons, its
    content, and how many deltas carried arguments."""
    calls: dict[int, dict] = {}
    reasons, content, pieces = [], "", 0
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"], call["name"] = delta.id, delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
                    pieces += 1
            reasons += [choice.finish_reason] if choice.finish_reason else []
    return calls, reasons, content, pieces


def test_a_streamed_calls_arguments_arrive_as_they_are_written(tools_client):
    stream = tools_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                                  tool_choice="required", max_tokens=120, temperature=0,
                                                  stream=True)
    calls, reasons, content, pieces = streamed_calls(stream)
    assert reasons == ["tool_calls"] and calls and "<tool_call>" not in content
    assert sorted(calls) == list(range(len(calls))) and pieces > len(calls)  # several deltas a call
    whole = tools_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                                 tool_choice="required", max_tokens=120, temperature=0)
    assert [c.function.name for c in whole.choices[0].message.tool_calls] == [calls[i]["name"] for i in calls]
    for i, call in calls.items():
        assert call["id"].startswith("call_")
        arguments = json.loads(call["arguments"])
        jsonschema.validate(arguments, SCHEMAS[call["name"]])
        assert arguments == json.loads(whole.choices[0].message.tool_calls[i].function.arguments)


def test_a_named_function_is_called_exactly_once(tools_client):
    reply = tools_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert_valid_calls(reply.choices[0].message)


def test_the_round_trip_is_rendered_and_served(tools_server, tools_client):
    first = tools_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER],
                                                 tool_choice="required", max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = tools_client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER],
                                                  tool_choice="none", max_tokens=4, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.tool_calls is None
    rendered = httpx.post(f"{tools_server}/tokenize", json={"messages": history, "tools": [WEATHER],
                                                            "return_token_strs": True}, timeout=30).json()
    text = "".join(rendered["token_strs"])
    assert "<tools>" in text and '"get_weather"' in text and "<tool_response>" in text and "21" in text
    assert text.count("<tool_call>") == 2  # the template's instruction, and the assistant's call


def test_tools_on_a_template_that_cannot_render_them_are_described_and_forced(plain_server, plain_client):
    client = plain_client
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                               tool_choice="required", max_tokens=200, temperature=temperature,
                                               seed=2)
        assert reply.choices[0].finish_reason == "tool_calls"
        assert_valid_calls(reply.choices[0].message)
    named = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                           max_tokens=200, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                            tool_choice="required", max_tokens=200, temperature=0, stream=True)
    calls, reasons, content, pieces = streamed_calls(stream)
    assert reasons == ["tool_calls"] and content == "" and pieces > len(calls) > 0
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    free = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content  # auto: free text
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    rendered = httpx.post(f"{plain_server}/tokenize", json={"messages": history, "tools": [WEATHER],
                                                         "return_token_strs": True}, timeout=30).json()
    text = "".join(rendered["token_strs"])
    assert '"tool_calls"' in text and '"get_weather"' in text and "tool_result" in text and "21 degrees" in text
    again = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER], max_tokens=4)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("which", ["tools", "plain"])
def test_parallel_tool_calls_false_makes_one_call(which, tools_client, plain_client):
    chosen = tools_client if which == "tools" else plain_client
    for stream in (False, True):
        reply = chosen.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                               tool_choice="required", max_tokens=200, temperature=1.0, seed=9,
                                               parallel_tool_calls=False, stream=stream)
        if stream:
            calls, reasons, _, _ = streamed_calls(reply)
            assert len(calls) == 1 and reasons == ["tool_calls"]
        else:
            assert len(reply.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_bad_tool_requests_are_400s_naming_the_field(tools_server, fields, param):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **fields}
    response = httpx.post(f"{tools_server}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
