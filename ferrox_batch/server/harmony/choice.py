"""One chat choice in the harmony format (`harmony`), said as OpenAI's answer shapes, and when the server
reads answers that way.

`HarmonyChoice` turns a choice's `Piece`s into what the chat and Responses formats send, in the order
written: thinking (`reasoning_content`), content, and tool calls (one delta each, whole: name, id and
arguments, once the call's message ended). Calls are the answer's only where the request offers tools
(`tool_choice` not `none`), as vLLM reads them; otherwise a call is dropped: its text is the model's
envelope, never content. With `parallel_tool_calls: false` only the first call is kept. A whole answer
is its text fed at once (`harmony_reply`), so it holds what a stream of it sends.

Selection: `--reasoning-parser openai_gptoss` or `--tool-call-parser openai` (vLLM's names) turn harmony
on, and a checkpoint whose family is `gpt_oss` gets both unless told otherwise (`parsers_for_family`).
`HarmonyToolCalls` is the format's `ToolCallParser` (`tools.definitions`): it reads calls out of a
harmony text, and refuses a forced `tool_choice`, whose grammar would have to write the format's
special tokens.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.server.harmony.reading import Call, HarmonyStream, Piece, Text
from ferrox_batch.server.tools.call_scanner import Arguments, Closed, Event, Named
from ferrox_batch.server.tools.definitions import ParsedReply, ToolCall
from ferrox_batch.structured import StructuredOutput

#: vLLM's names: `--reasoning-parser openai_gptoss`, `--tool-call-parser openai`.
HARMONY_REASONING = "openai_gptoss"
HARMONY_TOOLS = "openai"
#: `--tool-call-parser`'s names (the other formats are chosen by the chat template: `server.requests`).
TOOL_CALL_PARSERS = (HARMONY_TOOLS,)
#: The `model_type` of the families that write harmony.
HARMONY_FAMILIES = ("gpt_oss",)
#: The stop tokens that end a harmony answer: a final answer, a call.
STOP_TEXTS = ("<|return|>", "<|call|>")


def parsers_for_family(family: str | None, reasoning_parser: str | None,
                       tool_call_parser: str | None) -> tuple[str | None, str | None]:
    """(`reasoning_parser`, `tool_call_parser`) for a model of `family`: a harmony family gets vLLM's
    harmony names where none was given; any other keeps what was given."""
    if family in HARMONY_FAMILIES:
        return reasoning_parser or HARMONY_REASONING, tool_call_parser or HARMONY_TOOLS
    return reasoning_parser, tool_call_parser


def uses_harmony(reasoning_parser: str | None, tool_call_parser: str | None) -> bool:
    return reasoning_parser == HARMONY_REASONING or tool_call_parser == HARMONY_TOOLS


@dataclass(frozen=True, slots=True)
class HarmonyReply:
    """A whole answer: its thinking, its content (None where there is none) and its calls."""

    reasoning: str | None
    content: str | None
    calls: tuple[ToolCall, ...]


class HarmonyChoice:
    """One choice's text, as it comes, in OpenAI's pieces: `("reasoning", text)`, `("content", text)`,
    `("tool_calls", deltas)`, in the order written."""

    def __init__(self, tools: bool, parallel: bool = True) -> None:
        """`tools`: calls are read (the request offers tools); `parallel`: it may hold several."""
        self._stream = HarmonyStream()
        self._tools = tools
        self._parallel = parallel
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[tuple[str, Any]]:
        return self._said(self._stream.feed(text))

    def finish(self) -> list[tuple[str, Any]]:
        return self._said(self._stream.finish())

    def _said(self, pieces: Sequence[Piece]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, Text):
                out.append((piece.kind, piece.text))
                continue
            assert isinstance(piece, Call)
            if not self._tools or (self.calls and not self._parallel):
                continue
            index = len(self.calls)
            self.calls.append(ToolCall(piece.name, piece.arguments))
            delta = {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": piece.name, "arguments": piece.arguments}}
            if out and out[-1][0] == "tool_calls":
                out[-1][1].append(delta)
            else:
                out.append(("tool_calls", [delta]))
        return out


def harmony_reply(text: str, tools: bool, parallel: bool = True) -> HarmonyReply:
    """A whole answer's text read as a stream of it is."""
    choice = HarmonyChoice(tools, parallel)
    said = choice.feed(text) + choice.finish()
    reasoning = "".join(piece for kind, piece in said if kind == "reasoning")
    content = "".join(piece for kind, piece in said if kind == "content")
    return HarmonyReply(reasoning or None, content or None, tuple(choice.calls))


class HarmonyToolCalls:
    """The harmony format's calls, as a `ToolCallParser`."""

    def parse(self, text: str) -> ParsedReply:
        reply = harmony_reply(text, tools=True)
        return ParsedReply(reply.content, reply.calls)

    def grammar(self, functions: Sequence[dict[str, Any]], many: bool) -> StructuredOutput:
        raise InvalidRequest("tool_choice", [f["name"] for f in functions],
                             'cannot force a call in the harmony format (gpt-oss): use "auto" or "none"')

    def segmenter(self) -> HarmonySegmenter:
        return HarmonySegmenter()


class HarmonySegmenter:
    """A streamed harmony text's content, and its calls' events once each call's message ended."""

    def __init__(self) -> None:
        self._choice = HarmonyChoice(tools=True)

    def feed(self, text: str) -> tuple[str, list[Event]]:
        content: list[str] = []
        events: list[Event] = []
        for kind, piece in self._choice.feed(text):
            if kind == "content":
                content.append(piece)
            elif kind == "tool_calls":
                for delta in piece:
                    function = delta["function"]
                    events += [Named(delta["index"], function["name"]),
                               Arguments(delta["index"], function["arguments"]), Closed(delta["index"])]
        return "".join(content), events
