"""`CallScanner`: a tool call's JSON read as it streams, so its arguments can go out as they are written.

A model writes a call as JSON text (`{"name": "get_weather", "arguments": {"city": "Paris"}}`, alone in a
Hermes block or inside a generic `{"tool_calls": [...]}` object), a few characters a token. OpenAI's
streams send a call's name once it is known and its arguments as deltas of their text, so a client sees
the call take shape. The scanner walks each character once (linear in the text, whatever the chunking),
keeping a stack of the open containers and where it is in each, and reports, for every object at a call's
path:

* `Named(call, name)` once the `name` member's string is complete;
* `Arguments(call, text)`: the raw text of the `arguments` (or `parameters`) member's value as it arrives,
  from its first character to its last (no surrounding whitespace, no terminator), held until the call is
  named when the model writes the arguments first;
* `Closed(call)` when the call's object closes.

It is not a validator: text that is not JSON gives whatever events its brackets and quotes suggest, and
the caller's final parse of the whole text decides which calls the answer holds.

What it holds is linear in the text however deeply it nests: a container's place (its path) is kept only
down to the depth where a format's calls sit (`call_depth`); deeper containers are never calls, and a
path per level would cost the square of the depth (a model writing 100,000 brackets: gigabytes).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Union

#: A container's place: the member names and element indices from the root to it.
Path = tuple[Union[str, int], ...]
ARGUMENT_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class Named:
    call: int
    name: str


@dataclass(frozen=True, slots=True)
class Arguments:
    call: int
    text: str


@dataclass(frozen=True, slots=True)
class Closed:
    call: int


Event = Union[Named, Arguments, Closed]


@dataclass(slots=True)
class _Frame:
    kind: str  # "{" or "["
    path: Path | None  # None below the depth where calls sit: nothing there is a call
    call: int | None = None  # the call this object is, when it is at a call's path
    key: str | None = None  # objects: the member being read
    expect: str = "key"  # objects: "key", "colon", "value", "comma"; arrays: "value", "comma"
    index: int = 0  # arrays: the element being read


@dataclass(slots=True)
class _Call:
    name: str | None = None
    pending: list[str] = field(default_factory=list)  # arguments text written before the name


class CallScanner:
    """Feed text with `feed`; each call returns the events that text completed or continued."""

    def __init__(self, is_call: Callable[[Path], bool], first_call: int = 0, *, call_depth: int) -> None:
        """`is_call`: whether an object at this path is a call; `first_call`: the number its first call gets
        (calls are numbered in the order their objects open); `call_depth`: the longest path a call has (no
        object deeper is asked about)."""
        self._is_call = is_call
        self._call_depth = call_depth
        self._first = first_call
        self._stack: list[_Frame] = []
        self._calls: list[_Call] = []
        self._in_string = False
        self._escape = False
        self._string: list[str] = []  # the string being read, raw, quotes included
        self._string_role = ""  # "key", "name" or "" (any other string)
        self._capture: _Frame | None = None  # the call object whose arguments value is being read
        self._capture_depth = 0  # the stack depth inside that value (0: a scalar or string value)
        self._scalar = False  # reading a bare scalar (number, true, false, null)
        self.done = False  # the root value closed
        self.consumed = 0  # characters of the last feed read (fewer than given once the root closed)

    @property
    def calls(self) -> int:
        """Calls begun so far."""
        return len(self._calls)

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        out: list[str] = []  # arguments characters of this feed, flushed as one event per run
        self.consumed = 0
        for ch in text:
            if self.done:
                break
            self._step(ch, events, out)
            self.consumed += 1
        self._flush(events, out)
        return events

    # ------------------------------------------------------------------ one character

    def _step(self, ch: str, events: list[Event], out: list[str]) -> None:
        if self._in_string:
            self._string.append(ch)
            if self._capture is not None:
                out.append(ch)
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                self._string_done(events, out)
            return
        if self._scalar and (ch in WHITESPACE or ch in ",]}"):
            self._scalar = False
            self._value_done(events, out)
        if self._capture is not None and self._capture_depth > 0:
            out.append(ch)  # inside a container value: every character is the arguments' text
        if ch in WHITESPACE:
            return
        frame = self._stack_top()
        if ch == '"':
            self._in_string, self._string = True, [ch]
            if frame is not None and frame.kind == "{" and frame.expect == "key":
                self._string_role = "key"
            else:
                self._string_role = "name" if self._names_value(frame) else ""
                self._value_start(ch, out)
            return
        if ch in "{[":
            self._value_start(ch, out)
            path: Path | None = ()
            if frame is not None:
                path = None if frame.path is None or len(frame.path) >= self._call_depth else \
                    frame.path + ((frame.key or "") if frame.kind == "{" else frame.index,)
            new = _Frame(ch, path, expect="key" if ch == "{" else "value")
            if ch == "{" and self._capture is None and path is not None and self._is_call(path):
                new.call = len(self._calls)
                self._calls.append(_Call())
            self._stack.append(new)
            if self._capture is not None:
                self._capture_depth += 1
            return
        if ch in "}]":
            if not self._stack:
                return
            closed = self._stack.pop()
            if self._capture is not None:
                self._capture_depth -= 1
            if closed.call is not None:
                self._flush(events, out)
                events.append(Closed(self._first + closed.call))
            self._value_done(events, out)
            return
        if ch == ":" and frame is not None and frame.kind == "{":
            frame.expect = "value"
            return
        if ch == "," and frame is not None:
            frame.expect = "key" if frame.kind == "{" else "value"
            if frame.kind == "[":
                frame.index += 1
            return
        # A bare scalar's character (a number, true, false, null).
        if not self._scalar:
            self._scalar = True
            self._value_start(ch, out)
        elif self._capture is not None and self._capture_depth == 0:
            out.append(ch)

    # ------------------------------------------------------------------ values

    def _names_value(self, frame: _Frame | None) -> bool:
        return frame is not None and frame.call is not None and frame.expect == "value" and frame.key == "name"

    def _value_start(self, ch: str, out: list[str]) -> None:
        """A value begins at `ch`: a call's arguments value starts being captured here (a character inside
        a captured container was already taken)."""
        frame = self._stack_top()
        if self._capture is None and frame is not None and frame.call is not None and frame.expect == "value" \
                and frame.key in ARGUMENT_KEYS:
            self._capture, self._capture_depth = frame, 0
            out.append(ch)

    def _string_done(self, events: list[Event], out: list[str]) -> None:
        raw = "".join(self._string)
        frame = self._stack[-1] if self._stack else None
        if self._string_role == "key" and frame is not None:
            try:
                frame.key = json.loads(raw)
            except ValueError:
                frame.key = None
            frame.expect = "colon"
            return
        if self._string_role == "name" and frame is not None and frame.call is not None:
            try:
                name = json.loads(raw)
            except ValueError:
                name = None
            call = self._calls[frame.call]
            if isinstance(name, str) and call.name is None:
                self._flush(events, out)
                call.name = name
                events.append(Named(self._first + frame.call, name))
                if call.pending:
                    events.append(Arguments(self._first + frame.call, "".join(call.pending)))
                    call.pending.clear()
        self._value_done(events, out)

    def _value_done(self, events: list[Event], out: list[str]) -> None:
        """A value ended (a string, a scalar, or a container just popped)."""
        if self._capture is not None and self._capture_depth == 0 and self._capture is self._stack_top():
            self._flush(events, out)
            self._capture = None
        frame = self._stack_top()
        if frame is not None:
            frame.expect = "comma"
        elif not self._in_string:
            self.done = True

    def _stack_top(self) -> _Frame | None:
        return self._stack[-1] if self._stack else None

    def _flush(self, events: list[Event], out: list[str]) -> None:
        """The arguments characters read since the last flush, as one event (held until the call is named)."""
        if not out:
            return
        text = "".join(out)
        out.clear()
        if self._capture is None or self._capture.call is None:
            return
        call = self._calls[self._capture.call]
        if call.name is None:
            call.pending.append(text)
        else:
            events.append(Arguments(self._first + self._capture.call, text))
