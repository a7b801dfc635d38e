"""`Preparer`: a generation request's raw body turned into submitted batcher requests and its answer shapes.

It exists so that `Generations` coordinates a request (open-request slots, the prepare pool, events,
disconnects) without also knowing how a body becomes prompt ids and tickets. `Preparer.prepare` is
blocking work meant for the app's prepare pool, never the event loop. It promises:

* **Every refusal before anything is queued or sent.** A malformed body, a bad field, a model name this
  server does not serve, a chat template that cannot render the messages or tools, and the batcher's own
  admission refusals are all raised from `prepare`, as `DecodeError`s the handler answers as plain JSON.
* **All choices or none.** A request with several choices (`n`, `best_of`) is one ticket per candidate; if
  a later candidate is refused, the ones already submitted are abandoned before the refusal propagates.
* **The prompt as submitted is kept** (`Prepared.ids`), so an echoed completion prompt is exactly what ran.

`Preparer.wire_format` picks the answer shapes of a prepared request from what it asked for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.errors import InvalidRequest
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.server.choices import candidate_params
from ferrox_batch.server.client_policy import ClientPolicy
from ferrox_batch.server.errors import ModelNotFound
from ferrox_batch.server.prompt_ids import encode_chat_prompt, encode_prompt
from ferrox_batch.server.requests import (
    TOOL_PARSER,
    ChatRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
    parse_json_object,
)
from ferrox_batch.server.responses import ChatFormat, CompletionFormat, WireFormat
from ferrox_batch.server.streaming import Final, ReplyBridge


@dataclass(frozen=True, slots=True)
class Prepared:
    """A parsed request whose choices are all submitted."""

    request: CompletionRequest | ChatRequest
    bridges: list[ReplyBridge]  # one per choice (per `best_of` candidate), in order
    ids: list[int]  # the prompt as submitted


@dataclass(frozen=True, slots=True)
class Preparer:
    """What one app needs to turn a body into submitted requests: its batcher, tokenizer and defaults."""

    batcher: ContinuousBatcher
    tokenizer: Tokenizer
    model_name: str
    default_max_tokens: int
    default_chat_max_tokens: int
    #: The fields this server bounds (`priority`) and the tenant scoping of `cache_salt`.
    policy: ClientPolicy = ClientPolicy()
    #: The most bytes of streamed text a request queues for a client reading slower than it is written.
    max_buffered_reply_bytes: int | None = None

    def prepare(self, raw: bytes, chat: bool, loop: asyncio.AbstractEventLoop,
                on_final: Callable[[ReplyBridge, Final], None], namespace: str | None = None) -> Prepared:
        """Parse, check, tokenize and submit one request (blocking); `on_final` runs on `loop` per choice;
        `namespace`: the prefix-cache namespace of the request's tenant (`access.cache_namespace`)."""
        body = parse_json_object(raw)
        request: CompletionRequest | ChatRequest
        if chat:
            request = parse_chat_request(body, default_max_tokens=self.default_chat_max_tokens)
        else:
            request = parse_completion_request(body, default_max_tokens=self.default_max_tokens)
        if request.model is not None and request.model != self.model_name:
            raise ModelNotFound(request.model, self.model_name)
        options = self.policy.apply(request.options, namespace)
        # Every field is checked before the prompt is tokenized: a refusal costs no tokenizing.
        params = options.generation_params(self.tokenizer, request.max_tokens)
        if isinstance(request, ChatRequest):
            ids = chat_ids(self.tokenizer, request, self.batcher.ceiling)
        elif isinstance(request.prompt, str):
            ids = encode_prompt(self.tokenizer, request.prompt, self.batcher.ceiling)
        else:
            ids = list(request.prompt)
        bridges: list[ReplyBridge] = []
        try:
            for candidate in candidate_params(params, request.best_of, request.best_of > request.n):
                bridge = ReplyBridge(loop, forward_text=request.stream, on_final=on_final,
                                     max_buffered=self.max_buffered_reply_bytes)
                # Every choice after the first follows its prompt: admitted once that prompt is through,
                # it adopts the prompt's cached blocks (`choices`).
                bridge.ticket = self.batcher.submit(ids, candidate, self.tokenizer.stop_tokens, sink=bridge,
                                                    after=bridges[0].ticket if bridges else None)
                bridges.append(bridge)
        except BaseException:
            for bridge in bridges:  # a later candidate was refused: the request fails whole
                bridge.abandon()
            raise
        return Prepared(request, bridges, ids)

    def wire_format(self, prepared: Prepared, chat: bool, rid: str) -> WireFormat:
        """The request's answer shapes: its endpoint's, with what it asked for (log-probabilities, tool calls,
        the echoed prompt)."""
        request = prepared.request
        asked = request.options.logprobs is not None
        fmt: WireFormat = (ChatFormat if chat else CompletionFormat)(self.model_name, rid,
                                                                      self.tokenizer if asked else None)
        if isinstance(request, ChatRequest) and request.parses_tool_calls:
            fmt.tool_parser = TOOL_PARSER  # type: ignore[attr-defined]
        if isinstance(request, CompletionRequest) and request.echo:
            prompt = request.prompt
            fmt.echo = (prepared.ids, prompt if isinstance(prompt, str)  # type: ignore[attr-defined]
                        else self.tokenizer.decode_text(prompt))
        return fmt


def chat_ids(tokenizer: Tokenizer, request: ChatRequest, ceiling: ContextCeiling) -> list[int]:
    """The templated conversation's ids (refused unread when too long for `ceiling`: `prompt_ids`); a
    template that refuses the messages is the client's 400."""
    if request.tools and not tokenizer.supports_tools:
        raise InvalidRequest("tools", [t["function"]["name"] for t in request.tools],
                             "cannot be offered to this model: its chat template does not render tools")
    return encode_chat_prompt(tokenizer, request.messages, ceiling, tools=list(request.tools) or None)
