"""No hostile request stalls the others (`stall_probe.assert_no_stall`): a small greedy completion's latency
beside each stays within a bound derived from its latency alone, and every block comes back.

The hostile requests here are structured output's: a regex whose first mask cost 1 s and each later one
0.1 s per row on the worker (`n: 16`, each send varied so that no cache answers it), the same language as
a JSON-schema pattern, and a flood of 77 KB GBNF grammars that the converter takes quadratic time over
(four at once, each varied by one character). Each is refused with a 400 naming its field (or a 503 while
the conversions are busy) at no cost to the probe.
"""

from __future__ import annotations

import httpx
import pytest
from server_helpers import served, tiny_batcher
from stall_probe import assert_no_stall

PROBE = ("/v1/completions", {"prompt": "hello", "max_tokens": 16, "temperature": 0, "ignore_eos": True})


@pytest.fixture(scope="module")
def http(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model)) as (base_url, _app):
        with httpx.Client(base_url=base_url, timeout=120) as client:
            yield client


def regex(i: int) -> tuple[str, dict]:
    return ("/v1/completions", {"prompt": "x", "max_tokens": 16, "n": 16,
                                "structured_outputs": {"regex": f"(x{{600}}){{{600 + i}}}"}})


def pattern(i: int) -> tuple[str, dict]:
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": f"^(x{{600}}){{{600 + i}}}$"}},
              "required": ["a"]}
    return ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 16,
                                     "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "x", "schema": schema}}})


#: About 77 KB of GBNF: a chain of rules, which the converter takes quadratic time over.
CHAIN = "root ::= r0\n" + "".join(f"r{k} ::= r{k + 1} \"x\"\n" for k in range(4000))


def gbnf(i: int) -> tuple[str, dict]:
    grammar = CHAIN + f"r4000 ::= \"{i}\"\n"  # one character more or less: no cache answers it
    return ("/v1/completions", {"prompt": "x", "max_tokens": 4, "structured_outputs": {"grammar": grammar}})


def refused_naming(answers: list[httpx.Response], field: str, busy_ok: bool = False) -> None:
    assert answers
    for answer in answers:
        if busy_ok and answer.status_code == 503:
            continue
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == field, answer.text


def test_a_costly_regex_stalls_no_one(http):
    refused_naming(assert_no_stall(http, PROBE, regex), "structured_outputs.regex")


def test_a_costly_schema_pattern_stalls_no_one(http):
    refused_naming(assert_no_stall(http, PROBE, pattern), "response_format.json_schema.schema")


def test_a_flood_of_gbnf_grammars_stalls_no_one(http):
    refused_naming(assert_no_stall(http, PROBE, gbnf, copies=4), "structured_outputs.grammar", busy_ok=True)
