"""The batcher's lifetime: open, closing, or dead, and the one lock that makes "send a job" safe against both.

Upstream's worker exits when every handle is dropped; Python cannot observe
that, so the handle has an explicit `close()` that posts `CLOSE` on the job
channel, and the worker leaves only once it is idle (everything in flight and
waiting answered). A worker that crashes marks itself dead with the cause,
under the same lock, and then drains the channel, so no job can slip into the
channel after its final drain: every caller is answered, and every later
caller is refused at once.
"""

from __future__ import annotations

import queue
import threading

from ferrox_batch.errors import BatcherClosed, DecodeError, WorkerDied

#: Posted on the job channel by `close()`; the worker exits once idle after seeing it.
CLOSE = object()


class Lifecycle:
    __slots__ = ("_lock", "_closed", "_dead")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._dead: str | None = None

    def refusal(self) -> DecodeError | None:
        if self._dead is not None:
            return WorkerDied(self._dead)
        if self._closed:
            return BatcherClosed()
        return None

    def send(self, jobs: queue.SimpleQueue, job: object) -> None:
        """Put `job` on the channel, or raise the typed refusal if the worker is gone or closing."""
        with self._lock:
            refusal = self.refusal()
            if refusal is not None:
                raise refusal
            jobs.put(job)

    def close(self, jobs: queue.SimpleQueue) -> bool:
        """Refuse new work and tell the worker to finish; False if it was already closed or dead."""
        with self._lock:
            if self._closed or self._dead is not None:
                return False
            self._closed = True
            jobs.put(CLOSE)
            return True

    def mark_dead(self, cause: str, jobs: queue.SimpleQueue) -> list[object]:
        """Record the crash and take everything still on the channel (to answer it); nothing enters after."""
        with self._lock:
            self._dead = cause
            taken = []
            while True:
                try:
                    taken.append(jobs.get_nowait())
                except queue.Empty:
                    return taken

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def dead(self) -> str | None:
        return self._dead
