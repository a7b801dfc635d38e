"""The Messages answer writer and request translator, without a server.

Pins: an answer with thinking, text and several tool calls is blocks in that order, whole and streamed
alike, however its text is cut into chunks; a stream's blocks go one after another (a later call's events
held until the one before it stopped), each thinking block closing with a signature delta; stop reasons
map as Anthropic's (`max_tokens`, `stop_sequence` with its string, `tool_use`, `end_turn`); the translator
turns blocks into chat messages in order (tool results as `tool` messages, an assistant's text and calls
one turn, earlier thinking dropped) and refuses what it cannot say by name; errors map to Anthropic's
types and statuses (503 -> 529).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.finish_reason import FinishReason
from ferrox_batch.generation_types import GenerationResult
from ferrox_batch.replies import Chunk, Finished
from ferrox_batch.server.anthropic.answer import MessagesFormat
from ferrox_batch.server.anthropic.errors import ANTHROPIC_ERRORS
from ferrox_batch.server.anthropic.request import chat_body
from ferrox_batch.server.reasoning import ReasoningParser
from ferrox_batch.server.tools.hermes import HermesToolCalls
from ferrox_batch.usage import Usage

TEXT = ('<think>Let me see.</think>Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "g", "arguments": {"b": [2]}}</tool_call>')


def result(text: str, reason: FinishReason = FinishReason.STOP) -> GenerationResult:
    return GenerationResult(reason, (), text, Usage.new(7, 3))


def writer() -> MessagesFormat:
    return MessagesFormat("m", 7, ReasoningParser("qwen3"), HermesToolCalls(), True)


def streamed(fmt: MessagesFormat, pieces: list[str], final: GenerationResult) -> list[dict]:
    async def run() -> list[bytes]:
        async def events():
            for piece in pieces[1:]:
                yield 0, Chunk(piece)
            yield 0, Finished(final, 0.0)

        return [*fmt.opening(), *[piece async for piece in fmt.stream((0, Chunk(pieces[0])), events())]]

    out = []
    for raw in asyncio.run(run()):
        name, data = raw.decode().strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        out.append(payload)
    return out


def blocks_of(events: list[dict]) -> list[dict]:
    """The blocks a client accumulates from the events, checking they go one after another."""
    blocks: list[dict] = []
    open_index = None
    for e in events:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == len(blocks)
            open_index = e["index"]
            blocks.append(dict(e["content_block"], partial=""))
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
            d, b = e["delta"], blocks[e["index"]]
            key = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature",
                   "input_json_delta": "partial"}[d["type"]]
            b[key] += d["partial_json" if key == "partial" else key]
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index
            open_index = None
    assert open_index is None
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b["partial"])
        del b["partial"]
    return blocks


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(1, len(TEXT) - 1), max_size=12, unique=True))
def test_a_stream_has_the_whole_answers_blocks_one_after_another(cuts):
    at = [0, *sorted(cuts), len(TEXT)]
    pieces = [TEXT[a:b] for a, b in zip(at, at[1:])]
    events = streamed(writer(), pieces, result(TEXT))
    whole = json.loads("".join(writer().full([result(TEXT)])))
    assert [e["type"] for e in events][:1] == ["message_start"] and events[-1]["type"] == "message_stop"
    got = blocks_of(events)
    for block in got:
        if block["type"] == "tool_use":
            block["id"] = "x"
    for block in whole["content"]:
        if block["type"] == "tool_use":
            assert block["id"].startswith("toolu_")
            block["id"] = "x"
    assert got == whole["content"]
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert whole["content"][0] == {"type": "thinking", "thinking": "Let me see.", "signature": ""}
    assert [b["input"] for b in whole["content"][2:]] == [{"a": 1}, {"b": [2]}]
    assert whole["stop_reason"] == "tool_use" == events[-2]["delta"]["stop_reason"]
    assert whole["usage"] == {"input_tokens": 7, "output_tokens": 3, "cache_read_input_tokens": 0,
                              "cache_creation_input_tokens": 0}


@pytest.mark.parametrize("reason, expected", [
    (FinishReason.LENGTH, ("max_tokens", None)), (FinishReason.stop_sequence("END"), ("stop_sequence", "END")),
    (FinishReason.STOP, ("end_turn", None)),
])
def test_stop_reasons_are_anthropics(reason, expected):
    whole = json.loads("".join(writer().full([result("Just text.", reason)])))
    assert (whole["stop_reason"], whole["stop_sequence"]) == expected


def test_blocks_become_chat_messages_in_order():
    body = {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                  {"type": "text", "text": "Looking."},
                                                  {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"c": 1}}]},
                {"role": "user", "content": [{"type": "text", "text": "Before. "},
                                             {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                             {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                              "content": [{"type": "text", "text": "failed"}]},
                                             {"type": "text", "text": "Thanks."}]}],
            "stop_sequences": ["END"], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
            "metadata": {"user_id": "u1"}, "service_tier": "auto", "thinking": {"type": "disabled"}}
    chat = chat_body(body, thinks=False)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"c": 1}'}}]},
        {"role": "user", "content": "Before. "}, {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: failed"}, {"role": "user", "content": "Thanks."}]
    assert chat["stop"] == ["END"] and chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat["chat_template_kwargs"] == {"enable_thinking": False} and "add_generation_prompt" not in chat


@pytest.mark.parametrize("thinking, thinks, field", [
    ({"type": "enabled", "budget_tokens": 2000}, False, "thinking"),
    ({"type": "enabled", "budget_tokens": 1000}, True, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 4096}, True, "thinking.budget_tokens"),  # not under max_tokens
    ({"type": "sometimes"}, True, "thinking.type"),
])
def test_thinking_is_refused_by_name_where_it_cannot_be_honoured(thinking, thinks, field):
    body = {"model": "m", "max_tokens": 4096, "messages": [{"role": "user", "content": "Hi"}], "thinking": thinking}
    with pytest.raises(InvalidRequest) as refused:
        chat_body(body, thinks=thinks)
    assert refused.value.param == field


def test_thinking_with_a_budget_asks_the_template_to_think():
    body = {"model": "m", "max_tokens": 4096, "messages": [{"role": "user", "content": "Hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024}, "chat_template_kwargs": {"x": 1}}
    assert chat_body(body, thinks=True)["chat_template_kwargs"] == {"enable_thinking": True, "x": 1}


@pytest.mark.parametrize("status, expected", [
    (400, (400, "invalid_request_error")), (401, (401, "authentication_error")), (403, (403, "permission_error")),
    (404, (404, "not_found_error")), (413, (413, "request_too_large")), (429, (429, "rate_limit_error")),
    (500, (500, "api_error")), (503, (529, "overloaded_error")), (422, (422, "invalid_request_error")),
    (502, (502, "api_error")),
])
def test_errors_map_to_anthropics_statuses_and_types(status, expected):
    got, body = ANTHROPIC_ERRORS.translate(status, {"error": {"type": "x", "code": "y", "message": "why"}})
    assert (got, body["error"]["type"]) == expected
    assert body == {"type": "error", "error": {"type": expected[1], "message": "why"}}
