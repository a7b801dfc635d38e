"""`ToolStream`: one streamed choice's text, with its tool calls sent as OpenAI's deltas while they are written.

A call goes out as vLLM sends it: a first delta with the call's `index`, `id`, `type` and `name` (and empty
`arguments`) once its name is known, then deltas of its arguments' text as the model writes them; content
streams where the format's segmenter is sure it is content. At the end the whole text is parsed (the
format's `parse`, the same as a whole answer's): what no delta carried yet goes out then (a call whose
arguments were a JSON string, or that the stream never saw named), with the content still owed; the
streamed arguments are the model's own text of them, where a whole answer writes the parsed value as JSON
(the same JSON value either way). With `parallel_tool_calls: false` only the first call is kept. A forced
call's answer that ended before its grammar did (`finish(ended=False)`) is read as the calls it began
(`cut`): what no delta carried of them goes out then, and no content, ever, for a forced answer.

A feed costs its own length: the text is kept in a list and joined once, at `finish`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ferrox_batch.server.tools.call_scanner import Arguments, Named
from ferrox_batch.server.tools.cut import cut_calls
from ferrox_batch.server.tools.definitions import ToolCall, ToolCallParser


@dataclass(slots=True)
class _Sent:
    id: str
    name: str
    arguments: str = ""
    whole: bool = False  # its arguments are a JSON string: sent once parsed, at the end


class ToolStream:
    def __init__(self, parser: ToolCallParser, parallel: bool = True, forced: Sequence[str] | None = None) -> None:
        """`forced`: the functions a forced `tool_choice` may call (None: the calls are the model's choice)."""
        self._parser = parser
        self._segmenter = parser.segmenter()
        self._parallel = parallel
        self._forced = forced
        self._chunks: list[str] = []
        self._content = 0  # characters streamed as content
        self._sent: dict[int, _Sent] = {}
        #: Set by `finish`: the calls were read from a forced answer cut short, not parsed whole.
        self.cut = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content that may stream now, tool-call deltas) for the choice's next text."""
        self._chunks.append(text)
        content, events = self._segmenter.feed(text)
        self._content += len(content)
        deltas = []
        for event in events:
            if event.call > 0 and not self._parallel:
                continue
            if isinstance(event, Named):
                sent = self._sent[event.call] = _Sent(f"call_{uuid.uuid4().hex[:24]}", event.name)
                deltas.append({"index": event.call, "id": sent.id, "type": "function",
                               "function": {"name": event.name, "arguments": ""}})
            elif isinstance(event, Arguments) and event.call in self._sent:
                sent = self._sent[event.call]
                if not sent.arguments and event.text.startswith('"'):
                    sent.whole = True
                if sent.whole:
                    continue
                sent.arguments += event.text
                deltas.append({"index": event.call, "function": {"arguments": event.text}})
        return content, deltas

    def finish(self, ended: bool = True) -> tuple[str, list[dict[str, Any]], tuple[ToolCall, ...]]:
        """(content still to stream, the deltas still owed, the reply's calls) once the choice is done;
        `ended`: it ran to its natural end (not cut by `max_tokens` or a stop string)."""
        text = "".join(self._chunks)
        self._chunks = [text]
        parsed = self._parser.parse(text) if ended or self._forced is None else None
        if self._forced is not None and (parsed is None or not parsed.calls):
            self.cut = True
            self._content = len(text)
            calls = cut_calls(self._parser, text, self._forced, self._parallel)
            return "", self._owed(calls), calls
        assert parsed is not None
        calls = parsed.calls[:1] if not self._parallel else parsed.calls
        if not calls:
            rest, self._content = text[self._content:], len(text)
            return rest, [], ()
        deltas = []
        for index, call in enumerate(calls):
            sent = self._sent.get(index)
            if sent is None:
                deltas.append({"index": index, **call.to_openai()})
            elif sent.whole or (not sent.arguments and call.arguments):
                deltas.append({"index": index, "function": {"arguments": call.arguments}})
        content = parsed.content or ""
        streamed = text[:self._content]
        return (content[len(streamed):] if content.startswith(streamed) else ""), deltas, calls

    def _owed(self, calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
        """The deltas that complete what was streamed of a cut answer's `calls` (their arguments' text as far
        as the model wrote it: the scanner's text, of which the streamed deltas are a prefix)."""
        deltas = []
        for index, call in enumerate(calls):
            sent = self._sent.get(index)
            if sent is None:
                deltas.append({"index": index, **call.to_openai()})
                continue
            streamed = "" if sent.whole else sent.arguments
            rest = call.arguments[len(streamed):] if call.arguments.startswith(streamed) else ""
            if rest:
                deltas.append({"index": index, "function": {"arguments": rest}})
        return deltas
