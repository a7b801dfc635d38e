"""Fuzzing structured output with costly inputs: never a 5xx but a busy server's 503, nothing held after.

Bodies carry grammars that cost more than they weigh: regexes of nested counted repetitions
(`(x{N}){M}`, as `structured_outputs.regex`, `guided_regex` or a JSON-schema `pattern`), GBNF chains of
rules (quadratic to convert), and floods of newlines (before a GBNF or a Lark grammar, or alone). Each answer
is a 200; a 400 `grammar_too_costly` naming the field that said it, or `grammar_constraint` /
`invalid_request` (a grammar refused as invalid or over a size limit); or a 503 (grammar compiles or
conversions busy). Never another 5xx; after each, the worker lives and, once idle, every block is free.
"""

from __future__ import annotations

from typing import Any

import pytest
from fuzz_helpers import FUZZ_SETTINGS, fuzzed_server, settled
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.structured import MAX_SPEC_BYTES

#: Each costly example may cost up to a compile's or a conversion's CPU budget: fewer than the API fuzz's.
GRAMMAR_SETTINGS = settings(FUZZ_SETTINGS, max_examples=30)
REFUSALS = {"grammar_too_costly", "grammar_constraint", "invalid_request"}


@pytest.fixture(scope="module")
def fuzzed(tiny_batch_model):
    with fuzzed_server(tiny_batch_model) as http:
        yield http


def chain(rules: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1} \"x\"\n" for i in range(rules)) + f"r{rules} ::= \"y\"\n"


@st.composite
def costly_grammars(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """(the structured-output part of a body, the field a refusal names)."""
    shape = draw(st.sampled_from(["regex", "guided_regex", "pattern", "chain", "flood"]))
    if shape in ("regex", "guided_regex", "pattern"):
        inner, outer = draw(st.integers(1, 700)), draw(st.integers(1, 700))
        regex = f"(x{{{inner}}}){{{outer}}}"
        if shape == "regex":
            return {"structured_outputs": {"regex": regex}}, "structured_outputs.regex"
        if shape == "guided_regex":
            return {"guided_regex": regex}, "guided_regex"
        schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": f"^{regex}$"}},
                  "required": ["a"]}
        return ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                "response_format.json_schema.schema")
    if shape == "chain":
        return {"structured_outputs": {"grammar": chain(draw(st.integers(1, 4000)))}}, "structured_outputs.grammar"
    tail = draw(st.sampled_from(["", 'root ::= "x"\n', 'start: "x"\n']))
    flood = draw(st.sampled_from(["\n", "\r\n", " \n", "\t"])) * draw(st.integers(1, MAX_SPEC_BYTES // 2))
    return {"structured_outputs": {"grammar": flood + tail}}, "structured_outputs.grammar"


@GRAMMAR_SETTINGS
@given(costly_grammars(), st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.booleans())
def test_costly_grammars_are_served_or_refused_never_a_5xx(fuzzed, grammar, route, stream):
    part, field = grammar
    body: dict[str, Any] = ({"prompt": "Say"} if route == "/v1/completions"
                            else {"messages": [{"role": "user", "content": "Say"}]})
    body.update(part, max_tokens=2, temperature=0, stream=stream)
    reply = fuzzed.post(route, json=body)
    assert reply.status_code in (200, 400, 503), (reply.status_code, reply.text[:500])
    if reply.status_code == 200 and stream:
        assert reply.text.rstrip().endswith("data: [DONE]"), reply.text[-300:]
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert error["message"] and error["type"], error
        if reply.status_code == 400:
            assert error["code"] in REFUSALS and error["param"] == field, (error, field)
    settled(fuzzed)
