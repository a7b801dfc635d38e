"""Clients that stop reading, and answers too big to build on the loop.

* A streaming client that takes nothing for `write_timeout` seconds is treated as gone: its request is
  cancelled (the batcher's `aborted` counter rises, its blocks come back) and the server serves on.
* A stream whose reader falls more than `max_buffered_reply_bytes` behind is cancelled the same way,
  without waiting for the write timeout.
* A whole answer is built and encoded off the loop, in pieces sent as the client takes them: `/health`
  answers while a big one is encoded, and a client that never reads it is dropped after the timeout.

The stalled client is a raw socket with a tiny receive buffer that sends its request and reads nothing;
the kernel still takes a few megabytes for it (its send buffer grows to `tcp_wmem`'s 4 MiB), so the
tests pad each chunk (or repeat each answer's log-probabilities) to make megabytes from a few tokens.
The worker runs behind a `Gate`: the test lets a fixed number of tokens through, then holds the
worker with the request unfinished, so whether it ends by cancellation never depends on the model's
speed.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import DEADLINE, MODEL_NAME, gated_batcher, letter_gate, poll, served, stats, tiny_batcher
from starlette.responses import JSONResponse

from ferrox_batch.server.http.json_body import SLICE_CONTAINERS, SLICE_SCALARS, json_pieces
from ferrox_batch.server.openai.logprob_shapes import LogprobShapes
from ferrox_batch.server.openai.chat_format import ChatFormat

DISCONNECTS = "ferrox_batch_client_disconnects_total"
#: Tokens the gate lets through, each streamed with `PAD` (about 50 MB in all, far past any socket buffer).
PERMITS = 400
PAD = "x" * 128 * 1024
STREAM = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me everything."}],
          "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}


def stalled_client(base_url: str, path: str, body: dict) -> socket.socket:
    """A connection that sends `body` and never reads a byte of the answer (the caller closes it)."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
    sock.settimeout(DEADLINE)
    sock.connect((host, int(port)))
    raw = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return sock


def disconnects(app) -> float:
    return app.state.ferrox.generations.metrics.registry.get_sample_value(DISCONNECTS)


def still_serves(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health", timeout=DEADLINE).status_code == 200
    reply = httpx.post(f"{base_url}/v1/completions", timeout=DEADLINE,
                       json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def padded_chunks(monkeypatch) -> None:
    real = ChatFormat.text_chunk

    def padded(self, index, text, logprobs=(), token_ids=()):
        chunk = real(self, index, text, logprobs, token_ids)
        chunk["padding"] = PAD
        return chunk

    monkeypatch.setattr(ChatFormat, "text_chunk", padded)


def repeated_logprobs(monkeypatch, repeat: int) -> None:
    """Each choice's completion log-probabilities `repeat` times over: cheap to build, big to encode."""
    real = LogprobShapes.completion

    def repeated(self, entries, lazy=False):
        return {key: value * repeat for key, value in real(self, entries).items()}

    monkeypatch.setattr(LogprobShapes, "completion", repeated)


def cancelled_when_stalled(tiny_batch_model, monkeypatch, caplog, **limits) -> None:
    """Stall a stream behind the gate; it must be cancelled and its blocks come back."""
    padded_chunks(monkeypatch)
    gate = letter_gate(permits=PERMITS)
    caplog.set_level(logging.WARNING, logger="ferrox_batch.server")
    with served(gated_batcher(tiny_batch_model, gate), **limits) as (base_url, app):
        before = stats(base_url)
        sock = stalled_client(base_url, "/v1/chat/completions", STREAM)
        try:
            # Past its permits the worker holds with the request unfinished: only a cancel can end it.
            poll(lambda: disconnects(app) == 1, "the server to give up on the stalled client")
            gate.open()
            poll(lambda: stats(base_url)["kv_blocks_free"] == before["kv_blocks_total"], "the blocks to come back")
            assert stats(base_url)["aborted"] == before["aborted"] + 1
            still_serves(base_url)
        finally:
            gate.open()
            sock.close()


def test_a_stream_whose_client_stops_reading_is_cancelled_after_the_write_timeout(tiny_batch_model, monkeypatch,
                                                                                     caplog):
    cancelled_when_stalled(tiny_batch_model, monkeypatch, caplog, write_timeout=1.0,
                           max_buffered_reply_bytes=1 << 30)
    assert any("took nothing for 1 s" in r.getMessage() for r in caplog.records)


def test_a_stream_whose_client_falls_too_far_behind_is_cancelled(tiny_batch_model, monkeypatch, caplog):
    # One letter a token, no log-probabilities: 64 tokens queued for the stalled reader are too many.
    cancelled_when_stalled(tiny_batch_model, monkeypatch, caplog, write_timeout=600.0, max_buffered_reply_bytes=64)
    assert any("fell too far behind" in r.getMessage() for r in caplog.records)


def test_a_whole_answer_nobody_reads_is_dropped_after_the_write_timeout(tiny_batch_model, monkeypatch, caplog):
    repeated_logprobs(monkeypatch, 3000)  # about 50 MB of JSON
    caplog.set_level(logging.WARNING, logger="ferrox_batch.server")
    body = {"model": MODEL_NAME, "prompt": "Hello", "n": 4, "max_tokens": 32, "logprobs": 5, "ignore_eos": True}
    with served(tiny_batcher(tiny_batch_model), write_timeout=1.0) as (base_url, _app):
        sock = stalled_client(base_url, "/v1/completions", body)
        try:
            poll(lambda: any("took nothing for 1 s" in r.getMessage() for r in caplog.records),
                 "the server to give up on the client that reads nothing")
            still_serves(base_url)
        finally:
            sock.close()


def test_the_new_limits_are_checked_like_the_others(tiny_batch_model):
    from ferrox_batch.server import create_app

    batcher = tiny_batcher(tiny_batch_model)
    try:
        for bad in (0, -1.5, float("nan"), float("inf"), "5", True, None):
            with pytest.raises(ValueError, match="write_timeout must be a positive, finite number of seconds"):
                create_app(batcher, model_name=MODEL_NAME, write_timeout=bad)
        for name in ("max_buffered_reply_bytes", "max_concurrent_tokenizations"):
            for bad in (0, -1, 1.5, "5", True, None):
                with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
                    create_app(batcher, model_name=MODEL_NAME, **{name: bad})
    finally:
        assert batcher.close(DEADLINE)


# ------------------------------------------------------------------ whole answers off the loop


def test_small_answers_have_a_length_and_big_ones_are_chunked(server):
    base_url, _batcher = server
    small = httpx.post(f"{base_url}/v1/completions", timeout=DEADLINE,
                       json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    assert small.status_code == 200 and int(small.headers["content-length"]) == len(small.content)
    big = httpx.post(f"{base_url}/v1/chat/completions", timeout=6 * DEADLINE,
                     json={**STREAM, "stream": False, "n": 4, "max_tokens": 200, "logprobs": True,
                           "top_logprobs": 20})
    assert big.status_code == 200 and big.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in big.headers
    answer = big.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    for choice in answer["choices"]:
        assert len(choice["logprobs"]["content"]) == 200
        assert all(len(e["top_logprobs"]) == 20 for e in choice["logprobs"]["content"])
    assert answer["usage"]["completion_tokens"] == 800


def test_health_answers_while_a_big_answer_is_encoded(server, monkeypatch):
    base_url, _batcher = server
    # ~700,000 objects a choice, cheap to build and seconds to encode (the C encoder holds the GIL for a
    # whole `json.dumps` call, off the loop or not).
    repeat = 3000
    repeated_logprobs(monkeypatch, repeat)
    body = {"model": MODEL_NAME, "prompt": "Hello", "n": 4, "max_tokens": 32, "logprobs": 5, "ignore_eos": True}
    answer: dict = {}

    def request() -> None:
        started = time.perf_counter()
        answer["response"] = httpx.post(f"{base_url}/v1/completions", json=body, timeout=6 * DEADLINE)
        answer["secs"] = time.perf_counter() - started

    worker = threading.Thread(target=request)
    with httpx.Client(timeout=DEADLINE) as http:
        http.get(f"{base_url}/health")
        worker.start()
        # The longest time between two answers (the server shares this process: a stall of the
        # loop or of the GIL shows as a gap wherever it falls).
        worst, polls, last = 0.0, 0, time.perf_counter()
        while worker.is_alive():
            assert http.get(f"{base_url}/health").status_code == 200
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
            polls += 1
            time.sleep(0.01)
        worker.join()
    response = answer["response"]
    assert response.status_code == 200
    choices = response.json()["choices"]
    assert len(choices) == 4 and all(len(c["logprobs"]["tokens"]) == 32 * repeat for c in choices)
    # Built and encoded on the loop, the answer stopped it for most of the exchange (seconds); a
    # quarter of it is a generous allowance for a loaded machine.
    assert polls >= 3 and worst < answer["secs"] / 4, (worst, answer["secs"], polls)


# ------------------------------------------------------------------ the piecewise encoder


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=300) | st.tuples(inner, inner)
    | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=2000)


@settings(max_examples=300, deadline=None)
@given(value=JSON_VALUES)
def test_the_pieces_are_what_json_response_writes(value):
    expected = JSONResponse(value).body.decode("utf-8")
    assert "".join(json_pieces(value)) == expected
    if isinstance(value, list):  # an iterator writes as the list it yields
        assert "".join(json_pieces(iter(value))) == expected


def test_no_piece_encodes_more_than_a_slice_of_a_long_list():
    entry = {"token": "a", "logprob": -1.0, "top_logprobs": [{"token": "b", "logprob": -2.0}] * 20}
    pieces = list(json_pieces({"content": [entry] * 10_000}))
    assert max(len(p) for p in pieces) <= SLICE_CONTAINERS * (len(json.dumps(entry, separators=(",", ":"))) + 1)
    assert len(pieces) >= 10_000 // SLICE_CONTAINERS
    pieces = list(json_pieces(list(range(100_000, 200_000))))
    assert max(len(p) for p in pieces) <= SLICE_SCALARS * 7 and len(pieces) >= 100_000 // SLICE_SCALARS
