"""The operator's status lines: one per prefill batch, one every Nth decode forward.

The line formats are behaviour (operators grep them, and they diff against
the upstream's and SGLang's logs), so they are reproduced verbatim from the
upstream. Two rules the types here exist to keep:

* **One gauge convention.** `PoolUsage.used` excludes free *and* evictable
  units: an evictable cached prefix is memory, not occupancy. A pool is
  built from what could be served right now (`from_available`), and the
  subtraction saturates, so a double-counted unit reads as an emptier pool
  for one line instead of a nonsense number.
* **Throughput over the interval, not the run.** A decode line reports tokens
  since the last emitted line over the time since it; a lifetime average
  cannot show the change an operator reads a decode log for.

A pool the model does not have (`None`) is omitted from the line, not shown
as `0/0`, which would claim an allocated-but-empty pool. A hybrid model (local
layers sliding a window beside global ones, `admission.kv_groups`) has one
pool of blocks shared by both kinds; its lines add what each kind holds of it,
`full token usage` (the global layers') and `swa token usage` (the local ones').

`StatusReporter` holds no clock and no logger: the caller passes the time
(seconds since the worker started) and logs the returned line at INFO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ferrox_batch.admission.config import DEFAULT_DECODE_LOG_INTERVAL
from ferrox_batch.checks import check_int

__all__ = [
    "DEFAULT_DECODE_LOG_INTERVAL",
    "BatchStatus",
    "PoolUsage",
    "PrefillSnapshot",
    "StatusReporter",
    "throughput",
    "usage_ratio",
]

# DEFAULT_DECODE_LOG_INTERVAL (40 decode forwards between two decode lines)
# lives in `config` with the other defaults and is re-exported here, where
# the upstream keeps it.


def _seconds_at(name: str, value: object) -> float:
    """A point in time or a span: any finite real (may be negative: a gap
    measured against a clock that went backwards just reports zero)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}: {value!r}")
    if math.isnan(value):
        raise ValueError(f"{name} must be a number of seconds, got NaN")
    return float(value)


def usage_ratio(used: int, total: int) -> float:
    """`used / total`, or 0.0 for a pool of size 0."""
    check_int("used", used)
    check_int("total", total)
    if total == 0:
        return 0.0
    return used / total


def throughput(tokens: int, seconds: float) -> float:
    """Tokens per second, or 0.0 for a non-positive interval (never an infinity)."""
    check_int("tokens", tokens)
    seconds = _seconds_at("seconds", seconds)
    if seconds <= 0.0:
        return 0.0
    return tokens / seconds


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """A pool's occupancy in its own unit (here, KV pages). `total` excludes any
    reserved sentinel; `used` excludes free and evictable units alike.
    `PoolUsage()` is the empty pool (no budget)."""

    used: int = 0
    total: int = 0

    def __post_init__(self) -> None:
        check_int("used", self.used)
        check_int("total", self.total)
        if self.used > self.total:
            raise ValueError(f"used ({self.used}) must not exceed total ({self.total})")

    @classmethod
    def empty(cls) -> PoolUsage:
        return cls(0, 0)

    @classmethod
    def from_available(cls, total: int, available: int) -> PoolUsage:
        """A pool of `total` units of which `available` (free plus evictable)
        could be served now. Saturating: `available > total` reads as empty."""
        check_int("total", total)
        check_int("available", available)
        return cls(max(0, total - available), total)

    def ratio(self) -> float:
        """Fraction occupied; 0.0 for a pool that was never allocated."""
        return usage_ratio(self.used, self.total)


@dataclass(frozen=True, slots=True)
class BatchStatus:
    """The gauges every status line carries. The batcher fills it with
    `running_reqs = rows + prefills`, `queue_reqs = waiting` (jobs still in
    the channel not included), `kv_pages` in blocks, `page_size` = block size. `window_pages`, for a
    hybrid model only: `(global groups' blocks, local groups' blocks)` of the same pool."""

    running_reqs: int
    queue_reqs: int
    kv_pages: PoolUsage
    page_size: int
    window_pages: tuple[PoolUsage, PoolUsage] | None = None

    def __post_init__(self) -> None:
        check_int("running_reqs", self.running_reqs)
        check_int("queue_reqs", self.queue_reqs)
        check_int("page_size", self.page_size)
        if not isinstance(self.kv_pages, PoolUsage):
            raise TypeError(f"kv_pages must be a PoolUsage, got {type(self.kv_pages).__name__}")
        if self.window_pages is not None and not all(isinstance(p, PoolUsage) for p in self.window_pages):
            raise TypeError("window_pages must be two PoolUsage")

    def usage(self) -> str:
        """`token usage: r`, and for a hybrid model what each kind of layer holds of the pool."""
        line = f"token usage: {self.kv_pages.ratio():.2f}"
        if self.window_pages is not None:
            full, swa = self.window_pages
            line += f", full token usage: {full.ratio():.2f}, swa token usage: {swa.ratio():.2f}"
        return line


@dataclass(frozen=True, slots=True)
class PrefillSnapshot:
    """What a prefill batch looked like when it was *scheduled*: read after
    the forward, the live rows would report one new token each and the whole
    prompt as cached. Built by admission (`new_tokens` = the real prompt
    lengths admitted this tick)."""

    new_seqs: int = 0
    new_tokens: int = 0
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        check_int("new_seqs", self.new_seqs)
        check_int("new_tokens", self.new_tokens)
        check_int("cached_tokens", self.cached_tokens)

    @classmethod
    def empty(cls) -> PrefillSnapshot:
        return cls(0, 0, 0)


class StatusReporter:
    """Renders the batch log lines; see the module docstring."""

    __slots__ = ("_interval", "_last_prefill_time", "_last_decode_time", "_decode_forwards", "_decode_tokens")

    def __init__(self, interval: int = DEFAULT_DECODE_LOG_INTERVAL, now: float = 0.0) -> None:
        check_int("interval", interval)
        now = _seconds_at("now", now)
        # 0 means "log every forward", not a modulo by zero.
        self._interval = max(1, interval)
        self._last_prefill_time = now
        self._last_decode_time = now
        self._decode_forwards = 0
        self._decode_tokens = 0

    @property
    def decode_log_interval(self) -> int:
        return self._interval

    def report_prefill(self, now: float, snapshot: PrefillSnapshot, status: BatchStatus) -> str:
        """The line for a prefill batch (always emitted); input throughput is
        the snapshot's tokens over the gap since the last prefill line."""
        now = _seconds_at("now", now)
        if not isinstance(snapshot, PrefillSnapshot):
            raise TypeError(f"snapshot must be a PrefillSnapshot, got {type(snapshot).__name__}")
        if not isinstance(status, BatchStatus):
            raise TypeError(f"status must be a BatchStatus, got {type(status).__name__}")
        gap = now - self._last_prefill_time
        self._last_prefill_time = now
        tput = throughput(snapshot.new_tokens, gap)
        return (
            f"Prefill batch, #new-seq: {snapshot.new_seqs}, #new-token: {snapshot.new_tokens}, "
            f"#cached-token: {snapshot.cached_tokens}, {status.usage()}, "
            f"#running-req: {status.running_reqs}, #queue-req: {status.queue_reqs}, "
            f"input throughput (token/s): {tput:.2f}"
        )

    def report_decode(self, now: float, batch_reqs: int, status: BatchStatus) -> str | None:
        """Count one decode forward of `batch_reqs` rows (one token each);
        return a line every `decode_log_interval` forwards, else None."""
        now = _seconds_at("now", now)
        check_int("batch_reqs", batch_reqs)
        if not isinstance(status, BatchStatus):
            raise TypeError(f"status must be a BatchStatus, got {type(status).__name__}")
        # Every call counts, emitting or not: the silent forwards' tokens are
        # exactly what the emitted line's throughput measures.
        self._decode_forwards += 1
        self._decode_tokens += batch_reqs
        if self._decode_forwards % self._interval != 0:
            return None
        gap = now - self._last_decode_time
        self._last_decode_time = now
        tput = throughput(self._decode_tokens, gap)
        self._decode_tokens = 0
        return (
            f"Decode batch, #running-req: {status.running_reqs}, "
            f"#token: {status.kv_pages.used * status.page_size}, "
            f"{status.usage()}, "
            f"gen throughput (token/s): {tput:.2f}, #queue-req: {status.queue_reqs}"
        )
