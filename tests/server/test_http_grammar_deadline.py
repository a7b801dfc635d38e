"""A row past the worker's mask deadline, over HTTP: its own request ends, the others go on.

A regex that gets costly only after the probe's first masks: a few cheap letters, then `(x{600}){600}`
(about 75 ms of CPU a mask on the tiny tokenizer), against a deadline of 20 ms. Pins: the request ends with a 400
`grammar_too_slow` in OpenAI's error shape (streamed: an error event, then `[DONE]`), a concurrent
unconstrained request completes normally, and `/stats` settles with the queue empty and every block free.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from server_helpers import DEADLINE, MODEL_NAME, poll, served, stats

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.grammar_limits import PROBED_MASKS, GrammarLimits



def later_costly(letters: str) -> str:
    """Cheap for one more letter than the compile's probe looks at (`PROBED_MASKS`), then costly."""
    return f"({'|'.join(letters)}){{{PROBED_MASKS + 1}}}(x{{600}}){{600}}"
DEADLINE_MS = 20
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(tiny_batch_model):
    limits = GrammarLimits(mask_deadline_ms=DEADLINE_MS)
    with served(tiny_batcher(tiny_batch_model, limits)) as (base_url, _):
        yield base_url


def tiny_batcher(model, limits: GrammarLimits) -> ContinuousBatcher:
    return ContinuousBatcher.from_model(model, BatcherConfig(kv_block_size=16, kv_blocks=256), grammar_limits=limits)


def settled(base_url: str) -> bool:
    now = stats(base_url)
    return now["queue_depth"] == 0 and now["kv_blocks_free"] == now["kv_blocks_total"]


def hostile(stream: bool, letters: str) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": stream,
            "structured_outputs": {"regex": later_costly(letters)}}


def normal(base_url: str) -> dict:
    reply = httpx.post(f"{base_url}/v1/chat/completions", timeout=DEADLINE * 4,
                       json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
                             "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_late_row_ends_its_own_request_with_a_400(server):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(normal, server)
        raw = httpx.post(f"{server}/v1/chat/completions", timeout=DEADLINE * 4, json=hostile(False, "ab"))
        answer = other.result()
    assert raw.status_code == 400, raw.text
    error = raw.json()["error"]
    assert error["code"] == "grammar_too_slow" and error["type"] == "invalid_request_error"
    assert "--grammar-mask-deadline-ms" in error["message"]
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 8
    poll(lambda: settled(server), "the queue to empty and every block to come back")


def test_a_late_streamed_row_ends_with_an_error_event_then_done(server):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(normal, server)
        with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=DEADLINE * 4,
                          json=hostile(True, "cd")) as raw:
            assert raw.status_code == 200, raw.read()
            events = [line[len("data: "):] for line in raw.iter_lines() if line.startswith("data: ")]
        answer = other.result()
    assert events[-1] == "[DONE]"
    assert any(json.loads(event)["choices"] and json.loads(event)["choices"][0]["delta"].get("content")
               for event in events[:-2])  # late mid-way, after the cheap letters streamed
    error = json.loads(events[-2])["error"]
    assert error["code"] == "grammar_too_slow" and "--grammar-mask-deadline-ms" in error["message"]
    assert all("error" not in json.loads(event) for event in events[:-2])
    assert answer["usage"]["completion_tokens"] == 8
    poll(lambda: settled(server), "the queue to empty and every block to come back")
