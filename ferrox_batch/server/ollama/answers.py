"""Ollama's answers: NDJSON lines as the answer is written, or one object, for chat, generate and embed.

A generation's answer is the chat (or, for a raw prompt, completion) endpoint's answer rewritten: the
inner `WireFormat` splits the text into thinking, content and tool calls exactly as it does for
`/v1/chat/completions` (reasoning parser, tool-call parser, harmony), and each of its chunks becomes an
Ollama line: `message.content` / `message.thinking` for chat, `response` / `thinking` for generate, each
line `done: false`. Tool calls go out whole, once the answer is done, as Ollama sends them (a line whose
message holds `tool_calls`, each `{"function": {"name", "arguments": <object>}}`; a call whose arguments
are not a JSON object, one cut short, is dropped). The last line is `done: true` with `done_reason`
(`stop`, or `length` when `num_predict` or the context cut it) and the measured durations in nanoseconds:
`total_duration` from the request's arrival to this line, `load_duration` the time it waited for
admission (the model is never loaded per request; waiting for a slot is what Ollama's load time also
covers), `prompt_eval_duration` its prefill, `eval_duration` its decoding, with `prompt_eval_count` and
`eval_count` the tokens of each. With `logprobs`, each line carries its tokens' entries (chat's shape:
`token`, `logprob`, `bytes`, `top_logprobs`), raw prompts' too. A whole answer (`stream: false`) is the
same text fed at once: one object holding what the lines would have held. A failure after the first line
is a last line `{"error": ...}`, as Ollama's streams end.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.replies import Chunk
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.server.openai.embeddings import EmbeddingFormat
from ferrox_batch.server.http.errors import error_body
from ferrox_batch.server.http.json_body import json_pieces
from ferrox_batch.server.openai.logprob_shapes import LogprobShapes
from ferrox_batch.server.ollama.errors import OLLAMA_ERRORS
from ferrox_batch.server.ollama.translation import OLLAMA_CHAT, OLLAMA_EMBEDDINGS
from ferrox_batch.server.ollama.wire import MEDIA_TYPE, created_at, line
from ferrox_batch.server.openai.wire_format import WireFormat
from ferrox_batch.server.http.streaming import Event
from ferrox_batch.usage import Usage

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000


def done_reason(reason: FinishReason) -> str:
    """Ollama's `done_reason`: `length` when the budget or the context cut the answer, else `stop`."""
    return "length" if reason.kind == "length" else "stop"


def durations(usage: Usage, arrival: float) -> dict[str, int]:
    """The final line's counts and measured durations (nanoseconds); `arrival`: when the request came
    (monotonic seconds). The parts were measured inside the total, on the same monotonic clock: the `max`
    only absorbs their rounding to whole nanoseconds."""
    load = round((usage.queue_duration_ms or 0.0) * NS_PER_MS)
    prompt = round((usage.prompt_eval_duration_ms or 0.0) * NS_PER_MS)
    generation = round((usage.generation_duration_ms or 0.0) * NS_PER_MS)
    total = max(round((time.monotonic() - arrival) * NS_PER_S), load + prompt + generation)
    return {"total_duration": total, "load_duration": load, "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": prompt, "eval_count": usage.completion_tokens, "eval_duration": generation}


class OllamaFormat:
    """The answer of one `/api/chat` or `/api/generate` request: `stream` for its lines, `full` whole."""

    media_type = MEDIA_TYPE
    #: An NDJSON stream has no line a client would skip: it begins with its first token.
    keepalive_interval: float | None = None

    def opening(self) -> Sequence[bytes]:
        return ()

    def keepalive(self) -> bytes:
        return b""

    def __init__(self, endpoint: str, model: str, inner: WireFormat, arrival: float,
                 logprobs: Tokenizer | None = None) -> None:
        """`model`: the name as the client sent it; `inner`: the chat (or completion) shapes the text is read
        with; `arrival`: when the request came (monotonic seconds); `logprobs`: the tokenizer that names the
        tokens of the answer's log-probabilities (None: the request asked for none)."""
        self._chat = endpoint == OLLAMA_CHAT
        self.model = model
        self._inner = inner
        self._arrival = arrival
        self._shapes = None if logprobs is None else LogprobShapes(logprobs)
        self._logprobs_sent = 0
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> {"name", "arguments" text}

    # ------------------------------------------------------------------ pieces

    def _said(self, chunks: Sequence[dict[str, Any]]) -> tuple[str, str]:
        """(content, thinking) the inner chunks carry; their tool-call deltas are gathered."""
        content, thinking = [], []
        for chunk in chunks:
            for choice in chunk["choices"]:
                delta = choice.get("delta")
                if delta is None:  # a completion's chunk
                    content.append(choice.get("text") or "")
                    continue
                content.append(delta.get("content") or "")
                thinking.append(delta.get("reasoning_content") or "")
                for call in delta.get("tool_calls") or ():
                    gathered = self._calls.setdefault(call["index"], {"name": "", "arguments": ""})
                    function = call.get("function", {})
                    gathered["name"] = function.get("name") or gathered["name"]
                    gathered["arguments"] += function.get("arguments") or ""
        return "".join(content), "".join(thinking)

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """Ollama's entries (`token`, `logprob`, `bytes`, `top_logprobs`: chat's shape) of `entries`, counted
        as sent; none where the request asked for none."""
        if self._shapes is None or not entries:
            return []
        self._logprobs_sent += len(entries)
        return self._shapes.chat(entries)["content"]

    def _tool_calls(self) -> list[dict[str, Any]]:
        calls = []
        for index in sorted(self._calls):
            call = self._calls[index]
            try:
                arguments = json.loads(call["arguments"] or "{}")
            except ValueError:
                continue
            if isinstance(arguments, dict) and call["name"]:
                calls.append({"function": {"name": call["name"], "arguments": arguments}})
        return calls

    def _object(self, content: str, thinking: str, calls: list[dict[str, Any]] | None = None,
                logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        if self._chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            body["message"] = message
        else:
            body["response"] = content
            if thinking:
                body["thinking"] = thinking
        if logprobs:
            body["logprobs"] = logprobs
        return body

    def _finished(self, result: GenerationResult) -> tuple[str, str]:
        """What the inner shapes still owed at the answer's end (content, thinking)."""
        closing, _reason = self._inner.closing_chunks(0, result.finish_reason)
        return self._said(closing)

    def _final(self, body: dict[str, Any], result: GenerationResult) -> dict[str, Any]:
        body["done"] = True
        body["done_reason"] = done_reason(result.finish_reason)
        body.update(durations(result.usage, self._arrival))
        return body

    # ------------------------------------------------------------------ answers

    def full(self, results: Sequence[GenerationResult], usages: Sequence[Usage] | None = None) -> Iterator[str]:
        """The whole answer: its text fed at once through the same shapes as a stream."""
        (result,) = results
        content, thinking = self._said(self._inner.stream_chunks(0, result.text))
        more, more_thinking = self._finished(result)
        body = self._object(content + more, thinking + more_thinking, self._tool_calls(),
                            self._logprobs(result.logprobs or ()))
        return json_pieces(self._final(body, result))

    async def stream(self, first: tuple[int, Event], events: AsyncIterator[tuple[int, Event]]) -> AsyncIterator[bytes]:
        """The NDJSON lines from the request's first event to the `done: true` line (a failure: `error`)."""
        _, event = first
        while True:
            if isinstance(event, Chunk):
                content, thinking = self._said(self._inner.stream_chunks(0, event.text))
                logprobs = self._logprobs(event.logprobs)
                if content or thinking or logprobs:
                    yield line({**self._object(content, thinking, logprobs=logprobs), "done": False})
            elif isinstance(event.result, GenerationResult):
                content, thinking = self._finished(event.result)
                calls = self._tool_calls()
                # The tokens no chunk carried (text held back for a stop string that then matched).
                logprobs = self._logprobs((event.result.logprobs or ())[self._logprobs_sent:])
                if content or thinking or calls or logprobs:
                    yield line({**self._object(content, thinking, calls, logprobs), "done": False})
                yield line(self._final(self._object("", ""), event.result))
                return
            else:
                for piece in self.failure_events(event.error):
                    yield piece
                return
            _, event = await anext(events)

    def failure_events(self, error: BaseException) -> list[bytes]:
        """How a stream that has begun tells a failure: a last line `{"error": "<message>"}`."""
        _status, body = OLLAMA_ERRORS.translate(500, error_body(error))
        return [line(body)]


class OllamaEmbedFormat:
    """The answer of one `/api/embed` request (`embeddings`, with counts and durations) or `/api/embeddings`
    (one `embedding`): each vector as `/v1/embeddings` makes it (`EmbeddingFormat`). Only ever whole."""

    media_type = "application/json"
    keepalive_interval: float | None = None

    def opening(self) -> Sequence[bytes]:
        return ()

    def keepalive(self) -> bytes:
        return b""

    def stream(self, first: tuple[int, Event], events: AsyncIterator[tuple[int, Event]]) -> AsyncIterator[bytes]:
        raise InvalidRequest("stream", True, "embeddings are answered whole")

    def failure_events(self, error: BaseException) -> list[bytes]:
        _status, body = OLLAMA_ERRORS.translate(500, error_body(error))
        return [line(body)]

    def __init__(self, endpoint: str, model: str, inner: EmbeddingFormat, arrival: float) -> None:
        self._older = endpoint == OLLAMA_EMBEDDINGS
        self.model = model
        self._inner = inner
        self._arrival = arrival

    def full(self, results: Sequence[GenerationResult], usages: Sequence[Usage] | None = None) -> Iterator[str]:
        vectors = [self._inner._item(i, r)["embedding"] for i, r in enumerate(results)]  # the same vector
        if self._older:
            return json_pieces({"embedding": vectors[0]})
        timed = [durations(r.usage, self._arrival) for r in results]
        body = {"model": self.model, "embeddings": vectors,
                "total_duration": max(t["total_duration"] for t in timed),
                "load_duration": max(t["load_duration"] for t in timed),
                "prompt_eval_count": sum(t["prompt_eval_count"] for t in timed)}
        return json_pieces(body)
