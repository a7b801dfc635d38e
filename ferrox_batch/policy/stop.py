"""Stop sequences, in two layers, as one object a decode row holds.

A stop sequence is a promise about what reaches the client: the text before
the stop is the answer, and the stop and everything after it never existed.
Streaming makes that hard, because output leaves in pieces and a stop string
can straddle any number of them; SSE cannot take back a fragment that was
already sent. So:

* **Layer 1** (`StopMatcher.is_stop_token`): a stop string that is exactly
  one token in the vocabulary is matched on the *id*, before the token is
  detokenized. The caller resolves those ids (`resolve_stop_tokens`).
* **Layer 2** (`StopMatcher.push`): decoded text is buffered so that no
  suffix which could still grow into a stop string is ever released. Only the
  real partial match is withheld (not a fixed `longest_stop - 1`), so text
  that cannot match goes out at once and the buffer is usually empty.
  Withheld text that never became a stop is real output: `flush` returns it.

Offsets. The upstream is Rust and measures everything in UTF-8 bytes. The
public helpers `earliest_stop_match`, `stop_prefix_holdback` and
`floor_char_boundary` keep that contract exactly (byte offsets in, byte
offsets out) so they can be checked against upstream numbers. The matcher
itself works on code points, which is equivalent and cheaper: a suffix that
is a byte-prefix of a stop and starts on a character boundary is a whole
number of characters, so "withhold k bytes" and "withhold k' characters" pick
the same cut, and a code-point cut can never split a character (the job
`floor_char_boundary` does upstream).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Union

__all__ = [
    "Emit",
    "Matched",
    "StopMatcher",
    "StopStep",
    "earliest_stop_match",
    "floor_char_boundary",
    "resolve_stop_tokens",
    "stop_prefix_holdback",
]


@dataclass(frozen=True, slots=True)
class Emit:
    """Text that is provably safe to send; may be empty when the whole piece
    is still a possible partial match."""

    text: str


@dataclass(frozen=True, slots=True)
class Matched:
    """A stop string matched. `text` (possibly empty) is the last text of the
    answer; `stop` is the stop as the caller spelled it."""

    text: str
    stop: str


StopStep = Union[Emit, Matched]


# --------------------------------------------------------------------------
# Input checking. Private and per-file on purpose: one concept per file, and
# the messages name the argument of *this* module's functions.


def _token_id(value: object, name: str) -> int:
    """An integer token id. Accepts anything with `__index__` (numpy and torch
    integer scalars) but never a bool or a float: a float id is a bug
    upstream of us, and `True` silently meaning token 1 is worse."""
    if type(value) is int:
        if value < 0:
            raise ValueError(f"{name} must be a non-negative token id, got {value}")
        return value
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an integer token id, got {type(value).__name__}: {value!r}")
    ident = operator.index(value)
    if ident < 0:
        raise ValueError(f"{name} must be a non-negative token id, got {ident}")
    return ident


def _stop_strings(stops: object, name: str) -> tuple[str, ...]:
    """A sequence of stop strings. A bare `str` is refused rather than being
    iterated into one-character stops, which would silently stop on every
    letter of the intended stop."""
    if stops is None:
        return ()
    if isinstance(stops, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be a sequence of strings, not a single {type(stops).__name__}")
    try:
        items = tuple(stops)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be a sequence of strings, got {type(stops).__name__}") from None
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise TypeError(f"{name}[{i}] must be a str, got {type(s).__name__}: {s!r}")
    return items


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def _utf8_len(text: str) -> int:
    # surrogatepass keeps the helpers total on a str holding a lone surrogate
    # (never produced by `Utf8Stream`); it counts as the 3 bytes WTF-8 uses.
    return len(text.encode("utf-8", "surrogatepass"))


# --------------------------------------------------------------------------
# Code-point cores, shared by the matcher and the byte-offset helpers.


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
    found = _earliest_char(text, _stop_strings(stops, "stops"))
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
    k = _holdback_chars(text, [s for s in _stop_strings(stops, "stops") if s])
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


def resolve_stop_tokens(stops: Sequence[str], encode: Callable[[str], Sequence[int]]) -> list[int]:
    """Ids of the stop strings that encode to exactly one token, in first-seen
    order, deduplicated, empty strings skipped. Multi-token encodings are left
    to layer 2: one tokenization of a string says nothing reliable about how
    the *model* will spell it."""
    items = _stop_strings(stops, "stops")
    if not callable(encode):
        raise TypeError(f"encode must be callable (str -> list[int]), got {type(encode).__name__}")
    ids: list[int] = []
    for stop in items:
        if not stop:
            continue
        encoded = encode(stop)
        try:
            count = len(encoded)
        except TypeError:
            raise TypeError(
                f"encode({stop!r}) must return a sequence of token ids, got {type(encoded).__name__}"
            ) from None
        if count == 1:
            ident = _token_id(encoded[0], f"encode({stop!r})[0]")
            if ident not in ids:
                ids.append(ident)
    return ids


# --------------------------------------------------------------------------


class StopMatcher:
    """Both stop layers for one request: a set of stop-token ids and a
    withholding buffer over the stop strings (empty strings dropped: they
    would match at offset 0 of everything)."""

    __slots__ = ("_stops", "_stop_tokens", "_pending")

    def __init__(self, stops: Sequence[str] | None = (), stop_token_ids: Iterable[int] | None = ()) -> None:
        self._stops: tuple[str, ...] = tuple(s for s in _stop_strings(stops, "stops") if s)
        if stop_token_ids is None:
            stop_token_ids = ()
        if isinstance(stop_token_ids, (str, bytes, bytearray)) or not isinstance(stop_token_ids, Iterable):
            raise TypeError(
                f"stop_token_ids must be an iterable of token ids, got {type(stop_token_ids).__name__}"
            )
        self._stop_tokens: frozenset[int] = frozenset(
            _token_id(t, f"stop_token_ids[{i}]") for i, t in enumerate(stop_token_ids)
        )
        self._pending = ""

    @property
    def has_stop_strings(self) -> bool:
        """Whether layer 2 has anything to match (and so may buffer)."""
        return bool(self._stops)

    @property
    def stops(self) -> tuple[str, ...]:
        """The non-empty stop strings, in the caller's order."""
        return self._stops

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop_tokens

    def is_stop_token(self, token_id: int) -> bool:
        """Layer 1, checked on the id before any decoding: a stop token
        contributes nothing to the answer, whatever it renders as."""
        if type(token_id) is not int or token_id < 0:  # a plain int skips the call
            token_id = _token_id(token_id, "token_id")
        return token_id in self._stop_tokens

    def push(self, piece: str) -> StopStep:
        """Layer 2: feed one decoded piece; returns what may be sent now."""
        if not isinstance(piece, str):
            raise TypeError(f"piece must be a str, got {type(piece).__name__}")
        if not self._stops:
            # Nothing to match, so nothing to withhold: buffering here would
            # only delay output.
            return Emit(piece)
        pending = self._pending + piece
        found = _earliest_char(pending, self._stops)
        if found is not None:
            at, stop = found
            self._pending = ""
            return Matched(pending[:at], stop)
        keep = _holdback_chars(pending, self._stops)
        split = len(pending) - keep  # a code-point cut is always a char boundary
        self._pending = pending[split:]
        return Emit(pending[:split])

    def flush(self) -> str:
        """Return and clear whatever is withheld. Called when generation ends
        for any reason other than a stop match: the text was held against a
        match that never came, so it is ordinary output."""
        out, self._pending = self._pending, ""
        return out

    def __repr__(self) -> str:
        return (
            f"StopMatcher(stops={list(self._stops)!r}, stop_token_ids={sorted(self._stop_tokens)!r}, "
            f"pending={self._pending!r})"
        )
