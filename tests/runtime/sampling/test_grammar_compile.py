"""The grammar engine's compile (`runtime.sampling.grammar.Grammars`), on the tiny checkpoint's tokenizer.

Pins: a schema compiles once into a grammar each row copies (two rows advance independently, the compiled
grammar stays at its start); a schema or grammar over `MAX_SPEC_BYTES` is refused before any compiling;
one within the bytes but over the work bound (grammar symbols) is refused, and a realistic schema of
about 200 KB is not; the compiled cache is bounded in entries and in bytes, oldest out first; concurrent
compiles of one new schema build it once.
"""

from __future__ import annotations

import json
import threading

import llguidance
import pytest
from grammar_helpers import BuildRecorder, optional_properties, tool_schemas

from ferrox_batch.errors import GrammarConstraint
from ferrox_batch.runtime.sampling.grammar import COMPILED_BYTES, COMPILED_KEPT, MAX_GRAMMAR_SYMBOLS, Grammars
from ferrox_batch.structured import MAX_SPEC_BYTES, StructuredOutput

PET = StructuredOutput.json_schema({"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                                    "required": ["kind"], "additionalProperties": False})


def engine(model, **options) -> Grammars:
    tokenizer = model.tokenizer
    return Grammars(tokenizer.inner.to_str(), model.config.vocab_size, sorted(tokenizer.stop_tokens.ids), **options)


@pytest.fixture(scope="module")
def grammars(tiny_batch_model) -> Grammars:
    return engine(tiny_batch_model)


@pytest.fixture
def builds(monkeypatch) -> BuildRecorder:
    recorder = BuildRecorder(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", recorder)
    return recorder


def test_each_row_copies_the_compiled_grammar(tiny_batch_model, grammars):
    compiled = grammars.compile(PET)
    ids = tiny_batch_model.tokenizer.encode('{"kind":"ca')
    first = grammars.matcher(compiled)
    assert first.consume_tokens(ids) and not first.is_error()
    second = grammars.matcher(compiled)  # starts where the grammar starts, whatever the first row did
    assert second is not first and second.consume_tokens(ids) and not second.is_error()
    assert grammars.matcher(compiled).consume_tokens(ids)


def test_a_schema_compiles_once(grammars, builds):
    spec = StructuredOutput.json_schema({"type": "object", "properties": {"once": {"type": "integer"}}})
    compiled = grammars.compile(spec)
    assert grammars.compile(spec) is compiled and grammars.compile(StructuredOutput.json_schema(
        json.loads(spec.schema))) is compiled  # a value equal to it is the same schema
    assert len(builds.threads) == 1


def test_a_spec_over_the_byte_limit_is_refused_before_compiling(grammars, builds):
    padding = "x" * MAX_SPEC_BYTES
    for spec in (StructuredOutput.json_schema({"type": "string", "description": padding}),
                 StructuredOutput.lark(f'start: "a"\n// {padding}\n')):
        with pytest.raises(GrammarConstraint) as refused:
            grammars.compile(spec)
        assert f"{MAX_SPEC_BYTES}" in refused.value.detail
    assert builds.threads == []


def test_a_schema_over_the_work_limit_is_refused(grammars):
    schema = optional_properties(MAX_GRAMMAR_SYMBOLS // 6)  # about 7 symbols each: past the limit
    spec = StructuredOutput.json_schema(schema)
    assert len(spec.schema) < MAX_SPEC_BYTES / 4  # small in bytes: the symbols are what it costs
    with pytest.raises(GrammarConstraint) as refused:
        grammars.compile(spec)
    assert "too big" in refused.value.detail and f"{MAX_GRAMMAR_SYMBOLS}" in refused.value.detail
    grammars.compile(StructuredOutput.json_schema(optional_properties(MAX_GRAMMAR_SYMBOLS // 10)))  # within


def test_a_large_realistic_schema_compiles(grammars):
    spec = StructuredOutput.json_schema(tool_schemas(50))
    assert 150_000 < len(spec.schema) < MAX_SPEC_BYTES
    assert not grammars.matcher(grammars.compile(spec)).is_error()


def test_the_cache_is_bounded_in_bytes_and_entries(tiny_batch_model):
    assert MAX_SPEC_BYTES <= COMPILED_BYTES < COMPILED_KEPT * MAX_SPEC_BYTES  # the bytes bind before the count
    small = engine(tiny_batch_model, keep=3, keep_bytes=5000)

    def padded(i: int, size: int) -> StructuredOutput:
        spec = StructuredOutput.json_schema({"const": i, "description": "x" * size})
        assert size < len(spec.schema) < size + 50
        return spec

    specs = [padded(i, 2000) for i in range(5)]
    for spec in specs:
        small.compile(spec)  # nothing but the cache holds it once this returns
        entries, size = small.kept()
        assert size <= 5000 and entries <= 2
        assert small.live() == size  # what went out of the cache is freed
    newest = small.compile(specs[-1])
    assert small.compile(specs[-1]) is newest  # the newest is kept
    for i in range(5):
        small.compile(padded(10 + i, 10))
    assert small.kept()[0] == 3
    too_big = padded(99, 6000)  # more than the whole budget: compiled, answered, not kept
    small.compile(too_big)
    assert small.kept()[1] <= 5000


def test_concurrent_compiles_of_a_new_schema_build_it_once(tiny_batch_model, monkeypatch):
    fresh = engine(tiny_batch_model)
    fresh.compile(PET)  # the tokenizer is built before the gate is set
    gate = threading.Event()
    recorder = BuildRecorder(llguidance.LLMatcher, gate)
    monkeypatch.setattr(llguidance, "LLMatcher", recorder)
    spec = StructuredOutput.json_schema({"type": "object", "properties": {"together": {"type": "boolean"}}})
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(fresh.compile(spec))) for _ in range(4)]
    threads[0].start()
    for _ in range(3000):  # until the first compile is in flight, held at the gate
        if recorder.threads:
            break
        threads[0].join(0.01)
    assert recorder.threads, "the first compile never started"
    for thread in threads[1:]:
        thread.start()
    for thread in threads[1:]:
        thread.join(0.3)  # they wait for the first one's result (a regression would build here)
    gate.set()
    for thread in threads:
        thread.join(30)
    assert len(results) == 4 and all(r is results[0] for r in results)
    assert len(recorder.threads) == 1


def test_the_grammars_alive_are_bounded_and_freed_with_their_requests(tiny_batch_model):
    from ferrox_batch.runtime.sampling.grammar import GrammarsBusy

    # No cache: what stays alive is what the requests (here, the test) hold.
    grammars = engine(tiny_batch_model, keep=0, live_bytes=3000)
    schemas = [StructuredOutput.json_schema({"type": "object", "properties": {f"p{k}{i}": {"type": "string"}
                                                                           for i in range(40)}})
               for k in range(3)]
    assert all(1000 < s.size <= 1500 for s in schemas)
    held = [grammars.compile(schemas[0]), grammars.compile(schemas[1])]
    assert grammars.live() == sum(s.size for s in schemas[:2])
    with pytest.raises(GrammarsBusy) as busy:  # a queue of distinct schemas cannot pin memory without bound
        grammars.compile(schemas[2])
    assert busy.value.http_status == 503
    assert grammars.compile(schemas[0]) is held[0]  # a spec a request holds is neither built nor counted again
    held.pop()  # that request was answered: its grammar is freed
    assert grammars.live() == schemas[0].size
    grammars.compile(schemas[2])
