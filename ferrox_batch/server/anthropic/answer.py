"""A Messages answer: the engine's answer written as Anthropic's `message`, whole or as its stream of events.

The answer's text is read by the same splitters as chat and the Responses API (`ResponseBuilder`: the
reasoning parser, the tool-call parser, or the harmony reader) into items, which are Anthropic's content
blocks in order: a `thinking` block (its `signature` empty: nothing here signs thinking), `text` blocks,
and a `tool_use` block per call (`toolu_` ids, its input the call's arguments as an object). A whole
answer is its text fed at once, so a stream's blocks and a whole answer's are the same.

A stream is Anthropic's event grammar, each as `event: <type>` with its JSON: `message_start` (the
message, no content yet, the prompt's tokens), then per block `content_block_start`, its deltas
(`text_delta`, `thinking_delta` then a `signature_delta`, `input_json_delta`) and `content_block_stop`,
blocks strictly one after another (`BlockOrder`), then `message_delta` (stop reason, stop sequence, usage)
and `message_stop`. While the first token is not out (a long prompt being read, a queue), a `ping` goes
out every `keepalive_interval` seconds; a failure once the stream has begun is an `error` event in Anthropic's
error shape, and ends it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from ferrox_batch.errors import DecodeError
from ferrox_batch.generation_types import GenerationResult
from ferrox_batch.replies import Chunk
from ferrox_batch.server.anthropic.errors import ANTHROPIC_ERRORS
from ferrox_batch.server.http.errors import error_body
from ferrox_batch.server.http.json_body import json_pieces
from ferrox_batch.server.reasoning import ReasoningParser
from ferrox_batch.server.openai.responses_format import ResponseBuilder
from ferrox_batch.server.http.streaming import Event
from ferrox_batch.server.tools.definitions import ToolCallParser
from ferrox_batch.usage import Usage

#: Seconds between `ping` events while a stream waits for its first token (and what a stream waits for it
#: before it begins: a refusal that comes sooner is still a status, not an event).
PING_INTERVAL_SECS = 5.0
#: Deltas of the Responses items, by the block delta they become.
DELTAS = {"response.output_text.delta": ("text_delta", "text"),
          "response.reasoning_text.delta": ("thinking_delta", "thinking"),
          "response.function_call_arguments.delta": ("input_json_delta", "partial_json")}


def event(payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n".encode("utf-8")


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def block(item: dict[str, Any], whole: bool) -> dict[str, Any]:
    """The content block of a Responses item: as it ends (`whole`), or as it starts (empty)."""
    if item["type"] == "reasoning":
        return {"type": "thinking", "thinking": item["content"][0]["text"] if whole else "", "signature": ""}
    if item["type"] == "message":
        return {"type": "text", "text": item["content"][0]["text"] if whole else ""}
    arguments: Any = {}
    if whole:
        try:
            arguments = json.loads(item["arguments"]) if item["arguments"] else {}
        except ValueError:  # a call cut short by max_tokens: its input is not whole
            arguments = {}
        if not isinstance(arguments, dict):
            arguments = {}
    return {"type": "tool_use", "id": tool_use_id(item["call_id"]), "name": item["name"], "input": arguments}


class BlockOrder:
    """Anthropic's blocks go one at a time, where the items they come from may overlap (several tool calls
    stay open until the answer ends): the first unfinished block's events go out as they come, a later
    block's are held until every block before it has stopped."""

    def __init__(self) -> None:
        self._current = 0
        self._held: dict[int, list[dict[str, Any]]] = {}
        self._done: set[int] = set()

    def add(self, index: int, payload: dict[str, Any]) -> list[dict[str, Any]]:
        if index == self._current:
            return [payload]
        self._held.setdefault(index, []).append(payload)
        return []

    def stop(self, index: int) -> list[dict[str, Any]]:
        self._done.add(index)
        out: list[dict[str, Any]] = []
        while self._current in self._done:
            out.append({"type": "content_block_stop", "index": self._current})
            self._current += 1
            out += self._held.pop(self._current, [])
        return out


class MessagesFormat:
    """The answer of one `/v1/messages` request: `full` for a whole one, `stream` for its events."""

    #: Seconds between pings while the first token is awaited (a class attribute: tests shrink it).
    keepalive_interval: float | None = PING_INTERVAL_SECS
    media_type = "text/event-stream"

    def __init__(self, model: str, prompt_tokens: int, reasoning: ReasoningParser | None,
                 tool_parser: ToolCallParser | None, parallel: bool, forced: Sequence[str] | None = None, *,
                 harmony: bool = False) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self._prompt_tokens = prompt_tokens
        self._builder = ResponseBuilder(reasoning, tool_parser, parallel, forced, harmony)
        self._order = BlockOrder()
        self._thinking: set[int] = set()  # the blocks that are thinking (they close with a signature)

    def message(self, result: GenerationResult | None) -> dict[str, Any]:
        """The `message` object: as it starts (no result yet: no content) or whole."""
        content = [block(item, True) for item in self._builder.items] if result is not None else []
        reason, sequence = self._stop(result) if result is not None else (None, None)
        usage = (self._usage(result.usage) if result is not None
                 else {"input_tokens": self._prompt_tokens, "output_tokens": 0})
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage}

    def _stop(self, result: GenerationResult) -> tuple[str, str | None]:
        reason = result.finish_reason
        if reason.kind == "length":
            return "max_tokens", None
        if reason.kind == "stop_sequence":
            return "stop_sequence", reason.stop
        if any(item["type"] == "function_call" for item in self._builder.items):
            return "tool_use", None
        return "end_turn", None

    @staticmethod
    def _usage(usage: Usage) -> dict[str, Any]:
        # Anthropic's input_tokens leave out what the prompt cache supplied (cache_read_input_tokens).
        cached = usage.cached_tokens or 0
        return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def full(self, results: Sequence[GenerationResult], usages: Sequence[Usage] | None = None) -> Iterator[str]:
        (result,) = results
        self._builder.feed(result.text)
        self._builder.finish(result.finish_reason.kind == "stop")
        return json_pieces(self.message(result))

    def opening(self) -> Sequence[bytes]:
        """`message_start`: the message, no content yet, the prompt's tokens."""
        return [event({"type": "message_start", "message": self.message(None)})]

    def keepalive(self) -> bytes:
        return event({"type": "ping"})

    async def stream(self, first: tuple[int, Event], events: AsyncIterator[tuple[int, Event]]) -> AsyncIterator[bytes]:
        """The SSE body after `message_start`: the blocks from `first` (the request's first event) on, to
        `message_stop` (a failure: an `error` event)."""
        _, got = first
        while True:
            if isinstance(got, Chunk):
                for payload in self._blocks(self._builder.feed(got.text)):
                    yield event(payload)
            elif isinstance(got.result, GenerationResult):
                result = got.result
                for payload in self._blocks(self._builder.finish(result.finish_reason.kind == "stop")):
                    yield event(payload)
                message = self.message(result)
                yield event({"type": "message_delta", "usage": message["usage"],
                             "delta": {"stop_reason": message["stop_reason"],
                                       "stop_sequence": message["stop_sequence"]}})
                yield event({"type": "message_stop"})
                return
            else:
                for piece in self.failure_events(got.error):
                    yield piece
                return
            _, got = await anext(events)

    def _blocks(self, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The block events of the builder's item events, in Anthropic's order."""
        out: list[dict[str, Any]] = []
        for payload in payloads:
            kind = payload["type"]
            if kind == "response.output_item.added":
                index = payload["output_index"]
                start = block(payload["item"], False)
                if start["type"] == "thinking":
                    self._thinking.add(index)
                out += self._order.add(index, {"type": "content_block_start", "index": index, "content_block": start})
            elif kind in DELTAS:
                index = payload["output_index"]
                delta_type, key = DELTAS[kind]
                out += self._order.add(index, {"type": "content_block_delta", "index": index,
                                               "delta": {"type": delta_type, key: payload["delta"]}})
            elif kind == "response.output_item.done":
                index = payload["output_index"]
                if index in self._thinking:
                    out += self._order.add(index, {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "signature_delta", "signature": ""}})
                out += self._order.stop(index)
        return out

    def failure_events(self, error: BaseException) -> list[bytes]:
        """How a stream that has begun tells a failure: Anthropic's `error` event, with its error body."""
        status = error.http_status if isinstance(error, DecodeError) else 500
        _, body = ANTHROPIC_ERRORS.translate(status, error_body(error))
        return [event(body)]
