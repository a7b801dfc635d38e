"""`Utf8Stream`: turn a row's token bytes into text without breaking characters.

Byte-level BPE splits multibyte characters across tokens, so one token's
bytes are often not valid UTF-8 on their own. Decoding per token would turn
both halves of such a character into U+FFFD, in the stream and for good. This
stream sits *before* the stop matcher (a stop string is text, and half a
character is not text yet) and promises:

* `push` returns the longest text that is now certain: complete characters,
  plus one U+FFFD for each invalid sequence. An incomplete-but-valid tail
  (at most 3 bytes) is kept for the next push.
* `flush` returns exactly one U+FFFD if a tail is still pending (a character
  the generation ended inside of), else "".
* Concatenating every `push` and the final `flush` equals
  `data.decode("utf-8", "replace")` of all the bytes, whatever the cuts. The
  replacement rule is "one U+FFFD per maximal subpart of an ill-formed
  sequence" (Unicode ch. 3, "U+FFFD substitution of maximal subparts"),
  which is what both Python's codec and Rust's `from_utf8_lossy` /
  `Utf8Error::error_len` (the upstream) implement.

One difference from the upstream, found by comparing them and corrected
here: Python's incremental decoder keeps `ED A0..BF` (the first two bytes of
a UTF-16 surrogate, never valid UTF-8) pending until a third byte arrives,
where the upstream emits two U+FFFD for them at once. The output is the same
in total but the timing differs, and a `flush` right then would have
returned one U+FFFD instead of two. `push` therefore resolves such a tail
immediately, so each push returns exactly what the upstream's would.
"""

from __future__ import annotations

import codecs

__all__ = ["REPLACEMENT", "Utf8Stream"]

REPLACEMENT = "\ufffd"


class Utf8Stream:
    """Incremental UTF-8 decoding for one row; see the module docstring."""

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, data: bytes | bytearray | memoryview) -> str:
        """Append `data`; return every character it completes."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        out = self._decoder.decode(data, False)
        pending = self._decoder.getstate()[0]
        # A surrogate prefix is ill-formed already (after ED the second byte
        # must be 80..9F); see the module docstring.
        if len(pending) == 2 and pending[0] == 0xED and pending[1] >= 0xA0:
            self._decoder.reset()
            out += pending.decode("utf-8", "replace")
        return out

    def flush(self) -> str:
        """End of stream: one U+FFFD for a character left incomplete, else ""."""
        pending = self._decoder.getstate()[0]
        self._decoder.reset()
        return REPLACEMENT if pending else ""

    @property
    def is_pending(self) -> bool:
        """Whether bytes are held back waiting for the rest of a character."""
        return bool(self._decoder.getstate()[0])

    def __repr__(self) -> str:
        return f"Utf8Stream(pending={self._decoder.getstate()[0]!r})"
