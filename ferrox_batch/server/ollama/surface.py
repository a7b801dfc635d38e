"""Ollama's generation and embedding routes as surfaces over the engine: each body said as the chat,
completion or embedding body it amounts to (`translation`), its answer written as Ollama's (`answers`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ferrox_batch.server.http.error_shapes import ErrorShape
from ferrox_batch.server.ollama.answers import OllamaEmbedFormat, OllamaFormat
from ferrox_batch.server.ollama.errors import OLLAMA_ERRORS
from ferrox_batch.server.ollama.translation import OLLAMA_EMBED, OLLAMA_EMBEDDINGS, Served, translate
from ferrox_batch.server.openai.embeddings import EmbeddingRequest
from ferrox_batch.server.openai.surfaces import ChatSurface, CompletionsSurface, EmbeddingsSurface
from ferrox_batch.server.requests import ChatRequest

if TYPE_CHECKING:
    from ferrox_batch.server.surface import Prepared, Preparing
    from ferrox_batch.server.surface import EngineRequest

#: The OpenAI surfaces whose parsers and shapes read Ollama's translated bodies and answers.
CHAT, COMPLETIONS, EMBEDDINGS = ChatSurface(), CompletionsSurface(), EmbeddingsSurface()


def served(preparer: Preparing) -> Served:
    """What an Ollama request's translation needs to know of `preparer`'s server."""
    return Served((preparer.model_name, *preparer.aliases), preparer.batcher.ceiling.limit(),
                  preparer.default_chat_max_tokens, thinks=preparer.reasoning is not None or preparer.harmony,
                  harmony=preparer.harmony)


@dataclass(frozen=True, slots=True)
class OllamaSurface:
    """One of `/api/chat`, `/api/generate`, `/api/embed` and `/api/embeddings` (`endpoint`)."""

    endpoint: str
    errors: ErrorShape = OLLAMA_ERRORS

    def engine_body(self, body: Mapping[str, Any], preparer: Preparing) -> Mapping[str, Any]:
        return translate(self.endpoint, dict(body), served(preparer)).body

    def parse(self, body: Mapping[str, Any], preparer: Preparing) -> EngineRequest:
        if self.endpoint in (OLLAMA_EMBED, OLLAMA_EMBEDDINGS):
            return EMBEDDINGS.parse(body, preparer)
        # A chat, or a generation said as one; a raw generation is a completion (`translation` writes its
        # prompt as such, with no messages).
        return CHAT.parse(body, preparer) if "messages" in body else COMPLETIONS.parse(body, preparer)

    def answer_format(self, prepared: Prepared, preparer: Preparing, rid: str) -> OllamaFormat | OllamaEmbedFormat:
        request = prepared.request
        assert prepared.body is not None
        asked = prepared.body["model"]
        arrival = time.monotonic() if prepared.arrival is None else prepared.arrival
        if isinstance(request, EmbeddingRequest):
            return OllamaEmbedFormat(self.endpoint, asked, EMBEDDINGS.answer_format(prepared, preparer, rid).fmt,
                                     arrival)
        inner = (CHAT if isinstance(request, ChatRequest) else COMPLETIONS).answer_format(prepared, preparer, rid)
        tokenizer = preparer.tokenizer if request.options.logprobs is not None else None
        return OllamaFormat(self.endpoint, asked, inner.fmt, arrival, tokenizer)

