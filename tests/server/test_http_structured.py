"""Structured output (`response_format`, vLLM's `structured_outputs` and `guided_*`) over HTTP through the official `openai` client, on a tiny random
checkpoint whose free output is never JSON: the grammar alone makes it so.

Pins: a bounded JSON schema gives output that parses and validates, whole and streamed, and finishes with
`stop` where the grammar ends; JSON mode gives a JSON object; rows without a grammar batched beside
constrained ones are unchanged (their greedy answers equal the same requests alone); an invalid schema is a
400 `grammar_constraint` before anything is queued; `ignore_eos` with a grammar is a 400; the sampler's
masks come from the grammar engine for the constrained rows only. Every other kind (a regex, a choice, a
Lark or GBNF grammar, a schema through `structured_outputs`) constrains chat and completions, whole and
streamed, keeps free rows beside it unchanged, and an invalid one is a 400 before anything is queued.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

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
        assert list(json.loads(choice.message.content)) == list(SCHEMA["properties"])  # the schema's order
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


#: Every other kind, each in vLLM's `structured_outputs` object: (its member, value, a check of the output).
KINDS = {
    "regex": (r"(cat|dog)-[0-9]{2}", lambda text: re.fullmatch(r"(cat|dog)-[0-9]{2}", text)),
    "choice": (["alpha", "beta", "gamma delta"], lambda text: text in ("alpha", "beta", "gamma delta")),
    "grammar": ('start: "go " DIR\nDIR: "north" | "south"', lambda text: text in ("go north", "go south")),
    "json": (SCHEMA, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
}
GBNF = 'root ::= "id-" [0-9] [0-9] [0-9]'


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_constrains_both_endpoints_whole_and_streamed(client, kind):
    value, check = KINDS[kind]
    for temperature in (0.0, 1.0):
        chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=64, seed=2,
                                              temperature=temperature,
                                              extra_body={"structured_outputs": {kind: value}})
        assert chat.choices[0].finish_reason == "stop" and check(chat.choices[0].message.content)
    completion = client.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=64, temperature=0,
                                           extra_body={f"guided_{kind}": value})
    assert completion.choices[0].finish_reason == "stop" and check(completion.choices[0].text)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=64, temperature=0,
                                            stream=True, extra_body={"structured_outputs": {kind: value}})
    assert check("".join(c.choices[0].delta.content or "" for c in stream if c.choices))


def test_a_gbnf_grammar_and_json_object_through_structured_outputs(client):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16, temperature=1.0,
                                           seed=4, extra_body={"structured_outputs": {"grammar": GBNF}})
    assert re.fullmatch(r"id-[0-9]{3}", reply.choices[0].message.content)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200, temperature=0,
                                           extra_body={"structured_outputs": {"json_object": True}})
    assert reply.choices[0].message.content.startswith("{")


def test_free_rows_beside_every_kind_are_unchanged(client):
    def free(i: int) -> str:
        return client.completions.create(model=MODEL_NAME, prompt=f"Count {i}", max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    alone = [free(i) for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        constrained = {kind: pool.submit(client.chat.completions.create, model=MODEL_NAME, messages=MESSAGES,
                                         max_tokens=64, temperature=0,
                                         extra_body={"structured_outputs": {kind: value}})
                       for kind, (value, _) in KINDS.items()}
        together = [pool.submit(free, i) for i in range(4)]
        assert [f.result() for f in together] == alone
        for kind, future in constrained.items():
            assert KINDS[kind][1](future.result().choices[0].message.content), kind


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "(unclosed"}}, None),
    ({"guided_regex": "[z-a]"}, None),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, None),
    ({"guided_grammar": "root ::= (("}, None),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
def test_a_bad_spec_of_any_kind_is_a_400_before_anything_is_queued(server, client, extra, param):
    base_url = server[0]
    before = stats(base_url)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, extra_body=extra)
    if param is None:
        assert refused.value.code == "grammar_constraint"
    else:
        assert refused.value.param == param
    after = stats(base_url)
    assert after["queue_depth"] == 0 and after["prefill_tokens"] == before["prefill_tokens"]
    # and the server goes on serving
    assert client.completions.create(model=MODEL_NAME, prompt="ok", max_tokens=2).choices[0].text is not None
