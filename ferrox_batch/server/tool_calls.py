"""Tool calling: the request's tools and `tool_choice`, the grammar that forces a call, and the parsers that
turn a model's text into OpenAI's `tool_calls`.

* **Tools reach the model through its chat template**, which must render them (`Tokenizer.supports_tools`);
  a checkpoint whose template ignores `tools` gets a 400 rather than a model that never heard of them.
* **`tool_choice`**: `none` renders the tools and parses nothing; `auto` parses whatever calls the model
  writes; `required` and a named function constrain the output with a grammar (llguidance, as structured
  output) to one or more calls (`required`) or exactly one call of that function, each call's arguments
  valid JSON of the function's `parameters` schema.
* **Parsers** read one format each (`ToolCallParser`); `HermesToolCalls` reads the Hermes/Qwen format,
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, which Hermes, Qwen2.5 and SmolLM3-style
  templates teach. Text outside the calls stays the message's `content` (null when there is none).
* **Streams** (`ToolStream`): content streams until a call may begin (a tail that could start the tag is
  held back); the calls are parsed from the whole text at the end and sent as one `tool_calls` delta.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.structured import StructuredOutput, check_spec_bytes, json_bytes

#: OpenAI's rule for a function's name.
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: The values of `tool_choice` that are not a named function.
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self) -> dict[str, Any]:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str | None
    calls: tuple[ToolCall, ...]


class ToolCallParser(Protocol):
    """Reads one model family's tool-call format, and writes the grammar that forces it."""

    def parse(self, text: str) -> ParsedReply: ...

    def grammar(self, functions: Sequence[dict[str, Any]], many: bool) -> StructuredOutput: ...


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
                call = json.loads(body)
            except ValueError:
                continue  # not a call after all: it stays in the content
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                arguments = call.get("arguments", call.get("parameters", {}))
                calls.append(ToolCall(call["name"], arguments if isinstance(arguments, str) else
                                      json.dumps(arguments, ensure_ascii=False)))
        if not calls:
            return ParsedReply(text, ())
        kept, at = [], 0
        for start, end, _body in blocks:  # every block goes, calls or not
            kept.append(text[at:start])
            at = end
        kept.append(text[at:])
        rest = "".join(kept).strip()
        return ParsedReply(rest or None, tuple(calls))

    def grammar(self, functions: Sequence[dict[str, Any]], many: bool) -> StructuredOutput:
        """Calls of `functions` (Lark, with each call's JSON by its schema): one or more, or exactly one."""
        schemas = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                    "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
        schema = {"anyOf": schemas} if len(schemas) > 1 else schemas[0]
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        call = f'"{self.OPEN}\\n" %json {json.dumps(schema)} "\\n{self.CLOSE}"'
        start = 'call ("\\n" call)*' if many else "call"
        return StructuredOutput.lark(f"start: {start}\ncall: {call}\n")


def read_tools(value: Any) -> tuple[dict[str, Any], ...]:
    """OpenAI's `tools`: function definitions, returned as `{"type": "function", "function": {...}}`."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequest("tools", value, "must be a list of tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(where, tool, 'must be {"type": "function", "function": {...}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequest(f"{where}.function.name", name, "must be 1-64 letters, digits, _ or -")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise InvalidRequest(f"{where}.function.parameters", parameters, "must be a JSON schema object")
        check_spec_bytes(f"{where}.function.parameters", json_bytes(parameters))  # before any compiling
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequest(f"{where}.function.description", description, "must be a string")
        clean = {"name": name, "parameters": parameters, **({"description": description} if description else {})}
        tools.append({"type": "function", "function": clean})
    if len({t["function"]["name"] for t in tools}) != len(tools):
        raise InvalidRequest("tools", [t["function"]["name"] for t in tools], "names a function twice")
    return tuple(tools)


def read_tool_choice(value: Any, tools: Sequence[dict[str, Any]]) -> str:
    """`none`, `auto`, `required`, or the name of the function that must be called (default: `auto` with
    tools, `none` without)."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in CHOICES:
            raise InvalidRequest("tool_choice", value, f"must be one of {', '.join(CHOICES)} or a named function")
        if value != "none" and not tools:
            raise InvalidRequest("tool_choice", value, "needs tools")
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise InvalidRequest("tool_choice", value, "must name one of the request's tools")
        return f"function:{name}"
    raise InvalidRequest("tool_choice", value, 'must be "none", "auto", "required" or {"type": "function", ...}')


def forced_grammar(parser: ToolCallParser, tools: Sequence[dict[str, Any]], choice: str) -> StructuredOutput | None:
    """The grammar `tool_choice` imposes: None for `none` and `auto`."""
    functions = [t["function"] for t in tools]
    if choice == "required":
        return parser.grammar(functions, many=True)
    if choice.startswith("function:"):
        name = choice.removeprefix("function:")
        return parser.grammar([f for f in functions if f["name"] == name], many=False)
    return None


class ToolStream:
    """One streamed choice's text with tool calls held back: content streams until a call may begin; the
    calls are parsed from the whole text at the end (`HermesToolCalls` marks a call with its open tag).

    Feeding a chunk costs its own length: the chunks are kept in a list (joined once, by `finish`), and
    only the unsent tail, shorter than the open tag, is looked at again.
    """

    def __init__(self, parser: HermesToolCalls) -> None:
        self._parser = parser
        self._chunks: list[str] = []
        self._sent = 0  # characters of the text streamed as content
        self._unsent = ""  # the text after `_sent`, while no call has begun (a tail that could start the tag)
        self._held = False  # a call has begun: nothing more streams as content

    def feed(self, text: str) -> str:
        """The content that may stream now."""
        self._chunks.append(text)
        if self._held:
            return ""
        tag = self._parser.OPEN
        pending = self._unsent + text
        at = pending.find(tag)
        if at >= 0:
            self._held = True
            safe = at
        else:  # keep back a tail that could be the start of the tag
            safe = len(pending)
            for k in range(min(len(tag) - 1, len(pending)), 0, -1):
                if tag.startswith(pending[-k:]):
                    safe = len(pending) - k
                    break
        self._sent += safe
        self._unsent = "" if self._held else pending[safe:]
        return pending[:safe]

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """(the content still to stream, the calls) once the choice is done."""
        text = "".join(self._chunks)
        self._chunks = [text]
        parsed = self._parser.parse(text)
        if not parsed.calls:
            rest, self._sent, self._unsent = text[self._sent:], len(text), ""
            return rest, ()
        content = parsed.content or ""
        streamed = text[:self._sent]
        return (content[len(streamed):] if content.startswith(streamed) else ""), parsed.calls
