"""`QueueGate` and `AbortInbox`: the two pieces of shared state request threads touch.

`QueueGate` bounds how many jobs may wait for admission. A slot is taken on
the caller's thread at submission and given back when the worker admits the
job (or drops it: cancelled while waiting, send failed), so jobs already in
the worker's `waiting` deque still count. The check and the increment happen
under one lock, so N racing submitters admit exactly `cap`.

API choice (upstream returns `Result<(), usize>`): `try_reserve()` returns
None on success and the depth that refused on failure; `reserve()` is the
same but raises `QueueFull(queued=depth, cap=cap)`. Both count a refusal in
`rejected` exactly once.

`AbortInbox` is where cancellations land: any thread `enqueue`s an abort id,
and the worker `drain`s the whole set at the top of a tick, so cancellation is
applied between forwards, never during one.
"""

from __future__ import annotations

import threading

from ferrox_batch.checks import check_int
from ferrox_batch.errors import QueueFull

#: Opaque, ordered, hashable id of one submission, for cancellation.
AbortId = int


class QueueGate:
    __slots__ = ("_cap", "_depth", "_rejected", "_lock")

    def __init__(self, cap: int) -> None:
        check_int("max_queue", cap)
        self._cap = cap
        self._depth = 0
        self._rejected = 0
        self._lock = threading.Lock()

    @property
    def cap(self) -> int:
        return self._cap

    def try_reserve(self) -> int | None:
        """Take a slot: None on success, else the depth that refused (and `rejected` += 1)."""
        with self._lock:
            if self._depth >= self._cap:
                self._rejected += 1
                return self._depth
            self._depth += 1
            return None

    def reserve(self) -> None:
        """Take a slot or raise `QueueFull(queued, cap)`."""
        queued = self.try_reserve()
        if queued is not None:
            raise QueueFull(queued, self._cap)

    def release(self) -> None:
        """Give a slot back. Raises ValueError("queue depth underflow") if none is held."""
        with self._lock:
            if self._depth == 0:
                raise ValueError("queue depth underflow")
            self._depth -= 1

    def depth(self) -> int:
        """Jobs holding a slot: submitted, not yet admitted or dropped."""
        with self._lock:
            return self._depth

    def rejected(self) -> int:
        """Submissions refused because the queue was full."""
        with self._lock:
            return self._rejected

    def __repr__(self) -> str:
        return f"QueueGate(cap={self._cap}, depth={self.depth()}, rejected={self.rejected()})"


class AbortInbox:
    """Pending cancellations (a set: cancelling twice is one entry) plus the `aborted` counter."""

    __slots__ = ("_pending", "_next_id", "_aborted", "_lock")

    def __init__(self) -> None:
        self._pending: set[AbortId] = set()
        self._next_id = 0
        self._aborted = 0
        self._lock = threading.Lock()

    def next_id(self) -> AbortId:
        """A fresh id: 0, 1, 2, ... never reused."""
        with self._lock:
            value = self._next_id
            self._next_id += 1
            return value

    def enqueue(self, abort_id: AbortId) -> None:
        """Record a cancellation (any thread); the worker acts on it at its next tick."""
        check_int("abort_id", abort_id)
        with self._lock:
            self._pending.add(abort_id)

    def drain(self) -> set[AbortId]:
        """Take and clear every pending id at once (the worker, once per tick)."""
        with self._lock:
            pending, self._pending = self._pending, set()
            return pending

    def add_aborted(self, n: int = 1) -> None:
        """Count `n` requests the scheduler actually stopped because of a cancel."""
        check_int("n", n)
        with self._lock:
            self._aborted += n

    def aborted(self) -> int:
        with self._lock:
            return self._aborted

    def __repr__(self) -> str:
        with self._lock:
            return f"AbortInbox(pending={sorted(self._pending)}, aborted={self._aborted})"
