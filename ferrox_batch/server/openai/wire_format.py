"""The OpenAI wire shapes of answers: whole responses and streaming chunks, for both endpoints.

One `WireFormat` per request fixes its `id`, `created` and `model`, so every
chunk of a stream carries the same three, as OpenAI's do. Completions stream
`text_completion` objects with `choices[0].text`; chat streams
`chat.completion.chunk` objects with a `delta`, the first of which carries
`role: assistant` (`chat_format`). Every stream ends with a chunk holding the
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
from ferrox_batch.server.http.json_body import Slices, json_pieces
from ferrox_batch.server.openai.logprob_shapes import LogprobShapes, echo_entries, prompt_logprob_entries
from ferrox_batch.usage import Usage

DONE = b"data: [DONE]\n\n"
#: Seconds an OpenAI stream waits for its first token before it begins with a comment, then between comments:
#: well inside the 60 s idle timeouts of common proxies, and past most refusals (which stay statuses).
KEEPALIVE_SECS = 15.0
#: An SSE comment: every client's event parser skips it.
KEEPALIVE_COMMENT = b": keep-alive\n\n"


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


def combined_usage(usages: Sequence[Usage], per_prompt: int = 0) -> Usage:
    """One request's usage over its choices: each prompt once (the first of every `per_prompt` usages; 0: one
    prompt), with the first one's timings and every prompt's cache hits, and the completion tokens of every
    choice generated (with `best_of`, those not returned too)."""
    first = usages[0]
    if len(usages) == 1:
        return first
    prompts = usages[::per_prompt] if per_prompt else usages[:1]
    cached = [u.cached_tokens for u in prompts]
    return dataclasses.replace(first, prompt_tokens=sum(u.prompt_tokens for u in prompts),
                               completion_tokens=sum(u.completion_tokens for u in usages), total_tokens=None,
                               cached_tokens=None if None in cached else sum(cached))  # type: ignore[arg-type]


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


def output_ids(result: GenerationResult) -> list[int]:
    """The ids a choice generated, as `return_token_ids` reports them: the stop token that ended it too."""
    ids = list(result.token_ids)
    if result.stop_token_id is not None:
        ids.append(result.stop_token_id)
    return ids


class WireFormat:
    """Shapes for one request: `full` for a whole answer, the `*_chunk` methods for a stream.

    A request may have several choices (`n`); every choice-level shape takes the choice's `index`.
    """

    id_prefix = ""
    object_full = ""
    object_chunk = ""
    #: Choices per prompt (`n`): choice i answers prompt i // `choices_per_prompt`.
    choices_per_prompt = 1
    #: Whether each choice carries its tokens' log-probabilities (`logprobs`).
    sends_logprobs = False
    #: Alternatives per prompt token when the request asked for `prompt_logprobs` by name; else None.
    prompt_logprobs: int | None = None
    #: Each prompt's ids when the request asked for `return_token_ids`; else None.
    prompt_ids: Sequence[Sequence[int]] | None = None

    def __init__(self, model: str, request_id: str | None = None, logprobs: Tokenizer | None = None) -> None:
        """`request_id`: the exchange's `X-Request-Id` (a random one when None), after OpenAI's prefix.
        `logprobs`: the tokenizer that names the tokens of the request's log-probabilities (None: it asked
        for none)."""
        self.id = f"{self.id_prefix}-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self._tokenizer = logprobs
        self._shapes: dict[int, LogprobShapes] = {}  # per choice: a completion's text offset runs per choice
        self._opened: set[int] = set()  # streamed choices that have had their first chunk

    def _envelope(self, obj: str, choices: list[dict[str, Any]] | Iterator[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, results: Sequence[GenerationResult], usages: Sequence[Usage] | None = None) -> Iterator[str]:
        """The whole answer's JSON text, in pieces (`json_body.json_pieces`): one choice per result, in order;
        usage counts each prompt once, and the completion tokens of `usages` (every candidate generated;
        default: the results'). Blocking work for a pool: each choice, and each slice of its
        log-probabilities, is made only when the text reaches it, so a big answer is never whole in
        memory, and no one call holds the GIL long."""
        body = self._envelope(self.object_full, (self._full_choice_at(i, r) for i, r in enumerate(results)))
        self._request_fields(body, results)
        every = usages if usages is not None else [r.usage for r in results]
        prompts = max(1, len(results) // self.choices_per_prompt)  # `n` choices were returned per prompt
        body["usage"] = usage_dict(combined_usage(every, len(every) // prompts))
        return json_pieces(body)

    def _request_fields(self, body: dict[str, Any], results: Sequence[GenerationResult]) -> None:
        """Fields of the whole answer beside its choices (chat's prompt ids and log-probabilities)."""

    def _full_choice_at(self, index: int, result: GenerationResult) -> dict[str, Any]:
        choice = self._full_choice(result)
        choice["index"] = index
        choice["logprobs"] = self._logprobs(index, self._entries(index, result), lazy=True)
        if self.prompt_ids is not None:
            choice["token_ids"] = output_ids(result)
        return choice

    def _prompt_logprobs(self, result: GenerationResult) -> Slices | None:
        """vLLM's `prompt_logprobs` of the prompt `result` answered, when asked for by name."""
        if self.prompt_logprobs is None or self._tokenizer is None:
            return None
        return prompt_logprob_entries(LogprobShapes(self._tokenizer), result.prompt_logprobs or (),
                                      self.prompt_logprobs)

    def opening_chunks(self, choices: int) -> list[dict[str, Any]]:
        return []

    def text_chunk(self, index: int, text: str, logprobs: Sequence[TokenLogprob] = (),
                   token_ids: Sequence[int] = ()) -> dict[str, Any]:
        choice = self._chunk_choice(text, None)
        choice["index"] = index
        choice["logprobs"] = self._logprobs(index, logprobs)
        return self._streamed(index, choice, token_ids)

    def final_chunk(self, index: int, reason: str, logprobs: Sequence[TokenLogprob] = (),
                    token_ids: Sequence[int] = ()) -> dict[str, Any]:
        """The choice's chunk with its finish reason; `logprobs` and `token_ids`: those of tokens whose text no
        chunk carried (text held back for a stop string that then matched; the stop token's id)."""
        choice = self._chunk_choice(None, reason)
        choice["index"] = index
        choice["logprobs"] = self._logprobs(index, logprobs) if logprobs else None
        return self._streamed(index, choice, token_ids)

    def _streamed(self, index: int, choice: dict[str, Any], token_ids: Sequence[int]) -> dict[str, Any]:
        """A stream's chunk of one choice, with its tokens' ids when the request asked for them."""
        if self.prompt_ids is not None:
            choice["token_ids"] = list(token_ids)
        first = index not in self._opened
        self._opened.add(index)
        return self._chunk_envelope(index, choice, first)

    def _chunk_envelope(self, index: int, choice: dict[str, Any], first: bool) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [choice])

    def stream_chunks(self, index: int, text: str, logprobs: Sequence[TokenLogprob] = (),
                      token_ids: Sequence[int] = ()) -> list[dict[str, Any]]:
        """The chunks a choice's next text makes now (its tokens' log-probabilities and ids on the first);
        none while it is held back (tool calls)."""
        return [self.text_chunk(index, text, logprobs, token_ids)] if text else []

    def closing_chunks(self, index: int, reason: FinishReason) -> tuple[list[dict[str, Any]], str | None]:
        """Chunks a choice that ended for `reason` still owes, and the finish reason they impose (None: the
        result's)."""
        return [], None

    def usage_chunk(self, usages: Sequence[Usage]) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage_dict(combined_usage(usages, self.choices_per_prompt))
        return body

    def _logprobs(self, index: int, entries: Sequence[TokenLogprob | int], lazy: bool = False) -> dict[str, Any] | None:
        if not self.sends_logprobs or self._tokenizer is None:
            return None
        shapes = self._shapes.get(index)
        if shapes is None:
            shapes = self._shapes[index] = LogprobShapes(self._tokenizer)
        return self._shape(shapes, entries, lazy)

    def _shape(self, shapes: LogprobShapes, entries: Sequence[TokenLogprob | int], lazy: bool) -> dict[str, Any]:
        raise NotImplementedError

    def _entries(self, index: int, result: GenerationResult) -> Sequence[TokenLogprob | int]:
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
    #: With `echo`: each prompt's ids and text, which each of its choices starts with.
    echo: Sequence[tuple[Sequence[int], str]] | None = None
    #: Alternatives per echoed prompt token (`logprobs`).
    echo_top = 0

    def _full_choice(self, result: GenerationResult) -> dict[str, Any]:
        return {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish_reason(result.finish_reason)}

    def _full_choice_at(self, index: int, result: GenerationResult) -> dict[str, Any]:
        choice = super()._full_choice_at(index, result)
        prompt = index // self.choices_per_prompt
        if self.echo is not None:
            choice["text"] = self.echo[prompt][1] + choice["text"]
        if self.prompt_ids is not None:
            choice["prompt_token_ids"] = list(self.prompt_ids[prompt])
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(result)
        return choice

    def _chunk_envelope(self, index: int, choice: dict[str, Any], first: bool) -> dict[str, Any]:
        if first and self.prompt_ids is not None:
            choice["prompt_token_ids"] = list(self.prompt_ids[index // self.choices_per_prompt])
        return self._envelope(self.object_chunk, [choice])

    def _entries(self, index: int, result: GenerationResult) -> Sequence[TokenLogprob | int]:
        ids = self.echo[index // self.choices_per_prompt][0] if self.echo is not None else ()
        if not ids:
            return super()._entries(index, result)
        # The prompt's entries first; its first token has none (nothing predicts it). They carry as many
        # alternatives as `logprobs` asks, though `prompt_logprobs` may have had more computed.
        return echo_entries(ids[0], result.prompt_logprobs or (), self.echo_top, result.logprobs or ())

    def _shape(self, shapes: LogprobShapes, entries: Sequence[TokenLogprob | int], lazy: bool) -> dict[str, Any]:
        return shapes.completion(entries, lazy=lazy)

    def _chunk_choice(self, text: str | None, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
