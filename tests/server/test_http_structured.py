"""Structured output (`response_format`) over HTTP through the official `openai` client, on a tiny random
checkpoint whose free output is never JSON: the grammar alone makes it so.

Pins: a bounded JSON schema gives output that parses and validates, whole and streamed, and finishes with
`stop` where the grammar ends; JSON mode gives a JSON object; rows without a grammar batched beside
constrained ones are unchanged (their greedy answers equal the same requests alone); an invalid schema is a
400 `grammar_constraint` before anything is queued; `ignore_eos` with a grammar is a 400; the sampler's
masks come from the grammar engine for the constrained rows only.
"""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest
from server_helpers import MODEL_NAME, stats

MESSAGES = [{"role": "user", "content": "Describe a pet."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "indoor": {"type": "boolean"},
    },
    "required": ["kind", "age", "indoor"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}


def test_a_schema_constrained_answer_parses_and_validates(client):
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=64, seed=5,
                                               temperature=temperature, response_format=FORMAT)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=64, temperature=0,
                                            response_format=FORMAT, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_mode_gives_an_object(client):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200, temperature=0,
                                           response_format={"type": "json_object"})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # out of tokens mid-object: what there is starts an object
        assert choice.message.content.startswith("{")


def test_free_rows_batched_beside_constrained_ones_are_unchanged(client):
    def free(i: int) -> str:
        return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": f"Say {i}"}],
                                              max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].message.content

    alone = [free(i) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(client.chat.completions.create, model=MODEL_NAME, messages=MESSAGES,
                                   max_tokens=64, temperature=0, response_format=FORMAT) for _ in range(3)]
        together = [pool.submit(free, i) for i in range(3)]
        assert [f.result() for f in together] == alone
        for f in constrained:
            jsonschema.validate(json.loads(f.result().choices[0].message.content), SCHEMA)


def test_an_invalid_schema_and_ignore_eos_are_400s(server, client):
    base_url = server[0]
    before = stats(base_url)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, response_format=bad)
    assert refused.value.code == "grammar_constraint"
    assert stats(base_url)["queue_depth"] == 0 and stats(base_url)["prefill_tokens"] == before["prefill_tokens"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, response_format=FORMAT,
                                       extra_body={"ignore_eos": True})
    assert refused.value.param == "ignore_eos"
    for fmt in ({"type": "xml"}, {"type": "json_schema"}, "json"):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, response_format=fmt)
        assert refused.value.param.startswith("response_format")
