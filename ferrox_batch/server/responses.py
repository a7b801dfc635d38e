"""The OpenAI wire shapes of answers: whole responses and streaming chunks, for both endpoints.

One `WireFormat` per request fixes its `id`, `created` and `model`, so every
chunk of a stream carries the same three, as OpenAI's do. Completions stream
`text_completion` objects with `choices[0].text`; chat streams
`chat.completion.chunk` objects with a `delta`, the first of which carries
`role: assistant`. Every stream ends with a chunk holding the
`finish_reason`, then (when asked) a usage chunk with `choices: []`, then
`data: [DONE]`. A request that asked for log-probabilities gets them on every
choice, in the endpoint's shape (`logprob_shapes`): a stream's chunk carries
those of the tokens generated since the previous chunk. A whole answer is
written as JSON text in pieces (`full`, `json_body`), each choice made only
when the text reaches it.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.server.json_body import json_pieces
from ferrox_batch.server.logprob_shapes import LogprobShapes
from ferrox_batch.server.tool_calls import ToolCallParser, ToolStream
from ferrox_batch.usage import Usage

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def finish_reason(reason: FinishReason) -> str:
    """OpenAI's `finish_reason`. A cancelled request normally has no client left to read this; when
    one must still be answered (the server is shutting down) it reports "stop", an OpenAI value."""
    return "stop" if reason.kind == "cancelled" else reason.as_str()


#: Usage's timings -> the names the usage object carries them under (milliseconds; fields OpenAI does not
#: define, which its clients keep as extras): where the request's time went.
TIMINGS = {"queue_duration_ms": "queue_time_ms", "prompt_eval_duration_ms": "prefill_time_ms",
           "generation_duration_ms": "decode_time_ms", "time_to_first_token_ms": "time_to_first_token_ms"}


def combined_usage(usages: Sequence[Usage]) -> Usage:
    """One request's usage over its choices: the prompt once (the first choice's, with its cache hits and
    timings), the completion tokens of every choice generated (with `best_of`, those not returned too)."""
    first = usages[0]
    if len(usages) == 1:
        return first
    return dataclasses.replace(first, completion_tokens=sum(u.completion_tokens for u in usages),
                               total_tokens=None)


def usage_dict(usage: Usage) -> dict[str, Any]:
    """The OpenAI usage object: the three counts; with the prefix cache on, `prompt_tokens_details.cached_tokens`
    as OpenAI and vLLM report it; and the timings the request has (`TIMINGS`), rounded to microseconds."""
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if usage.cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    for field, name in TIMINGS.items():
        value = getattr(usage, field)
        if value is not None:
            body[name] = round(value, 3)
    return body


class WireFormat:
    """Shapes for one request: `full` for a whole answer, the `*_chunk` methods for a stream.

    A request may have several choices (`n`); every choice-level shape takes the choice's `index`.
    """

    id_prefix = ""
    object_full = ""
    object_chunk = ""

    def __init__(self, model: str, request_id: str | None = None, logprobs: Tokenizer | None = None) -> None:
        """`request_id`: the exchange's `X-Request-Id` (a random one when None), after OpenAI's prefix.
        `logprobs`: the tokenizer that names the tokens of the request's log-probabilities (None: it asked
        for none)."""
        self.id = f"{self.id_prefix}-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self._tokenizer = logprobs
        self._shapes: dict[int, LogprobShapes] = {}  # per choice: a completion's text offset runs per choice

    def _envelope(self, obj: str, choices: list[dict[str, Any]] | Iterator[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, results: Sequence[GenerationResult], usages: Sequence[Usage] | None = None) -> Iterator[str]:
        """The whole answer's JSON text, in pieces (`json_body.json_pieces`): one choice per result, in order;
        usage counts the prompt once, and the completion tokens of `usages` (every candidate generated;
        default: the results'). Blocking work for a pool: each choice, and each slice of its
        log-probabilities, is made only when the text reaches it, so a big answer is never whole in
        memory, and no one call holds the GIL long."""
        body = self._envelope(self.object_full, (self._full_choice_at(i, r) for i, r in enumerate(results)))
        body["usage"] = usage_dict(combined_usage(usages if usages is not None else [r.usage for r in results]))
        return json_pieces(body)

    def _full_choice_at(self, index: int, result: GenerationResult) -> dict[str, Any]:
        choice = self._full_choice(result)
        choice["index"] = index
        choice["logprobs"] = self._logprobs(index, self._entries(result), lazy=True)
        return choice

    def opening_chunks(self, choices: int) -> list[dict[str, Any]]:
        return []

    def text_chunk(self, index: int, text: str, logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        choice = self._chunk_choice(text, None)
        choice["index"] = index
        choice["logprobs"] = self._logprobs(index, logprobs)
        return self._envelope(self.object_chunk, [choice])

    def final_chunk(self, index: int, reason: str, logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        """The choice's chunk with its finish reason; `logprobs`: those of tokens whose text no chunk carried
        (text held back for a stop string that then matched)."""
        choice = self._chunk_choice(None, reason)
        choice["index"] = index
        choice["logprobs"] = self._logprobs(index, logprobs) if logprobs else None
        return self._envelope(self.object_chunk, [choice])

    def streamed_text(self, index: int, text: str) -> str:
        """What of a choice's next text streams now (all of it, unless tool calls are being held back)."""
        return text

    def closing_chunks(self, index: int) -> tuple[list[dict[str, Any]], str | None]:
        """Chunks a choice still owes at its end, and the finish reason they impose (None: the result's)."""
        return [], None

    def usage_chunk(self, usages: Sequence[Usage]) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage_dict(combined_usage(usages))
        return body

    def _logprobs(self, index: int, entries: Sequence[TokenLogprob | int], lazy: bool = False) -> dict[str, Any] | None:
        if self._tokenizer is None:
            return None
        shapes = self._shapes.get(index)
        if shapes is None:
            shapes = self._shapes[index] = LogprobShapes(self._tokenizer)
        return self._shape(shapes, entries, lazy)

    def _shape(self, shapes: LogprobShapes, entries: Sequence[TokenLogprob | int], lazy: bool) -> dict[str, Any]:
        raise NotImplementedError

    def _entries(self, result: GenerationResult) -> Sequence[TokenLogprob | int]:
        """The log-probability entries of a whole answer's choice."""
        return result.logprobs or ()

    def _full_choice(self, result: GenerationResult) -> dict[str, Any]:
        raise NotImplementedError

    def _chunk_choice(self, text: str | None, reason: str | None) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(WireFormat):
    id_prefix = "cmpl"
    object_full = "text_completion"
    object_chunk = "text_completion"
    #: With `echo`: the prompt's ids and text, which each choice starts with.
    echo: tuple[Sequence[int], str] | None = None

    def _full_choice(self, result: GenerationResult) -> dict[str, Any]:
        text = result.text if self.echo is None else self.echo[1] + result.text
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(result.finish_reason)}

    def _entries(self, result: GenerationResult) -> Sequence[TokenLogprob | int]:
        if self.echo is None or not self.echo[0]:
            return super()._entries(result)
        # The prompt's entries first; its first token has none (nothing predicts it).
        ids = self.echo[0]
        return [ids[0], *(result.prompt_logprobs or ())[1:], *(result.logprobs or ())]  # type: ignore[list-item]

    def _shape(self, shapes: LogprobShapes, entries: Sequence[TokenLogprob | int], lazy: bool) -> dict[str, Any]:
        return shapes.completion(entries, lazy=lazy)

    def _chunk_choice(self, text: str | None, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}


class ChatFormat(WireFormat):
    id_prefix = "chatcmpl"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    #: With tools: what reads the model's calls out of its text (`tool_calls`).
    tool_parser: ToolCallParser | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._streams: dict[int, ToolStream] = {}  # per streamed choice, with tools

    def streamed_text(self, index: int, text: str) -> str:
        if self.tool_parser is None:
            return text
        if index not in self._streams:
            self._streams[index] = ToolStream(self.tool_parser)  # type: ignore[arg-type]
        return self._streams[index].feed(text)

    def closing_chunks(self, index: int) -> tuple[list[dict[str, Any]], str | None]:
        stream = self._streams.get(index)
        if stream is None:
            return [], None
        rest, calls = stream.finish()
        chunks = [self.text_chunk(index, rest)] if rest else []
        if not calls:
            return chunks, None
        deltas = [{"index": k, **call.to_openai()} for k, call in enumerate(calls)]
        chunks.append(self._envelope(self.object_chunk, [{"index": index, "delta": {"tool_calls": deltas},
                                                          "logprobs": None, "finish_reason": None}]))
        return chunks, "tool_calls"

    def _full_choice(self, result: GenerationResult) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        reason = finish_reason(result.finish_reason)
        if self.tool_parser is not None:
            parsed = self.tool_parser.parse(result.text)
            if parsed.calls:
                message = {"role": "assistant", "content": parsed.content,
                           "tool_calls": [call.to_openai() for call in parsed.calls]}
                reason = "tool_calls"
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}

    def _shape(self, shapes: LogprobShapes, entries: Sequence[TokenLogprob | int], lazy: bool) -> dict[str, Any]:
        return shapes.chat(entries, lazy=lazy)  # type: ignore[arg-type]  # chat has no echo: never an int

    def opening_chunks(self, choices: int) -> list[dict[str, Any]]:
        return [self._envelope(self.object_chunk, [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            for i in range(choices)]

    def _chunk_choice(self, text: str | None, reason: str | None) -> dict[str, Any]:
        delta = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
