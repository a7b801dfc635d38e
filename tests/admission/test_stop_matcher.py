"""Stop matching (docs/upstream.md, Stopping and text): the upstream `stop` tests, byte-offset helpers
checked against a byte-level oracle, and streaming properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.policy.stop import Emit, Matched, StopMatcher, resolve_stop_tokens
from ferrox_batch.policy.stop_offsets import earliest_stop_match, floor_char_boundary, stop_prefix_holdback


def matcher(*stops: str) -> StopMatcher:
    return StopMatcher(list(stops), [])


# ---------------------------------------------------------------------------
# Upstream tests (stop.rs, sampling_loop.rs)


def test_a_partial_match_is_never_emitted() -> None:
    m = matcher("</tool_call>")
    assert m.push("answer ") == Emit("answer ")
    for piece in ["<", "/", "tool", "_ca"]:
        assert m.push(piece) == Emit(""), f"a growing partial match escaped at {piece!r}"
    assert m.push("ll>") == Matched("", "</tool_call>")


def test_text_that_cannot_match_is_not_withheld() -> None:
    m = matcher("<|im_end|>")
    assert m.push("hello") == Emit("hello")
    assert m.push(" world") == Emit(" world")
    assert m.flush() == ""


def test_an_abandoned_partial_match_is_released_immediately() -> None:
    m = matcher("<|im_end|>")
    assert m.push("a<|im") == Emit("a")
    assert m.push("_x") == Emit("<|im_x")
    assert m.flush() == ""


def test_a_stop_in_the_middle_of_a_piece_cuts_it_there() -> None:
    m = matcher("STOP")
    assert m.push("keep thisSTOPdrop this") == Matched("keep this", "STOP")
    assert m.flush() == "", "everything after the stop is gone"


def test_the_leftmost_stop_wins_when_several_could_match() -> None:
    m = matcher("world", "hello")
    assert m.push("say hello world") == Matched("say ", "hello")


def test_earliest_stop_match_finds_the_leftmost_match_across_multiple_stops() -> None:
    assert earliest_stop_match("hello world", ["world", "hello"]) == (0, "hello")
    assert earliest_stop_match("hello world", ["nope"]) is None


def test_stops_starting_at_the_same_offset_report_the_longest() -> None:
    assert earliest_stop_match("x</tool_call>", ["</tool", "</tool_call>"]) == (1, "</tool_call>")
    assert earliest_stop_match("x</tool_call>", ["</tool_call>", "</tool"]) == (1, "</tool_call>")


def test_a_pending_partial_is_released_when_generation_ends_otherwise() -> None:
    m = matcher("<|im_end|>")
    assert m.push("done<|im") == Emit("done")
    assert m.flush() == "<|im"
    assert m.flush() == "", "flushing twice must not duplicate it"


def test_no_stop_sequences_means_no_buffering_at_all() -> None:
    m = matcher()
    assert not m.has_stop_strings
    assert m.push("<|im") == Emit("<|im")
    assert m.flush() == ""


def test_an_empty_stop_string_is_ignored() -> None:
    m = matcher("")
    assert not m.has_stop_strings
    assert m.push("hello") == Emit("hello")
    assert earliest_stop_match("hello", [""]) is None


def test_multibyte_text_is_never_cut_mid_character() -> None:
    m = matcher("éx")
    assert m.push("aé") == Emit("a")
    assert m.push("y") == Emit("éy")

    m = matcher("ありがとう")
    assert m.push("あり") == Emit("")
    assert m.push("がとう") == Matched("", "ありがとう")


def test_partial_suffix_length_is_the_longest_real_partial() -> None:
    assert stop_prefix_holdback("xxab", ["abc"]) == 2
    assert stop_prefix_holdback("xxa", ["abc"]) == 1
    assert stop_prefix_holdback("xxb", ["abc"]) == 0
    assert stop_prefix_holdback("abc", ["abc"]) == 0, "a whole match is not a proper prefix"
    assert stop_prefix_holdback("xabc", ["ab", "abcd"]) == 3, "longest wins across stops"


def test_holdback_is_measured_in_bytes_and_holds_a_multibyte_prefix_whole() -> None:
    # "é" is two UTF-8 bytes and a prefix of "éx": both bytes are held.
    assert stop_prefix_holdback("aé", ["éx"]) == 2
    assert stop_prefix_holdback("あり", ["ありがとう"]) == 6
    # The first byte of "é" (0xC3) is not a prefix of anything by itself.
    assert stop_prefix_holdback("aé", ["\u00c3x"]) == 0


def test_a_single_token_stop_string_becomes_a_stop_token() -> None:
    table = {"<|im_end|>": [100], "hello world": [1, 2, 3]}
    ids = resolve_stop_tokens(["<|im_end|>", "hello world"], lambda s: table.get(s, []))
    assert ids == [100], "only the single-token stop is a token-level stop"


def test_duplicate_and_empty_stop_strings_do_not_duplicate_ids() -> None:
    seen: list[str] = []

    def encode(s: str) -> list[int]:
        seen.append(s)
        return [7] if s == "<|end|>" else []

    assert resolve_stop_tokens(["<|end|>", "<|end|>", ""], encode) == [7]
    assert "" not in seen, "an empty stop is skipped, not encoded"


def test_a_stop_token_is_matched_by_id_not_by_how_it_renders() -> None:
    m = StopMatcher(["<|im_end|>"], [100])
    assert m.is_stop_token(100)
    assert not m.is_stop_token(101)
    # This model renders token 100 as "": the text layer has nothing to go on.
    assert m.push("") == Emit("")
    assert m.flush() == ""


def test_stop_tokens_work_without_any_stop_strings() -> None:
    m = StopMatcher([], [42])
    assert m.is_stop_token(42)
    assert not m.is_stop_token(43)
    assert m.push("free text") == Emit("free text")


def test_stop_token_ids_accept_integer_scalars_from_array_libraries() -> None:
    class Index:  # a numpy/torch-like integer scalar
        def __init__(self, v: int) -> None:
            self.v = v

        def __index__(self) -> int:
            return self.v

    m = StopMatcher([], [Index(5)])
    assert m.is_stop_token(5)
    assert m.is_stop_token(Index(5))  # type: ignore[arg-type]


def test_matched_and_emit_are_small_values() -> None:
    assert Matched("a", "b") == Matched(text="a", stop="b")
    match Matched("t", "s"):
        case Matched(text, stop):
            assert (text, stop) == ("t", "s")
    with pytest.raises(AttributeError):
        Emit("x").text = "y"  # type: ignore[misc]


# ---------------------------------------------------------------------------
# Bad input: a clear error naming the argument, never a silent wrong answer


@pytest.mark.parametrize(
    ("stops", "ids", "error", "name"),
    [
        ("STOP", [], TypeError, "stops"),  # a bare str would stop on every letter
        (b"STOP", [], TypeError, "stops"),
        ([1], [], TypeError, "stops[0]"),
        (5, [], TypeError, "stops"),
        ([], [True], TypeError, "stop_token_ids[0]"),
        ([], [1.0], TypeError, "stop_token_ids[0]"),
        ([], [-1], ValueError, "stop_token_ids[0]"),
        ([], 7, TypeError, "stop_token_ids"),
        ([], "7", TypeError, "stop_token_ids"),
    ],
)
def test_a_malformed_matcher_is_refused_by_argument(stops: object, ids: object, error: type, name: str) -> None:
    with pytest.raises(error, match=name.replace("[", r"\[").replace("]", r"\]")):
        StopMatcher(stops, ids)  # type: ignore[arg-type]


def test_none_means_no_stops_and_no_stop_tokens() -> None:
    m = StopMatcher(None, None)
    assert not m.has_stop_strings
    assert m.push("x") == Emit("x")
    assert not m.is_stop_token(0)


def test_bad_arguments_to_the_methods_and_helpers_are_refused() -> None:
    m = matcher("x")
    with pytest.raises(TypeError, match="piece"):
        m.push(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="token_id"):
        m.is_stop_token(True)
    with pytest.raises(TypeError, match="token_id"):
        m.is_stop_token(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token_id"):
        m.is_stop_token(-3)
    with pytest.raises(TypeError, match="text"):
        earliest_stop_match(None, ["x"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stops"):
        earliest_stop_match("x", "x")
    with pytest.raises(TypeError, match="text"):
        stop_prefix_holdback(b"x", ["x"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stops"):
        stop_prefix_holdback("x", "abc")
    with pytest.raises(TypeError, match="i must"):
        floor_char_boundary("abc", 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="i must"):
        floor_char_boundary("abc", True)
    with pytest.raises(ValueError, match="i must"):
        floor_char_boundary("abc", -1)
    with pytest.raises(TypeError, match="s must"):
        floor_char_boundary(b"abc", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="encode"):
        resolve_stop_tokens(["x"], None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="encode"):
        resolve_stop_tokens(["x"], lambda s: 3)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match=r"encode\('x'\)\[0\]"):
        resolve_stop_tokens(["x"], lambda s: [True])
    with pytest.raises(TypeError, match="stops"):
        resolve_stop_tokens("x", lambda s: [1])


# ---------------------------------------------------------------------------
# Byte-offset helpers against a byte-level oracle (what the Rust code computes)


def _oracle_earliest(text: str, stops: list[str]) -> tuple[int, str] | None:
    data = text.encode()
    hits = [(data.find(s.encode()), -len(s.encode()), i) for i, s in enumerate(stops) if s and s.encode() in data]
    if not hits:
        return None
    at, _, i = min(hits)
    return at, stops[i]


def _is_boundary(data: bytes, i: int) -> bool:
    return i == len(data) or data[i] & 0xC0 != 0x80


def _oracle_holdback(text: str, stops: list[str]) -> int:
    data = text.encode()
    best = 0
    for s in stops:
        sb = s.encode()
        for k in range(min(len(data), len(sb) - 1), 0, -1):
            start = len(data) - k
            if _is_boundary(data, start) and sb.startswith(data[start:]):
                best = max(best, k)
                break
    return best


CHARS = ["a", "b", "c", "<", "|", "é", "あ", "😀", "\u00c3", "\u0301"]
texts = st.text(alphabet=st.sampled_from(CHARS), max_size=24)
stop_lists = st.lists(st.text(alphabet=st.sampled_from(CHARS), max_size=4), max_size=4)


@settings(max_examples=300, deadline=None)
@given(texts, stop_lists)
def test_earliest_stop_match_is_the_byte_level_leftmost_longest(text: str, stops: list[str]) -> None:
    # Ties can only be between a stop and its own prefix, so "longest" is
    # unambiguous; list order does not matter.
    assert earliest_stop_match(text, stops) == _oracle_earliest(text, stops)
    assert earliest_stop_match(text, list(reversed(stops))) == _oracle_earliest(text, stops)


@settings(max_examples=300, deadline=None)
@given(texts, stop_lists)
def test_stop_prefix_holdback_matches_the_byte_level_rule(text: str, stops: list[str]) -> None:
    k = stop_prefix_holdback(text, stops)
    assert k == _oracle_holdback(text, stops)
    data = text.encode()
    assert _is_boundary(data, len(data) - k), "a multibyte prefix is held whole"
    assert floor_char_boundary(text, len(data) - k) == len(data) - k


@settings(max_examples=200, deadline=None)
@given(texts, st.integers(min_value=0, max_value=120))
def test_floor_char_boundary_is_the_largest_boundary_at_or_below(text: str, i: int) -> None:
    data = text.encode()
    got = floor_char_boundary(text, i)
    expected = max(j for j in range(min(i, len(data)) + 1) if _is_boundary(data, j))
    assert got == expected
    data[:got].decode()  # never splits a character


# ---------------------------------------------------------------------------
# Streaming properties


def _cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def _first_stop_by_boundary(text: str, pieces: list[str], stops: list[str]) -> tuple[int, str] | None:
    """Brute force: after each piece, look for complete stops in everything
    received; the first piece that completes one decides, and among the stops
    complete by then the leftmost (then longest) wins. This is the upstream's
    streaming contract: a stop that starts earlier but would complete later
    does not win against one already complete."""
    received = 0
    for piece in pieces:
        received += len(piece)
        found = [
            (start, -len(s), s)
            for s in stops
            if s
            for start in range(received)
            if text.startswith(s, start) and start + len(s) <= received
        ]
        if found:
            start, _, stop = min(found)
            return start, stop
    return None


def _run(stops: list[str], pieces: list[str]) -> tuple[list[tuple[str, int]], Matched | None, str]:
    """Feed `pieces`; return the (emitted text, received length) after each
    push, the match if any, and what `flush` released."""
    m = StopMatcher(stops, [])
    emitted: list[tuple[str, int]] = []
    received = 0
    for piece in pieces:
        received += len(piece)
        step = m.push(piece)
        if isinstance(step, Matched):
            return emitted, step, m.flush()
        assert isinstance(step, Emit)
        emitted.append((step.text, received))
    return emitted, None, m.flush()


@settings(max_examples=400, deadline=None)
@given(texts, stop_lists, st.lists(st.integers(min_value=0, max_value=24), max_size=12))
def test_streamed_text_is_the_text_before_the_stop_and_nothing_is_lost(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    pieces = _cut(text, cuts)
    emitted, match, flushed = _run(stops, pieces)
    out = "".join(t for t, _ in emitted)
    expected = _first_stop_by_boundary(text, pieces, stops)
    if expected is None:
        assert match is None
        assert out + flushed == text, "withheld text is released by flush"
    else:
        at, stop = expected
        assert match is not None and match.stop == stop
        assert out + match.text == text[:at]
        assert flushed == ""


@settings(max_examples=200, deadline=None)
@given(texts, stop_lists)
def test_one_piece_matches_the_leftmost_stop_of_the_whole_text(text: str, stops: list[str]) -> None:
    step = StopMatcher(stops, []).push(text)
    whole = _oracle_earliest(text, stops)
    if whole is None:
        assert isinstance(step, Emit)
    else:
        at, stop = whole
        assert step == Matched(text.encode()[:at].decode(), stop)


@settings(max_examples=400, deadline=None)
@given(texts, stop_lists, st.lists(st.integers(min_value=0, max_value=24), max_size=12))
def test_no_emitted_text_could_still_become_part_of_a_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    """After every push, nothing already sent may be the start of a stop that
    the text received so far is still on its way to: for every sent position
    `s`, `text[s:received]` is not a prefix of any stop. So whatever comes
    next, no stop ever completes over text that was already streamed."""
    emitted, _, _ = _run(stops, _cut(text, cuts))
    sent = 0
    for piece, received in emitted:
        sent += len(piece)
        for s in range(sent):
            tail = text[s:received]
            assert not any(stop and stop.startswith(tail) for stop in stops), (
                f"sent {text[:sent]!r} but {tail!r} may still grow into a stop"
            )


@settings(max_examples=200, deadline=None)
@given(texts, st.lists(st.integers(min_value=0, max_value=24), max_size=12))
def test_without_stop_strings_every_piece_goes_out_as_is(text: str, cuts: list[int]) -> None:
    pieces = _cut(text, cuts)
    m = StopMatcher([], [1, 2])
    assert [m.push(p) for p in pieces] == [Emit(p) for p in pieces]
    assert m.flush() == ""


def _first_stop_ending_after(text: str, pieces: list[str], stops: list[str], held: int) -> tuple[int, str] | None:
    """`_first_stop_by_boundary` where a stop counts only if it ends after the first `held` pieces' text
    (`min_tokens`: it may start inside them)."""
    boundary = sum(len(p) for p in pieces[:held])
    received = boundary
    for piece in pieces[held:]:
        received += len(piece)
        found = [(start, -len(s), s) for s in stops if s for start in range(received)
                 if text.startswith(s, start) and boundary < start + len(s) <= received]
        if found:
            start, _, stop = min(found)
            return start, stop
    return None


@settings(max_examples=400, deadline=None)
@given(texts, stop_lists, st.lists(st.integers(min_value=0, max_value=24), max_size=12), st.integers(0, 6))
def test_no_stop_ends_in_the_unmatched_pieces_but_one_may_start_there(
    text: str, stops: list[str], cuts: list[int], held: int
) -> None:
    pieces = _cut(text, cuts)
    m = StopMatcher(stops, [])
    out, match = "", None
    for i, piece in enumerate(pieces):
        step = m.push_unmatched(piece) if i < held else m.push(piece)
        if isinstance(step, Matched):
            match = step
            break
        out += step.text
    expected = _first_stop_ending_after(text, pieces, stops, held)
    if expected is None:
        assert match is None and out + m.flush() == text
    else:
        at, stop = expected
        assert match is not None and match.stop == stop and out + match.text == text[:at]
