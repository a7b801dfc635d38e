"""OpenAI's surfaces: Completions, Chat Completions, Responses and embeddings over the engine pipeline.

Their bodies are the engine's own requests (the Responses API's is rewritten into the chat body it amounts
to, `responses_api`), so each surface is which parser reads the body and which shapes write the answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.generation_types import GenerationResult
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.server.http.error_shapes import OPENAI_ERRORS, ErrorShape
from ferrox_batch.server.http.streaming import Event
from ferrox_batch.server.openai.chat_format import ChatFormat
from ferrox_batch.server.openai.embeddings import EmbeddingFormat, EmbeddingRequest, parse_embedding_request
from ferrox_batch.server.openai.responses_api import chat_body
from ferrox_batch.server.openai.responses_format import ResponsesFormat
from ferrox_batch.server.openai.sse_events import failure_events, sse_events
from ferrox_batch.server.openai.wire_format import KEEPALIVE_COMMENT, KEEPALIVE_SECS, CompletionFormat, WireFormat
from ferrox_batch.server.requests import (
    TOOL_FORMATS,
    ChatRequest,
    CompletionRequest,
    parse_completion_request,
)
from ferrox_batch.usage import Usage

if TYPE_CHECKING:
    from ferrox_batch.server.surface import Prepared, Preparing

#: Server-sent events, the media type of every OpenAI stream.
EVENT_STREAM = "text/event-stream"


@dataclass(slots=True)
class SseAnswer:
    """A Chat Completions or Completions answer: `fmt`'s shapes, streamed as OpenAI's server-sent events."""

    fmt: WireFormat
    include_usage: bool
    choices: int
    media_type: ClassVar[str] = EVENT_STREAM
    keepalive_interval: ClassVar[float | None] = KEEPALIVE_SECS

    def opening(self) -> Sequence[bytes]:
        return ()

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT

    def full(self, results: Sequence[GenerationResult], usages: Sequence[Usage] | None = None) -> Iterator[str]:
        return self.fmt.full(results, usages)

    def stream(self, first: tuple[int, Event], events: AsyncIterator[tuple[int, Event]]) -> AsyncIterator[bytes]:
        return sse_events(first, events, self.fmt, self.include_usage, self.choices)

    def failure_events(self, error: BaseException) -> Sequence[bytes]:
        return failure_events(error)


@dataclass(slots=True)
class WholeEmbeddings:
    """An embeddings answer: only ever whole (a streamed one is refused when parsed)."""

    fmt: EmbeddingFormat
    media_type: ClassVar[str] = "application/json"
    keepalive_interval: ClassVar[float | None] = None

    def opening(self) -> Sequence[bytes]:
        return ()

    def keepalive(self) -> bytes:
        return b""

    def full(self, results: Sequence[GenerationResult], usages: Sequence[Usage] | None = None) -> Iterator[str]:
        return self.fmt.full(results, usages)

    def stream(self, first: tuple[int, Event], events: AsyncIterator[tuple[int, Event]]) -> AsyncIterator[bytes]:
        raise InvalidRequest("stream", True, "embeddings are answered whole")

    def failure_events(self, error: BaseException) -> Sequence[bytes]:
        return failure_events(error)


def _openai_format(fmt: WireFormat, prepared: Prepared, preparer: Preparing) -> WireFormat:
    """`fmt` told what the request asked for: choices, log-probabilities, token ids, tool calls, echo."""
    request = prepared.request
    assert isinstance(request, (ChatRequest, CompletionRequest))
    fmt.choices_per_prompt = request.n
    fmt.sends_logprobs = request.options.logprobs is not None
    fmt.prompt_logprobs = request.prompt_logprobs
    if request.return_token_ids:
        fmt.prompt_ids = prepared.prompts
    if isinstance(fmt, ChatFormat):
        fmt.reasoning = preparer.reasoning
        fmt.harmony = preparer.harmony
    if isinstance(request, ChatRequest) and request.parses_tool_calls:
        fmt.tool_parser = TOOL_FORMATS[request.tool_format]  # type: ignore[attr-defined]
        fmt.parallel_tool_calls = request.parallel_tool_calls  # type: ignore[attr-defined]
        fmt.forced_functions = request.forced_functions  # type: ignore[attr-defined]
    if isinstance(request, CompletionRequest) and request.echo:
        fmt.echo_top = request.options.logprobs or 0  # type: ignore[attr-defined]
        fmt.echo = [(ids, prompt if isinstance(prompt, str) and request.truncate_prompt_tokens is None  # type: ignore[attr-defined]
                     else preparer.tokenizer.decode_text(ids)) for ids, prompt in zip(prepared.prompts, request.prompts)]
    return fmt


def _sse_answer(fmt: WireFormat, prepared: Prepared, preparer: Preparing) -> SseAnswer:
    request = prepared.request
    assert isinstance(request, (ChatRequest, CompletionRequest))
    return SseAnswer(_openai_format(fmt, prepared, preparer), request.include_usage, len(prepared.bridges))


def _logprob_names(prepared: Prepared, preparer: Preparing) -> Tokenizer | None:
    """The tokenizer that names the request's log-probabilities' tokens, where it asked for any."""
    request = prepared.request
    asked = request.options.logprobs is not None or request.prompt_logprobs is not None  # type: ignore[union-attr]
    return preparer.tokenizer if asked else None


@dataclass(frozen=True, slots=True)
class CompletionsSurface:
    """`POST /v1/completions`."""

    errors: ErrorShape = OPENAI_ERRORS

    def engine_body(self, body: Mapping[str, Any], preparer: Preparing) -> Mapping[str, Any]:
        return body

    def parse(self, body: Mapping[str, Any], preparer: Preparing) -> CompletionRequest:
        return parse_completion_request(body, default_max_tokens=preparer.default_max_tokens)

    def answer_format(self, prepared: Prepared, preparer: Preparing, rid: str) -> SseAnswer:
        fmt = CompletionFormat(preparer.answer_name(prepared.request), rid, _logprob_names(prepared, preparer))
        return _sse_answer(fmt, prepared, preparer)


@dataclass(frozen=True, slots=True)
class ChatSurface:
    """`POST /v1/chat/completions`."""

    errors: ErrorShape = OPENAI_ERRORS

    def engine_body(self, body: Mapping[str, Any], preparer: Preparing) -> Mapping[str, Any]:
        return body

    def parse(self, body: Mapping[str, Any], preparer: Preparing) -> ChatRequest:
        return preparer.parse_chat(body)

    def answer_format(self, prepared: Prepared, preparer: Preparing, rid: str) -> SseAnswer:
        fmt = ChatFormat(preparer.answer_name(prepared.request), rid, _logprob_names(prepared, preparer))
        return _sse_answer(fmt, prepared, preparer)


@dataclass(frozen=True, slots=True)
class ResponsesSurface:
    """`POST /v1/responses`: said as the chat request it amounts to, checked by the chat parser."""

    errors: ErrorShape = OPENAI_ERRORS

    def engine_body(self, body: Mapping[str, Any], preparer: Preparing) -> Mapping[str, Any]:
        return chat_body(body)

    def parse(self, body: Mapping[str, Any], preparer: Preparing) -> ChatRequest:
        return preparer.parse_chat(body)

    def answer_format(self, prepared: Prepared, preparer: Preparing, rid: str) -> ResponsesFormat:
        request = prepared.request
        assert isinstance(request, ChatRequest) and prepared.body is not None
        parser = TOOL_FORMATS[request.tool_format] if request.parses_tool_calls else None
        return ResponsesFormat(preparer.answer_name(request), rid, prepared.body, preparer.tokenizer,
                               preparer.reasoning, parser, request.parallel_tool_calls, request.forced_functions,
                               harmony=preparer.harmony)


@dataclass(frozen=True, slots=True)
class EmbeddingsSurface:
    """`POST /v1/embeddings`."""

    errors: ErrorShape = OPENAI_ERRORS

    def engine_body(self, body: Mapping[str, Any], preparer: Preparing) -> Mapping[str, Any]:
        return body

    def parse(self, body: Mapping[str, Any], preparer: Preparing) -> EmbeddingRequest:
        return parse_embedding_request(body, default_pooling=preparer.pooling,
                                       hidden_size=preparer.batcher.hidden_size)

    def answer_format(self, prepared: Prepared, preparer: Preparing, rid: str) -> WholeEmbeddings:
        request = prepared.request
        assert isinstance(request, EmbeddingRequest)
        return WholeEmbeddings(EmbeddingFormat(preparer.answer_name(request), request))
