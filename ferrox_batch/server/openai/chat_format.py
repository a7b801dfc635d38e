"""`ChatFormat`: the chat endpoint's answer shapes, with what a chat answer may hold besides its text: the
model's thinking (`reasoning`) and its tool calls (`tools`).

A whole answer's text is split into thinking (`message.reasoning_content`, when the server has a reasoning
parser) and the answer, whose tool calls are parsed into `message.tool_calls` (finish reason
`tool_calls`). A stream does the same a piece at a time: thinking goes out as `delta.reasoning_content`,
the answer's content as `delta.content`, its calls as `delta.tool_calls` deltas, each as soon as the
splitters are sure of it; what they held back goes out at the choice's end. A forced call (`tool_choice`
`required` or a named function) is always calls, never content: one cut short (`max_tokens`) is the calls
it began, with their arguments as far as they were written, and the finish reason that cut it
(`tools.cut`). A model that writes the harmony format (`harmony`) has its answers read by
`harmony_choice` instead, into the same fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.server.harmony.choice import HarmonyChoice, harmony_reply
from ferrox_batch.server.openai.logprob_shapes import LogprobShapes
from ferrox_batch.server.reasoning import ReasoningParser, ReasoningSplit
from ferrox_batch.server.openai.wire_format import WireFormat, finish_reason
from ferrox_batch.server.tools.cut import cut_calls
from ferrox_batch.server.tools.definitions import ToolCallParser
from ferrox_batch.server.tools.stream import ToolStream


class ChatFormat(WireFormat):
    id_prefix = "chatcmpl"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    #: With tools: what reads the model's calls out of its text (`tools`), and whether it may make several.
    tool_parser: ToolCallParser | None = None
    parallel_tool_calls = True
    #: The functions a forced `tool_choice` may call (`definitions.forced_functions`); None: not forced.
    forced_functions: tuple[str, ...] | None = None
    #: What splits the model's thinking from its answer (`--reasoning-parser`); None: no thinking is read.
    reasoning: ReasoningParser | None = None
    #: Whether answers are in the harmony format (thinking, content and calls read by `harmony_choice`).
    harmony = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._streams: dict[int, ToolStream] = {}  # per streamed choice, with tools
        self._splits: dict[int, ReasoningSplit] = {}  # per streamed choice, with a reasoning parser
        self._harmony: dict[int, HarmonyChoice] = {}  # per streamed choice, in the harmony format

    # ------------------------------------------------------------------ streams

    def stream_chunks(self, index: int, text: str, logprobs: Sequence[TokenLogprob] = (),
                      token_ids: Sequence[int] = ()) -> list[dict[str, Any]]:
        if self.harmony:
            return self._harmony_chunks(index, self._harmony_choice(index).feed(text), logprobs, token_ids)
        chunks: list[dict[str, Any]] = []
        if self.reasoning is not None:
            split = self._splits.setdefault(index, ReasoningSplit(self.reasoning.implicit))
            thinking, text = split.feed(text)
            if thinking:
                chunks.append(self._delta_chunk(index, {"reasoning_content": thinking}, logprobs, token_ids))
                logprobs, token_ids = (), ()
        return chunks + self._answer_chunks(index, text, logprobs, token_ids)

    def _answer_chunks(self, index: int, text: str, logprobs: Sequence[TokenLogprob] = (),
                       token_ids: Sequence[int] = ()) -> list[dict[str, Any]]:
        """The chunks of the answer's text (after any thinking): content, and tool-call deltas."""
        if self.tool_parser is None:
            return super().stream_chunks(index, text, logprobs, token_ids)
        if index not in self._streams:
            self._streams[index] = ToolStream(self.tool_parser, self.parallel_tool_calls, self.forced_functions)
        content, deltas = self._streams[index].feed(text) if text else ("", [])
        chunks = []
        if content:
            chunks.append(self.text_chunk(index, content, logprobs, token_ids))
            logprobs, token_ids = (), ()
        if deltas:
            chunks.append(self._delta_chunk(index, {"tool_calls": deltas}, logprobs, token_ids))
        return chunks

    def _delta_chunk(self, index: int, delta: dict[str, Any], logprobs: Sequence[TokenLogprob] = (),
                     token_ids: Sequence[int] = ()) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": self._logprobs(index, logprobs) if logprobs else None,
                  "finish_reason": None}
        return self._streamed(index, choice, token_ids)

    def _harmony_choice(self, index: int) -> HarmonyChoice:
        if index not in self._harmony:
            self._harmony[index] = HarmonyChoice(self.tool_parser is not None, self.parallel_tool_calls)
        return self._harmony[index]

    def _harmony_chunks(self, index: int, said: list[tuple[str, Any]], logprobs: Sequence[TokenLogprob] = (),
                        token_ids: Sequence[int] = ()) -> list[dict[str, Any]]:
        """A chunk per piece a harmony choice said (`reasoning_content`, `content`, `tool_calls`), in order."""
        chunks = []
        for kind, piece in said:
            if kind == "content":
                chunks.append(self.text_chunk(index, piece, logprobs, token_ids))
            else:
                key = "reasoning_content" if kind == "reasoning" else kind
                chunks.append(self._delta_chunk(index, {key: piece}, logprobs, token_ids))
            logprobs, token_ids = (), ()
        return chunks

    def closing_chunks(self, index: int, reason: FinishReason) -> tuple[list[dict[str, Any]], str | None]:
        if self.harmony:
            choice = self._harmony_choice(index)
            return self._harmony_chunks(index, choice.finish()), "tool_calls" if choice.calls else None
        chunks: list[dict[str, Any]] = []
        split = self._splits.get(index)
        if split is not None:
            thinking, content = split.finish()
            if thinking:
                chunks.append(self._delta_chunk(index, {"reasoning_content": thinking}))
            chunks += self._answer_chunks(index, content)
        stream = self._streams.get(index)
        if stream is None:
            return chunks, None
        rest, deltas, calls = stream.finish(ended=reason.kind == "stop")
        if rest:
            chunks.append(self.text_chunk(index, rest))
        if deltas:
            chunks.append(self._delta_chunk(index, {"tool_calls": deltas}))
        return chunks, "tool_calls" if calls and not stream.cut else None

    def opening_chunks(self, choices: int) -> list[dict[str, Any]]:
        chunks = []
        for i in range(choices):
            chunk = self._envelope(self.object_chunk, [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            if self.prompt_ids is not None:
                chunk["prompt_token_ids"] = list(self.prompt_ids[0])
            chunks.append(chunk)
        return chunks

    def _chunk_choice(self, text: str | None, reason: str | None) -> dict[str, Any]:
        delta = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}

    # ------------------------------------------------------------------ whole answers

    def _full_choice(self, result: GenerationResult) -> dict[str, Any]:
        if self.harmony:
            return self._harmony_full(result)
        thinking, content = None, result.text
        if self.reasoning is not None:
            thinking, content = self.reasoning.split(result.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = thinking
        reason = finish_reason(result.finish_reason)
        if self.tool_parser is not None and content:
            ended = result.finish_reason.kind == "stop"
            parsed = self.tool_parser.parse(content) if ended or self.forced_functions is None else None
            if parsed is not None and parsed.calls:
                calls = parsed.calls if self.parallel_tool_calls else parsed.calls[:1]
                message["content"] = parsed.content
                message["tool_calls"] = [call.to_openai() for call in calls]
                reason = "tool_calls"
            elif self.forced_functions is not None:  # cut short: the calls it began, never the envelope
                calls = cut_calls(self.tool_parser, content, self.forced_functions, self.parallel_tool_calls)
                message["content"] = None
                if calls:
                    message["tool_calls"] = [call.to_openai() for call in calls]
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}

    def _harmony_full(self, result: GenerationResult) -> dict[str, Any]:
        reply = harmony_reply(result.text, self.tool_parser is not None, self.parallel_tool_calls)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content, "reasoning_content": reply.reasoning}
        reason = finish_reason(result.finish_reason)
        if reply.calls:
            message["tool_calls"] = [call.to_openai() for call in reply.calls]
            reason = "tool_calls"
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}

    def _shape(self, shapes: LogprobShapes, entries: Sequence[TokenLogprob | int], lazy: bool) -> dict[str, Any]:
        return shapes.chat(entries, lazy=lazy)  # type: ignore[arg-type]  # chat has no echo: never an int

    def _request_fields(self, body: dict[str, Any], results: Sequence[GenerationResult]) -> None:
        if self.prompt_ids is not None:
            body["prompt_token_ids"] = list(self.prompt_ids[0])
        if self.prompt_logprobs is not None and results:
            body["prompt_logprobs"] = self._prompt_logprobs(results[0])
