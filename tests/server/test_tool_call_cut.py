"""A forced tool call is always a tool call: an answer cut before its grammar ended is the calls it began.

With `tool_choice` naming a function (or `required`), an answer cut by `max_tokens` came back as `content`
holding the server's internal envelope (`<tool_call>...`, `{"tool_calls": [...`) with finish reason
`length`. Now it is `tool_calls` with the arguments written so far and finish reason `length`, as vLLM
answers, in whole answers and streams, on the chat endpoint and the Responses API; the envelope never
reaches a client.

Pins, for every cut point of an envelope (both formats, one to three calls, one or two functions, with
and without parallel calls): each call whose name is complete comes back with its arguments' text up to
the cut; a call cut before its name is complete comes back (arguments `""`) only as the first call when
one function may be called, else not at all; a stream cut anywhere and chunked anyhow sends no content and
deltas that add up to the same calls. Over HTTP, with the official client and a tiny model, on a template
that renders tools (Hermes blocks) and one that does not (the generic object): the cut call's arguments
are a prefix of the uncut answer's, whole and streamed alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import DEADLINE, MODEL_NAME, openai_client, served, tiny_batcher
from tiny_checkpoint import TOOLS_TEMPLATE, write_tiny_checkpoint

from ferrox_batch.runtime.loading.loader import load_model
from ferrox_batch.server.tools.cut import cut_calls
from ferrox_batch.server.tools.definitions import ToolCall
from ferrox_batch.server.tools.generic import GenericToolCalls
from ferrox_batch.server.tools.hermes import HermesToolCalls
from ferrox_batch.server.tools.stream import ToolStream

PARSERS = {"hermes": HermesToolCalls(), "generic": GenericToolCalls()}


@dataclass(frozen=True)
class Written:
    """One call in an envelope: its name, and where its name ends and its arguments begin and end."""

    name: str
    name_end: int
    arguments_start: int
    arguments_end: int


def envelope(fmt: str, calls: list[tuple[str, str]], spaced: bool) -> tuple[str, list[Written]]:
    """The forced answer holding `calls` ((name, arguments JSON)), and where each call's parts are."""
    sep, colon = (", ", ": ") if spaced else (",", ":")
    text = '{"tool_calls"' + colon + "[" if fmt == "generic" else ""
    written = []
    for i, (name, arguments) in enumerate(calls):
        if i:
            text += sep if fmt == "generic" else "\n"
        if fmt == "hermes":
            text += "<tool_call>\n"
        text += '{"name"' + colon + json.dumps(name)
        name_end = len(text)
        text += sep + '"arguments"' + colon
        written.append(Written(name, name_end, len(text), len(text) + len(arguments)))
        text += arguments + "}"
        if fmt == "hermes":
            text += "\n</tool_call>"
    return text + ("]}" if fmt == "generic" else ""), written


def expected(text: str, written: list[Written], cut: int, functions: list[str], parallel: bool) -> tuple:
    calls = [ToolCall(w.name, text[w.arguments_start:min(cut, w.arguments_end)] if cut > w.arguments_start else "")
             for w in written if cut >= w.name_end]
    if not calls and len(functions) == 1 and cut > 0:
        calls = [ToolCall(functions[0], "")]
    return tuple(calls if parallel else calls[:1])


leaves = st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(alphabet='ab"\\{}[],: \n\u00e9', max_size=5)
arguments = st.dictionaries(st.text(alphabet='ab"\\{ ', max_size=4),
                            st.recursive(leaves, lambda inner: st.lists(inner, max_size=3)
                                         | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=8),
                            max_size=3)


@st.composite
def forced_answers(draw):
    fmt = draw(st.sampled_from(sorted(PARSERS)))
    functions = draw(st.sampled_from([["get_weather"], ["get_weather", "get_time"]]))
    spaced = draw(st.booleans())
    calls = [(draw(st.sampled_from(functions)),
              json.dumps(value, ensure_ascii=False, separators=(", ", ": ") if spaced else (",", ":")))
             for value in draw(st.lists(arguments, min_size=1, max_size=3))]
    text, written = envelope(fmt, calls, spaced)
    return fmt, functions, text, written, draw(st.integers(0, len(text))), draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(forced_answers())
def test_every_cut_of_an_envelope_is_the_calls_it_began(answer):
    fmt, functions, text, written, cut, parallel = answer
    assert cut_calls(PARSERS[fmt], text[:cut], functions, parallel) == expected(text, written, cut, functions,
                                                                                 parallel)


@settings(max_examples=300, deadline=None)
@given(forced_answers(), st.lists(st.integers(0, 10_000), max_size=8))
def test_a_cut_stream_sends_no_content_and_deltas_that_add_up_to_the_calls(answer, cuts):
    fmt, functions, text, written, cut, parallel = answer
    prefix = text[:cut]
    stream = ToolStream(PARSERS[fmt], parallel, functions)
    bounds = sorted({0, len(prefix), *(c % (len(prefix) + 1) for c in cuts)})
    content, deltas = "", []
    for start, end in zip(bounds, bounds[1:]):
        piece, made = stream.feed(prefix[start:end])
        content, deltas = content + piece, deltas + made
    rest, owed, calls = stream.finish(ended=False)
    assert content == "" and rest == "" and stream.cut
    assert calls == expected(text, written, cut, functions, parallel)
    assembled: dict[int, dict] = {}
    for delta in deltas + owed:
        call = assembled.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in delta:
            assert call["id"] is None, "a call's id comes once"
            call["id"], call["name"] = delta["id"], delta["function"]["name"]
        call["arguments"] += delta["function"].get("arguments", "")
    assert [ToolCall(assembled[i]["name"], assembled[i]["arguments"]) for i in sorted(assembled)] == list(calls)


def test_a_forced_answer_that_ran_to_its_end_is_parsed_as_before():
    text, _ = envelope("hermes", [("get_weather", '{"city": "Paris"}')], spaced=True)
    stream = ToolStream(PARSERS["hermes"], True, ["get_weather"])
    stream.feed(text)
    _rest, _owed, calls = stream.finish(ended=True)
    assert calls == (ToolCall("get_weather", '{"city": "Paris"}'),) and not stream.cut


# ---------------------------------------------------------------------------------------------- over HTTP

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                                           "unit": {"enum": ["C", "F"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module", params=["hermes", "generic"])
def tools_server(request, tmp_path_factory):
    """A tiny checkpoint whose template renders tools (Hermes blocks) or does not (the generic object)."""
    template = {"chat_template": TOOLS_TEMPLATE} if request.param == "hermes" else {}
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-cut-{request.param}"), tie=False, std=0.15,
                                   seed=5, max_positions=4096, **template)
    model = load_model(folder, device="cpu", dtype="float32")
    assert model.tokenizer.supports_tools == (request.param == "hermes")
    with served(tiny_batcher(model)) as (base_url, _app):
        yield base_url


def streamed(stream) -> tuple[str, dict[int, dict], list[str]]:
    """A chat stream's content, its calls assembled from their deltas, and its finish reasons."""
    content, calls, reasons = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            reasons += [choice.finish_reason] if choice.finish_reason else []
    return content, calls, reasons


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_cut_forced_call_is_a_tool_call_whole_and_streamed(tools_server, choice):
    tools = [WEATHER] if choice == NAMED else [WEATHER, CLOCK]
    with openai_client(tools_server, timeout=60) as client:
        def ask(max_tokens: int, **options):
            return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=tools, tool_choice=choice,
                                                  max_tokens=max_tokens, temperature=0, parallel_tool_calls=False,
                                                  **options)

        answer = ask(200)
        full = answer.choices[0]
        assert full.finish_reason == "tool_calls"
        (whole_call,) = full.message.tool_calls
        _, uncut, _ = streamed(ask(200, stream=True))
        written = uncut[0]["arguments"]  # the model's own text of them (a whole answer re-encodes the value)
        assert json.loads(written) == json.loads(whole_call.function.arguments)
        # Cut anywhere before the grammar's end: in the tag, the name, the arguments, the closing tag (the tiny
        # tokenizer spends a token on most characters).
        tokens = answer.usage.completion_tokens
        for max_tokens in sorted({1, 12, 30, 40, tokens // 2, 3 * tokens // 4, tokens - 1} & set(range(1, tokens))):
            cut = ask(max_tokens).choices[0]
            assert cut.finish_reason == "length" and cut.message.content is None, cut
            content, calls, reasons = streamed(ask(max_tokens, stream=True))
            assert reasons == ["length"] and content == ""
            if choice == NAMED or cut.message.tool_calls:
                (call,) = cut.message.tool_calls
                assert call.function.name == whole_call.function.name and call.id.startswith("call_")
                # A cut inside a character's bytes ends the text with U+FFFD, as any cut answer's text does.
                assert written.startswith(call.function.arguments.removesuffix("\ufffd"))
                assert [(c["name"], c["arguments"]) for c in calls.values()] == \
                    [(call.function.name, call.function.arguments)]
            else:  # cut before the name said which of the two functions it calls
                assert cut.message.tool_calls is None and calls == {}


def test_a_cut_forced_call_on_the_responses_api_is_an_incomplete_function_call(tools_server):
    body = {"model": MODEL_NAME, "input": MESSAGES[0]["content"], "tools": [{"type": "function", **WEATHER["function"]}],
            "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 60, "temperature": 0}
    whole = httpx.post(f"{tools_server}/v1/responses", json=body, timeout=DEADLINE).json()
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = whole["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["status"] == "incomplete"
    with httpx.stream("POST", f"{tools_server}/v1/responses", json={**body, "stream": True}, timeout=DEADLINE) as reply:
        events = [json.loads(line.removeprefix("data: ")) for line in reply.iter_lines() if line.startswith("data: ")]
    assert not any(e["type"].startswith("response.output_text") for e in events)
    completed = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and completed["status"] == "incomplete"
    (streamed_item,) = completed["output"]
    assert (streamed_item["name"], streamed_item["arguments"], streamed_item["status"]) == \
        (item["name"], item["arguments"], "incomplete")
