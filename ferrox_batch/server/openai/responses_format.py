"""The Responses API's answer shapes: a `response` object with output items, whole or as a stream of events.

One answer becomes, in order: a `reasoning` item (its thinking, with a reasoning parser), a `message` item
(its text, one `output_text` part), and a `function_call` item per tool call. `ResponseBuilder` makes the
items from the answer's text as it comes, through the same splitters as chat (`reasoning`, `tools`); a whole
answer is its text fed at once, so a stream's final `response.completed` and a whole answer hold the same
items. A stream's events are OpenAI's: `response.created`, `response.in_progress`, then per item
`response.output_item.added`, its deltas (`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`), its closing events, `response.output_item.done`, and at the
end `response.completed`, each numbered (`sequence_number`) and sent as `event: <type>` with its JSON.
A model that writes the harmony format has its text read by `harmony_choice` into the same items.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.replies import Chunk
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.server.http.errors import error_body
from ferrox_batch.server.harmony.choice import HarmonyChoice
from ferrox_batch.server.http.json_body import json_pieces
from ferrox_batch.server.reasoning import ReasoningParser, ReasoningSplit
from ferrox_batch.server.http.streaming import Event
from ferrox_batch.server.openai.wire_format import KEEPALIVE_COMMENT, KEEPALIVE_SECS
from ferrox_batch.server.tools.definitions import ToolCallParser
from ferrox_batch.server.tools.stream import ToolStream
from ferrox_batch.usage import Usage

#: Request fields a response echoes back, with their defaults.
ECHOED = {"instructions": None, "metadata": {}, "parallel_tool_calls": True, "temperature": 1.0, "top_p": 1.0,
          "tool_choice": "auto", "tools": [], "max_output_tokens": None, "text": {"format": {"type": "text"}}}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One answer's output items, made from its text as it comes (`feed`, then `finish`)."""

    def __init__(self, reasoning: ReasoningParser | None, tool_parser: ToolCallParser | None, parallel: bool,
                 forced: Sequence[str] | None = None, harmony: bool = False) -> None:
        """`forced`: the functions a forced `tool_choice` may call (None: not forced; `tools.cut`); `harmony`:
        the text is in the harmony format (`harmony_choice`), and `reasoning` is not used."""
        self._harmony = HarmonyChoice(tool_parser is not None, parallel) if harmony else None
        self._split = None if reasoning is None or harmony else ReasoningSplit(reasoning.implicit)
        self._tools = None if tool_parser is None or harmony else ToolStream(tool_parser, parallel, forced)
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, int] = {}  # "reasoning" / "message" -> the open item's output index
        self._calls: dict[int, int] = {}  # tool-call index -> its item's output index
        self.thinking = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._harmony is not None:
            self._harmony_said(self._harmony.feed(text), events)
            return events
        if self._split is not None:
            thinking, text = self._split.feed(text)
            self._think(thinking, events)
        self._answer(text, events)
        return events

    def finish(self, ended: bool = True) -> list[dict[str, Any]]:
        """What the splitters held back, then every open item closed; `ended`: the answer ran to its natural
        end (else its calls are `incomplete`, a forced one's as far as it was written)."""
        events: list[dict[str, Any]] = []
        if self._harmony is not None:
            self._harmony_said(self._harmony.finish(), events)
        if self._split is not None:
            thinking, text = self._split.finish()
            self._think(thinking, events)
            self._answer(text, events)
        if self._tools is not None:
            rest, deltas, _calls = self._tools.finish(ended)
            self._content(rest, events)
            self._call_deltas(deltas, events)
        for kind in ("reasoning", "message"):
            self._close(kind, events)
        for index in sorted(self._calls.values()):
            item = self.items[index]
            if item["status"] == "in_progress":
                item["status"] = "completed" if ended else "incomplete"
                events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                               "output_index": index, "name": item["name"], "arguments": item["arguments"]})
                events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        return events

    # ------------------------------------------------------------------ pieces

    def _harmony_said(self, said: list[tuple[str, Any]], events: list[dict[str, Any]]) -> None:
        for kind, piece in said:
            if kind == "reasoning":
                self._close("message", events)  # thinking after a message: an item of its own, after it
                self._think(piece, events)
            elif kind == "content":
                self._content(piece, events)
            else:
                self._call_deltas(piece, events)

    def _think(self, thinking: str, events: list[dict[str, Any]]) -> None:
        if not thinking:
            return
        index = self._opened("reasoning", events)
        self.thinking += thinking
        self.items[index]["content"][0]["text"] += thinking
        events.append({"type": "response.reasoning_text.delta", "item_id": self.items[index]["id"],
                       "output_index": index, "content_index": 0, "delta": thinking})

    def _answer(self, text: str, events: list[dict[str, Any]]) -> None:
        if not text:
            return
        if self._tools is None:
            self._content(text, events)
            return
        content, deltas = self._tools.feed(text)
        self._content(content, events)
        self._call_deltas(deltas, events)

    def _content(self, text: str, events: list[dict[str, Any]]) -> None:
        if not text:
            return
        self._close("reasoning", events)
        index = self._opened("message", events)
        item = self.items[index]
        item["content"][0]["text"] += text
        events.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "delta": text, "logprobs": []})

    def _call_deltas(self, deltas: Sequence[dict[str, Any]], events: list[dict[str, Any]]) -> None:
        for delta in deltas:
            function = delta.get("function", {})
            if "id" in delta and delta["index"] not in self._calls:
                for kind in ("reasoning", "message"):
                    self._close(kind, events)
                item = {"type": "function_call", "id": _id("fc"), "call_id": delta["id"], "name": function["name"],
                        "arguments": "", "status": "in_progress"}
                self._calls[delta["index"]] = len(self.items)
                self.items.append(item)
                events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                               "item": dict(item)})
            piece = function.get("arguments", "")
            if piece and delta["index"] in self._calls:
                index = self._calls[delta["index"]]
                self.items[index]["arguments"] += piece
                events.append({"type": "response.function_call_arguments.delta", "item_id": self.items[index]["id"],
                               "output_index": index, "delta": piece})

    def _opened(self, kind: str, events: list[dict[str, Any]]) -> int:
        """The open item of `kind`, opened (with its added events) if there is none."""
        if kind in self._open:
            return self._open[kind]
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        index = self._open[kind] = len(self.items)
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": index,
                       "item": {**item, "content": []}})
        events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "part": {**item["content"][0], "text": ""}})
        return index

    def _close(self, kind: str, events: list[dict[str, Any]]) -> None:
        index = self._open.pop(kind, None)
        if index is None:
            return
        item = self.items[index]
        item["status"] = "completed"
        part = item["content"][0]
        done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append({"type": done, "item_id": item["id"], "output_index": index, "content_index": 0,
                       "text": part["text"], **extra})
        events.append({"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "part": part})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})


class ResponsesFormat:
    """The answer of one `/v1/responses` request: `full` for a whole one, `stream` for its events."""

    media_type = "text/event-stream"
    #: As a Chat Completions stream: SSE comments while the first token is awaited.
    keepalive_interval: float | None = KEEPALIVE_SECS

    def opening(self) -> Sequence[bytes]:
        return ()

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT

    def __init__(self, model: str, rid: str, body: Mapping[str, Any], tokenizer: Tokenizer,
                 reasoning: ReasoningParser | None, tool_parser: ToolCallParser | None, parallel: bool,
                 forced: Sequence[str] | None = None, *, harmony: bool = False) -> None:
        self.id = f"resp_{rid}"
        self.created = int(time.time())
        self.model = model
        self._body = body
        self._tokenizer = tokenizer
        self._builder = ResponseBuilder(reasoning, tool_parser, parallel, forced, harmony)
        self._sequence = 0

    def response(self, status: str, result: GenerationResult | None) -> dict[str, Any]:
        """The `response` object: in progress (no result yet) or done."""
        body: dict[str, Any] = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                                "model": self.model, "output": self._builder.items, "error": None,
                                "incomplete_details": None, "usage": None}
        for field, default in ECHOED.items():
            value = self._body.get(field)
            body[field] = default if value is None else value
        if result is not None:
            if result.finish_reason == FinishReason.LENGTH:
                body["status"] = "incomplete"
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            body["usage"] = self._usage(result.usage)
        return body

    def _usage(self, usage: Usage) -> dict[str, Any]:
        # The thinking's tokens: its text encoded again (the model's own split of them is not kept).
        thinking = len(self._tokenizer.encode(self._builder.thinking, add_special_tokens=False)) \
            if self._builder.thinking else 0
        return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens or 0},
                "output_tokens_details": {"reasoning_tokens": thinking}}

    def full(self, results: Sequence[GenerationResult], usages: Sequence[Usage] | None = None) -> Iterator[str]:
        (result,) = results
        self._builder.feed(result.text)
        self._builder.finish(result.finish_reason.kind == "stop")
        return json_pieces(self.response("completed", result))

    async def stream(self, first: tuple[int, Event], events: AsyncIterator[tuple[int, Event]]) -> AsyncIterator[bytes]:
        """The SSE body from the request's first event to `response.completed` (a failure: `error`)."""
        yield self._event({"type": "response.created", "response": self.response("in_progress", None)})
        yield self._event({"type": "response.in_progress", "response": self.response("in_progress", None)})
        _, event = first
        while True:
            if isinstance(event, Chunk):
                for payload in self._builder.feed(event.text):
                    yield self._event(payload)
            elif isinstance(event.result, GenerationResult):
                for payload in self._builder.finish(event.result.finish_reason.kind == "stop"):
                    yield self._event(payload)
                yield self._event({"type": "response.completed", "response": self.response("completed", event.result)})
                return
            else:
                for piece in self.failure_events(event.error):
                    yield piece
                return
            _, event = await anext(events)

    def failure_events(self, error: BaseException) -> list[bytes]:
        """How a stream that has begun tells a failure: OpenAI's `error` event, with the error's code, message
        and param (Responses streams have no `[DONE]`)."""
        detail = error_body(error)["error"]
        return [self._event({"type": "error", "code": detail.get("code"), "message": detail["message"],
                             "param": detail.get("param")})]

    def _event(self, payload: dict[str, Any]) -> bytes:
        payload["sequence_number"] = self._sequence
        self._sequence += 1
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {payload['type']}\ndata: {data}\n\n".encode("utf-8")
