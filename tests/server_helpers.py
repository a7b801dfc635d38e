"""Helpers for the server tests: a real uvicorn server on 127.0.0.1 in a background thread.

* `running_server(app)` starts uvicorn on a free port (port 0, read back
  from the bound socket, so no other process can take it between choosing
  and binding), yields the base URL, and stops it cleanly: uvicorn's own
  shutdown, the app's lifespan (which cancels what is in flight and joins its
  pools), and a join of the thread that asserts it ended.
* `served(model_or_batcher, ...)` does that for a batcher too and closes the
  batcher afterwards, asserting its worker exited.
* `gated_batcher` builds a batcher whose detokenizer is a `worker_helpers.Gate`
  over one-letter-per-token `identity_decode`: every token is one visible
  chunk, and a test can hold the worker inside a decode call to make queue
  and disconnect tests deterministic.
* `openai_client(base_url)`: the official client, no retries (a 503 must be
  seen, not retried away), short timeouts.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import uvicorn
from batch_helpers import identity_decode
from worker_helpers import Gate

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.server import create_app

#: How long a test waits for a server to start or stop, or for a state it polls for.
DEADLINE = 15.0
#: Request options for a reproducible reply: greedy, and past EOS (a random checkpoint may pick it).
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
MODEL_NAME = "tiny"


@contextlib.contextmanager
def running_server(app, *, graceful_shutdown_secs: float = 3.0) -> Iterator[str]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, log_level="warning",
                            access_log=False, lifespan="on", timeout_graceful_shutdown=graceful_shutdown_secs)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE
    while not server.started:
        assert thread.is_alive(), "uvicorn exited during startup"
        assert time.monotonic() < deadline, "uvicorn did not start in time"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(DEADLINE)
        assert not thread.is_alive(), "uvicorn did not shut down in time"


@contextlib.contextmanager
def served(batcher: ContinuousBatcher, **app_options) -> Iterator[tuple[str, object]]:
    """Serve `batcher` as "tiny"; yield (base URL, app); stop the server, then close the batcher."""
    try:
        app = create_app(batcher, model_name=MODEL_NAME, **app_options)
        with running_server(app) as base_url:
            yield base_url, app
        prefix = app.state.ferrox.generations.thread_prefix
        leaked = [t.name for t in threading.enumerate() if t.name.startswith(prefix)]
        assert not leaked, f"the app left threads running: {leaked}"
    finally:
        assert batcher.close(DEADLINE), "the batcher's worker did not exit"


def tiny_batcher(model, **config) -> ContinuousBatcher:
    """`from_model` with small blocks, so the tests can see blocks come back."""
    options = {"kv_block_size": 16, "kv_blocks": 256, **config}
    return ContinuousBatcher.from_model(model, BatcherConfig(**options))


def gated_batcher(model, gate: Gate, **config) -> ContinuousBatcher:
    """A batcher on `model` detokenizing through `gate` (one letter per token), encoding with the real tokenizer."""
    options = {"kv_block_size": 16, "kv_blocks": 64, **config}
    batcher = ContinuousBatcher.spawn_with_config(model.decoder, gate, BatcherConfig(**options))
    batcher.tokenizer = model.tokenizer
    return batcher


def letter_gate(permits: int | None = None) -> Gate:
    return Gate(identity_decode, permits=permits)


def openai_client(base_url: str, timeout: float = 30.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def stats(base_url: str) -> dict:
    return httpx.get(f"{base_url}/stats", timeout=DEADLINE).json()


def poll(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)
