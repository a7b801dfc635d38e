"""`create_app`: the HTTP front of one `ContinuousBatcher`: OpenAI's, Anthropic's and Ollama's APIs.

Endpoints:

* `POST /v1/completions`, `POST /v1/chat/completions` (the checkpoint's chat
  template), both with `stream: true` as server-sent events ending with
  `data: [DONE]` (see `generation` for how a request is served);
* `GET /v1/models`: the one served model, in OpenAI's list shape;
* `GET /health`: 200 `{"status": "ok"}`, 503 once the worker is dead;
* `GET /metrics`: Prometheus text (see `metrics`);
* `GET /stats`: `BatcherStats` as JSON;
* `POST /tokenize`, `POST /detokenize`: vLLM's shapes (see `tokenization`);
* `POST /v1/messages` (also as `?beta=true`), `POST /v1/messages/count_tokens`: Anthropic's Messages API
  on the same engine and admission, its errors in Anthropic's shape (see `anthropic`);
* `GET /`: the chat page (`chat_page`), unless `ui` is off;
* Ollama's API (`ollama`): `POST /api/chat`, `/api/generate` (NDJSON streams), `/api/embed`,
  `/api/embeddings`, `/api/show`; `GET /api/tags`, `/api/ps`, `/api/version`; `HEAD /` ("Ollama is
  running"); model management (`/api/pull`, ...) refused. Errors there are Ollama's.

Each API is a surface (`surface`) the routes pick: its request translated into the engine's, its answer
written in its own shapes. Every error, routing ones included, is a JSON body in the error shape of the
API the path belongs to (`http.error_shapes`): OpenAI's, Anthropic's on the Messages API's routes, Ollama's
under `/api`.
Every response carries `X-Request-Id`; with `api_key` set, every route but
`/health` and `/metrics` needs it as a bearer token, with `allowed_hosts` every
route but `/health` a listed `Host`, and every POST a JSON body (see `access`). With
`allowed_origins`, browsers on those origins may call the API (CORS,
Starlette's middleware, outermost so preflights never need the key).
Nothing is global: each app has its own pools, metrics registry and state
(`app.state.ferrox`, `endpoints.ServerState`), so several apps can live in one process. The app does
not own the batcher: closing it is the caller's job (`serve` does); on
shutdown the app cancels whatever is still in flight and joins its pools.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.generation_types import POOLING
from ferrox_batch.server.anthropic.errors import ANTHROPIC_ERRORS
from ferrox_batch.server.anthropic.errors import PREFIX as MESSAGES_PREFIX
from ferrox_batch.server.chat_page import PAGE_PATH, ChatPage
from ferrox_batch.server.client_policy import DEFAULT_CLIENT_PRIORITIES, ClientPolicy
from ferrox_batch.server.endpoints import ServerState
from ferrox_batch.server.generation import Generations
from ferrox_batch.server.harmony.choice import HARMONY_REASONING, TOOL_CALL_PARSERS, uses_harmony
from ferrox_batch.server.http.access import REQUEST_ID_HEADER, AccessMiddleware
from ferrox_batch.server.http.access_policy import AccessPolicy
from ferrox_batch.server.http.body import DEFAULT_BODY_READ_TIMEOUT_SECS
from ferrox_batch.server.http.error_shapes import OPENAI_ERRORS, ErrorShape, ErrorShapes, shaped_response
from ferrox_batch.server.http.errors import error_body
from ferrox_batch.server.http.generation_limits import (
    DEFAULT_MAX_BUFFERED_REPLY_BYTES,
    DEFAULT_MAX_CONCURRENT_TOKENIZATIONS,
    DEFAULT_WRITE_TIMEOUT_SECS,
    Limits,
)
from ferrox_batch.server.ollama.errors import OLLAMA_ERRORS
from ferrox_batch.server.ollama.models import OllamaModels
from ferrox_batch.server.ollama.routes import PREFIX as OLLAMA_PREFIX
from ferrox_batch.server.ollama.routes import add_ollama_routes
from ferrox_batch.server.openai.embeddings import DEFAULT_POOLING
from ferrox_batch.server.reasoning import ReasoningParser
from ferrox_batch.server.request_caps import RequestCaps
from ferrox_batch.server.requests import DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_MAX_TOKENS

log = logging.getLogger("ferrox_batch.server")


#: Request bodies larger than this are refused with 413. A 1 MB prompt still fits, and is then
#: refused by the context ceiling with a 400 that names the numbers.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: Generation requests open at once (in flight or being prepared); one more is refused with
#: 503 `server_busy`. A request in flight holds no thread: the worker posts its events to the loop.
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
#: Threads that parse, tokenize and submit.
DEFAULT_PREPARE_THREADS = 4


def create_app(
    batcher: ContinuousBatcher,
    *,
    model_name: str | Sequence[str],
    default_max_tokens: int = DEFAULT_COMPLETION_MAX_TOKENS,
    default_chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
    prepare_threads: int = DEFAULT_PREPARE_THREADS,
    body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT_SECS,
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_SECS,
    max_buffered_reply_bytes: int = DEFAULT_MAX_BUFFERED_REPLY_BYTES,
    max_concurrent_tokenizations: int = DEFAULT_MAX_CONCURRENT_TOKENIZATIONS,
    api_key: str | Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] | None = None,
    shared_prefix_cache: bool = False,
    client_priorities: tuple[int, int] = DEFAULT_CLIENT_PRIORITIES,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    pooling: str = DEFAULT_POOLING,
    ui: bool = True,
    escape_control_tokens: bool = False,
    request_caps: RequestCaps = RequestCaps(),
) -> FastAPI:
    """An app serving `batcher` under the name `model_name`, or under each of several names (requests may
    name any; answers carry the one asked for, else the first).

    When a request sends neither `max_tokens` nor `max_completion_tokens`, `/v1/completions`
    generates up to `default_max_tokens` (OpenAI's 16) and chat up to `default_chat_max_tokens`
    (1024); the batcher clamps any budget to the context ceiling. A generation request whose
    body has not arrived `body_read_timeout` seconds after it was accepted gets 408 and gives
    its open-request slot back. The batcher must have a tokenizer (`ContinuousBatcher.from_model`).
    A client that takes nothing of its reply for `write_timeout` seconds, or falls more than
    `max_buffered_reply_bytes` behind a stream, is treated as gone: its request is cancelled and its
    response ended (`streaming`). `/tokenize` and `/detokenize` take `max_concurrent_tokenizations`
    requests at once (503 `server_busy` past it).
    `api_key`: the bearer token every route but `/health` and `/metrics` needs (None: open), or several,
    one per tenant: each key's requests get a prefix-cache namespace of their own unless
    `shared_prefix_cache` (see `api_keys`).
    `allowed_origins`: the browser origins CORS allows (`"*"` for any; empty: CORS off).
    `allowed_hosts`: the `Host` names requests to any route but `/health` may carry (None: any; `serve`
    defaults it from its address, see `host_check`). Every POST needs a JSON body (`access_policy`).
    `client_priorities`: the inclusive range of `priority` requests may use (`client_policy`).
    `reasoning_parser`: how chat answers' thinking is told from the answer (`reasoning`: `deepseek_r1`,
    `qwen3`, or `openai_gptoss`: the harmony format, `harmony_choice`); None: it is not. `tool_call_parser`:
    `openai` reads answers in the harmony format, calls included (either harmony name turns it on: its
    markers must never reach a client); None: the chat template decides (`requests.TOOL_FORMATS`).
    `pooling`: how `/v1/embeddings` pools a prompt unless the request says (`last` or `mean`). `ui`: serve the chat page on `GET /` (`chat_page`). `escape_control_tokens`:
    control-token text in messages' content is read as text, on chat and `/tokenize` alike
    (`runtime.loading.control_text`).
    `request_caps`: what one request may cost (`ferrox_batch.request_caps`; each a 400 naming the field past
    it, `server.request_caps`): ids in `allowed_token_ids` as sent, characters over its stop strings, prompt
    log-probability entries over its rows, ids a `/tokenize` answer lists or a `/detokenize` request sends,
    bytes of text a `/detokenize` answer holds.
    """
    tokenizer = batcher.tokenizer
    if tokenizer is None:
        raise ValueError("create_app needs a batcher with a tokenizer: build it with ContinuousBatcher.from_model")
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    if not names or any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"model_name must be a non-empty string or several distinct ones, got {model_name!r}")
    limits = Limits(default_max_tokens, default_chat_max_tokens, max_body_bytes, max_concurrent_requests,
                    prepare_threads, body_read_timeout, write_timeout=write_timeout,
                    max_buffered_reply_bytes=max_buffered_reply_bytes,
                    max_concurrent_tokenizations=max_concurrent_tokenizations)
    for field in dataclasses.fields(limits):
        value = getattr(limits, field.name)
        if field.name in ("body_read_timeout", "write_timeout"):  # seconds: positive and finite (NaN fails `0 <`)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{field.name} must be a positive, finite number of seconds, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field.name} must be a positive integer, got {value!r}")
    policy = ClientPolicy(tuple(client_priorities) if isinstance(client_priorities, (tuple, list))
                          else client_priorities)
    access = AccessPolicy(api_key=api_key, allowed_hosts=allowed_hosts, shared_prefix_cache=shared_prefix_cache)
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {tool_call_parser!r}; use one of {', '.join(TOOL_CALL_PARSERS)}")
    harmony = uses_harmony(reasoning_parser, tool_call_parser)
    reasoning = None if reasoning_parser in (None, HARMONY_REASONING) else ReasoningParser(reasoning_parser)
    if pooling not in POOLING:
        raise ValueError(f"pooling must be one of {', '.join(POOLING)}, got {pooling!r}")
    if not isinstance(escape_control_tokens, bool):
        raise ValueError(f"escape_control_tokens must be true or false, got {escape_control_tokens!r}")
    if not isinstance(request_caps, RequestCaps):
        raise ValueError(f"request_caps must be RequestCaps, got {request_caps!r}")
    error_shapes = api_error_shapes()
    state = ServerState(batcher, Generations(batcher, tokenizer, names, limits, policy, reasoning, pooling,
                                             request_caps,
                                             escape_control_tokens=escape_control_tokens, harmony=harmony), names,
                        error_shapes)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await state.generations.shutdown()

    app = FastAPI(title="ferrox-batch", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ferrox = state
    app.add_api_route("/v1/completions", state.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", state.chat, methods=["POST"])
    app.add_api_route("/v1/embeddings", state.embeddings, methods=["POST"])
    app.add_api_route("/v1/responses", state.responses, methods=["POST"])
    app.add_api_route("/v1/models", state.models, methods=["GET"])
    app.add_api_route("/health", state.health, methods=["GET"])
    app.add_api_route("/metrics", state.metrics, methods=["GET"])
    app.add_api_route("/stats", state.stats, methods=["GET"])
    app.add_api_route("/tokenize", state.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", state.detokenize, methods=["POST"])
    # Anthropic's Messages API.
    app.add_api_route("/v1/messages", state.messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", state.count_tokens, methods=["POST"])
    if ui:
        app.add_api_route(PAGE_PATH, ChatPage().get, methods=["GET"])
    add_ollama_routes(app, state.generations, OllamaModels(batcher, names, limits, started=state.created,
                                                           thinks=reasoning is not None or harmony), ui=ui)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(AccessMiddleware, policy=access, error_shapes=error_shapes)  # type: ignore[arg-type]
    origins = list(allowed_origins)
    if any(not isinstance(o, str) or not o for o in origins):
        raise ValueError(f"allowed_origins must be non-empty strings, got {origins!r}")
    if origins:  # added last: the outermost layer, so a preflight is answered before any key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "OPTIONS"],  # type: ignore[arg-type]
                           allow_headers=["Authorization", "Content-Type", REQUEST_ID_HEADER, "x-api-key",
                                          "anthropic-version", "anthropic-beta"],
                           expose_headers=[REQUEST_ID_HEADER])
    return app


def api_error_shapes() -> ErrorShapes:
    """Each API beside OpenAI's, by the path prefix its routes share, with the shape it answers errors in: the
    app's refusals and a Ray ingress's alike."""
    return ErrorShapes(((MESSAGES_PREFIX, ANTHROPIC_ERRORS), (OLLAMA_PREFIX, OLLAMA_ERRORS)))


def _error_shape(request: Request) -> ErrorShape:
    state = getattr(request.app.state, "ferrox", None)
    return state.error_shapes.for_path(request.url.path) if state is not None else OPENAI_ERRORS


async def _http_error(request: Request, exc: Exception) -> Response:
    """Routing errors (404, 405) in the error shape of the API the path belongs to too."""
    assert isinstance(exc, StarletteHTTPException)
    body = {"error": {"type": "invalid_request_error", "code": None, "message": str(exc.detail)}}
    return shaped_response(_error_shape(request), exc.status_code, body, exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error serving a request", exc_info=exc)
    return shaped_response(_error_shape(request), 500, error_body(exc))
