"""`HermesToolCalls`: reading `<tool_call>` blocks out of a model's text, and the grammar that forces them.

Pins: one or several well-formed blocks become calls (arguments as JSON text, `parameters` accepted as the
arguments' other name), the text around them is the content (None when nothing is left); a block whose body
is not a call stays in the content; text with no block is all content; the forcing grammar compiles and
validates against a real tokenizer, and is compiled once; streamed, content flows until a call may begin (a tail that could
start the tag is held), a call's name comes in its first delta and its arguments in deltas as they arrive.
"""

from __future__ import annotations

import json

from ferrox_batch.server.tools.definitions import ToolCall
from ferrox_batch.server.tools.hermes import HermesToolCalls
from ferrox_batch.server.tools.stream import ToolStream

PARSER = HermesToolCalls()


def test_blocks_become_calls_and_the_rest_is_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "parameters": {"zone": "UTC"}}</tool_call>')
    parsed = PARSER.parse(text)
    assert parsed.content == "Let me check."
    assert parsed.calls == (ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", '{"zone": "UTC"}'))
    only = PARSER.parse('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert only.content is None and only.calls == (ToolCall("f", "{}"),)


def test_text_that_is_not_a_call_stays_content():
    for text in ("plain answer", "<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 "<tool_call>{\"name\": \"f\""):
        parsed = PARSER.parse(text)
        assert parsed.calls == () and parsed.content == text


def test_calls_are_written_in_openai_shape():
    call = ToolCall("f", '{"a": 1}').to_openai()
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_the_forcing_grammar_compiles(tiny_batch_model):
    from ferrox_batch.runtime.sampling.grammar import Grammars

    tokenizer = tiny_batch_model.tokenizer
    grammars = Grammars(tokenizer.inner.to_str(), tiny_batch_model.config.vocab_size, sorted(tokenizer.stop_tokens.ids))
    functions = [{"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
                 {"name": "g", "parameters": {"type": "object"}}]
    for many in (True, False):
        spec = PARSER.grammar(functions, many)
        assert spec.kind == "lark" and "<tool_call>" in spec.schema and json.dumps("f") in spec.schema
        assert grammars.compile(spec) is grammars.compile(spec)  # compiled once, then kept


def test_a_stream_holds_back_what_may_be_a_call_and_streams_its_arguments():
    stream = ToolStream(PARSER)
    pieces = ["Sure, ", "checking <to", "ol_call>\n{\"name\": \"f\", ", "\"arguments\": {\"a\"", ": 1}}\n</tool_call>"]
    fed = [stream.feed(p) for p in pieces]
    assert [content for content, _ in fed] == ["Sure, ", "checking ", "", "", ""]
    deltas = [d for _, ds in fed for d in ds]
    assert deltas[0]["function"] == {"name": "f", "arguments": ""} and deltas[0]["id"].startswith("call_")
    assert [d["function"]["arguments"] for d in deltas[1:]] == ['{"a"', ": 1}"]
    rest, owed, calls = stream.finish()
    assert rest == "" and owed == [] and calls == (ToolCall("f", '{"a": 1}'),)
    plain = ToolStream(PARSER)
    assert [plain.feed(p)[0] for p in ["a <", "b> c"]] == ["a ", "<b> c"]
    assert plain.finish() == ("", [], ())
    tail = ToolStream(PARSER)
    assert tail.feed("ends with <tool")[0] == "ends with "
    assert tail.finish() == ("<tool", [], ())
