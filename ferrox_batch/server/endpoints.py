"""`ServerState`: what one app holds (`app.state.ferrox`), and its endpoints: each generation route serves
its API's surface through the app's `Generations`; the others answer from the batcher (models, health,
metrics, stats) or off the event loop (vLLM's `/tokenize` and `/detokenize`, Anthropic's token count)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.errors import DecodeError
from ferrox_batch.server.anthropic.count_tokens import count_tokens
from ferrox_batch.server.anthropic.errors import ANTHROPIC_ERRORS
from ferrox_batch.server.anthropic.surface import MessagesSurface
from ferrox_batch.server.generation import CLIENT_CLOSED_REQUEST, Generations
from ferrox_batch.server.http.body import read_body
from ferrox_batch.server.http.error_shapes import OPENAI_ERRORS, ErrorShape, ErrorShapes
from ferrox_batch.server.http.errors import error_response
from ferrox_batch.server.http.json_body import JSONBodyResponse, json_pieces
from ferrox_batch.server.http.metrics import CONTENT_TYPE
from ferrox_batch.server.openai.surfaces import ChatSurface, CompletionsSurface, EmbeddingsSurface, ResponsesSurface
from ferrox_batch.server.openai.tokenization import (
    LARGE_TOKENIZATION_BYTES,
    MAX_LARGE_TOKENIZATIONS,
    TokenizationsBusy,
    check_detokenize_body,
    detokenize,
    tokenize,
)
from ferrox_batch.server.requests import parse_json_object

#: OpenAI's surfaces (stateless: each request's own state is its answer format's).
COMPLETIONS_SURFACE = CompletionsSurface()
CHAT_SURFACE = ChatSurface()
RESPONSES_SURFACE = ResponsesSurface()
EMBEDDINGS_SURFACE = EmbeddingsSurface()
#: Anthropic's Messages API.
MESSAGES_SURFACE = MessagesSurface()


class ServerState:
    """What one app holds (`app.state.ferrox`), and its endpoints."""

    def __init__(self, batcher: ContinuousBatcher, generations: Generations, model_names: tuple[str, ...],
                 error_shapes: ErrorShapes = ErrorShapes()) -> None:
        self.batcher = batcher
        #: Each API's error shape by its routes' path prefix (OpenAI's elsewhere).
        self.error_shapes = error_shapes
        self.generations = generations
        self.model_names = model_names
        self.model_name = model_names[0]
        self.created = int(time.time())
        #: `/tokenize` and `/detokenize` requests reading their body or being answered (loop thread only).
        self.tokenizations_open = 0
        #: Those of them whose body is past `LARGE_TOKENIZATION_BYTES`, parsed or being answered (loop thread only).
        self.large_tokenizations_open = 0

    async def completions(self, request: Request) -> Response:
        return await self.generations.serve(request, surface=COMPLETIONS_SURFACE)

    async def chat(self, request: Request) -> Response:
        return await self.generations.serve(request, surface=CHAT_SURFACE)

    async def embeddings(self, request: Request) -> Response:
        return await self.generations.serve(request, surface=EMBEDDINGS_SURFACE)

    async def responses(self, request: Request) -> Response:
        return await self.generations.serve(request, surface=RESPONSES_SURFACE)

    async def messages(self, request: Request) -> Response:
        return await self.generations.serve(request, surface=MESSAGES_SURFACE)

    async def count_tokens(self, request: Request) -> Response:
        preparer = self.generations.preparer
        return await self._off_loop(request, lambda body: count_tokens(preparer, body), errors=ANTHROPIC_ERRORS)

    async def models(self) -> dict[str, Any]:
        """Each served name, with the longest prompt + output a request may have (`max_model_len`, vLLM's)."""
        limit = self.batcher.ceiling.limit()
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "ferrox-batch", "root": self.model_name,
             "max_model_len": limit} for name in self.model_names]}

    async def health(self) -> Response:
        if self.batcher.stats().worker_alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": "the batch scheduler's worker is not running"},
                            status_code=503)

    async def metrics(self) -> Response:
        return Response(self.generations.metrics.render(), media_type=CONTENT_TYPE)

    async def stats(self) -> dict[str, Any]:
        return {**self.batcher.stats().to_dict(), **self.batcher.model_stats}

    async def tokenize(self, request: Request) -> Response:
        tokenizer, ceiling, caps = self.generations.tokenizer, self.batcher.ceiling, self.generations.caps
        escape = self.generations.escape_control_tokens
        return await self._off_loop(request, lambda body: tokenize(body, tokenizer, ceiling, caps,
                                                                   escape_control_tokens=escape))

    async def detokenize(self, request: Request) -> Response:
        tokenizer, caps = self.generations.tokenizer, self.generations.caps
        return await self._off_loop(request, lambda body: detokenize(body, tokenizer, caps),
                                    lambda size: check_detokenize_body(size, tokenizer, caps))

    async def _off_loop(self, request: Request, answer: Callable[[dict[str, Any]], dict[str, Any]],
                        check_size: Callable[[int], None] = lambda _size: None,
                        errors: ErrorShape = OPENAI_ERRORS) -> Response:
        """Read the body under the generation endpoints' limits, check its size (`check_size`, before it is
        parsed), parse and answer it on the prepare pool, and encode the answer on the answer pool
        (`json_body`). At most `max_concurrent_tokenizations` are open, counted before the body is read, and
        `MAX_LARGE_TOKENIZATIONS` of a body past `LARGE_TOKENIZATION_BYTES` (503 `server_busy` past either)."""
        generations = self.generations
        limits = generations.limits
        try:
            if self.tokenizations_open >= limits.max_concurrent_tokenizations:
                raise TokenizationsBusy(self.tokenizations_open, limits.max_concurrent_tokenizations)
            self.tokenizations_open += 1
            try:
                raw = await read_body(request, limits.max_body_bytes, limits.body_read_timeout)
                check_size(len(raw))
                large = len(raw) > LARGE_TOKENIZATION_BYTES
                if large and self.large_tokenizations_open >= MAX_LARGE_TOKENIZATIONS:
                    raise TokenizationsBusy(self.large_tokenizations_open, MAX_LARGE_TOKENIZATIONS,
                                            f"tokenizations of a body over {LARGE_TOKENIZATION_BYTES:,} bytes")
                self.large_tokenizations_open += int(large)
                try:
                    loop = asyncio.get_running_loop()
                    result = await loop.run_in_executor(generations.prepare_pool,
                                                        lambda: answer(parse_json_object(raw)))
                finally:
                    self.large_tokenizations_open -= int(large)
            finally:
                self.tokenizations_open -= 1
        except DecodeError as refusal:
            return error_response(refusal, errors)
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONBodyResponse(json_pieces(result), generations.answer_pool, write_timeout=limits.write_timeout)
