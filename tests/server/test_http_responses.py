"""`/v1/responses` (stateless) through the official `openai` client's `responses.create`.

Pins: a text answer is the chat endpoint's answer to the same conversation (`instructions` as the system
message), whole and streamed; a stream is OpenAI's event sequence (created, in progress, the item's added /
delta / done events, completed), numbered, its deltas adding up to the final text and its
`response.completed` holding the same items as a whole answer; input items (text parts, earlier function
calls and their outputs) are served; a required tool call comes back as `function_call` items, its
arguments streamed as deltas; `text.format` constrains the output; `max_output_tokens` makes an
`incomplete` response; what a stateless text server cannot honour is a 400 naming the field; thinking
(with a reasoning parser) is a `reasoning` item before the message and the calls.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_helpers import MODEL_NAME, openai_client, served, tiny_batcher
from tiny_checkpoint import write_tiny_checkpoint

from ferrox_batch.runtime.loading.loader import load_model
from ferrox_batch.server.reasoning import ReasoningParser
from ferrox_batch.server.openai.responses_format import ResponseBuilder
from ferrox_batch.server.tools.hermes import HermesToolCalls

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-responses"), tie=False, std=0.15, seed=5,
                                   max_positions=4096)
    model = load_model(folder, device="cpu", dtype="float32")
    with served(tiny_batcher(model)) as (base_url, _app), openai_client(base_url, timeout=60) as c:
        yield c


def test_a_text_answer_is_the_chat_answer(client):
    reply = client.responses.create(model=MODEL_NAME, input="Hello there", instructions="Be brief.",
                                    max_output_tokens=10, **GREEDY)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=10, **GREEDY, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert reply.output_text == chat.choices[0].message.content and reply.object == "response"
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.input_tokens == chat.usage.prompt_tokens and reply.usage.output_tokens == 10
    assert reply.instructions == "Be brief." and reply.max_output_tokens == 10


def test_a_stream_is_openais_event_sequence(client):
    whole = client.responses.create(model=MODEL_NAME, input="Hello there", max_output_tokens=8, **GREEDY)
    events = list(client.responses.create(model=MODEL_NAME, input="Hello there", max_output_tokens=8, stream=True,
                                          **GREEDY))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert [item.type for item in final.output] == [item.type for item in whole.output] == ["message"]


def test_input_items_and_a_function_call_round_trip(client):
    history = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "3 degrees"}]
    reply = client.responses.create(model=MODEL_NAME, input=history, tools=[WEATHER], max_output_tokens=4, **GREEDY)
    assert reply.status == "incomplete" and reply.usage.input_tokens > 0


def test_a_required_call_whole_and_streamed(client):
    reply = client.responses.create(model=MODEL_NAME, input="Weather?", tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=200, temperature=0)
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and reply.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client.responses.create(model=MODEL_NAME, input="Weather?", tools=[WEATHER], temperature=0,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=200, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and len(deltas) > 1 and "".join(deltas) == done[0].arguments
    jsonschema.validate(json.loads(done[0].arguments), WEATHER["parameters"])
    assert events[-1].response.output[-1].arguments == done[0].arguments


def test_text_format_constrains_the_output(client):
    fmt = {"format": {"type": "json_schema", "name": "check", "schema": SCHEMA, "strict": True}}
    reply = client.responses.create(model=MODEL_NAME, input="Is it ok?", text=fmt, max_output_tokens=30,
                                    temperature=0)
    jsonschema.validate(json.loads(reply.output_text), SCHEMA)
    assert reply.text.format.type == "json_schema"


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store"),
    ({"background": True}, "background"), ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"), ({"input": ""}, "input"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"), ({"truncation": "auto"}, "truncation"),
    ({"metadata": {"a": 1}}, "metadata"), ({"include": ["file_search_call.results"]}, "include"),
])
def test_what_a_stateless_text_server_cannot_honour_is_a_400(client, extra, param):
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/responses", body=body, cast_to=object)
    assert refused.value.param == param


def test_thinking_is_a_reasoning_item_before_the_message_and_the_calls():
    text = '<think>Let me see.</think>Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    builder = ResponseBuilder(ReasoningParser("qwen3"), HermesToolCalls(), True)
    events = [e for i in range(0, len(text), 5) for e in builder.feed(text[i:i + 5])] + builder.finish()
    assert [item["type"] for item in builder.items] == ["reasoning", "message", "function_call"]
    assert builder.items[0]["content"][0]["text"] == "Let me see."
    assert builder.items[1]["content"][0]["text"].strip() == "Sure."
    assert json.loads(builder.items[2]["arguments"]) == {"a": 1} and builder.items[2]["name"] == "f"
    assert all(item["status"] == "completed" for item in builder.items)
    thinking = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thinking == "Let me see."
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == [0, 1, 2] and sorted(done) == [0, 1, 2]
