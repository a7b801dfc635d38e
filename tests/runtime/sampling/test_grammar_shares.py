"""The live-grammar budget on small budgets: what it counts, when it refuses, and whose refusal a waiter gets.

Pins: idle cached grammars never make a new spec a 503 (they are evicted first), and the busy message counts
only the grammars requests hold; a client past its share is refused before its spec is compiled (nothing
built, nothing cached), and a spec that fails to compile gives its share back; a request waiting on another
request's build of an equal spec is answered on its own terms: built again with its own token when the
builder's client left, refused naming its own field when the spec is too costly.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time

import pytest

from ferrox_batch.cancel import CancelToken
from ferrox_batch.errors import GrammarConstraint
from ferrox_batch.grammar_limits import GrammarLimits, GrammarTooCostly
from ferrox_batch.runtime.sampling import grammar_compiler
from ferrox_batch.runtime.sampling.gbnf import GrammarCancelled
from ferrox_batch.runtime.sampling.grammar import Grammars, GrammarsBusy
from ferrox_batch.structured import StructuredOutput


def engine(model, **limits) -> Grammars:
    tokenizer = model.tokenizer
    return Grammars(tokenizer.inner.to_str(), model.config.vocab_size, sorted(tokenizer.stop_tokens.ids),
                    limits=GrammarLimits(**limits))


def schema(k: int, properties: int = 30) -> StructuredOutput:
    return StructuredOutput.json_schema({"type": "object", "properties": {f"p{k}_{i}": {"type": "string"}
                                                                          for i in range(properties)}})


def of(spec: StructuredOutput, client: str | None = None, source: str | None = None) -> StructuredOutput:
    return dataclasses.replace(spec, client=client, source=source)


def test_idle_cached_grammars_are_evicted_before_a_spec_is_refused(tiny_batch_model):
    first, second, third = schema(0), schema(1), schema(2)
    grammars = engine(tiny_batch_model, live_bytes=first.size + second.size + third.size - 1)
    held = [grammars.compile(of(first, "a")), grammars.compile(of(second, "a"))]
    held.clear()  # the client's requests are answered: both stay cached, held by nobody
    gc.collect()
    assert grammars.kept()[0] == 2 and grammars.held("a") == 0
    assert grammars.compile(of(third, "b")).spec == third
    assert grammars.live() <= first.size + second.size + third.size - 1


def test_the_busy_message_counts_only_the_grammars_requests_hold(tiny_batch_model):
    first, second, big = schema(0), schema(1), schema(2, properties=60)
    grammars = engine(tiny_batch_model, live_bytes=first.size + big.size - 1)
    held = grammars.compile(of(first, "a"))
    dropped = grammars.compile(of(second, "a"))
    del dropped
    gc.collect()
    with pytest.raises(GrammarsBusy) as busy:
        grammars.compile(of(big, "b"))
    assert busy.value.live_bytes == first.size and f"hold {first.size} bytes" in str(busy.value)
    assert held.spec == first


def test_a_client_past_its_share_is_refused_before_its_spec_is_compiled(tiny_batch_model):
    first, second = schema(0), schema(1)
    grammars = engine(tiny_batch_model, client_live_bytes=first.size + second.size - 1)
    held = grammars.compile(of(first, "a"))
    kept, live = grammars.kept(), grammars.live()
    with pytest.raises(GrammarsBusy, match="this client"):
        grammars.compile(of(second, "a"))
    assert grammars.kept() == kept and grammars.live() == live  # nothing built, nothing cached
    assert grammars.held("a") == first.size and held.spec == first


def test_a_spec_that_fails_to_compile_gives_its_share_back(tiny_batch_model):
    grammars = engine(tiny_batch_model)
    with pytest.raises(GrammarConstraint):
        grammars.compile(of(StructuredOutput.lark("start: undefined_rule\n"), "a"))
    assert grammars.held("a") == 0


def until_waited_on(grammars: Grammars, spec: StructuredOutput) -> None:
    """Returns once a thread waits on the build of `spec` in flight (its future's condition has a waiter)."""
    while True:
        pending = grammars._compiler._pending.get(spec)
        if pending is not None and pending._condition._waiters:
            return
        time.sleep(0.002)


def test_a_waiter_builds_again_when_the_builders_request_is_cancelled(tiny_batch_model, monkeypatch):
    grammars = engine(tiny_batch_model)
    tokens: list[CancelToken | None] = []

    def to_lark(text: str, cancel: CancelToken | None = None) -> str:
        tokens.append(cancel)
        if len(tokens) == 1:  # the builder's conversion runs until its client leaves
            while not cancel.is_cancelled():
                time.sleep(0.002)
            raise GrammarCancelled()
        return 'start: "yes"\n'

    monkeypatch.setattr(grammars._compiler._gbnf, "to_lark", to_lark)
    spec = StructuredOutput.grammar('root ::= "yes"\n')
    builder_token, waiter_token = CancelToken(), CancelToken()
    answers: dict[str, object] = {}

    def compile_as(name: str, token: CancelToken) -> None:
        try:
            answers[name] = grammars.compile(spec, token)
        except Exception as failed:  # noqa: BLE001 - the answer is what the test checks
            answers[name] = failed

    builder = threading.Thread(target=compile_as, args=("builder", builder_token))
    builder.start()
    while not tokens:
        time.sleep(0.002)
    waiter = threading.Thread(target=compile_as, args=("waiter", waiter_token))
    waiter.start()
    until_waited_on(grammars, spec)
    builder_token.cancel()
    builder.join()
    waiter.join()
    assert isinstance(answers["builder"], GrammarCancelled)
    assert not isinstance(answers["waiter"], Exception) and answers["waiter"].spec == spec
    assert tokens == [builder_token, waiter_token]  # built again, with the waiter's own token


def test_a_waiter_is_refused_as_too_costly_naming_its_own_field(tiny_batch_model, monkeypatch):
    grammars = engine(tiny_batch_model, first_masks_ms=10)
    gate = threading.Event()
    probing = threading.Event()

    def costly_probe(*args, **kwargs) -> float:
        probing.set()
        assert gate.wait(30), "the test never released the probe"
        return 1.0  # seconds: far past the budget

    monkeypatch.setattr(grammar_compiler, "first_masks_cpu_s", costly_probe)
    regex = StructuredOutput.regex("x+")
    answers: dict[str, object] = {}

    def compile_as(source: str) -> None:
        try:
            grammars.compile(of(regex, source=source))
        except Exception as failed:  # noqa: BLE001 - the answer is what the test checks
            answers[source] = failed

    builder = threading.Thread(target=compile_as, args=("structured_outputs.regex",))
    builder.start()
    assert probing.wait(30)
    waiter = threading.Thread(target=compile_as, args=("response_format.json_schema.schema",))
    waiter.start()
    until_waited_on(grammars, regex)
    gate.set()
    builder.join()
    waiter.join()
    for source, refusal in answers.items():
        assert isinstance(refusal, GrammarTooCostly) and refusal.param == source
    assert len(answers) == 2
