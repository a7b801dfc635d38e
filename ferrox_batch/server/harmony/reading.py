"""OpenAI's harmony format (gpt-oss), read from the model's text: its thinking, its answer, its tool calls.

After the prompt's `<|start|>assistant`, a harmony model writes messages, each a header and a body:
`<|channel|>analysis<|message|>...<|end|>`, then `<|start|>assistant<|channel|>final<|message|>...`, or a
call, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}` (the recipient may also
come before `<|channel|>`). `<|return|>` and `<|call|>` end the answer (they are its stop tokens, so they
are usually absent from the text: the text's end ends the last message). The markers are the tokenizer's
special tokens, kept in the text for this reader (the server asks the detokenizer for them) and never
passed on. `HarmonyStream` reads the text in pieces of any size and says, in order:

* `Text("reasoning", ...)`: an `analysis` message's body, or one addressed to a recipient other than a
  function (a built-in tool the client cannot run);
* `Text("content", ...)`: a `final` message's body, a `commentary` one with no recipient (a preamble
  the user sees), one on an unknown channel or with none, and text written with no header at all (a model
  that does not speak harmony, or an answer a grammar shaped: what it wrote is its answer, held until it
  is longer than any header, `MAX_HEADER`, then streamed);
* `Call(name, arguments)`: a message to `functions.NAME`, once it ends, with its body as arguments: JSON
  (re-written compactly, as vLLM does) where the header says JSON or no content type; a body that is not
  valid JSON there is no call, and goes out as content, as the other tool formats keep such text;

Messages of one kind are joined by a newline, as vLLM joins them. A header that never reaches its
`<|message|>` says nothing; `<|message|>` or `<|constrain|>` inside a body begins another body under the
same header. A stream and a whole text read the same way: text streams as it comes,
holding back only a tail that could begin a marker, and a call waits for its message's end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Union

from ferrox_batch import bounded_json

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = (END, RETURN, CALL)
LONGEST = max(map(len, MARKERS))
#: The most characters of text, with no marker, a header may hold: past it, the text is the answer itself
#: (a real header is a recipient and a content type: `to=functions.NAME json`, NAME at most 64 characters).
MAX_HEADER = 128
FUNCTIONS = "functions."


@dataclass(frozen=True, slots=True)
class Text:
    kind: str  # "reasoning" or "content"
    text: str


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


Piece = Union[Text, Call]


@dataclass(frozen=True, slots=True)
class Header:
    """What a message's header says: its channel, its recipient (`to=`), its content type."""

    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    @classmethod
    def read(cls, parts: list[tuple[str | None, str]]) -> Header:
        """The header of `parts`: each the marker before a stretch of header text (None: no marker)."""
        channel = recipient = content_type = None
        for marker, text in parts:
            words = text.split()
            if marker == CHANNEL and words and channel is None:
                channel, words = words[0], words[1:]
            elif marker == CONSTRAIN and words:
                content_type, words = words[0], words[1:]
            for word in words:
                if word.startswith("to="):
                    recipient = recipient or word[3:]
                elif marker == CHANNEL and content_type is None:
                    content_type = word  # `commentary json`: the type written without <|constrain|>
        return cls(channel, recipient, content_type)

    @property
    def function(self) -> str | None:
        """The function the message calls, if it is addressed to one."""
        if self.recipient is not None and self.recipient.startswith(FUNCTIONS) and len(self.recipient) > len(FUNCTIONS):
            return self.recipient[len(FUNCTIONS):]
        return None

    @property
    def kind(self) -> str:
        """Where a body that is not a call goes: "reasoning" or "content"."""
        if self.channel == "analysis" or (self.recipient is not None and self.function is None):
            return "reasoning"
        return "content"


def marker_tail(text: str) -> int:
    """How many characters at the end of `text` could begin a marker (a whole one is no beginning)."""
    # A marker holds one "<", its first character: only a tail from the last "<" can begin one.
    at = text.rfind("<", max(0, len(text) - LONGEST + 1))
    tail = text[at:] if at >= 0 else ""
    return len(tail) if any(m.startswith(tail) and m != tail for m in MARKERS) and tail else 0


class HarmonyStream:
    """One answer's harmony text, read as it comes (`feed`, then `finish`) into `Piece`s."""

    def __init__(self, max_header: int = MAX_HEADER) -> None:
        self._max_header = max_header
        self._held = ""  # a tail that could begin a marker
        self._mode = "header"  # "header": reading a header; "body": a message's body
        self._parts: list[tuple[str | None, str]] = [(None, "")]  # the header read so far
        self._marked = False  # the header began at <|start|> or holds a marker: it is no answer text
        self._header = Header()
        self._body: list[str] = []  # a call's body, until its message ends
        self._fresh = True  # nothing of the current message went out yet
        self._said: set[str] = set()  # the kinds that went out

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        text, self._held = self._held + text, ""
        at = 0
        while (found := text.find("<|", at)) >= 0:
            marker = next((m for m in MARKERS if text.startswith(m, found)), None)
            if marker is not None:
                self._text(text[at:found], out)
                self._marker(marker, out)
                at = found + len(marker)
            elif len(text) - found < LONGEST and any(m.startswith(text[found:]) for m in MARKERS):
                break  # the text ends inside what may be a marker
            else:
                self._text(text[at:found + 1], out)
                at = found + 1
        rest = text[at:]
        keep = marker_tail(rest)
        self._text(rest[:len(rest) - keep], out)
        self._held = rest[len(rest) - keep:]
        return out

    def finish(self) -> list[Piece]:
        """What is left once the answer is complete: a held tail is text, the open message ends, and text
        written with no header at all is content."""
        out: list[Piece] = []
        held, self._held = self._held, ""
        self._text(held, out)
        if self._mode == "body":
            self._end(out)
        elif not self._marked:
            text = "".join(part for _marker, part in self._parts)
            if text.strip():
                self._fresh = True
                self._say("content", text, out)
        self._new_header(marked=False)
        return out

    # ------------------------------------------------------------------ states

    def _text(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self._mode == "header":
            marker, part = self._parts[-1]
            self._parts[-1] = (marker, part + text)
            if not self._marked and len(part) + len(text) > self._max_header and (part + text).strip():
                # No header is this long: the text is the answer itself, and streams from here on.
                self._mode, self._header, self._fresh = "body", Header(), True
                self._say("content", part + text, out)
        elif self._header.function is not None:
            self._body.append(text)
        else:
            self._say(self._header.kind, text, out)

    def _marker(self, marker: str, out: list[Piece]) -> None:
        if self._mode == "body":
            if marker in (MESSAGE, CONSTRAIN):
                # Out of place in a body: another message with the same header begins (the texts on either
                # side are joined by a newline, so no marker can be spelt across the cut).
                self._end(out)
                self._fresh, self._body = True, []
                return
            self._end(out)
            self._new_header(marked=marker in (START, CHANNEL))
            if marker == CHANNEL:  # a new header without <|end|><|start|>
                self._parts.append((CHANNEL, ""))
            return
        if marker == START:
            self._new_header(marked=True)
        elif marker in (CHANNEL, CONSTRAIN):
            self._marked = True
            self._parts.append((marker, ""))
        elif marker == MESSAGE:
            self._header = Header.read(self._parts)
            self._mode, self._fresh, self._body = "body", True, []
        else:  # an end with no body: the header said nothing
            self._new_header(marked=False)

    def _new_header(self, marked: bool) -> None:
        self._mode, self._parts, self._marked, self._header = "header", [(None, "")], marked, Header()

    def _end(self, out: list[Piece]) -> None:
        """The current message ends: a call's body is read."""
        name = self._header.function
        if name is not None:
            body, self._body = "".join(self._body), []
            arguments = _arguments(body, self._header.content_type)
            if arguments is not None:
                out.append(Call(name, arguments))
            else:
                self._say("content", body, out)

    def _say(self, kind: str, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self._fresh and kind in self._said:
            text = "\n" + text  # a message after another of its kind
        self._fresh = False
        self._said.add(kind)
        if out and isinstance(out[-1], Text) and out[-1].kind == kind:
            out[-1] = Text(kind, out[-1].text + text)
        else:
            out.append(Text(kind, text))


def _arguments(body: str, content_type: str | None) -> str | None:
    """A call's arguments from its body; None when it should be JSON and is not."""
    if content_type is not None and "json" not in content_type:
        return body
    try:
        value = bounded_json.loads(body)
    except ValueError:  # JsonTooDeep too: nested deeper than a request may send back
        return None
    return json.dumps(value, ensure_ascii=False)
