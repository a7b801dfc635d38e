"""`Utf8Stream` (docs/upstream.md, Stopping and text): the upstream tests, a per-push comparison with a
transcription of the upstream algorithm, and whole-stream properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.policy.utf8_stream import REPLACEMENT, Utf8Stream


def stream_in_chunks(data: bytes, chunk: int) -> str:
    s = Utf8Stream()
    out = "".join(s.push(data[i : i + chunk]) for i in range(0, len(data), chunk))
    return out + s.flush()


# ---------------------------------------------------------------------------
# Upstream tests


def test_a_split_emoji_is_held_until_complete() -> None:
    llama = "🦙".encode()
    s = Utf8Stream()
    assert s.push(llama[:2]) == "", "emitted an incomplete character"
    assert s.is_pending
    assert s.push(llama[2:]) == "🦙"
    assert not s.is_pending
    assert s.flush() == ""


def test_cjk_fed_one_byte_at_a_time_comes_out_whole() -> None:
    text = "你好，世界"
    s = Utf8Stream()
    pieces = [s.push(bytes([b])) for b in text.encode()]
    assert "".join(pieces) == text
    assert all(p in ("",) or len(p) == 1 for p in pieces), "each character leaves once, whole"
    assert s.flush() == ""


def test_ascii_is_never_held() -> None:
    s = Utf8Stream()
    assert s.push(b"hello") == "hello"
    assert not s.is_pending
    assert s.push(b" w") == " w"


def test_an_invalid_byte_becomes_one_replacement_and_decoding_continues() -> None:
    s = Utf8Stream()
    assert s.push(b"a\xffb") == "a" + REPLACEMENT + "b"
    assert s.push(b"\x80") == REPLACEMENT, "a stray continuation byte"
    assert s.push("é".encode()) == "é"
    assert s.flush() == ""


def test_a_truncated_character_surfaces_at_flush_exactly_once() -> None:
    s = Utf8Stream()
    assert s.push("ok".encode() + "😀".encode()[:3]) == "ok"
    assert s.flush() == REPLACEMENT
    assert s.flush() == "", "a second flush has nothing left"
    assert s.push(b"x") == "x", "the stream is usable after a flush"


def test_byte_at_a_time_matches_the_whole_string_for_every_chunk_size() -> None:
    text = "hello 🦙 wörld — 你好 🏳️‍🌈 done"
    for chunk in range(1, 9):
        assert stream_in_chunks(text.encode(), chunk) == text, f"chunk {chunk}"


@pytest.mark.parametrize(
    "data",
    [
        b"plain ascii",
        b"\xf0\x9f\xa6\x99",
        b"\xff\xfe",
        b"a\xe4\xbd\xa0b",
        b"a\x80b",
        b"\xe4\xbd",
        b"\xe0\x80",  # overlong: E0 must be followed by A0..BF
        b"\xf4\x90\x80\x80",  # past U+10FFFF
        b"\xed\xa0\x80",  # a UTF-16 surrogate
        b"\xc0\xaf",  # overlong '/'
    ],
)
def test_output_always_matches_a_lossy_decode_of_the_whole_buffer(data: bytes) -> None:
    for chunk in range(1, 5):
        assert stream_in_chunks(data, chunk) == data.decode("utf-8", "replace")


def test_finishing_an_empty_stream_emits_nothing() -> None:
    s = Utf8Stream()
    assert s.push(b"ok") == "ok"
    assert s.push(b"") == ""
    assert s.flush() == ""


def test_a_surrogate_prefix_is_replaced_at_once_as_the_upstream_does() -> None:
    # Python's incremental codec keeps b"\xed\xa0" pending until a third byte
    # arrives; the upstream (and this stream) emit its two U+FFFD at once, so
    # a flush right after it has nothing left.
    s = Utf8Stream()
    assert s.push(b"\xed") == ""
    assert s.push(b"\xa0") == REPLACEMENT * 2
    assert not s.is_pending
    assert s.flush() == ""


def test_bytes_like_inputs_are_accepted_and_text_is_refused() -> None:
    s = Utf8Stream()
    assert s.push(bytearray(b"ab")) == "ab"
    assert s.push(memoryview(b"cd")) == "cd"
    with pytest.raises(TypeError, match="data must be bytes"):
        s.push("text")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="data must be bytes"):
        s.push([104, 105])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="data must be bytes"):
        s.push(None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# The upstream algorithm, transcribed: Rust's `str::from_utf8` reports
# `valid_up_to` and `error_len` (None = an incomplete sequence at the end of
# the input; Some(n) = a maximal ill-formed subpart of n bytes), per the
# well-formed byte sequences of Unicode Table 3-7.

_SECOND = {
    **{b: (2, 0x80, 0xBF) for b in range(0xC2, 0xE0)},
    0xE0: (3, 0xA0, 0xBF),
    **{b: (3, 0x80, 0xBF) for b in range(0xE1, 0xED)},
    0xED: (3, 0x80, 0x9F),
    0xEE: (3, 0x80, 0xBF),
    0xEF: (3, 0x80, 0xBF),
    0xF0: (4, 0x90, 0xBF),
    0xF1: (4, 0x80, 0xBF),
    0xF2: (4, 0x80, 0xBF),
    0xF3: (4, 0x80, 0xBF),
    0xF4: (4, 0x80, 0x8F),
}


def _from_utf8(buf: bytes) -> tuple[int, int | None] | None:
    """None when `buf` is valid, else (valid_up_to, error_len)."""
    i = 0
    while i < len(buf):
        b0 = buf[i]
        if b0 < 0x80:
            i += 1
            continue
        if b0 not in _SECOND:
            return i, 1
        width, lo, hi = _SECOND[b0]
        for j in range(1, width):
            if i + j >= len(buf):
                return i, None
            ok = lo <= buf[i + j] <= hi if j == 1 else 0x80 <= buf[i + j] <= 0xBF
            if not ok:
                return i, j
        i += width
    return None


class UpstreamUtf8Stream:
    def __init__(self) -> None:
        self.pending = b""

    def push(self, data: bytes) -> str:
        self.pending += data
        out = ""
        while True:
            err = _from_utf8(self.pending)
            if err is None:
                out += self.pending.decode()
                self.pending = b""
                return out
            valid, error_len = err
            out += self.pending[:valid].decode()
            if error_len is None:
                self.pending = self.pending[valid:]
                return out
            out += REPLACEMENT
            self.pending = self.pending[valid + error_len :]

    def flush(self) -> str:
        had, self.pending = self.pending, b""
        return REPLACEMENT if had else ""


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


# Bytes that exercise every row of Table 3-7 and its edges.
EDGE_BYTES = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1,
              0xEC, 0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF]
# Two-byte starts: valid prefixes and the ill-formed ones next to them
# (overlong, surrogate, past U+10FFFF).
PREFIXES = [b"\xc2", b"\xe0\xa0", b"\xe0\x80", b"\xed\x9f", b"\xed\xa0", b"\xed\xbf", b"\xf0\x90",
            b"\xf0\x8f", b"\xf4\x8f", b"\xf4\x90", b"\xf0\x9f\x98"]
fragment = st.one_of(
    st.sampled_from(EDGE_BYTES).map(lambda b: bytes([b])),
    st.sampled_from(PREFIXES),
    st.text(max_size=3).map(str.encode),
)
raw_bytes = st.one_of(
    st.binary(max_size=24),
    st.lists(st.sampled_from(EDGE_BYTES), max_size=24).map(bytes),
    st.lists(fragment, max_size=10).map(b"".join),
)
cut_lists = st.lists(st.integers(min_value=0, max_value=40), max_size=10)


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=30), cut_lists)
def test_any_text_cut_at_any_byte_comes_back_exactly(text: str, cuts: list[int]) -> None:
    s = Utf8Stream()
    out = "".join(s.push(p) for p in _cut(text.encode(), cuts))
    assert s.flush() == ""
    assert out == text


@settings(max_examples=500, deadline=None)
@given(raw_bytes, cut_lists)
def test_any_bytes_decode_like_the_whole_buffer_with_one_replacement_per_maximal_subpart(
    data: bytes, cuts: list[int]
) -> None:
    expected = data.decode("utf-8", "replace")
    s = Utf8Stream()
    out = ""
    for piece in _cut(data, cuts):
        out += s.push(piece)
        assert expected.startswith(out), "a streaming reader never sees text it must take back"
    assert out + s.flush() == expected


@settings(max_examples=500, deadline=None)
@given(raw_bytes, cut_lists)
def test_every_push_returns_what_the_upstream_push_returns(data: bytes, cuts: list[int]) -> None:
    ours, theirs = Utf8Stream(), UpstreamUtf8Stream()
    for piece in _cut(data, cuts):
        assert ours.push(piece) == theirs.push(piece), piece
        assert ours.is_pending == bool(theirs.pending)
    assert ours.flush() == theirs.flush()
