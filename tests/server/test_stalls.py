"""No hostile request stalls the others (`stall_probe.assert_no_stall`): a small greedy completion's latency
beside each stays within a bound derived from its latency alone, and every block comes back.

The hostile requests here are structured output's: a regex whose first mask cost 1 s and each later one
0.1 s per row on the worker (`n: 16`, each send varied so that no cache answers it), the same language as
a JSON-schema pattern, and a flood of 77 KB GBNF grammars that the converter takes quadratic time over
(four at once, each varied by one character). Each is refused with a 400 naming its field (or a 503 while
the conversions are busy) at no cost to the probe. A realistic 220 KB schema with `n: 16`, new each time, is
answered (a 200: compiled once per request, off the worker). And one client's long requests holding big
schemas leave another client's schema requests answered: each client's grammars are priced against its own
share of the live-grammar budget (here the probe is the other client's schema request).
"""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import MODEL_NAME, served, tiny_batcher
from stall_probe import assert_no_stall

from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.bench.schemas import tool_schemas
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.grammar_limits import GrammarLimits
from ferrox_batch.runtime.sampling.grammar import Grammars
from ferrox_batch.structured import StructuredOutput

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


#: A chat request with a 220 KB schema of 50 tools and `n: 16`, encoded once; each send names its tools anew.
BIG_SCHEMA = json.dumps({"messages": [{"role": "user", "content": "fill it"}], "max_tokens": 8, "n": 16,
                         "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "big", "schema": tool_schemas(50)}}},
                        separators=(",", ":")).encode()


def big_schema(i: int) -> tuple[str, bytes]:
    return "/v1/chat/completions", BIG_SCHEMA.replace(b'"tool_0"', b'"tool_0_%d"' % i)  # no cache answers it


def test_a_220_kb_schema_with_n_16_stalls_no_one(http):
    for answer in assert_no_stall(http, PROBE, big_schema, rows=16):
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["choices"]) == 16


ALICE, BOB = "sk-alice-1", "sk-bob-2"
#: Properties of the hog's schemas: each schema's text is about 40 KB, all the same size.
HOG_PROPERTIES = 1000


def hog_schema(k: int) -> dict:
    """Every property required: an answer runs to its `max_tokens`, holding its grammar as long."""
    names = [f"p{k}_{i:04d}" for i in range(HOG_PROPERTIES)]
    return {"type": "object", "properties": {name: {"type": "string"} for name in names}, "required": names}


SMALL = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


def shared_grammars(model) -> tuple[Grammars, int]:
    """Grammars whose live budget one client's four hog schemas overfill, by less than the small schema, while
    each client's share takes two of them: without shares the hog's three would leave the small schema no room
    (so a probe with it would be refused), with them it always has room. Nothing is kept past its requests,
    so the live bytes are the requests' own."""
    size = StructuredOutput.json_schema(hog_schema(0)).size
    small = StructuredOutput.json_schema(SMALL).size
    limits = GrammarLimits(live_bytes=3 * size + small - 1, client_live_bytes=2 * size + small)
    tokenizer = model.tokenizer
    grammars = Grammars(tokenizer.inner.to_str(), model.config.vocab_size, sorted(tokenizer.stop_tokens.ids),
                        keep=0, keep_bytes=0, limits=limits)
    return grammars, size


@pytest.fixture(scope="module")
def tenants(tiny_batch_model):
    """A server with two API keys (two clients) and `shared_grammars`: (Bob's client, Alice's headers)."""
    model = tiny_batch_model
    grammars, _size = shared_grammars(model)
    config = BatcherConfig(kv_block_size=16, kv_blocks=256)
    ceiling = ContextCeiling(config.context_limit(model.config.max_position_embeddings), model.kv_shape())
    batcher = ContinuousBatcher.spawn_with_ceiling(model.decoder, model.tokenizer.decode, config, ceiling,
                                                   grammars=grammars)
    batcher.tokenizer = model.tokenizer
    with served(batcher, api_key=(ALICE, BOB)) as (base_url, _app):
        with httpx.Client(base_url=base_url, timeout=120, headers={"Authorization": f"Bearer {BOB}"}) as client:
            yield client, {"Authorization": f"Bearer {ALICE}"}


#: Four requests with big schemas, each long enough that the hog's four copies hold theirs together.
HOGS = [json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": 64, "structured_outputs": {"json": hog_schema(k)}},
                   separators=(",", ":")).encode() for k in range(4)]


def hog(i: int) -> tuple[str, bytes]:
    return "/v1/completions", HOGS[i % 4]


def test_one_clients_big_schemas_leave_another_clients_schema_answered(tenants):
    bob, alice = tenants
    probe = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 16,
                                      "temperature": 0, "response_format": {
                                          "type": "json_schema", "json_schema": {"name": "small", "schema": SMALL}}})
    answers = assert_no_stall(bob, probe, hog, copies=4, hostile_headers=alice, rows=4)  # every probe answered 200
    busy = [a for a in answers if a.status_code == 503]
    assert busy, "the hog never went past its share"
    assert all("this client" in a.json()["error"]["message"] for a in busy), busy[0].text
    assert all(a.status_code in (200, 503) for a in answers)
