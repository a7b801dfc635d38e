"""`Surface`: one API the server speaks, as a translator over the one engine pipeline.

Every API (OpenAI's Chat Completions, Completions, Responses and embeddings, and the others beside them)
says the same few things in its own words. A surface turns its request body into the engine's request
(a chat, completion or embedding request: `engine_body`, then `parse`) and the engine's answer into its
own shapes (`answer_format`: whole, or streamed), and names its error shape. The routes pick a surface;
`generation` and `preparation` run any surface the same way and never ask which one it is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ferrox_batch.generation_types import GenerationResult
from ferrox_batch.server.http.error_shapes import ErrorShape
from ferrox_batch.server.http.streaming import Event, ReplyBridge
from ferrox_batch.usage import Usage

if TYPE_CHECKING:
    from ferrox_batch.engine.handle import ContinuousBatcher
    from ferrox_batch.runtime.loading.tokenizer import Tokenizer
    from ferrox_batch.server.openai.embeddings import EmbeddingRequest
    from ferrox_batch.server.reasoning import ReasoningParser
    from ferrox_batch.server.requests import ChatRequest, CompletionRequest

    EngineRequest = ChatRequest | CompletionRequest | EmbeddingRequest


@dataclass(frozen=True, slots=True)
class Prepared:
    """A parsed request whose choices are all submitted."""

    request: EngineRequest
    bridges: list[ReplyBridge]  # one per candidate: `best_of` per prompt, prompt by prompt
    prompts: list[list[int]]  # each prompt as submitted
    body: Mapping[str, Any] | None = None  # the request's body as sent (what a response echoes)
    arrival: float | None = None  # when the request came (monotonic seconds), for answers that time it


class Preparing(Protocol):
    """What a surface reads of the server that prepares its request (`preparation.Preparer`)."""

    @property
    def batcher(self) -> ContinuousBatcher: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def model_name(self) -> str: ...
    @property
    def aliases(self) -> tuple[str, ...]: ...
    @property
    def default_max_tokens(self) -> int: ...
    @property
    def default_chat_max_tokens(self) -> int: ...
    @property
    def reasoning(self) -> ReasoningParser | None: ...
    @property
    def harmony(self) -> bool: ...
    @property
    def pooling(self) -> str: ...

    def parse_chat(self, body: Mapping[str, Any]) -> ChatRequest:
        """An engine chat request parsed from OpenAI's chat `body`, with this server's defaults."""
        ...

    def answer_name(self, request: EngineRequest) -> str:
        """The model name an answer carries."""
        ...


class AnsweredAtOnce(Exception):
    """Raised by a surface's `engine_body` for a request its API answers without the engine (a load request):
    `body` is the whole answer."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__("answered at once")
        self.body = body


class AnswerFormat(Protocol):
    """How one request's answer is written in its API's shapes."""

    #: The media type of a streamed answer (server-sent events, NDJSON, ...).
    media_type: str
    #: Seconds a stream waits for its first event before it begins anyway, then between its keep-alives
    #: until that event comes (a long prompt read, a queue): proxies cut connections that stay silent.
    #: A refusal that comes sooner is still a status; a later one is told in the stream. None: a stream
    #: begins with its first event, however long that takes.
    keepalive_interval: float | None

    def opening(self) -> Sequence[bytes]:
        """What a stream sends first, before anything of the answer is known."""
        ...

    def keepalive(self) -> bytes:
        """What a stream sends every `keepalive_interval` while its first event is awaited."""
        ...

    def full(self, results: Sequence[GenerationResult], usages: Sequence[Usage] | None = None) -> Iterator[str]:
        """The whole answer's JSON text in pieces (blocking: built on the answer pool), one result per choice;
        `usages`: what every candidate generated (default: the results')."""
        ...

    def stream(self, first: tuple[int, Event], events: AsyncIterator[tuple[int, Event]]) -> AsyncIterator[bytes]:
        """The streamed body from the first (choice, event) on, after `opening`; `events` yields the rest as
        they come."""
        ...

    def failure_events(self, error: BaseException) -> Sequence[bytes]:
        """How a stream that has begun tells `error`, its last bytes."""
        ...


class Surface(Protocol):
    """One API's translator: its request into the engine's, the engine's answer into its shapes."""

    #: How this API writes errors (its refusals are made in OpenAI's shape and translated).
    errors: ErrorShape

    def engine_body(self, body: Mapping[str, Any], preparer: Preparing) -> Mapping[str, Any]:
        """The engine's request body (OpenAI's chat, completion or embedding body) `body` amounts to on
        `preparer`'s server; a `DecodeError` naming the field for what the engine cannot do."""
        ...

    def parse(self, body: Mapping[str, Any], preparer: Preparing) -> EngineRequest:
        """The engine's request parsed and checked from `engine_body`'s result, with `preparer`'s defaults."""
        ...

    def answer_format(self, prepared: Prepared, preparer: Preparing, rid: str) -> AnswerFormat:
        """The answer shapes of a prepared request (`rid`: the exchange's request id)."""
        ...
