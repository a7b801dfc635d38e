"""What one request's structured output may cost (`ferrox_batch.grammar_limits`), on the tiny checkpoint's tokenizer.

Pins: a regex or schema whose first masks cost more CPU than the budget is refused at compile with a 400
naming the field it came from, and a repeat is refused without compiling again; a realistic schema is
not; the worker's masks come within a deadline, a late row (a fake slow matcher, or the real hostile
regex) is reported alone while the others' masks arrive, and the wait is bounded by the deadline, not by
the slow row; a late row's thread never delays a later step's masks; each client's grammars are priced
against its own share, its builds in flight too; a GBNF grammar past its conversion limit is a 400 naming the field, and a
conversion stops as soon as its request is cancelled.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time

import numpy as np
import pytest
from grammar_helpers import tool_schemas

from ferrox_batch.cancel import CancelToken
from ferrox_batch.errors import GrammarConstraint
from ferrox_batch.grammar_limits import GrammarLimits, GrammarTooCostly
from ferrox_batch.runtime.sampling.gbnf import GbnfConverter
from ferrox_batch.runtime.sampling.grammar import Grammars, GrammarsBusy
from ferrox_batch.runtime.sampling.mask_pool import MaskPool
from ferrox_batch.structured import StructuredOutput

HOSTILE = "(x{600}){600}"
#: The same language as a JSON-schema pattern (which matches anywhere in the string unless anchored).
PATTERN = f"^{HOSTILE}$"


def engine(model, **limits) -> Grammars:
    tokenizer = model.tokenizer
    return Grammars(tokenizer.inner.to_str(), model.config.vocab_size, sorted(tokenizer.stop_tokens.ids),
                    limits=GrammarLimits(**limits))


def chain(rules: int) -> str:
    """A GBNF chain of rules: the converter finds one terminal rule per pass, so it takes rules**2 steps."""
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1} \"x\"\n" for i in range(rules)) + f"r{rules} ::= \"y\"\n"


@pytest.fixture(scope="module")
def grammars(tiny_batch_model) -> Grammars:
    return engine(tiny_batch_model)


def test_a_regex_or_pattern_whose_first_masks_are_costly_is_refused_naming_its_field(grammars):
    regex = dataclasses.replace(StructuredOutput.regex(HOSTILE), source="structured_outputs.regex")
    with pytest.raises(GrammarTooCostly) as refused:
        grammars.compile(regex)
    assert refused.value.param == "structured_outputs.regex" and refused.value.http_status == 400
    assert "--grammar-first-masks-ms" in str(refused.value)
    schema = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": PATTERN}},
                                           "required": ["a"]})
    with pytest.raises(GrammarTooCostly) as refused:
        grammars.compile(dataclasses.replace(schema, source="response_format.json_schema.schema"))
    assert refused.value.param == "response_format.json_schema.schema"
    began = time.thread_time()
    with pytest.raises(GrammarTooCostly):  # remembered: a repeat costs no compile and no probe
        grammars.compile(regex)
    assert time.thread_time() - began < GrammarLimits().first_masks_ms / 1e3
    grammars.compile(StructuredOutput.json_schema(tool_schemas(50)))  # a realistic 220 KB schema passes


class SlowFill:
    """A fake slow matcher: the mask of the row named `slow` takes until `release` is set (or 30 s)."""

    def __init__(self, slow: object) -> None:
        self.slow = slow
        self.release = threading.Event()

    def __call__(self, matcher: object, bits: np.ndarray, row: int) -> None:
        if matcher is self.slow:
            self.release.wait(30)
        bits[row] = row + 1


def test_a_late_row_is_reported_alone_and_the_wait_is_bounded_by_the_deadline():
    slow = object()
    fill = SlowFill(slow)
    pool = MaskPool(fill, words=2, deadline_s=0.05)
    try:
        matchers = [object(), slow, object()]
        began = time.monotonic()
        bits, late, failed = pool.start(matchers).collect()
        waited = time.monotonic() - began
        assert late == [1] and failed == {}
        assert bits[0].tolist() == [1, 1] and bits[2].tolist() == [3, 3]
        assert not fill.release.is_set()  # returned while the slow mask was still being computed
        # The next step's masks do not queue behind the late row's thread, which is still busy.
        bits, late, _ = pool.start([object(), object()]).collect()
        assert late == [] and bits[:, 0].tolist() == [1, 2]
    finally:
        fill.release.set()
        pool.close()
    assert waited < 30


def test_rows_that_never_started_are_not_late_for_it():
    slow = object()
    fill = SlowFill(slow)
    pool = MaskPool(fill, words=1, deadline_s=0.05, threads=1)  # the second row waits for the first's thread
    try:
        bits, late, _ = pool.start([slow, object()]).collect()
        assert late == [0] and bits[1].tolist() == [2]
    finally:
        fill.release.set()
        pool.close()


def test_the_real_hostile_regex_misses_the_workers_deadline_alone(tiny_batch_model):
    # Let the probe pass it (a budget above what it costs), as a grammar that only gets costly later would.
    grammars = engine(tiny_batch_model, first_masks_ms=600_000, mask_deadline_ms=20)
    try:
        hostile = grammars.compile(StructuredOutput.regex(HOSTILE))
        fine = grammars.compile(StructuredOutput.regex("[a-z]+"))
        matchers = [grammars.matcher(fine), grammars.matcher(hostile), grammars.matcher(fine)]
        bits, late, failed = grammars.start_masks(matchers).collect()
        assert late == [1] and failed == {}
        allowed = grammars.unpack(bits, "cpu")
        assert allowed[0].any() and allowed[2].any()
    finally:
        grammars.close()


def test_each_client_is_priced_against_its_own_share(tiny_batch_model):
    grammars = engine(tiny_batch_model, live_bytes=10_000, client_live_bytes=3_000)
    schemas = [StructuredOutput.json_schema({"type": "object", "properties": {f"p{k}{i}": {"type": "string"}
                                                                           for i in range(40)}})
               for k in range(4)]
    assert all(1000 < s.size <= 1500 for s in schemas)

    def spec(k: int, client: str) -> StructuredOutput:
        return dataclasses.replace(schemas[k], client=client)

    hog = [grammars.compile(spec(0, "a")), grammars.compile(spec(1, "a")), grammars.compile(spec(0, "a"))]
    assert grammars.held("a") == schemas[0].size + schemas[1].size  # a spec held twice counts once
    with pytest.raises(GrammarsBusy) as busy:
        grammars.compile(spec(2, "a"))
    assert busy.value.http_status == 503 and "this client" in str(busy.value)
    other = grammars.compile(spec(2, "b"))  # another client's schema is not refused for it
    assert grammars.held("b") == schemas[2].size and other.spec == schemas[2]
    del hog[:2]
    gc.collect()
    assert grammars.held("a") == schemas[0].size  # still held by one request
    hog.clear()
    gc.collect()
    assert grammars.held("a") == 0
    grammars.compile(spec(3, "a"))


def test_a_clients_builds_in_flight_count_against_its_share(tiny_batch_model, monkeypatch):
    grammars = engine(tiny_batch_model, live_bytes=10_000, client_live_bytes=2_000)
    schemas = [StructuredOutput.json_schema({"type": "object", "properties": {f"p{k}{i}": {"type": "string"}
                                                                           for i in range(40)}})
               for k in range(2)]
    building, release = threading.Event(), threading.Event()
    build = grammars._build

    def held_build(*args, **kwargs):  # the first build waits, so the test sees it in flight
        building.set()
        release.wait(30)
        return build(*args, **kwargs)

    monkeypatch.setattr(grammars, "_build", held_build)
    first = threading.Thread(target=grammars.compile, args=(dataclasses.replace(schemas[0], client="a"),))
    first.start()
    try:
        assert building.wait(30)
        assert grammars.held("a") == schemas[0].size  # priced before it is built
        monkeypatch.setattr(grammars, "_build", build)
        with pytest.raises(GrammarsBusy, match="this client"):  # refused by its share, before building
            grammars.compile(dataclasses.replace(schemas[1], client="a"))
        assert grammars.live() == schemas[0].size
    finally:
        release.set()
        first.join(30)
    gc.collect()
    assert grammars.held("a") == 0


def test_a_gbnf_grammar_past_its_conversion_limit_is_refused_naming_its_field(tiny_batch_model):
    grammars = engine(tiny_batch_model, gbnf_ms=200)
    costly = dataclasses.replace(StructuredOutput.grammar(chain(3000)), source="structured_outputs.grammar")
    with pytest.raises(GrammarTooCostly) as refused:
        grammars.compile(costly)
    assert refused.value.param == "structured_outputs.grammar" and "--grammar-gbnf-ms" in str(refused.value)
    assert grammars.compile(StructuredOutput.grammar('root ::= "yes" | "no"\n')) is not None


def test_a_conversion_stops_when_its_request_is_cancelled():
    converter = GbnfConverter(limit_s=600)
    cancel = CancelToken()
    timer = threading.Timer(0.3, cancel.cancel)
    timer.start()
    began = time.monotonic()
    with pytest.raises(GrammarConstraint, match="cancelled"):
        converter.to_lark(chain(20_000), cancel)
    # Stopped at the cancel, far before the conversion itself would end (it takes minutes).
    assert time.monotonic() - began < 60
    timer.join()
