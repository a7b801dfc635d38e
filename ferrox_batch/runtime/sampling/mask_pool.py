"""`MaskPool`: constrained rows' grammar masks, each on a thread of its own, waited for up to a deadline.

Why per row and not llguidance's one parallel call over the batch: that call returns when its slowest row
is done, and one row's grammar can make a mask cost a second, so the whole batch (every other client)
would wait on it. Here each row's mask is a task of its own, started while the forward runs (llguidance
drops the GIL while it computes). Once the forward is done the worker waits at most `deadline_s` more;
a row whose mask started but is not done by then is *late*, and only that row fails (the caller ends it
with its own error). A computation cannot be stopped part-way, so a late row's thread is left to finish
alone: the pool is replaced, so the next steps' masks never queue behind it. A task that had not started
by the deadline (every thread busy) is not the row's fault: it goes to the fresh pool and gets a deadline
of its own, so the wait is bounded by the deadline times the rounds it takes to start every row (one,
unless more rows were constrained than the pool has threads).

Masks are written into one `[rows, words]` int32 bit array per step (llguidance's layout: bit `t % 32`
of word `t // 32` allows token `t`); a late row's thread writes into that step's array only, which it
keeps alive until it is done.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: Threads one pool may run at once: a step's constrained rows each get one while they compute.
MAX_MASK_THREADS = 64

#: Fills row `index` of a `[rows, words]` int32 bit array with `matcher`'s next mask.
Fill = Callable[[Any, np.ndarray, int], None]


class MaskPool:
    """Computes rows' masks on threads and collects them within a deadline (module docstring)."""

    def __init__(self, fill: Fill, words: int, deadline_s: float, threads: int = MAX_MASK_THREADS) -> None:
        self._fill = fill
        self._words = words
        self.deadline_s = deadline_s
        self._threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # guards `_pool` (started on the worker, closed from any thread)

    def start(self, matchers: Sequence[Any]) -> PendingMasks:
        """Start computing every matcher's next mask (row `i` of the result is `matchers[i]`'s)."""
        bits = np.zeros((len(matchers), self._words), dtype=np.int32)
        pending = PendingMasks(self, matchers, bits)
        pending.submit(range(len(matchers)))
        return pending

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

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


class PendingMasks:
    """One step's masks being computed; `collect` waits for them within the pool's deadline."""

    def __init__(self, pool: MaskPool, matchers: Sequence[Any], bits: np.ndarray) -> None:
        self._pool = pool
        self._matchers = matchers
        self.bits = bits
        self._futures: dict[int, concurrent.futures.Future[None]] = {}
        self._started: set[int] = set()  # rows whose computation began (set by their threads)
        self._lock = threading.Lock()

    def submit(self, rows: Sequence[int] | range) -> None:
        executor = self._pool._executor()
        for row in rows:
            self._futures[row] = executor.submit(self._compute, row)

    def _compute(self, row: int) -> None:
        with self._lock:
            self._started.add(row)
        self._pool._fill(self._matchers[row], self.bits, row)

    def collect(self) -> tuple[np.ndarray, list[int], dict[int, BaseException]]:
        """(the bit array, the late rows, the rows whose computation raised and what it raised), waiting at
        most the deadline per round (module docstring)."""
        late: list[int] = []
        failed: dict[int, BaseException] = {}
        waiting = dict(self._futures)
        while waiting:
            done, _ = concurrent.futures.wait(waiting.values(), timeout=self._pool.deadline_s)
            for row, future in list(waiting.items()):
                if future in done:
                    del waiting[row]
                    if future.exception() is not None:
                        failed[row] = future.exception()  # type: ignore[assignment]
            if not waiting:
                break
            with self._lock:
                started = {row for row in waiting if row in self._started}
            late.extend(sorted(started))
            unstarted = [row for row in waiting if row not in started and waiting[row].cancel()]
            # A task that started between the check and its cancel is late too: it had the deadline.
            late.extend(row for row in waiting if row not in started and row not in unstarted)
            self._pool._abandon()
            if not unstarted:
                break
            self.submit(unstarted)
            waiting = {row: self._futures[row] for row in unstarted}
        return self.bits, sorted(late), failed
