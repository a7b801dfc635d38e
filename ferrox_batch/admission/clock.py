"""`RowClock`: the one clock a batched row is timed by, and the only way to its `Usage`.

The upstream's batched path once answered with token counts and no rates,
because the private decode loop set the timings and the batcher never did.
This type owns both the timestamps *and* the construction of the row's
`Usage`, so there is no path from a finished row to a `Usage` that forgets
the rates.

Timing rules (docs/upstream.md, Results and timing):

* the clock starts when the job is *admitted* to the worker, so queue wait is
  not counted as prefill time;
* prefill ends when the prompt is through (`prefill_finished`);
* only the first generated token sets the time-to-first-token;
* a row is timed by wall clock, which under batching includes the steps run
  for other rows. That is deliberate: the rate a caller cares about is the
  rate its own request was served at.

The time source is injectable (`now`, seconds as a float, monotonic) so tests
are deterministic. Like Rust's `Instant::duration_since`, a source that runs
backwards yields zero-length phases rather than negative ones.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from ferrox_batch.checks import check_int
from ferrox_batch.usage import Usage

__all__ = ["RowClock"]

Now = Callable[[], float]


def _read(now: Now) -> float:
    value = now()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"now() must return a number of seconds, got {type(value).__name__}: {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"now() must return a finite number of seconds, got {value!r}")
    return float(value)


class RowClock:
    """Timestamps for one row, from admission to the token that ended it.

    `RowClock(now)` and `RowClock.start(now)` both return a clock started at
    `now()` (the second spelling mirrors the upstream constructor)."""

    __slots__ = ("_now", "_started", "_prefill_done", "_first_token")

    def __init__(self, now: Now = time.monotonic) -> None:
        if not callable(now):
            raise TypeError(f"now must be a callable returning seconds, got {type(now).__name__}")
        self._now = now
        self._started = _read(now)
        self._prefill_done: float | None = None
        self._first_token: float | None = None

    @classmethod
    def start(cls, now: Now = time.monotonic) -> RowClock:
        """A clock started now: called when the job is admitted."""
        return cls(now)

    @property
    def started(self) -> float:
        return self._started

    @property
    def prefill_done(self) -> float | None:
        return self._prefill_done

    @property
    def first_token(self) -> float | None:
        return self._first_token

    def prefill_finished(self) -> None:
        """Mark the end of prefill (the handover from prefill to decode row)."""
        self._prefill_done = _read(self._now)

    def token(self) -> None:
        """Record a generated token. Only the first one moves the clock, so
        the push site need not know which token it is holding."""
        if self._first_token is None:
            self._first_token = _read(self._now)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> Usage:
        """The row's `Usage`, rates included.

        A row that ended during prefill has no `prefill_done`: its prefill
        runs to now and its decode phase is empty, and `with_timings` leaves
        a rate unset for an empty phase instead of inventing one."""
        check_int("prompt_tokens", prompt_tokens)
        check_int("completion_tokens", completion_tokens)
        ended = _read(self._now)
        prefill_end = ended if self._prefill_done is None else self._prefill_done
        prefill_secs = max(0.0, prefill_end - self._started)
        decode_secs = max(0.0, ended - prefill_end)
        usage = Usage.new(prompt_tokens, completion_tokens).with_timings(prefill_secs, decode_secs)
        if self._first_token is not None:
            usage = usage.with_ttft(max(0.0, self._first_token - self._started))
        return usage

    def __repr__(self) -> str:
        return (
            f"RowClock(started={self._started!r}, prefill_done={self._prefill_done!r}, "
            f"first_token={self._first_token!r})"
        )
