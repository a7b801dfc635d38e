"""`serve`: load a checkpoint, start its batcher, and serve it over HTTP until stopped (`ferrox-batch serve`).

It promises a clean exit: however uvicorn stops (Ctrl-C, SIGTERM, `stop`, a
port already in use), the app first cancels what is still in flight and joins
its threads, then the batcher is closed and its worker joined. It reads no
environment: the CLI passes every setting in (a `batcher_config` of None means
the serving defaults, `BatcherConfig.serving()`, not `BatcherConfig.from_env()`). What start-up made is
frozen out of the garbage collector before the first request (`gc.freeze`), so a collection never walks
the model and the app.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.grammar_limits import GrammarLimits
from ferrox_batch.request_caps import RequestCaps
from ferrox_batch.runtime.loading.loader import LoadedModel, load_model
from ferrox_batch.server.app import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    create_app,
)
from ferrox_batch.server.client_policy import DEFAULT_CLIENT_PRIORITIES
from ferrox_batch.server.harmony.choice import parsers_for_family
from ferrox_batch.server.http.host_check import default_allowed_hosts
from ferrox_batch.server.http.listener import DEFAULT_DRAIN_TIMEOUT_SECS, DrainingServer, server_config
from ferrox_batch.server.requests import DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_MAX_TOKENS

log = logging.getLogger("ferrox_batch.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
#: Seconds to wait for the batcher's worker to exit once everything in flight was cancelled.
BATCHER_CLOSE_SECS = 30.0


def default_model_name(source: Path) -> str:
    """The name a checkpoint is served under unless told otherwise: its folder or file name."""
    return source.stem if source.is_file() else source.name


def serve(
    model: str | Path | LoadedModel,
    batcher_config: BatcherConfig | None = None,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    model_name: str | Sequence[str] | None = None,
    device: str = "auto",
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    weights: str = "auto",
    batch_invariant: str = "auto",
    chat_template: str | None = None,
    default_max_tokens: int = DEFAULT_COMPLETION_MAX_TOKENS,
    default_chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
    log_level: str = "info",
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_SECS,
    stop: threading.Event | None = None,
    api_key: str | Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] | None = None,
    shared_prefix_cache: bool = False,
    client_priorities: tuple[int, int] = DEFAULT_CLIENT_PRIORITIES,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    pooling: str = "last",
    ui: bool = True,
    grammar_limits: GrammarLimits = GrammarLimits(),
    escape_control_tokens: bool = False,
    request_caps: RequestCaps = RequestCaps(),
) -> None:
    """Serve `model` (a checkpoint folder, a `.gguf` file, or a loaded model) on `host:port`; block until stopped.

    Ctrl-C / SIGTERM stop it when called on the main thread; `stop`, when given, stops it from any
    thread. A stop drains: no new connections, requests in flight get `drain_timeout` seconds to finish,
    then what is left is cancelled (`listener`). `allowed_hosts` defaults to the loopback names when `host`
    is a loopback address, else no check (`host_check`). `model_name` (one name or several) defaults to the
    checkpoint's folder
    (or file) name; `chat_template` (Jinja text) replaces the checkpoint's; `grammar_limits` bound what
    one request's structured output may cost (`ferrox_batch.grammar_limits`), `request_caps` what one
    request may cost beyond it (`ferrox_batch.request_caps`); a checkpoint of a harmony family (gpt-oss)
    gets the harmony `reasoning_parser` and `tool_call_parser` where they are None (`harmony_choice`); the
    other keywords are `create_app`'s.
    """
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device=device, dtype=dtype,
                                                                                kv_cache_dtype=kv_cache_dtype,
                                                                                weights=weights,
                                                                                batch_invariant=batch_invariant,
                                                                                chat_template=chat_template)
    name = model_name or default_model_name(loaded.source)
    reasoning_parser, tool_call_parser = parsers_for_family(loaded.config.family, reasoning_parser, tool_call_parser)
    batcher = ContinuousBatcher.from_model(loaded, batcher_config if batcher_config is not None
                                           else BatcherConfig.serving(), grammar_limits)
    try:
        app = create_app(batcher, model_name=name, default_max_tokens=default_max_tokens,
                         default_chat_max_tokens=default_chat_max_tokens, max_body_bytes=max_body_bytes,
                         max_concurrent_requests=max_concurrent_requests, api_key=api_key,
                         allowed_origins=allowed_origins, shared_prefix_cache=shared_prefix_cache,
                         allowed_hosts=default_allowed_hosts(host) if allowed_hosts is None else allowed_hosts,
                         client_priorities=client_priorities, reasoning_parser=reasoning_parser,
                         tool_call_parser=tool_call_parser, pooling=pooling,
                         ui=ui, escape_control_tokens=escape_control_tokens, request_caps=request_caps)
        config = server_config(app, host=host, port=port, log_level=log_level, drain_timeout=drain_timeout,
                               max_concurrent_requests=max_concurrent_requests)
        server = DrainingServer(config, on_deadline=app.state.ferrox.generations.end_in_flight)
        finished = threading.Event()
        if stop is not None:
            threading.Thread(target=_stop_when, args=(stop, finished, server), name="ferrox-serve-stop",
                             daemon=True).start()
        # Everything made so far (the model, the tokenizer, the app) lives as long as the server: frozen out
        # of the garbage collector's walks, a full collection that a burst of large answers sets off scans
        # only what requests made, and pauses every thread for milliseconds instead of a walk of it all.
        gc.freeze()
        if ui:
            shown = f"[{host}]" if ":" in host else ("127.0.0.1" if host in ("0.0.0.0", "") else host)
            log.info("chat page: http://%s:%d/", shown, port)
        try:
            server.run()
        finally:
            finished.set()
    finally:
        if not batcher.close(BATCHER_CLOSE_SECS):
            log.warning("the batcher's worker did not exit within %.0f s", BATCHER_CLOSE_SECS)


def _stop_when(stop: threading.Event, finished: threading.Event, server: uvicorn.Server) -> None:
    """Ask uvicorn to exit once `stop` is set; give up when the server finished on its own."""
    while not finished.is_set():
        if stop.wait(0.1):
            server.should_exit = True
            return
