"""`Usage` (docs/upstream.md, Results and timing): token counts plus the optional timings of one request.

Builders return new values (`Usage.new(p, c).with_timings(...)`), and
`to_dict()` omits every field that is None, so a plain `Usage.new(2, 3)`
serialises to exactly the three counts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ferrox_batch.checks import check_int, check_seconds


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts plus optional timings; the `with_*` builders return a new Usage.

    `total_tokens` is always `prompt_tokens + completion_tokens` (computed when
    omitted; a contradicting value is refused). Optional fields that are None
    are left out of `to_dict()`.
    """

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int | None = None
    prompt_per_second: float | None = None
    predicted_per_second: float | None = None
    prompt_eval_duration_ms: float | None = None
    generation_duration_ms: float | None = None
    time_to_first_token_ms: float | None = None
    #: Prompt tokens adopted from the prefix cache instead of computed; None when no cache was consulted.
    cached_tokens: int | None = None
    #: From submit to admission: the time spent waiting for a row and KV blocks (port-only).
    queue_duration_ms: float | None = None

    def __post_init__(self) -> None:
        check_int("prompt_tokens", self.prompt_tokens)
        check_int("completion_tokens", self.completion_tokens)
        total = self.prompt_tokens + self.completion_tokens
        if self.total_tokens is None:
            object.__setattr__(self, "total_tokens", total)
        elif self.total_tokens != total:
            raise ValueError(
                f"total_tokens must be prompt_tokens + completion_tokens = {total}, got {self.total_tokens!r}"
            )
        if self.cached_tokens is not None:
            check_int("cached_tokens", self.cached_tokens, maximum=self.prompt_tokens)

    @classmethod
    def new(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        """Counts only."""
        return cls(prompt_tokens, completion_tokens)

    def with_timings(self, prefill_s: float, decode_s: float) -> Usage:
        """Both durations always set (ms); a rate only when its phase took time and produced tokens."""
        prefill_s = check_seconds("prefill_s", prefill_s)
        decode_s = check_seconds("decode_s", decode_s)
        prompt_rate = _rate(self.prompt_tokens, prefill_s)
        decode_rate = _rate(self.completion_tokens, decode_s)
        return dataclasses.replace(
            self,
            prompt_eval_duration_ms=prefill_s * 1000.0,
            generation_duration_ms=decode_s * 1000.0,
            prompt_per_second=prompt_rate,
            predicted_per_second=decode_rate,
        )

    def with_cached_tokens(self, cached: int | None) -> Usage:
        """The prompt tokens the prefix cache supplied (None: no cache was consulted)."""
        return dataclasses.replace(self, cached_tokens=cached)

    def with_queue_time(self, seconds: float) -> Usage:
        """How long the request waited for admission."""
        return dataclasses.replace(self, queue_duration_ms=check_seconds("queue_s", seconds) * 1000.0)

    def with_ttft(self, seconds: float) -> Usage:
        """Time to first token; left unset when nothing was generated."""
        seconds = check_seconds("ttft", seconds)
        if self.completion_tokens == 0:
            return self
        return dataclasses.replace(self, time_to_first_token_ms=seconds * 1000.0)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value
        return out


def _rate(tokens: int, seconds: float) -> float | None:
    """tokens / seconds, or None when that is not a meaningful finite rate.

    Upstream guards only `seconds > 0`; a subnormal duration would still give
    inf, which JSON cannot carry, so a non-finite quotient is dropped too.
    """
    if seconds <= 0 or tokens <= 0:
        return None
    rate = tokens / seconds
    return rate if math.isfinite(rate) else None
