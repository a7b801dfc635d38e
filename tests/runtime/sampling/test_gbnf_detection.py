"""Telling a Lark grammar from a GBNF one (`runtime.sampling.gbnf.is_lark`) in the server process.

Pins: the check agrees with llguidance's own (`gbnf_to_lark.is_lark_syntax`) on every text, its time grows
linearly with the text however its whitespace is laid out (llguidance's regex is quadratic or worse on runs of
newlines, and holds the GIL while it runs), a 256 KiB grammar of newlines leaves the server's other threads
running, and compiling never runs llguidance's detection in the server process at all (a converted grammar
is compiled as Lark).
"""

from __future__ import annotations

import threading
import time

import llguidance._grammar_from
import pytest
from hypothesis import given
from hypothesis import strategies as st
from llguidance import gbnf_to_lark

from ferrox_batch.errors import GrammarConstraint
from ferrox_batch.grammar_limits import GrammarLimits
from ferrox_batch.runtime.sampling import gbnf
from ferrox_batch.runtime.sampling.gbnf import GbnfConverter
from ferrox_batch.runtime.sampling.grammar import Grammars
from ferrox_batch.structured import MAX_SPEC_BYTES, StructuredOutput

#: Whitespace laid out the ways that make a line-anchored regex slow: runs of newlines, of other line
#: breaks, of blanks, and of both alternating; and a `start` whose colon never comes.
SHAPES = ("\n", " ", "\n ", "\r", " \t\x0b\x0c", "\r\n")
LARK_TAIL = 'start: "x"\n'


def best_of(runs: int, call, *args) -> float:
    spent = []
    for _ in range(runs):
        began = time.perf_counter()
        call(*args)
        spent.append(time.perf_counter() - began)
    return min(spent)


@given(st.lists(st.sampled_from([" ", "\n", "\t", "\r", "\x0b", "\x85", "\u2028", ":", "%", "_", "s", "start",
                                  "%llguidance", "root ::=", "x", "é"]), max_size=40).map("".join))
def test_the_check_agrees_with_llguidances(text):
    assert gbnf.is_lark(text) == gbnf_to_lark.is_lark_syntax(text)


@pytest.mark.parametrize("shape", SHAPES)
def test_telling_lark_from_gbnf_takes_time_linear_in_the_text(shape):
    """Sixteen times the text costs at most four times sixteen times as long (a linear check's ratio is
    sixteen; noise gets four times that), where a quadratic check's ratio is 256. Through the converter, whose
    first step it is: a Lark grammar behind the whitespace is answered as it is, without a child."""
    converter = GbnfConverter(limit_s=1.0)
    small = shape * (2048 // len(shape)) + LARK_TAIL
    large = shape * (16 * 2048 // len(shape)) + LARK_TAIL
    assert converter.to_lark(large) == large
    ratio = best_of(5, converter.to_lark, large) / best_of(5, converter.to_lark, small)
    assert ratio < 4 * 16


def longest_pause(call, *args) -> tuple[float, object]:
    """The longest a thread that ticks every millisecond went without ticking while `call(*args)` ran on this
    one, and what it answered."""
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.01)
        began = time.monotonic()
        answer = call(*args)
        ended = time.monotonic()
    finally:
        stop.set()
        ticker.join()
    during = [began] + [t for t in ticks if began < t < ended] + [ended]
    return max(b - a for a, b in zip(during, during[1:])), answer


def test_a_grammar_of_newlines_at_the_size_limit_leaves_other_threads_running(tiny_batch_model):
    """Another thread is kept from running while the server compiles 256 KiB of newlines at most four times
    sixteen times as long as while it compiles a sixteenth of them (whatever the compile's own GIL-holding
    work is, it is linear in the text), where a check whose time grows with the square of the run would stop
    it for minutes. A Lark grammar, so that all of it is the server's own work (a GBNF one's conversion is a
    child's, whose CPU time is bounded on its own)."""
    tokenizer = tiny_batch_model.tokenizer
    grammars = Grammars(tokenizer.inner.to_str(), tiny_batch_model.config.vocab_size,
                        sorted(tokenizer.stop_tokens.ids), limits=GrammarLimits(), keep=1)
    text = "\n" * (MAX_SPEC_BYTES - len(LARK_TAIL)) + LARK_TAIL
    small = min(longest_pause(grammars.compile, StructuredOutput.grammar(f"// {n}\n" + text[-MAX_SPEC_BYTES // 16:]))[0]
                for n in range(3))
    pause, compiled = longest_pause(grammars.compile, StructuredOutput.grammar(text))
    assert pause < 4 * 16 * small
    assert compiled.spec.schema == text


def test_compiling_never_runs_llguidances_detection_in_the_server(tiny_batch_model, monkeypatch):
    """A converted GBNF grammar is compiled as Lark, and a Lark one as it is: llguidance's regex (which a
    `grammar` format runs again) is never called here."""

    def refused(text: str) -> bool:
        raise AssertionError("llguidance's Lark detection ran in the server process")

    monkeypatch.setattr(gbnf_to_lark, "is_lark_syntax", refused)
    monkeypatch.setattr(llguidance._grammar_from, "any_to_lark", refused)
    tokenizer = tiny_batch_model.tokenizer
    grammars = Grammars(tokenizer.inner.to_str(), tiny_batch_model.config.vocab_size,
                        sorted(tokenizer.stop_tokens.ids), limits=GrammarLimits())
    assert grammars.compile(StructuredOutput.grammar('root ::= "yes" | "no"\n')) is not None
    assert grammars.compile(StructuredOutput.grammar('start: "yes" | "no"\n')) is not None
    with pytest.raises(GrammarConstraint):
        grammars.compile(StructuredOutput.grammar("\n" * 1000))  # no root rule: the converter's refusal
