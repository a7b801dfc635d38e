"""The upstream's stop-string helpers in its own units: UTF-8 byte offsets in, byte offsets out.

The upstream is Rust and measures everything in bytes; these keep that contract exactly so they can be
checked against its numbers. They search directly, one stop at a time, which is fine off the hot path;
`StopMatcher` (`stop`) answers the same questions on code points, incrementally, with one automaton.
"""

from __future__ import annotations

from collections.abc import Sequence

from ferrox_batch.policy.stop import checked_stops

__all__ = ["earliest_stop_match", "floor_char_boundary", "stop_prefix_holdback"]


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def _utf8_len(text: str) -> int:
    # surrogatepass keeps the helpers total on a str holding a lone surrogate
    # (never produced by `Utf8Stream`); it counts as the 3 bytes WTF-8 uses.
    return len(text.encode("utf-8", "surrogatepass"))


# --------------------------------------------------------------------------
# Code-point cores of the byte-offset helpers: a direct search, one stop at a
# time. The matcher answers the same questions incrementally with a
# `StopAutomaton` instead, so that its cost per token does not grow with the
# number of stops.


def _earliest_char(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        at = text.find(stop)
        if at < 0:
            continue
        # Leftmost wins (that is where the answer is cut). Two stops at the
        # same place: the longest, the more specific claim -- otherwise the
        # reported stop would depend on the order the caller listed them.
        if best is None or at < best[0] or (at == best[0] and len(stop) > len(best[1])):
            best = (at, stop)
    return best


def _holdback_chars(text: str, stops: Sequence[str]) -> int:
    """Longest suffix of `text`, in code points, that is a *proper* prefix of
    some stop. Proper: a whole match is the other branch of `push`."""
    best = 0
    for stop in stops:
        upper = min(len(text), len(stop) - 1)
        # Only lengths longer than the best so far can change the answer.
        for k in range(upper, best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


# --------------------------------------------------------------------------
# Public helpers, byte semantics.


def earliest_stop_match(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The leftmost occurrence of any non-empty stop in `text`, as
    `(utf8_byte_offset, stop)`; ties at one offset go to the longest stop.
    `None` when nothing matches."""
    text = _text(text, "text")
    found = _earliest_char(text, checked_stops(stops, "stops"))
    if found is None:
        return None
    at, stop = found
    return _utf8_len(text[:at]), stop


def stop_prefix_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing UTF-8 bytes of `text` must be withheld: the largest
    `k` such that the last `k` bytes start on a character boundary and are a
    byte-prefix of some stop strictly longer than `k`; 0 if none. A withheld
    multibyte character is therefore always held whole."""
    text = _text(text, "text")
    k = _holdback_chars(text, [s for s in checked_stops(stops, "stops") if s])
    return _utf8_len(text[len(text) - k:]) if k else 0


def floor_char_boundary(s: str, i: int) -> int:
    """The largest UTF-8 character boundary of `s` at or below byte index `i`
    (Rust's `str::floor_char_boundary`: an index past the end gives the
    length)."""
    s = _text(s, "s")
    if isinstance(i, bool) or not isinstance(i, int):
        raise TypeError(f"i must be an int byte index, got {type(i).__name__}: {i!r}")
    if i < 0:
        raise ValueError(f"i must be a non-negative byte index, got {i}")
    data = s.encode("utf-8", "surrogatepass")
    if i >= len(data):
        return len(data)
    # Continuation bytes are 10xxxxxx; step back over them to the lead byte.
    while i > 0 and data[i] & 0xC0 == 0x80:
        i -= 1
    return i
