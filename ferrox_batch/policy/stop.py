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
  Every stop is matched in one pass (`StopAutomaton`), so a token costs the
  same whatever the length of the list.

Offsets. The upstream is Rust and measures everything in UTF-8 bytes; its
byte-offset helpers are `stop_offsets`. The matcher works on code points,
which is equivalent and cheaper: a suffix that is a byte-prefix of a stop and
starts on a character boundary is a whole number of characters, so "withhold
k bytes" and "withhold k' characters" pick the same cut, and a code-point cut
can never split a character.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Union

from ferrox_batch.policy.stop_automaton import ROOT, StopAutomaton

__all__ = [
    "Emit",
    "Matched",
    "StopMatcher",
    "StopStep",
    "checked_stops",
    "resolve_stop_tokens",
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
# Input checking, shared with the byte-offset helpers (`stop_offsets`): the
# messages name the argument of the caller's function.


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


def checked_stops(stops: object, name: str) -> tuple[str, ...]:
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


def resolve_stop_tokens(stops: Sequence[str], encode: Callable[[str], Sequence[int]]) -> list[int]:
    """Ids of the stop strings that encode to exactly one token, in first-seen
    order, deduplicated, empty strings skipped. Multi-token encodings are left
    to layer 2: one tokenization of a string says nothing reliable about how
    the *model* will spell it."""
    items = checked_stops(stops, "stops")
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
    would match at offset 0 of everything).

    Layer 2 keeps one automaton state across pushes: it stands for exactly
    the withheld text, so each push only walks the new piece's characters, in
    steps that do not depend on how many stops there are. The automaton is
    built here, once per request, in time and memory linear in the stops'
    total length."""

    __slots__ = ("_stops", "_stop_tokens", "_pending", "_automaton", "_state")

    def __init__(self, stops: Sequence[str] | None = (), stop_token_ids: Iterable[int] | None = ()) -> None:
        self._stops: tuple[str, ...] = tuple(s for s in checked_stops(stops, "stops") if s)
        if stop_token_ids is None:
            stop_token_ids = ()
        if isinstance(stop_token_ids, (str, bytes, bytearray)) or not isinstance(stop_token_ids, Iterable):
            raise TypeError(
                f"stop_token_ids must be an iterable of token ids, got {type(stop_token_ids).__name__}"
            )
        self._stop_tokens: frozenset[int] = frozenset(
            _token_id(t, f"stop_token_ids[{i}]") for i, t in enumerate(stop_token_ids)
        )
        # Invariant between pushes: `_pending` is the text `_state` stands for.
        self._pending = ""
        self._automaton = StopAutomaton(self._stops)
        self._state = ROOT

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
        # The withheld text holds no whole stop (that would have matched), so
        # a match in `pending + piece` ends inside `piece`: feeding the piece
        # from the withheld text's state finds it, at its place in `pending`.
        pending = self._pending + piece
        state, found = self._automaton.feed(self._state, piece, len(self._pending))
        if found is not None:
            at, stop = found
            self._pending, self._state = "", ROOT
            return Matched(pending[:at], stop)
        # No match, so the state's suffix is the longest one that is a proper
        # prefix of some stop: exactly what must be withheld.
        split = len(pending) - self._automaton.depth(state)  # a code-point cut is always a char boundary
        self._pending, self._state = pending[split:], state
        return Emit(pending[:split])

    def push_unmatched(self, piece: str) -> Emit:
        """Feed a piece no stop may end in (text of the tokens before `min_tokens`): a stop completing in it
        is ignored, but a stop's beginning in it is still withheld, so a stop that starts here and ends in
        a later piece matches there."""
        if not isinstance(piece, str):
            raise TypeError(f"piece must be a str, got {type(piece).__name__}")
        if not self._stops:
            return Emit(piece)
        pending = self._pending + piece
        state = self._automaton.walk(self._state, piece)
        split = len(pending) - self._automaton.depth(state)
        self._pending, self._state = pending[split:], state
        return Emit(pending[:split])

    def flush(self) -> str:
        """Return and clear whatever is withheld. Called when generation ends
        for any reason other than a stop match: the text was held against a
        match that never came, so it is ordinary output."""
        out, self._pending, self._state = self._pending, "", ROOT
        return out

    def __repr__(self) -> str:
        return (
            f"StopMatcher(stops={list(self._stops)!r}, stop_token_ids={sorted(self._stop_tokens)!r}, "
            f"pending={self._pending!r})"
        )
