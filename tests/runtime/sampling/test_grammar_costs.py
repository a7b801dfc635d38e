"""What one request's structured output may cost (`ferrox_batch.grammar_limits`), on the tiny checkpoint's tokenizer.

Pins: a regex or schema whose first masks cost more CPU than the budget is refused at compile with a 400
naming the field it came from, and a repeat is refused without compiling again; a realistic schema is
not; the worker's masks come within a deadline, a late row (a fake slow matcher, or the real hostile
regex) is reported alone while the others' masks arrive, and the wait is bounded by the deadline, not by
the slow row; a late row's thread never delays a later step's masks; late threads are bounded however
many steps a client's rows are late in, and a new grammar is busy (503) while many run; each client's
grammars are priced against its own share; a GBNF grammar past its conversion limit (the child's CPU
time, not the wall's) is a 400 naming the field, and a conversion stops as soon as its request is cancelled.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import subprocess
import threading
import time
import weakref

import numpy as np
import pytest
from grammar_helpers import tool_schemas

from ferrox_batch.cancel import CancelToken
from ferrox_batch.errors import GrammarConstraint
from ferrox_batch.grammar_limits import GrammarLimits, GrammarTooCostly
from ferrox_batch.runtime.sampling import gbnf
from ferrox_batch.runtime.sampling.gbnf import GbnfBusy, GbnfConverter
from ferrox_batch.runtime.sampling.grammar import Grammars, GrammarsBusy
from ferrox_batch.runtime.sampling.grammar_probe import first_masks_cpu_s
from ferrox_batch.runtime.sampling.mask_pool import LATE_WALL_DEADLINES, MaskPool, MasksBusy
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
    """A fake matcher engine: the mask of a row whose matcher is in `slow` takes until `release` is set (or
    30 s), waiting (a thread the machine does not run) or, with `burn`, spinning on the CPU (a costly
    grammar); every other row's is done at once, and `done` is set once `fast` of them are; `slow_done`
    once a slow row's is."""

    def __init__(self, *slow: object, fast: int = 0, burn: bool = False) -> None:
        self.slow = slow
        self.release = threading.Event()
        self.done = threading.Event()
        self.slow_done = threading.Event()
        self._fast = fast
        self._burn = burn
        self._lock = threading.Lock()

    def __call__(self, matcher: object, bits: np.ndarray, row: int) -> None:
        if any(matcher is s for s in self.slow):
            if self._burn:
                ends = time.monotonic() + 30
                while not self.release.is_set() and time.monotonic() < ends:
                    pass
            else:
                self.release.wait(30)
        bits[row] = row + 1
        if any(matcher is s for s in self.slow):
            self.slow_done.set()
        else:
            with self._lock:
                self._fast -= 1
                if self._fast <= 0:
                    self.done.set()


def mask_threads() -> int:
    return sum(t.name.startswith("ferrox-grammar") for t in threading.enumerate())


#: The worker's default wait for a mask: what a trivial mask's thread must be scheduled within, on the
#: server's own terms (a test that needs the fast rows done first waits for them instead).
DEFAULT_DEADLINE_S = GrammarLimits().mask_deadline_ms / 1e3


def test_a_late_row_is_reported_alone_and_the_wait_is_bounded_by_the_deadline():
    slow = object()
    fill = SlowFill(slow, fast=2)
    # Any deadline makes the slow row late; a short one, since the fast rows are waited for before collecting.
    pool = MaskPool(fill, words=2, deadline_s=0.05)
    try:
        matchers = [object(), slow, object()]
        pending = pool.start(matchers)
        fill.done.wait(30)
        bits, late, failed = pending.collect()
        # Returned while the slow mask was still being computed (it ends only when the test releases it, or
        # after 30 s): the wait was the deadline's, not the slow row's.
        assert not fill.slow_done.is_set()
        assert late == [1] and failed == {}
        assert bits[0].tolist() == [1, 1] and bits[2].tolist() == [3, 3]
        # The next step's masks do not queue behind the late row's thread, which is still busy.
        fill.done.clear()
        fill._fast = 2
        pending = pool.start([object(), object()])
        fill.done.wait(30)
        bits, late, _ = pending.collect()
        assert late == [] and bits[:, 0].tolist() == [1, 2]
    finally:
        fill.release.set()
        pool.close()


def test_rows_that_never_started_are_not_late_for_it():
    slow = object()
    fill = SlowFill(slow, burn=True)
    # The second row waits for the first's thread; once it has a thread of its own, the default deadline.
    pool = MaskPool(fill, words=1, deadline_s=DEFAULT_DEADLINE_S, threads=1)
    try:
        bits, late, _ = pool.start([slow, object()]).collect()
        assert late == [0] and bits[1].tolist() == [2]
    finally:
        fill.release.set()
        pool.close()


def test_a_row_that_waited_for_a_thread_gets_the_whole_deadline_from_its_start():
    """One thread: the first row's mask takes half the deadline, the second's starts after it and takes
    more than the rest of the first's deadline but less than a deadline of its own: neither is late."""
    deadline_s = DEFAULT_DEADLINE_S
    first, second = object(), object()

    def fill(matcher: object, bits: np.ndarray, row: int) -> None:
        time.sleep(deadline_s / 2 if matcher is first else deadline_s * 0.7)
        bits[row] = row + 1

    pool = MaskPool(fill, words=1, deadline_s=deadline_s, threads=1)
    try:
        bits, late, failed = pool.start([first, second]).collect()
        assert late == [] and failed == {} and bits[:, 0].tolist() == [1, 2]
    finally:
        pool.close()


def test_a_row_is_late_for_its_grammars_cpu_not_for_a_thread_the_machine_left_waiting():
    """Past the deadline on the wall, a row whose mask burns CPU is late; one whose thread got no CPU (a
    loaded machine, a collector's pause) is waited for, up to `LATE_WALL_DEADLINES` deadlines."""
    deadline_s = DEFAULT_DEADLINE_S / 2
    burning, waiting = object(), object()
    burn = SlowFill(burning, burn=True)
    stalled_s = deadline_s * (1 + LATE_WALL_DEADLINES) / 2  # past the deadline, within the wall's limit

    def fill(matcher: object, bits: np.ndarray, row: int) -> None:
        if matcher is waiting:
            time.sleep(stalled_s)
            bits[row] = row + 1
        else:
            burn(matcher, bits, row)

    pool = MaskPool(fill, words=1, deadline_s=deadline_s)
    try:
        began = time.monotonic()
        bits, late, _ = pool.start([burning, waiting]).collect()
        assert late == [0] and bits[1].tolist() == [2]
        assert time.monotonic() - began >= stalled_s
        stuck = SlowFill(waiting)  # never runs: late at the wall's limit
        pool_ = MaskPool(stuck, words=1, deadline_s=0.01)
        began = time.monotonic()
        assert pool_.start([waiting]).collect()[1] == [0]
        assert time.monotonic() - began >= 0.01 * LATE_WALL_DEADLINES
        stuck.release.set()
        pool_.close()
    finally:
        burn.release.set()
        pool.close()


def test_late_threads_are_bounded_and_a_new_grammar_is_busy_meanwhile():
    threads, busy, most = 2, 3, 4
    slow = [object() for _ in range(12)]
    fill = SlowFill(*slow)
    pool = MaskPool(fill, words=1, deadline_s=0.01, threads=threads, late_busy=busy, late_most=most)
    before = mask_threads()
    try:
        pool.check_room()
        lates = []
        for step in range(6):  # a hostile client's rows, every one late, step after step
            bits, late, _ = pool.start(slow[2 * step:2 * step + 2]).collect()
            lates.append(pool.late())
            assert late == [0, 1]
            assert mask_threads() - before < most + threads  # never more, however many steps
        assert lates[:2] == [2, 4] and lates[-1] == 4  # past `most`, no mask is started at all
        with pytest.raises(MasksBusy) as refused:
            pool.check_room()
        assert refused.value.http_status == 503 and refused.value.retry_after_secs
        began = time.monotonic()
        _, late, _ = pool.start([object()]).collect()  # no room: late at once, no thread, no wait
        assert late == [0] and time.monotonic() - began < pool.deadline_s * 10
    finally:
        fill.release.set()
        assert pool.close(timeout_s=30)
    assert pool.late() == 0 and mask_threads() == before
    pool.check_room()


class Matcher:
    """A stand-in matcher that a weak reference can follow."""


def test_a_late_rows_matcher_lives_until_its_thread_is_done():
    slow = Matcher()
    alive = weakref.ref(slow)
    release = threading.Event()
    pool = MaskPool(lambda matcher, bits, row: release.wait(30), words=1, deadline_s=0.01)
    try:
        assert pool.start([slow]).collect()[1] == [0]
        del slow  # the row is released: only the late thread's step holds its matcher now
        gc.collect()
        assert alive() is not None
    finally:
        release.set()
        assert pool.close(timeout_s=30)
    gc.collect()
    assert alive() is None


def test_a_new_grammar_is_busy_while_late_masks_run(tiny_batch_model):
    busy = engine(tiny_batch_model)
    slow = [object(), object()]
    fill = SlowFill(*slow)
    busy._pool = MaskPool(fill, words=1, deadline_s=0.01, late_busy=2)  # two late masks make it busy
    try:
        assert busy._pool.start(slow).collect()[1] == [0, 1]
        with pytest.raises(MasksBusy):
            busy.compile(StructuredOutput.regex("[a-z]+"))
    finally:
        fill.release.set()
        busy.close()
    busy.compile(StructuredOutput.regex("[a-z]+"))  # served again once they ended


def test_the_real_hostile_regex_misses_the_workers_deadline_alone(tiny_batch_model):
    # Let the probe pass it (a budget above what it costs), as a grammar that only gets costly later would.
    grammars = engine(tiny_batch_model, first_masks_ms=600_000)
    try:
        hostile = grammars.compile(StructuredOutput.regex(HOSTILE))
        fine = grammars.compile(StructuredOutput.regex("[a-z]+"))
        # A mask takes at least its CPU time on the wall: a deadline of half the hostile mask's CPU cuts it,
        # and leaves the fine rows (microseconds each) as long as the machine allows.
        cost_s = first_masks_cpu_s(grammars.matcher(hostile), tiny_batch_model.config.vocab_size, 1, 600)
        grammars._pool.deadline_s = cost_s / 2
        matchers = [grammars.matcher(fine), grammars.matcher(hostile), grammars.matcher(fine)]
        bits, late, failed = grammars.start_masks(matchers).collect()
        assert late == [1] and failed == {}, cost_s
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


def test_a_gbnf_grammar_past_its_conversion_limit_is_refused_naming_its_field(tiny_batch_model):
    grammars = engine(tiny_batch_model, gbnf_ms=200)
    costly = dataclasses.replace(StructuredOutput.grammar(chain(3000)), source="structured_outputs.grammar")
    with pytest.raises(GrammarTooCostly) as refused:
        grammars.compile(costly)
    assert refused.value.param == "structured_outputs.grammar" and "--grammar-gbnf-ms" in str(refused.value)
    assert grammars.compile(StructuredOutput.grammar('root ::= "yes" | "no"\n')) is not None


def test_a_child_kept_off_the_cpu_is_not_a_costly_grammar(monkeypatch):
    """The child is stopped (as a loaded machine's lowest-priority process waits for a core) for longer than
    the limit: its conversion uses a few ms of CPU, so it is converted, not refused as too costly."""
    limit_s = 0.2
    stopped_s = 3 * limit_s
    children: list[subprocess.Popen] = []

    class Held(subprocess.Popen):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            os.kill(self.pid, signal.SIGSTOP)
            children.append(self)
            threading.Timer(stopped_s, os.kill, (self.pid, signal.SIGCONT)).start()

    monkeypatch.setattr(gbnf.subprocess, "Popen", Held)
    began = time.monotonic()
    lark = GbnfConverter(limit_s=limit_s).to_lark('root ::= "yes" | "no"\n')
    assert children and time.monotonic() - began >= stopped_s
    assert "yes" in lark


def test_a_child_that_never_gets_the_cpu_is_given_up_as_busy(monkeypatch):
    children: list[subprocess.Popen] = []

    class Stopped(subprocess.Popen):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            os.kill(self.pid, signal.SIGSTOP)
            children.append(self)

    monkeypatch.setattr(gbnf.subprocess, "Popen", Stopped)
    with pytest.raises(GbnfBusy) as busy:
        GbnfConverter(limit_s=0.02, starved_s=0.5).to_lark('root ::= "yes" | "no"\n')
    assert busy.value.http_status == 503  # not the grammar's fault: nothing remembered, retry
    assert children[0].poll() is not None  # killed


def test_a_conversion_stops_when_its_request_is_cancelled(monkeypatch):
    children: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            children.append(self)

    monkeypatch.setattr(gbnf.subprocess, "Popen", Recorded)
    converter = GbnfConverter(limit_s=600, starved_s=600)
    cancel = CancelToken()
    timer = threading.Timer(0.3, cancel.cancel)
    timer.start()
    with pytest.raises(GrammarConstraint, match="cancelled"):
        converter.to_lark(chain(20_000), cancel)
    timer.join()
    # Stopped at the cancel: its child killed (a conversion of minutes, which neither limit ended), not done.
    assert len(children) == 1 and children[0].returncode == -signal.SIGKILL
