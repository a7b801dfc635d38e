"""Tools for a model whose chat template does not render them: described in a system message, called in a
generic JSON object, as llama.cpp's server does for such templates.

The model is told the tools (their JSON definitions) and the one form a call takes: the whole reply is
`{"tool_calls": [{"name": ..., "arguments": {...}}]}`. `tool_choice` `required` or a named function
forces that object with a grammar whatever the model would have written, so even a model never trained
on tools calls them; with `auto` the model is free, and a reply that is such an object (alone, or in a
Markdown code fence) is read as calls. Earlier turns are rewritten the same way: an assistant's calls
become that JSON as its content, and a tool's answer becomes a user turn saying which call it answers,
so any template renders them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ferrox_batch import bounded_json
from ferrox_batch.runtime.loading.chat_template import ChatMessage
from ferrox_batch.server.tools.call_scanner import CallScanner, Event
from ferrox_batch.server.tools.definitions import ParsedReply, ToolCall
from ferrox_batch.structured import StructuredOutput

#: What the system message says before the tools' definitions.
INSTRUCTIONS = (
    "You can call the tools below. To call one or more of them, reply with only a JSON object of this form "
    'and nothing else: {"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}. '
    "Otherwise, answer normally.\nThe tools, one JSON definition a line:\n"
)
FENCES = ("```json", "```")


def describe_tools(messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]]) -> list[ChatMessage]:
    """`messages` for a template that does not render tools: the tools in the system message (the first
    one's, or a new one first), earlier calls as JSON content, tool answers as user turns."""
    listing = INSTRUCTIONS + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    out: list[ChatMessage] = []
    for message in messages:
        if message.tool_calls:
            calls = [{"name": c["function"].get("name"), "arguments": c["function"].get("arguments", {})}
                     for c in message.tool_calls]
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            out.append(ChatMessage("assistant", f"{message.content}\n{text}" if message.content else text))
        elif message.role == "tool":
            answer = {"tool_result": message.content, **({"tool_call_id": message.tool_call_id}
                                                         if message.tool_call_id else {})}
            out.append(ChatMessage("user", json.dumps(answer, ensure_ascii=False)))
        else:
            out.append(message)
    if out and out[0].role in ("system", "developer"):
        out[0] = ChatMessage(out[0].role, f"{out[0].content}\n\n{listing}")
    else:
        out.insert(0, ChatMessage("system", listing))
    return out


class GenericToolCalls:
    """`{"tool_calls": [{"name": ..., "arguments": {...}}]}` (or `{"tool_call": {...}}`) as the whole reply."""

    def parse(self, text: str) -> ParsedReply:
        body = text.strip()
        for fence in FENCES:
            if body.startswith(fence) and body.endswith("```") and len(body) > len(fence) + 3:
                body = body[len(fence):-3].strip()
                break
        try:
            value = bounded_json.loads(body)
        except ValueError:  # JsonTooDeep too: nested deeper than a request may nest, it is content
            return ParsedReply(text, ())
        if not isinstance(value, dict):
            return ParsedReply(text, ())
        listed = value.get("tool_calls")
        if listed is None and isinstance(value.get("tool_call"), dict):
            listed = [value["tool_call"]]
        calls = [c for c in map(ToolCall.read, listed if isinstance(listed, list) else ()) if c is not None]
        if not calls:
            return ParsedReply(text, ())
        return ParsedReply(None, tuple(calls))

    def grammar(self, functions: Sequence[dict[str, Any]], many: bool) -> StructuredOutput:
        """The object with one or more calls of `functions` (exactly one unless `many`), each call's arguments
        valid against its function's schema."""
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
        items = {"anyOf": calls} if len(calls) > 1 else calls[0]
        listed: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if not many:
            listed["maxItems"] = 1
        return StructuredOutput.json_schema({"type": "object", "properties": {"tool_calls": listed},
                                             "required": ["tool_calls"], "additionalProperties": False})

    def segmenter(self) -> GenericSegmenter:
        return GenericSegmenter()


class GenericSegmenter:
    """A reply that opens with `{` (or a code fence) may be the call object: held, and read by a
    `CallScanner` for its calls; any other reply is content and streams as it comes."""

    def __init__(self) -> None:
        self._start = ""  # the reply's leading text, until it shows which it is
        self._mode = ""  # "", "content" or "calls"
        self._scanner = CallScanner(_call_path, call_depth=2)

    def feed(self, text: str) -> tuple[str, list[Event]]:
        if self._mode == "content":
            return text, []
        if self._mode == "calls":
            return "", self._scanner.feed(text)
        self._start += text
        head = self._start.lstrip()
        if not head:
            return "", []
        if head.startswith("{"):
            self._mode = "calls"
            return "", self._scanner.feed(head)
        if any(fence.startswith(head[:len(fence)]) for fence in FENCES):
            if len(head) < len(FENCES[0]) + 1 or "\n" not in head:
                return "", []  # may still be a fenced object
            body = head[head.index("\n"):].lstrip()
            if body.startswith("{") or not body:
                self._mode = "calls"
                return "", self._scanner.feed(body)
        self._mode = "content"
        return self._start, []


def _call_path(path: tuple[object, ...]) -> bool:
    """The objects in the root's `tool_calls` list, or its `tool_call` member."""
    return (len(path) == 2 and path[0] == "tool_calls" and isinstance(path[1], int)) or path == ("tool_call",)
