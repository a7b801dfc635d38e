"""`Preparer`: a generation request's raw body turned into submitted batcher requests and its answer shapes.

It exists so that `Generations` coordinates a request (open-request slots, the prepare pool, events,
disconnects) without also knowing how a body becomes prompt ids and tickets. `Preparer.prepare` is
blocking work meant for the app's prepare pool, never the event loop. It promises:

* **Every refusal before anything is queued or sent.** A malformed body, a bad field, a model name this
  server does not serve, a chat template that cannot render the messages or tools, and the batcher's own
  admission refusals are all raised from `prepare`, as `DecodeError`s the handler answers as plain JSON.
* **All choices or none.** A request with several choices (`n`, `best_of`) is one ticket per candidate; if
  a later candidate is refused, the ones already submitted are abandoned before the refusal propagates.
* **Each prompt as submitted is kept** (`Prepared.prompts`: after `truncate_prompt_tokens`), so an echoed
  completion prompt, and the prompt ids `return_token_ids` reports, are exactly what ran.
* **Several prompts** (a completion's list of prompts) are `best_of` rows each, prompt by prompt: choice
  `i * n + j` is prompt i's choice j, as OpenAI and vLLM number them.

Which API's body it reads, and how that API's answer is written, is the request's `Surface`'s business.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any
from dataclasses import dataclass

from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.cancel import CancelToken
from ferrox_batch.generation_types import GenerationParams
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.server.choices import candidate_params
from ferrox_batch.server.client_policy import ClientPolicy
from ferrox_batch.server.extra_fields import CONTEXT_LENGTH
from ferrox_batch.server.harmony.choice import STOP_TEXTS
from ferrox_batch.server.http.errors import ModelNotFound
from ferrox_batch.server.http.streaming import Final, ReplyBridge
from ferrox_batch.server.openai.embeddings import DEFAULT_POOLING, EmbeddingRequest
from ferrox_batch.server.prompt_ids import encode_chat_prompt, encode_prompt
from ferrox_batch.server.reasoning import ReasoningParser
from ferrox_batch.server.request_caps import RequestCaps, check_body, check_prompt_logprobs
from ferrox_batch.server.requests import ChatRequest, CompletionRequest, parse_chat_request, parse_json_object
from ferrox_batch.server.surface import Prepared, Surface
from ferrox_batch.server.tools.generic import describe_tools

__all__ = ["Prepared", "Preparer", "chat_ids"]


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
    #: What splits a chat answer's thinking from its answer (`--reasoning-parser`); None: no thinking read.
    reasoning: ReasoningParser | None = None
    #: How an embedding pools its prompt when the request does not say (`--pooling`).
    pooling: str = DEFAULT_POOLING
    #: The other names the model is served under (`--served-model-name`'s after the first).
    aliases: tuple[str, ...] = ()
    #: Whether control-token text in messages' content is read as text (`--escape-control-tokens`).
    escape_control_tokens: bool = False
    #: What one request may cost (`request_caps`), resolved against the model's vocabulary.
    caps: RequestCaps = RequestCaps()
    #: Whether chat answers are read in the harmony format (gpt-oss: `harmony_choice`).
    harmony: bool = False

    def prepare(self, raw: bytes, surface: Surface, loop: asyncio.AbstractEventLoop,
                on_final: Callable[[ReplyBridge, Final], None], namespace: str | None = None,
                client: str | None = None, cancel: CancelToken | None = None,
                arrival: float | None = None) -> Prepared:
        """Parse (as `surface` reads its API's body), check, tokenize and submit one request (blocking);
        `on_final` runs on `loop` per choice; `namespace`: the prefix-cache
        namespace of the request's tenant (`access.cache_namespace`); `client`: who sent it (its grammar
        is priced against that client's share of the live-grammar budget); `cancel`: cancelled when the
        client leaves (work on its behalf stops, from its grammar's conversion on); `arrival`: when the request
        came (monotonic seconds)."""
        original = parse_json_object(raw)
        body = surface.engine_body(original, self)
        check_body(self.caps, body)  # before a list is read: its length and total size are known unread
        request = surface.parse(body, self)
        chat = isinstance(request, ChatRequest)
        if request.model is not None and request.model != self.model_name and request.model not in self.aliases:
            raise ModelNotFound(request.model, ", ".join((self.model_name, *self.aliases)))
        options = self.policy.apply(request.options, namespace)
        if chat and self.reasoning is not None and options.structured is not None and not self.harmony:
            # The output's form (a schema, a forced tool call) applies to the answer after the thinking.
            how = "implicit" if self.reasoning.implicit else "tagged"
            options = dataclasses.replace(options, structured=dataclasses.replace(options.structured, reasoning=how))
        if client is not None and options.structured is not None:
            options = dataclasses.replace(options, structured=dataclasses.replace(options.structured, client=client))
        # Every field is checked before the prompt is tokenized: a refusal costs no tokenizing.
        params = options.generation_params(self.tokenizer, request.max_tokens, self.caps.max_stop_chars)
        if cancel is not None:
            params = dataclasses.replace(params, cancel=cancel)
        if chat and self.harmony:
            params = self._harmony_params(params)
        prompts = [self._prompt_ids(request, prompt) for prompt in request.prompts]
        # Each row that scores its prompt holds its entries until its answer is written: priced before any runs.
        check_prompt_logprobs(self.caps, prompts, request.best_of, params.prompt_logprobs,
                              "prompt_logprobs" if request.prompt_logprobs is not None else "logprobs")
        bridges: list[ReplyBridge] = []
        try:
            for ids in prompts:
                first: ReplyBridge | None = None
                for candidate in candidate_params(params, request.best_of, request.best_of > request.n):
                    bridge = ReplyBridge(loop, forward_text=request.stream, on_final=on_final,
                                         max_buffered=self.max_buffered_reply_bytes)
                    # Every choice after a prompt's first follows that prompt: admitted once it is through,
                    # it adopts the prompt's cached blocks (`choices`).
                    bridge.ticket = self.batcher.submit(ids, candidate, self.tokenizer.stop_tokens, sink=bridge,
                                                        after=None if first is None else first.ticket)
                    bridges.append(bridge)
                    first = first or bridge
        except BaseException:
            for bridge in bridges:  # a later candidate was refused: the request fails whole
                bridge.abandon()
            raise
        return Prepared(request, bridges, prompts, original, arrival)

    def _harmony_params(self, params: GenerationParams) -> GenerationParams:
        """A harmony answer's settings: its markers (special tokens) kept in the text for its reader, which
        never passes them on, and its stop tokens (`<|return|>`, `<|call|>`) stopping it even where the
        checkpoint's generation config does not list them, as vLLM adds them."""
        known = set(params.stop_token_ids) | set(self.tokenizer.stop_tokens.ids)
        ids = [i for i in map(self.tokenizer.token_to_id, STOP_TEXTS) if i is not None and i not in known]
        return dataclasses.replace(params, skip_special_tokens=False,
                                   stop_token_ids=params.stop_token_ids + tuple(ids))

    def _prompt_ids(self, request: CompletionRequest | ChatRequest | EmbeddingRequest, prompt: object) -> list[int]:
        """One prompt's ids: templated (chat), tokenized (text) or as sent (ids), then truncated to its last
        `truncate_prompt_tokens`. A text provably too long for the context is refused untokenized, unless
        it is to be truncated."""
        keep = request.truncate_prompt_tokens
        ceiling = self.batcher.ceiling if keep is None else None
        if isinstance(request, ChatRequest):
            ids = chat_ids(self.tokenizer, request, ceiling)
        elif isinstance(prompt, str):
            ids = encode_prompt(self.tokenizer, prompt, ceiling)
        else:
            ids = list(prompt)  # type: ignore[call-overload]
        if keep == CONTEXT_LENGTH:
            keep = self.batcher.ceiling.limit()
        if keep is not None and len(ids) > keep:
            ids = ids[len(ids) - keep:]
        return ids

    def parse_chat(self, body: Mapping[str, Any]) -> ChatRequest:
        """An engine chat request parsed from OpenAI's chat `body`, with this server's defaults and chat format."""
        return parse_chat_request(body, default_max_tokens=self.default_chat_max_tokens,
                                  renders_tools=self.tokenizer.supports_tools,
                                  escape_control_text=self.escape_control_tokens,
                                  tool_format="harmony" if self.harmony else None)

    def answer_name(self, request: CompletionRequest | ChatRequest | EmbeddingRequest) -> str:
        """The model name an answer carries: the one the request asked for, else the served name."""
        return request.model if request.model is not None else self.model_name


def chat_ids(tokenizer: Tokenizer, request: ChatRequest, ceiling: ContextCeiling | None) -> list[int]:
    """The templated conversation's ids (refused unread when too long for `ceiling`: `prompt_ids`; None:
    no such check); a template that refuses the messages is the client's 400."""
    if request.tools and request.tool_format == "generic":  # the template does not render tools
        return encode_chat_prompt(tokenizer, describe_tools(request.messages, request.tools), ceiling,
                                  rendering=request.rendering)
    return encode_chat_prompt(tokenizer, request.messages, ceiling, tools=list(request.tools) or None,
                              rendering=request.rendering)
