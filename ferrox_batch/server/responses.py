"""The OpenAI wire shapes of answers: whole responses and streaming chunks, for both endpoints.

One `WireFormat` per request fixes its `id`, `created` and `model`, so every
chunk of a stream carries the same three, as OpenAI's do. Completions stream
`text_completion` objects with `choices[0].text`; chat streams
`chat.completion.chunk` objects with a `delta`, the first of which carries
`role: assistant`. Every stream ends with a chunk holding the
`finish_reason`, then (when asked) a usage chunk with `choices: []`, then
`data: [DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from ferrox_batch.generation_types import FinishReason, GenerationResult
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
    """Shapes for one request: `full` for a whole answer, the `*_chunk` methods for a stream."""

    id_prefix = ""
    object_full = ""
    object_chunk = ""

    def __init__(self, model: str, request_id: str | None = None) -> None:
        """`request_id`: the exchange's `X-Request-Id` (a random one when None), after OpenAI's prefix."""
        self.id = f"{self.id_prefix}-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, result: GenerationResult) -> dict[str, Any]:
        body = self._envelope(self.object_full, [self._full_choice(result)])
        body["usage"] = usage_dict(result.usage)
        return body

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [self._chunk_choice(text, None)])

    def final_chunk(self, reason: str) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [self._chunk_choice(None, reason)])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage_dict(usage)
        return body

    def _full_choice(self, result: GenerationResult) -> dict[str, Any]:
        raise NotImplementedError

    def _chunk_choice(self, text: str | None, reason: str | None) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(WireFormat):
    id_prefix = "cmpl"
    object_full = "text_completion"
    object_chunk = "text_completion"

    def _full_choice(self, result: GenerationResult) -> dict[str, Any]:
        return {"index": 0, "text": result.text, "logprobs": None,
                "finish_reason": finish_reason(result.finish_reason)}

    def _chunk_choice(self, text: str | None, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}


class ChatFormat(WireFormat):
    id_prefix = "chatcmpl"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def _full_choice(self, result: GenerationResult) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                "finish_reason": finish_reason(result.finish_reason)}

    def opening_chunks(self) -> list[dict[str, Any]]:
        return [self._envelope(self.object_chunk, [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])]

    def _chunk_choice(self, text: str | None, reason: str | None) -> dict[str, Any]:
        delta = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
