"""The fuzzed server the API fuzz tests share: the tiny checkpoint behind small per-request caps, and the
check each answer must pass (never a 5xx, OpenAI's error shape, the worker alive, nothing held once idle)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import httpx
from hypothesis import HealthCheck, settings
from server_helpers import DEADLINE, served, tiny_batcher

from ferrox_batch.request_caps import RequestCaps

EXAMPLES = 120
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                HealthCheck.data_too_large])
VOCAB = 384  # the tiny checkpoint's
#: The fuzzed server's per-request caps: above what the plausible bodies send, low enough to reach.
CAPS = {"max_allowed_token_ids": 100, "max_stop_chars": 64, "max_prompt_logprobs": 1000,
        "max_tokenization_ids": 256, "max_detokenize_bytes": 600}


@contextlib.contextmanager
def fuzzed_server(model) -> Iterator[httpx.Client]:
    """`model` served with the prefix cache on (as when serving) and `CAPS`; a client of it."""
    batcher = tiny_batcher(model, prefix_cache=True, max_queue_wait_ms=60_000)
    with served(batcher, write_timeout=10.0, request_caps=RequestCaps(**CAPS)) as (base_url, _app):
        with httpx.Client(base_url=base_url, timeout=60.0) as http:
            yield http


def check(http: httpx.Client, reply: httpx.Response) -> None:
    """No 5xx; a 4xx in the error shape of the API its path belongs to; nothing held once idle."""
    assert reply.status_code < 500, (reply.status_code, reply.text[:500])
    if reply.status_code >= 400 and reply.request.method != "HEAD":  # a HEAD answer has no body
        path, body = reply.request.url.path, reply.json()
        if path == "/api" or path.startswith("/api/"):  # Ollama's: the message alone
            assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
        else:
            if path == "/v1/messages" or path.startswith("/v1/messages/"):  # Anthropic's: typed, then the error
                assert body["type"] == "error", body
            error = body["error"]
            assert isinstance(error["message"], str) and error["message"], error
            assert isinstance(error["type"], str) and error["type"], error
    settled(http)


def settled(http: httpx.Client) -> None:
    """The worker alive, and once idle nothing held: every block free, nothing queued."""
    assert http.get("/health").status_code == 200, "the worker stopped"
    deadline = time.monotonic() + DEADLINE
    while True:
        stats = http.get("/stats").json()
        idle = stats["queue_depth"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
        if idle:
            return
        assert time.monotonic() < deadline, f"blocks are still held when idle: {stats}"
        time.sleep(0.01)
