"""Structured output's compile over HTTP: on the caller's side, once per schema, within limits.

Pins: a request of `n` choices compiles its schema once, on a prepare thread, never on the batcher's
worker (which only copies the compiled grammar for each row); a `response_format` schema or a tool's
`parameters` over the byte limit is a 400 naming the field, in OpenAI's error shape, before anything is
queued; a schema small in bytes but over the compile-work bound is a 400 `grammar_constraint`; the server
serves normally after each refusal.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import llguidance
import openai
import pytest
from grammar_helpers import BuildRecorder, optional_properties
from server_helpers import DEADLINE, MODEL_NAME, stats

from ferrox_batch.engine.handle import WORKER_THREAD_NAME
from ferrox_batch.runtime.sampling.grammar import MAX_GRAMMAR_SYMBOLS
from ferrox_batch.structured import MAX_SPEC_BYTES

MESSAGES = [{"role": "user", "content": "Describe a pet."}]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def still_serves(base_url: str, client: openai.OpenAI, before: dict) -> None:
    after = stats(base_url)
    assert after["queue_depth"] == 0 and after["prefill_tokens"] == before["prefill_tokens"]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature=0)
    assert reply.choices[0].message.content is not None


def test_n_choices_compile_once_and_never_on_the_worker(client, monkeypatch):
    recorder = BuildRecorder(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", recorder)
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["colour", "legs"], "additionalProperties": False}
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=4, max_tokens=48, seed=3,
                                           temperature=1.0, response_format=schema_format(schema))
    assert len(reply.choices) == 4
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
    assert [t for t in recorder.threads if t.startswith((WORKER_THREAD_NAME, "ferrox-grammar"))] == []
    assert len(recorder.threads) == 1, recorder.threads  # one compile for the four choices


def test_a_schema_over_the_byte_limit_is_a_400(server, client):
    base_url = server[0]
    before = stats(base_url)
    huge = {"type": "object", "properties": {"note": {"type": "string", "description": "x" * MAX_SPEC_BYTES}}}
    raw = httpx.post(f"{base_url}/v1/chat/completions", timeout=DEADLINE,
                     json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4,
                           "response_format": schema_format(huge)})
    assert raw.status_code == 400
    error = raw.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
    assert error["param"] == "response_format.json_schema.schema" and str(MAX_SPEC_BYTES) in error["message"]
    assert len(error["message"]) < 500  # the schema is not echoed back
    tool = {"type": "function", "function": {"name": "f", "parameters": huge}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, tools=[tool],
                                       tool_choice="required")
    assert refused.value.param == "tools[0].function.parameters"
    still_serves(base_url, client, before)


def test_a_schema_over_the_compile_work_bound_is_a_400(server, client):
    base_url = server[0]
    before = stats(base_url)
    costly = optional_properties(MAX_GRAMMAR_SYMBOLS // 6)  # about 7 grammar symbols each
    assert len(json.dumps(costly)) < MAX_SPEC_BYTES / 4
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                       response_format=schema_format(costly))
    assert refused.value.code == "grammar_constraint" and "too big" in str(refused.value)
    still_serves(base_url, client, before)
