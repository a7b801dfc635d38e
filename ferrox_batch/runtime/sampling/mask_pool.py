"""`MaskPool`: constrained rows' grammar masks, each on a thread of its own, waited for up to a deadline.

Why per row and not llguidance's one parallel call over the batch: that call returns when its slowest row
is done, and one row's grammar can make a mask cost a second, so the whole batch (every other client)
would wait on it. Here each row's mask is a task of its own, started while the forward runs (llguidance
drops the GIL while it computes). Once the forward is done the worker waits for each row at most
`deadline_s` from the later of then and the row's start (a row that waited for a thread is not charged for
the wait). A row not done by then is *late* when its grammar is to blame: its mask has used half the
deadline in CPU time (its thread's own clock), so a cheap mask whose thread a loaded machine left waiting
(other processes, a collector's pause) is not cut for it; whatever CPU it got, a row is late after
`LATE_WALL_DEADLINES` deadlines, which bounds the worker's wait. Only a late row fails (the caller ends it
with its own error). A computation cannot be stopped part-way, so a late row's thread is left to finish
alone: the pool is replaced, and the rows not started yet go to the fresh pool, so neither they nor the
next steps' masks queue behind it. A row moved so once that still does not start within a deadline is
late too, so the wait is bounded by `LATE_WALL_DEADLINES` deadlines times the rounds it takes to start
every row (one, unless more rows were constrained than the pool has threads).

Late threads are bounded, so that a client whose grammars keep missing the deadline cannot make the server
spawn threads without end: a late computation is counted until it ends. While `MAX_LATE_BUSY` of them run,
a new grammar is refused as busy (`MasksBusy`, a 503 at compile, on the caller's side); while
`MAX_LATE` of them run, no further mask is started at all and the step's constrained rows are late at
once (rows already admitted could otherwise add one thread each). So at most `threads` threads serve a
step and fewer than `MAX_LATE + threads` late ones run. A late row's matcher is held by its step's
`PendingMasks` until its thread is done, and is never used again: the row ends with its error that step and
its sampler row is released.

Masks are written into one `[rows, words]` int32 bit array per step (llguidance's layout: bit `t % 32`
of word `t // 32` allows token `t`); a late row's thread writes into that step's array only, which it
keeps alive until it is done.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferrox_batch.errors import DecodeError

#: Threads one pool may run at once: a step's constrained rows each get one while they compute.
MAX_MASK_THREADS = 64
#: Late computations still running past which a new grammar is refused as busy (a quarter of the pool).
MAX_LATE_BUSY = MAX_MASK_THREADS // 4
#: Late computations still running past which no mask is started (module docstring).
MAX_LATE = MAX_MASK_THREADS


#: A row past its deadline on the wall is late once its mask has used this share of the deadline in CPU
#: time, or once it has run `LATE_WALL_DEADLINES` deadlines on the wall whatever CPU it got (module docstring).
LATE_CPU_SHARE = 0.5
LATE_WALL_DEADLINES = 4
#: How often, in deadlines, a row past its deadline but not charged yet is looked at again.
RECHECK_DEADLINES = 1 / 8


@dataclass(frozen=True, slots=True)
class _Start:
    """When a row's computation began: the wall's time, and its thread's CPU clock and reading."""

    at: float
    clock: int | None
    cpu: float

    @classmethod
    def now(cls) -> _Start:
        """Read on the computing thread."""
        try:
            clock = time.pthread_getcpuclockid(threading.get_ident())
            return cls(time.monotonic(), clock, time.clock_gettime(clock))
        except (AttributeError, OSError):  # no per-thread CPU clock here: the wall alone decides
            return cls(time.monotonic(), None, 0.0)

    def cpu_spent(self) -> float | None:
        """CPU seconds its thread has run since (None where that cannot be read)."""
        if self.clock is None:
            return None
        try:
            return time.clock_gettime(self.clock) - self.cpu
        except OSError:
            return None


class MasksBusy(DecodeError):
    """Grammar masks that missed the worker's deadline are still being computed: a new grammar must wait for
    them to end (503: the request is fine, retry shortly)."""

    retry_after_secs = 1
    http_status = 503
    error_code = "server_busy"

    def __init__(self, late: int) -> None:
        super().__init__(f"server is at capacity: {late} grammar masks that missed their deadline are still "
                         "being computed; retry shortly")

#: Fills row `index` of a `[rows, words]` int32 bit array with `matcher`'s next mask.
Fill = Callable[[Any, np.ndarray, int], None]


class MaskPool:
    """Computes rows' masks on threads and collects them within a deadline (module docstring)."""

    def __init__(self, fill: Fill, words: int, deadline_s: float, threads: int = MAX_MASK_THREADS,
                 late_busy: int = MAX_LATE_BUSY, late_most: int = MAX_LATE) -> None:
        self._fill = fill
        self._words = words
        self.deadline_s = deadline_s
        self._threads = threads
        self._late_busy = late_busy
        self._late_most = late_most
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # Guards `_pool` (started on the worker, closed from any thread) and the late computations.
        self._lock = threading.Lock()
        self._late: set[concurrent.futures.Future[None]] = set()  # late computations still running

    def start(self, matchers: Sequence[Any]) -> PendingMasks:
        """Start computing every matcher's next mask (row `i` of the result is `matchers[i]`'s)."""
        bits = np.zeros((len(matchers), self._words), dtype=np.int32)
        pending = PendingMasks(self, matchers, bits)
        if not self._full():
            pending.submit(range(len(matchers)))
        return pending

    def late(self) -> int:
        """Late computations still running."""
        with self._lock:
            return len(self._late)

    def check_room(self) -> None:
        """`MasksBusy` while `late_busy` late computations run (a new grammar's refusal)."""
        late = self.late()
        if late >= self._late_busy:
            raise MasksBusy(late)

    def _full(self) -> bool:
        return self.late() >= self._late_most

    def _mark_late(self, futures: Sequence[concurrent.futures.Future[None]]) -> None:
        """Count `futures` as late until each ends."""
        with self._lock:
            self._late.update(futures)
        for future in futures:
            future.add_done_callback(self._ended)

    def _ended(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._late.discard(future)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="ferrox-grammar")
            return self._pool

    def _abandon(self) -> None:
        """Leave the current pool to its late threads (they end when their masks do); a new one serves next."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop the threads: wait for the current pool's, and up to `timeout_s` (None: as long as they take)
        for the late ones; whether every one ended."""
        with self._lock:
            pool, self._pool = self._pool, None
            late = list(self._late)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        _, running = concurrent.futures.wait(late, timeout=timeout_s)
        return not running


class PendingMasks:
    """One step's masks being computed; `collect` waits for them within the pool's deadline."""

    def __init__(self, pool: MaskPool, matchers: Sequence[Any], bits: np.ndarray) -> None:
        self._pool = pool
        self._matchers = matchers
        self.bits = bits
        self._futures: dict[int, concurrent.futures.Future[None]] = {}
        self._started: dict[int, _Start] = {}  # row -> when its computation began (set by its thread)
        self._lock = threading.Lock()

    def submit(self, rows: Sequence[int] | range) -> None:
        executor = self._pool._executor()
        for row in rows:
            self._futures[row] = executor.submit(self._compute, row)

    def _compute(self, row: int) -> None:
        start = _Start.now()
        with self._lock:
            self._started[row] = start
        self._pool._fill(self._matchers[row], self.bits, row)

    def _charged(self, start: _Start, began: float, now: float) -> bool:
        """Whether a row past its deadline on the wall is late: its mask used `LATE_CPU_SHARE` of the
        deadline in CPU (its grammar's cost, not the machine's load), or ran `LATE_WALL_DEADLINES` of them."""
        deadline = self._pool.deadline_s
        if now - max(began, start.at) >= deadline * LATE_WALL_DEADLINES:
            return True
        spent = start.cpu_spent()
        return spent is None or spent >= deadline * LATE_CPU_SHARE

    def collect(self) -> tuple[np.ndarray, list[int], dict[int, BaseException]]:
        """(the bit array, the late rows, the rows whose computation raised and what it raised), each row
        waited for up to the deadline from the later of this call and its start (module docstring)."""
        deadline = self._pool.deadline_s
        began = time.monotonic()
        late: list[int] = []
        failed: dict[int, BaseException] = {}
        waiting = dict(self._futures)
        moved: set[int] = set()  # rows sent to a fresh pool once already
        until = began + deadline
        while waiting:
            done, _ = concurrent.futures.wait(waiting.values(), timeout=max(0.0, until - time.monotonic()))
            for row, future in list(waiting.items()):
                if future in done:
                    del waiting[row]
                    if future.exception() is not None:
                        failed[row] = future.exception()  # type: ignore[assignment]
            if not waiting:
                break
            now = time.monotonic()
            with self._lock:
                starts = {row: self._started[row] for row in waiting if row in self._started}
            due = {row: max(began, start.at) + deadline for row, start in starts.items()}
            overdue = [row for row, when in due.items() if when <= now and self._charged(starts[row], began, now)]
            late.extend(overdue)
            self._pool._mark_late([waiting.pop(row) for row in overdue])
            # Past its deadline but not charged yet: looked at again soon, and at its wall limit at the latest.
            running = [when if when > now else min(now + deadline * RECHECK_DEADLINES,
                                                   max(began, starts[row].at) + deadline * LATE_WALL_DEADLINES)
                       for row, when in due.items() if row in waiting]
            if overdue or not running:
                # Threads are held by late rows (or none started a row for a whole deadline): the rows not
                # started yet go to a fresh pool instead of queueing behind them, once; a row whose cancel
                # fails has just started and keeps its own deadline.
                unstarted = [row for row in waiting if row not in due and waiting[row].cancel()]
                self._pool._abandon()
                for row in unstarted:
                    del waiting[row]
                again = [row for row in unstarted if row not in moved]
                late.extend(row for row in unstarted if row in moved)
                if again and self._pool._full():
                    late.extend(again)  # no room to start them: late, without a wait
                elif again:
                    moved.update(again)
                    self.submit(again)
                    waiting.update({row: self._futures[row] for row in again})
            until = min(running) if running else time.monotonic() + deadline
        if not self._futures:  # never started: late threads hold every place
            late.extend(range(len(self._matchers)))
        return self.bits, sorted(late), failed
