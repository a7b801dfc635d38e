"""The Hermes/Qwen tool-call format: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks,
which Hermes, Qwen2.5, Qwen3 and SmolLM3-style chat templates teach.

`HermesToolCalls` parses a whole reply and writes the grammar that forces calls (a block nested deeper than
a request body may nest, `bounded_json`, is not a call: the client could not send it back, and the model's
text is never a failure of the request); `HermesSegmenter` finds
them in a stream: content flows until an open tag (a tail that could start the tag is held back), then
each block's JSON goes through a `CallScanner` (its name, then its arguments as they are written), and
text between or after the blocks waits for the final parse.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ferrox_batch import bounded_json
from ferrox_batch.server.tools.call_scanner import CallScanner, Event
from ferrox_batch.server.tools.definitions import ParsedReply, ToolCall
from ferrox_batch.structured import StructuredOutput


class HermesToolCalls:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (Hermes / Qwen).

    A block runs from an open tag to the first close tag after it; its body, stripped of whitespace,
    is the call. `parse` finds the blocks with a left-to-right scan of the tags, linear in the text
    (a regex with a lazy body between two `\\s*` backtracks: seconds for an open tag and a few
    thousand spaces), and reads them as `<tool_call>\\s*(.*?)\\s*</tool_call>` (DOTALL) would.
    """

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def blocks(self, text: str) -> list[tuple[int, int, str]]:
        """Each block's (start, end, stripped body), left to right, none overlapping."""
        found = []
        at = 0
        while (start := text.find(self.OPEN, at)) >= 0:
            close = text.find(self.CLOSE, start + len(self.OPEN))
            if close < 0:
                break  # no close after this open tag, so none after any later one either
            at = close + len(self.CLOSE)
            found.append((start, at, text[start + len(self.OPEN):close].strip()))
        return found

    def parse(self, text: str) -> ParsedReply:
        calls = []
        blocks = self.blocks(text)
        for _start, _end, body in blocks:
            try:
                call = ToolCall.read(bounded_json.loads(body))
            except ValueError:  # JsonTooDeep too: a call nested deeper than a request may nest
                continue  # not a call after all: it stays in the content
            if call is not None:
                calls.append(call)
        if not calls:
            return ParsedReply(text, ())
        kept, at = [], 0
        for start, end, _body in blocks:  # every block goes, calls or not
            kept.append(text[at:start])
            at = end
        kept.append(text[at:])
        rest = "".join(kept).strip()
        return ParsedReply(rest or None, tuple(calls))

    def segmenter(self) -> HermesSegmenter:
        return HermesSegmenter(self)

    def grammar(self, functions: Sequence[dict[str, Any]], many: bool) -> StructuredOutput:
        """Calls of `functions` (Lark, with each call's JSON by its schema): one or more, or exactly one."""
        schemas = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                    "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
        schema = {"anyOf": schemas} if len(schemas) > 1 else schemas[0]
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        call = f'"{self.OPEN}\\n" %json {json.dumps(schema)} "\\n{self.CLOSE}"'
        start = 'call ("\\n" call)*' if many else "call"
        return StructuredOutput.lark(f"start: {start}\ncall: {call}\n")


def held_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class HermesSegmenter:
    """A streamed reply's content before its first block, and its blocks' call events."""

    def __init__(self, parser: HermesToolCalls) -> None:
        self._parser = parser
        self._unsent = ""  # content not yet sent: a tail that could start the open tag
        self._calls_begun = False
        self._scanner: CallScanner | None = None  # the block being read
        self._offset = 0  # calls of the blocks before it
        self._between = ""  # after a block's JSON: text that may hold the next open tag

    def feed(self, text: str) -> tuple[str, list[Event]]:
        events: list[Event] = []
        if not self._calls_begun:
            pending = self._unsent + text
            at = pending.find(self._parser.OPEN)
            if at < 0:
                keep = held_tail(pending, self._parser.OPEN)
                self._unsent = pending[len(pending) - keep:]
                return pending[:len(pending) - keep], events
            self._calls_begun, self._unsent = True, ""
            content, text = pending[:at], pending[at + len(self._parser.OPEN):]
            self._scanner = CallScanner(_root, self._offset, call_depth=0)
        else:
            content = ""
        while text:
            if self._scanner is not None:
                events += self._scanner.feed(text)
                if not self._scanner.done:
                    break
                # The JSON closed inside this text: what follows it is between blocks.
                text = text[self._scanner.consumed:]
                self._offset += self._scanner.calls
                self._scanner, self._between = None, ""
                continue
            pending = self._between + text
            at = pending.find(self._parser.OPEN)
            if at < 0:
                self._between = pending[len(pending) - held_tail(pending, self._parser.OPEN):]
                break
            text = pending[at + len(self._parser.OPEN):]
            self._scanner = CallScanner(_root, self._offset, call_depth=0)
        return content, events


def _root(path: tuple[object, ...]) -> bool:
    """A Hermes block's call is its root object."""
    return path == ()
