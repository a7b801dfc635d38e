"""The Hermes tool-call parser scans in linear time and gives what the regex it replaced gave, on any text.

The regex `<tool_call>\\s*(.*?)\\s*</tool_call>` backtracked: an open tag followed by 3,000 spaces and
no close took seconds (quadratic in the whitespace and more), on the event loop. `ToolStream.feed`
copied the whole text at every chunk (quadratic in a long reply).
"""

from __future__ import annotations

import json
import re
import time

from hypothesis import example, given, settings
from hypothesis import strategies as st

from ferrox_batch.server.tools.definitions import ParsedReply, ToolCall
from ferrox_batch.server.tools.hermes import HermesToolCalls
from ferrox_batch.server.tools.stream import ToolStream

#: The parser this one replaced, verbatim: the reference its results must equal.
OLD_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def regex_parse(text: str) -> ParsedReply:
    calls = []
    for body in OLD_BLOCK.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments", call.get("parameters", {}))
            calls.append(ToolCall(call["name"], arguments if isinstance(arguments, str) else
                                  json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return ParsedReply(text, ())
    rest = OLD_BLOCK.sub("", text).strip()
    return ParsedReply(rest or None, tuple(calls))


#: Fragments that make tags, near-tags, whitespace of every kind `\s` knows, and calls good and bad.
FRAGMENTS = st.sampled_from([
    "<tool_call>", "</tool_call>", "<tool_call", "tool_call>", "</tool_", "<", "/", ">",
    " ", "\n", "\t", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\xa0", "\u2003", "\u3000", "\u200b",
    '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "parameters": "x"}', '{"name": 3}', "[1]", "{",
    "}", "text", "é",
])
TEXTS = st.lists(st.one_of(FRAGMENTS, st.text(max_size=4)), max_size=14).map("".join)


@settings(max_examples=1500, deadline=None)
@given(text=TEXTS)
def test_the_scan_parses_every_text_as_the_regex_did(text):
    assert HermesToolCalls().parse(text) == regex_parse(text)


def test_an_open_tag_followed_by_whitespace_parses_in_linear_time():
    parser = HermesToolCalls()
    started = time.perf_counter()
    for text in ("<tool_call>" + " " * 3000 + "x",  # took about 20 s with the regex
                 "<tool_call>" + " \n" * 500_000,
                 "<tool_call>" * 100_000 + " " * 100_000,
                 ("<tool_call> " + " " * 1000 + "</tool_call>") * 1000):
        parser.parse(text)
    # A megabyte of adversarial text in well under a second (each of these is milliseconds).
    assert time.perf_counter() - started < 1.0


def test_a_long_streamed_reply_is_fed_in_linear_time():
    tag = "<tool_call>"
    for held in (False, True):
        stream = ToolStream(HermesToolCalls())
        pieces = ([tag] if held else []) + ["ab"] * 400_000
        started = time.perf_counter()
        out = "".join(stream.feed(piece)[0] for piece in pieces)
        elapsed = time.perf_counter() - started
        assert out == ("" if held else "ab" * 400_000)
        # Copying the whole text at each chunk took about 30 s here; feeding them is about 0.3 s (1.5 s
        # where the call's JSON is scanned character by character).
        assert elapsed < 10.0, elapsed
        rest, owed, calls = stream.finish()
        assert calls == () and owed == [] and rest == (tag + "ab" * 400_000 if held else "")


@settings(max_examples=500, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(0, 200), max_size=8))
@example(text='a<tool_call>{"name": "g", "parameters": "x"}</tool_call><tool_call>{"name": "f", "arguments": '
              '{"a": [1, "}"]}}</tool_call>', cuts=[3, 20, 40, 61])
def test_streamed_content_and_calls_are_the_whole_parse(text, cuts):
    """Whatever the chunking, the content streamed plus what `finish` adds is the parse of the whole text
    when it has no calls, and a prefix of the content before the first tag when it has."""
    stream = ToolStream(HermesToolCalls())
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    fed = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    streamed = "".join(content for content, _ in fed)
    rest, owed, calls = stream.finish()
    whole = regex_parse(text)
    assert calls == whole.calls
    # The calls assembled from their deltas are the whole parse's, JSON value for JSON value.
    assembled: dict[int, dict] = {}
    for delta in [d for _, deltas in fed for d in deltas] + owed:
        call = assembled.setdefault(delta["index"], {"name": None, "arguments": ""})
        if "id" in delta:
            call["name"] = delta["function"]["name"]
        call["arguments"] += delta["function"]["arguments"]
    for index, call in enumerate(calls):
        assert assembled[index]["name"] == call.name
        assert same_arguments(assembled[index]["arguments"], call.arguments)


def same_arguments(streamed: str, whole: str) -> bool:
    """The same JSON value, or, for arguments the model wrote as a JSON string, the same text."""
    try:
        value = json.loads(whole)
    except ValueError:
        return streamed == whole
    return json.loads(streamed) == value
    if not calls:
        assert streamed + rest == text
    else:
        assert "<tool_call>" not in streamed and text.startswith(streamed)
        assert streamed + rest == (whole.content or "") or rest == ""
