"""`FinishReason`: why a generation ended, the one fact every finished request reports.

It has a module of its own because the worker that ends a row, the result
that carries the answer, the server that writes OpenAI's `finish_reason` and
the cache that decides what may be kept all read it, and none of them needs
the request parameters to do so. It imports nothing from the package, so any
layer can import it (`ferrox_batch.generation_types` re-exports it).

What it promises:

* A value is one of four kinds: `stop`, `stop_sequence` (carrying the
  caller's stop string, and only then a string), `length`, `cancelled`;
  anything else is refused on construction with a `ValueError`.
* Values are frozen and compare, hash and pickle by kind and stop string.
* `as_str()` is OpenAI's spelling, in which a stop sequence is plain `"stop"`;
  `completed()` is False only for a cancelled request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = ["FinishReason"]

_FINISH_KINDS = ("stop", "stop_sequence", "length", "cancelled")


@dataclass(frozen=True, slots=True)
class FinishReason:
    """Why a generation ended: `stop`, `stop_sequence` (with the caller's string), `length`, `cancelled`.

    Use the constants `FinishReason.STOP`, `.LENGTH`, `.CANCELLED` and the
    factory `FinishReason.stop_sequence(s)`; values compare by kind and string.
    """

    kind: str
    stop: str | None = None

    STOP: ClassVar[FinishReason]
    LENGTH: ClassVar[FinishReason]
    CANCELLED: ClassVar[FinishReason]

    def __post_init__(self) -> None:
        if self.kind not in _FINISH_KINDS:
            raise ValueError(f"finish reason kind must be one of {_FINISH_KINDS}, got {self.kind!r}")
        if (self.kind == "stop_sequence") != isinstance(self.stop, str):
            raise ValueError(f"only a stop_sequence finish carries a stop string, got {self.kind!r} with {self.stop!r}")

    @staticmethod
    def stop_sequence(stop: str) -> FinishReason:
        if not isinstance(stop, str):
            raise TypeError(f"stop must be a string, got {stop!r}")
        return FinishReason("stop_sequence", stop)

    def as_str(self) -> str:
        """The OpenAI `finish_reason`: a stop sequence reports as plain `"stop"`."""
        return "stop" if self.kind == "stop_sequence" else self.kind

    def matched_stop(self) -> str | None:
        return self.stop

    def completed(self) -> bool:
        """True when the answer ran to a natural end (only those may be cached); False for Cancelled."""
        return self.kind != "cancelled"

    def __str__(self) -> str:
        return self.as_str()

    def __repr__(self) -> str:
        return f"FinishReason.stop_sequence({self.stop!r})" if self.stop is not None else f"FinishReason.{self.kind.upper()}"


# The constants are assigned after the class body because a frozen dataclass
# cannot construct instances of itself until its decorator has run.
FinishReason.STOP = FinishReason("stop")
FinishReason.LENGTH = FinishReason("length")
FinishReason.CANCELLED = FinishReason("cancelled")
