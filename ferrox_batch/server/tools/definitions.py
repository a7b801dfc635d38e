"""Tool calling's vocabulary: a request's tools and `tool_choice`, a parsed call, and what a format's parser
does (`ToolCallParser`).

* **`tool_choice`**: `none` offers the tools and parses nothing; `auto` parses whatever calls the model
  writes; `required` and a named function constrain the output with a grammar (llguidance, as structured
  output) to one or more calls (`required`; exactly one with `parallel_tool_calls: false`) or exactly one
  call of that function, each call's arguments valid JSON of the function's `parameters` schema.
* **Formats**: a chat template that renders tools teaches the Hermes/Qwen blocks (`hermes`); on one that
  does not, the tools are described in a system message and called in a generic JSON object (`generic`),
  as llama.cpp's server does. Either way the text outside the calls is the message's `content`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.server.tools.call_scanner import Event
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

    @classmethod
    def read(cls, value: Any) -> ToolCall | None:
        """A call written as JSON (`{"name": ..., "arguments": ...}`, `parameters` as the arguments' other name;
        arguments given as a string are taken as they are); None when `value` is not one."""
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        return cls(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


@dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str | None
    calls: tuple[ToolCall, ...]


class ToolCallParser(Protocol):
    """Reads one tool-call format, writes the grammar that forces it, and finds its calls in a stream."""

    def parse(self, text: str) -> ParsedReply: ...

    def grammar(self, functions: Sequence[dict[str, Any]], many: bool) -> StructuredOutput: ...

    def segmenter(self) -> Segmenter: ...


class Segmenter(Protocol):
    """One streamed reply's text, split as it comes into content that may stream now and call events
    (`call_scanner`); text it is not sure of yet is held, and the final parse decides what it was."""

    def feed(self, text: str) -> tuple[str, list[Event]]: ...


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


def read_parallel(value: Any) -> bool:
    """`parallel_tool_calls`: whether a reply may hold several calls (default true)."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise InvalidRequest("parallel_tool_calls", value, "must be true or false")
    return value


def forced_functions(tools: Sequence[dict[str, Any]], choice: str) -> tuple[str, ...] | None:
    """The functions a forced `tool_choice` may call: every tool's for `required`, the named one's; None for
    `none` and `auto` (nothing is forced)."""
    if choice == "required":
        return tuple(t["function"]["name"] for t in tools)
    if choice.startswith("function:"):
        return (choice.removeprefix("function:"),)
    return None


def forced_grammar(parser: ToolCallParser, tools: Sequence[dict[str, Any]], choice: str,
                   parallel: bool = True) -> StructuredOutput | None:
    """The grammar `tool_choice` imposes: None for `none` and `auto`."""
    functions = [t["function"] for t in tools]
    if choice == "required":
        return parser.grammar(functions, many=parallel)
    if choice.startswith("function:"):
        name = choice.removeprefix("function:")
        return parser.grammar([f for f in functions if f["name"] == name], many=False)
    return None
