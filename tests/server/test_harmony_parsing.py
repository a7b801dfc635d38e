"""The harmony format (gpt-oss) read from the model's text: `server.harmony` and `server.harmony_choice`.

Pins: each channel goes where vLLM sends it (analysis -> reasoning, final and a recipient-less commentary
-> content, a message to `functions.NAME` -> a call, its JSON arguments re-written compactly), with the
recipient before or after `<|channel|>`; malformed answers (no header, no channel, an unknown channel, an
unterminated message, arguments that are not JSON, a header cut short) read as documented; however a text
is cut into stream pieces, it reads as the whole text does, and no marker reaches the text sent on; the
chat shapes (whole and streamed) and the Responses items carry the same thinking, content and calls.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.server.openai.chat_format import ChatFormat
from ferrox_batch.server.harmony.reading import MARKERS, Call, Header, HarmonyStream, Text, marker_tail
from ferrox_batch.server.harmony.choice import HarmonyChoice, HarmonyToolCalls, harmony_reply
from ferrox_batch.server.openai.responses_format import ResponseBuilder
from ferrox_batch.server.tools.definitions import ToolCall
from ferrox_batch.usage import Usage

THINK_THEN_ANSWER = ("<|channel|>analysis<|message|>The user greets.<|end|>"
                     "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>")
CALL = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"location":"SF"}<|call|>')
CALL_IN_HEADER = ('<|channel|>analysis<|message|>hm<|end|><|start|>assistant to=functions.get_weather'
                  '<|channel|>commentary json<|message|>{"location": "SF", "unit": "C"}')


def read(text: str) -> list:
    stream = HarmonyStream()
    return stream.feed(text) + stream.finish()


@pytest.mark.parametrize("text, reasoning, content, calls", [
    (THINK_THEN_ANSWER, "The user greets.", "Hello!", ()),
    (CALL, "Need weather.", None, (ToolCall("get_weather", '{"location": "SF"}'),)),
    (CALL_IN_HEADER, "hm", None, (ToolCall("get_weather", '{"location": "SF", "unit": "C"}'),)),
    # A preamble (commentary, no recipient) is content, joined to the final answer by a newline.
    ("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.",
     None, "Let me check.\nSunny.", ()),
    # Two analysis messages are joined by a newline; two calls are two calls.
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     '<|start|>assistant<|channel|>commentary to=functions.f<|message|>{}<|end|>'
     '<|start|>assistant<|channel|>commentary to=functions.g json<|message|>[1, 2]',
     "a\nb", None, (ToolCall("f", "{}"), ToolCall("g", "[1, 2]"))),
    # Malformed: no header at all (plain text), no channel, an unknown channel, unterminated messages.
    ("Just text, no harmony.", None, "Just text, no harmony.", ()),
    ("<|message|>no channel", None, "no channel", ()),
    ("<|channel|>weird<|message|>odd channel<|end|>", None, "odd channel", ()),
    ("<|channel|>analysis<|message|>cut short", "cut short", None, ()),
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>fin", "x", None, ()),
    ("<|channel|>final<|message|>", None, None, ()),
    ("", None, None, ()),
    # Arguments that are not JSON are no call: the text is content, as other formats keep it.
    ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": ', None, '{"a": ', ()),
    # A non-JSON content type passes the body as it is; a built-in tool's message is thinking.
    ("<|channel|>commentary to=functions.run <|constrain|>python<|message|>print(1)", None, None,
     (ToolCall("run", "print(1)"),)),
    ("<|channel|>analysis to=browser.search<|message|>q<|call|>", "q", None, ()),
    # A new header without <|end|><|start|>, and a lone "<|" in a body.
    ("<|channel|>analysis<|message|>a <| b<|channel|>final<|message|>c", "a <| b", "c", ()),
])
def test_each_channel_goes_where_vllm_sends_it(text, reasoning, content, calls):
    reply = harmony_reply(text, tools=True)
    assert (reply.reasoning, reply.content, reply.calls) == (reasoning, content, calls)


def test_calls_are_dropped_without_tools_and_kept_first_only_without_parallel():
    two = CALL + '<|start|>assistant<|channel|>commentary to=functions.g<|message|>{"b": 2}'
    assert harmony_reply(two, tools=False).calls == () and harmony_reply(two, tools=False).content is None
    assert [c.name for c in harmony_reply(two, tools=True, parallel=False).calls] == ["get_weather"]
    assert [c.name for c in harmony_reply(two, tools=True).calls] == ["get_weather", "g"]


def test_the_header_is_read_wherever_its_parts_are():
    assert Header.read([(None, " to=functions.f"), ("<|channel|>", "commentary json")]) == \
        Header("commentary", "functions.f", "json")
    header = Header.read([(None, ""), ("<|channel|>", "commentary to=functions.f "), ("<|constrain|>", "json")])
    assert header == Header("commentary", "functions.f", "json") and header.function == "f"
    assert Header("commentary", "functions.").function is None and Header("final").kind == "content"
    assert Header("commentary", "python").kind == "reasoning" and Header("analysis").kind == "reasoning"


def test_text_longer_than_any_header_streams_as_content():
    stream = HarmonyStream(max_header=10)
    assert stream.feed("short") == [] and stream.feed(" and then more") == [Text("content", "short and then more")]
    assert stream.feed("!<|channel|>final<|message|>x") == [Text("content", "!\nx")] and stream.finish() == []
    assert harmony_reply('{"answer": "' + "y" * 200 + '"}', tools=True).content == '{"answer": "' + "y" * 200 + '"}'


def test_only_a_tail_that_could_begin_a_marker_is_held():
    assert marker_tail("abc<|ch") == 4 and marker_tail("abc<") == 1 and marker_tail("abc<|x") == 0
    assert marker_tail("a<|channel") == 9 and marker_tail("<|end|>") == 0 and marker_tail("") == 0


FRAGMENTS = st.sampled_from([
    *MARKERS, "<|", "|>", "<", "<|chan", "nel|>", "assistant", "analysis", "final", "commentary", "weird",
    " to=functions.f", " to=functions.get_weather", " to=browser.open", " json", "json", " ", "\n", "{", "}",
    '"a"', ":", "1", ",", "hi", "é", "to=",
])


def streamed(text: str, cuts: list[int], max_header: int = 128) -> tuple[str, str, list[Call]]:
    stream = HarmonyStream(max_header)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [p for a, b in zip(bounds, bounds[1:]) for p in stream.feed(text[a:b])] + stream.finish()
    said = {kind: "".join(p.text for p in pieces if isinstance(p, Text) and p.kind == kind)
            for kind in ("reasoning", "content")}
    return said["reasoning"], said["content"], [p for p in pieces if isinstance(p, Call)]


@settings(max_examples=600, deadline=None)
@given(fragments=st.lists(FRAGMENTS, max_size=16), cuts=st.lists(st.integers(0, 120), max_size=8),
       max_header=st.integers(1, 12))
def test_a_stream_reads_as_the_whole_text_and_no_marker_gets_through(fragments, cuts, max_header):
    text = "".join(fragments)
    assert streamed(text, cuts, max_header) == streamed(text, [], max_header)  # headers cut short too
    reasoning, content, calls = streamed(text, cuts)
    assert (reasoning, content, calls) == streamed(text, [])
    for said in (reasoning, content, *(c.name for c in calls)):
        assert not any(marker in said for marker in MARKERS)
    reply = harmony_reply(text, tools=True)
    assert (reply.reasoning, reply.content) == (reasoning or None, content or None)
    assert reply.calls == tuple(ToolCall(c.name, c.arguments) for c in calls)


def result(text: str) -> GenerationResult:
    return GenerationResult(FinishReason.STOP, (), text, Usage.new(1, 1))


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_chat_shapes_carry_the_same_thinking_content_and_calls(step):
    text = ("<|channel|>commentary<|message|>Checking.<|end|>" + CALL.replace("<|call|>", ""))
    whole = ChatFormat("m", "r")
    whole.harmony, whole.tool_parser = True, HarmonyToolCalls()
    choice = whole._full_choice(result(text))
    message = choice["message"]
    assert message["reasoning_content"] == "Need weather." and message["content"] == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [("get_weather", '{"location": "SF"}')]
    assert choice["finish_reason"] == "tool_calls"
    stream = ChatFormat("m", "r")
    stream.harmony, stream.tool_parser = True, HarmonyToolCalls()
    chunks = [c for i in range(0, len(text), step) for c in stream.stream_chunks(0, text[i:i + step])]
    closing, reason = stream.closing_chunks(0, FinishReason.STOP)
    deltas = [c["choices"][0]["delta"] for c in chunks + closing]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need weather."
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert [(t["index"], t["function"]["name"], t["function"]["arguments"]) for t in calls] == \
        [(0, "get_weather", '{"location": "SF"}')] and calls[0]["id"].startswith("call_")
    assert reason == "tool_calls"


def test_without_tools_the_chat_answer_is_its_thinking_and_content():
    fmt = ChatFormat("m", "r")
    fmt.harmony = True
    choice = fmt._full_choice(result(THINK_THEN_ANSWER.replace("<|return|>", "")))
    assert choice["message"] == {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets."}
    assert choice["finish_reason"] == "stop"


def test_responses_items_are_the_same_whole_and_streamed():
    text = THINK_THEN_ANSWER.replace("<|return|>", "<|end|><|start|>assistant") + CALL
    whole = ResponseBuilder(None, HarmonyToolCalls(), True, harmony=True)
    whole.feed(text)
    whole.finish()
    stream = ResponseBuilder(None, HarmonyToolCalls(), True, harmony=True)
    for i in range(0, len(text), 5):
        stream.feed(text[i:i + 5])
    stream.finish()
    kinds = [item["type"] for item in whole.items]
    assert kinds == [item["type"] for item in stream.items] == ["reasoning", "message", "reasoning", "function_call"]
    assert whole.items[1]["content"][0]["text"] == "Hello!" and stream.items[1]["content"][0]["text"] == "Hello!"
    assert whole.items[3]["name"] == "get_weather" and json.loads(stream.items[3]["arguments"]) == {"location": "SF"}


def test_a_segmenter_gives_a_call_once_its_message_ends_and_a_forced_call_is_refused():
    segmenter = HarmonyToolCalls().segmenter()
    content, events = segmenter.feed('<|channel|>final<|message|>hi<|end|><|start|>assistant to=functions.f'
                                     '<|channel|>commentary<|message|>{"x": 1}<|end|>')
    assert content == "hi" and [type(e).__name__ for e in events] == ["Named", "Arguments", "Closed"]
    with pytest.raises(InvalidRequest, match="harmony"):
        HarmonyToolCalls().grammar([{"name": "f", "parameters": {}}], many=False)


def test_a_choice_says_its_pieces_in_the_order_written():
    choice = HarmonyChoice(tools=True)
    said = choice.feed("<|channel|>commentary<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b")
    said += choice.finish()
    assert said == [("content", "a"), ("reasoning", "b")]
