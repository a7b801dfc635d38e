"""The stop matcher's automaton: `push` answers exactly what the direct search it replaced answered (kept
here as the reference), and its work per token does not grow with the number of stop strings."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.policy.stop import Emit, Matched, StopMatcher, StopStep
from ferrox_batch.stop_limits import MAX_STOP_STRING_CHARS, MAX_STOPS

# ---------------------------------------------------------------------------
# The reference: the matcher as a direct search of the pending text, one `find` and one suffix scan per
# stop on every push. Its rules are the contract: leftmost start wins, a tie at one start goes to the
# longest stop, and only the longest suffix that is a proper prefix of some stop is withheld.


def _reference_earliest(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(stop) > len(best[1]))):
            best = (at, stop)
    return best


def _reference_holdback(text: str, stops: Sequence[str]) -> int:
    best = 0
    for stop in stops:
        for k in range(min(len(text), len(stop) - 1), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class ReferenceMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def push(self, piece: str) -> StopStep:
        if not self.stops:
            return Emit(piece)
        pending = self.pending + piece
        found = _reference_earliest(pending, self.stops)
        if found is not None:
            self.pending = ""
            return Matched(pending[: found[0]], found[1])
        split = len(pending) - _reference_holdback(pending, self.stops)
        self.pending = pending[split:]
        return Emit(pending[:split])

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# ---------------------------------------------------------------------------
# Equivalence: every push and flush of a random session, over small alphabets (where stops overlap,
# nest and share prefixes as often as possible), random stop lists and random piece splits.

ALPHABETS = ["ab", "abc", "a", "aé😀"]


@st.composite
def sessions(draw: Any) -> tuple[list[str], list[str | None]]:
    """A stop list and a script: a piece to push, or None for a flush."""
    alphabet = draw(st.sampled_from(ALPHABETS))
    chars = st.sampled_from(alphabet)
    stops = draw(st.lists(st.text(alphabet=chars, max_size=6), max_size=8))
    script = draw(st.lists(st.one_of(st.text(alphabet=chars, max_size=7), st.none()), max_size=16))
    return stops, script


@settings(max_examples=500, deadline=None)
@given(sessions())
def test_every_push_and_flush_is_the_direct_searchs_answer(session: tuple[list[str], list[str | None]]) -> None:
    stops, script = session
    ours, reference = StopMatcher(stops, []), ReferenceMatcher(stops)
    for step, piece in enumerate(script):
        if piece is None:
            assert ours.flush() == reference.flush(), (stops, script[: step + 1])
        else:
            assert ours.push(piece) == reference.push(piece), (stops, script[: step + 1])
    assert ours.flush() == reference.flush()


def test_an_earlier_stop_still_completing_beats_a_shorter_one_already_complete() -> None:
    """The cases an automaton reporting matches by their end would get wrong."""
    for stops, pieces, expected in [
        (["abcd", "bc"], ["abcd"], Matched("", "abcd")),  # "bc" ends first, "abcd" starts first
        (["ab", "abc"], ["xabc"], Matched("x", "abc")),  # same start: the longer one, which ends later
        (["abcd", "bc"], ["abc"], Matched("a", "bc")),  # "abcd" has not completed by the end of the piece
        (["bcd", "abcde", "c"], ["abcdef"], Matched("", "abcde")),
        (["aab", "ab"], ["a", "a", "b"], Matched("", "aab")),
    ]:
        m, steps = StopMatcher(stops, []), []
        for piece in pieces:
            steps.append(m.push(piece))
        assert steps[-1] == expected, (stops, pieces, steps)
        ref = ReferenceMatcher(stops)
        assert [ref.push(p) for p in pieces] == steps


# ---------------------------------------------------------------------------
# Cost: Python lines executed by `push`, counted with a trace function -- the same count on any machine.


def _lines_pushing(stops: list[str], pieces: list[str]) -> int:
    matcher = StopMatcher(stops, [])  # built before counting: only the per-token work is measured
    lines = 0

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        for piece in pieces:
            matcher.push(piece)
    finally:
        sys.settrace(previous)
    return lines


def _tokens(rng: random.Random, alphabet: str, count: int) -> list[str]:
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(count)]


def test_push_does_the_same_work_with_the_most_stops_as_with_one() -> None:
    """256 tokens through a matcher with one stop and with `MAX_STOPS` stops of up to `MAX_STOP_STRING_CHARS`
    characters. The text keeps partially matching (a two-letter alphabet, stops made of the same letters,
    some of them the text itself), which is where a per-stop search works hardest. The direct search does
    about `MAX_STOPS` times the work; the automaton does the same work whatever the list (a factor 3 is
    allowed for the failure steps a different trie takes)."""
    rng = random.Random(7)
    tokens = _tokens(rng, "ab", 256)
    text = "".join(tokens)
    stops = [text[i : i + 5 + 3 * i] for i in range(MAX_STOPS // 2)]  # prefixes of the text itself
    stops += ["".join(rng.choice("ab") for _ in range(rng.randint(2, MAX_STOP_STRING_CHARS))) for _ in range(MAX_STOPS // 2)]
    stops = [s + "!" for s in stops]  # none completes: every token is matched against the whole list
    assert len(stops) == MAX_STOPS and max(map(len, stops)) <= MAX_STOP_STRING_CHARS
    one = _lines_pushing(stops[:1], tokens)
    many = _lines_pushing(stops, tokens)
    assert many < 3 * one, f"{many} lines with {MAX_STOPS} stops against {one} with one"


def test_a_long_partial_match_costs_no_more_per_token_than_a_short_one() -> None:
    """A run of one letter against stops that are runs of it with a different end: the direct search
    re-scans the withheld run (up to `MAX_STOP_STRING_CHARS` characters) for every stop on every token."""
    tokens = ["a"] * 512
    stops = ["a" * (MAX_STOP_STRING_CHARS - 1 - i) + "b" for i in range(MAX_STOPS)]
    one = _lines_pushing(["ab"], tokens)
    many = _lines_pushing(stops, tokens)
    assert many < 3 * one, f"{many} lines with {MAX_STOPS} long stops against {one} with one short one"
