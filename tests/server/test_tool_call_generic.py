"""The generic tool-call format (tools described in a system message, calls as one JSON object) and the
scanner that streams any call's arguments.

Pins: the object's calls parse (alone, in a code fence, `tool_call` for one), anything else is content;
the forcing grammar compiles and holds one call or several; the tools land in the system message and
earlier calls and tool answers become JSON turns; streamed, whatever the chunking, each call's name comes
once and its arguments' deltas add up to the whole parse's value, for any JSON arguments; a reply that is
not an object streams as content at once.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.runtime.loading.chat_template import ChatMessage
from ferrox_batch.server.tools.call_scanner import Arguments, CallScanner, Closed, Named
from ferrox_batch.server.tools.definitions import ToolCall
from ferrox_batch.server.tools.generic import GenericToolCalls, describe_tools
from ferrox_batch.server.tools.stream import ToolStream

PARSER = GenericToolCalls()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from('ab"\\{}[],: \n\u00e9'), max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12)


def chunks(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_the_object_parses_and_anything_else_is_content():
    text = '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]}'
    assert PARSER.parse(text).calls == (ToolCall("f", '{"a": 1}'), ToolCall("g", "{}"))
    assert PARSER.parse(text).content is None
    assert PARSER.parse('```json\n{"tool_call": {"name": "f", "arguments": {}}}\n```').calls == (ToolCall("f", "{}"),)
    for other in ("hello", '{"answer": 1}', '{"tool_calls": []}', "[1]", '{"tool_calls": [{"arguments": {}}]}'):
        assert PARSER.parse(other).calls == () and PARSER.parse(other).content == other


def test_the_forcing_grammar_holds_one_or_many(tiny_batch_model):
    from ferrox_batch.runtime.sampling.grammar import Grammars

    tokenizer = tiny_batch_model.tokenizer
    grammars = Grammars(tokenizer.inner.to_str(), tiny_batch_model.config.vocab_size, sorted(tokenizer.stop_tokens.ids))
    functions = [WEATHER["function"], {"name": "g", "parameters": {"type": "object"}}]
    one, many = PARSER.grammar(functions, many=False), PARSER.grammar(functions, many=True)
    assert json.loads(one.schema)["properties"]["tool_calls"]["maxItems"] == 1
    assert "maxItems" not in json.loads(many.schema)["properties"]["tool_calls"]
    assert grammars.compile(one) and grammars.compile(many)


def test_tools_go_in_the_system_message_and_history_becomes_json():
    history = [ChatMessage("user", "Weather?"),
               ChatMessage("assistant", "", ({"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},)),
               ChatMessage("tool", "3 degrees", tool_call_id="call_1")]
    out = describe_tools(history, [WEATHER])
    assert out[0].role == "system" and '"get_weather"' in out[0].content and "tool_calls" in out[0].content
    assert json.loads(out[2].content) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
    assert out[3].role == "user" and json.loads(out[3].content) == {"tool_result": "3 degrees", "tool_call_id": "call_1"}
    with_system = describe_tools([ChatMessage("system", "Be brief."), *history[:1]], [WEATHER])
    assert len(with_system) == 2 and with_system[0].content.startswith("Be brief.\n\n")


@settings(max_examples=300, deadline=None)
@given(arguments=st.lists(json_values, min_size=1, max_size=3), cuts=st.lists(st.integers(0, 300), max_size=10),
       fenced=st.booleans(), spaced=st.booleans())
def test_streamed_calls_add_up_to_the_whole_parse(arguments, cuts, fenced, spaced):
    calls = [{"name": f"f{i}", "arguments": a} for i, a in enumerate(arguments)]
    text = json.dumps({"tool_calls": calls}, indent=1 if spaced else None, ensure_ascii=False)
    if fenced:
        text = f"```json\n{text}\n```"
    stream = ToolStream(PARSER)
    fed = [stream.feed(piece) for piece in chunks(text, cuts)]
    rest, owed, parsed = stream.finish()
    assert "".join(c for c, _ in fed) + rest == "" and len(parsed) == len(calls)
    assembled: dict[int, dict] = {}
    for delta in [d for _, ds in fed for d in ds] + owed:
        call = assembled.setdefault(delta["index"], {"names": [], "arguments": ""})
        if "id" in delta:
            call["names"].append(delta["function"]["name"])
        call["arguments"] += delta["function"]["arguments"]
    for index, call in enumerate(calls):
        assert assembled[index]["names"] == [call["name"]]  # named once
        got = assembled[index]["arguments"]
        want = call["arguments"]
        assert (got == want) if isinstance(want, str) else (json.loads(got) == want)


def test_a_reply_that_is_not_an_object_streams_at_once():
    stream = ToolStream(PARSER)
    assert [stream.feed(p)[0] for p in ["  ", "Hello", " there"]] == ["", "  Hello", " there"]
    assert stream.finish() == ("", [], ())


@settings(max_examples=300, deadline=None)
@given(value=json_values, cuts=st.lists(st.integers(0, 200), max_size=8), first=st.booleans())
def test_the_scanner_reports_a_calls_name_and_its_arguments_text(value, cuts, first):
    members = [("name", "go"), ("arguments", value)] if first else [("arguments", value), ("name", "go")]
    text = "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in members) + "} trailing"
    scanner = CallScanner(lambda path: path == (), call_depth=0)
    events = [e for piece in chunks(text, cuts) for e in scanner.feed(piece)]
    assert scanner.done
    named = [e for e in events if isinstance(e, Named)]
    assert named == [Named(0, "go")] and events[-1] == Closed(0)
    assert events.index(named[0]) < min((i for i, e in enumerate(events) if isinstance(e, Arguments)), default=99)
    assert "".join(e.text for e in events if isinstance(e, Arguments)) == json.dumps(value)
