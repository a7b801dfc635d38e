"""Priorities and queue deadlines over HTTP, through the official `openai` client.

Pins: with one row busy, a request sent later with a more urgent `priority` is answered before one sent
earlier with a less urgent one (the server answers in admission order when one row serves them all);
a request still waiting past its `max_queue_wait_ms` gets 503 `queue_timeout` with Retry-After, and
every usage reports the time spent waiting for admission (`queue_time_ms`) beside the prefill and
decode times.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import time

import openai
import pytest
from server_helpers import DEADLINE, MODEL_NAME, gated_batcher, letter_gate, openai_client, poll, served, stats

REQUEST = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
#: The priorities these servers let clients use (by default only 0: `test_client_priorities`).
PRIORITIES = (-10, 10)


def create(client: openai.OpenAI, rid: str, **extra):
    return client.completions.create(**REQUEST, extra_headers={"X-Request-Id": rid},
                                     extra_body={"ignore_eos": True, **extra})


def test_priority_orders_admission_and_a_queue_deadline_is_503(tiny_batch_model, caplog):
    gate = letter_gate(permits=0)
    batcher = gated_batcher(tiny_batch_model, gate, max_seqs=1)
    caplog.set_level(logging.INFO, logger="ferrox_batch.server")
    with served(batcher, client_priorities=PRIORITIES) as (base_url, _app), openai_client(base_url) as client, \
            concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = pool.submit(create, client, "running")
        gate.wait_calls(1)  # admitted, and holding the worker (and its one row) inside its first decode
        relaxed = pool.submit(create, client, "relaxed", priority=5)
        poll(lambda: stats(base_url)["queue_depth"] == 1, "the relaxed request to queue")
        urgent = pool.submit(create, client, "urgent", priority=-1)
        poll(lambda: stats(base_url)["queue_depth"] == 2, "the urgent request to queue")
        late = pool.submit(create, client, "late", max_queue_wait_ms=1)
        poll(lambda: stats(base_url)["queue_depth"] == 3, "the request with a deadline to queue")
        time.sleep(0.05)  # past its 1 ms: refused at the worker's next tick
        gate.open()
        with pytest.raises(openai.InternalServerError) as refused:
            late.result(DEADLINE)
        assert refused.value.status_code == 503 and refused.value.code == "queue_timeout"
        assert refused.value.response.headers["retry-after"] == "1"
        replies = {name: f.result(DEADLINE) for name, f in (("running", running), ("relaxed", relaxed),
                                                              ("urgent", urgent))}
    answered = [m.group(1) for m in (re.match(r"request (\w+): length", r.getMessage()) for r in caplog.records) if m]
    assert answered == ["running", "urgent", "relaxed"]
    for reply in replies.values():
        usage = reply.usage.model_dump()
        assert usage["completion_tokens"] == 3
        assert {"queue_time_ms", "prefill_time_ms", "decode_time_ms"} <= set(usage)
    assert replies["relaxed"].usage.model_dump()["queue_time_ms"] >= 50  # it waited out the held row and more


def test_bad_priorities_and_deadlines_are_400s_naming_the_field(tiny_batch_model):
    batcher = gated_batcher(tiny_batch_model, letter_gate(permits=None))
    with served(batcher, client_priorities=PRIORITIES) as (base_url, _app), openai_client(base_url) as client:
        for field, value in (("priority", 1.5), ("priority", 2**31), ("priority", True), ("max_queue_wait_ms", 0),
                             ("max_queue_wait_ms", -3), ("max_queue_wait_ms", "10")):
            with pytest.raises(openai.BadRequestError) as bad:
                create(client, "bad", **{field: value})
            assert bad.value.param == field, (field, value)
        assert create(client, "good", priority=-7, max_queue_wait_ms=60_000).usage.completion_tokens == 3
