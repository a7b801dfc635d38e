"""`CancelToken`: a request's cancellation flag, shared between the caller and the scheduler.

A caller (an HTTP handler noticing a dropped connection, a test) calls
`cancel()`; whoever serves the request polls `is_cancelled()` or registers a
one-shot hook with `on_cancel()` (the batcher's hook records an abort id in its
inbox, and the worker acts on it between forwards).

What it promises (docs/upstream.md, Cancellation):

* `cancel()` is idempotent: the flag is set once and every hook runs exactly
  once, on the thread that cancelled first, outside the token's lock (a hook
  may call back into the token without deadlocking).
* `on_cancel(hook)` after the token was cancelled runs the hook immediately on
  the registering thread. The check and the registration happen under one lock,
  so a cancel racing a registration can neither lose the hook nor run it twice.
"""

from __future__ import annotations

import threading
from typing import Callable

Hook = Callable[[], None]


class CancelToken:
    """A shared flag plus a list of one-shot hooks; safe to use from any thread."""

    __slots__ = ("_lock", "_cancelled", "_hooks")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._hooks: list[Hook] = []

    def cancel(self) -> None:
        """Set the flag and run (then forget) every registered hook; a second call does nothing."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            hooks, self._hooks = self._hooks, []
        # Hooks run outside the lock: one that re-enters the token (is_cancelled,
        # on_cancel) must not deadlock, and a slow hook must not block readers.
        for hook in hooks:
            hook()

    def is_cancelled(self) -> bool:
        with self._lock:
            return self._cancelled

    def on_cancel(self, hook: Hook) -> None:
        """Run `hook` once when the token is cancelled (now, if it already is)."""
        if not callable(hook):
            raise TypeError(f"on_cancel needs a callable hook, got {hook!r}")
        with self._lock:
            if not self._cancelled:
                self._hooks.append(hook)
                return
        hook()

    def __repr__(self) -> str:
        return f"CancelToken(cancelled={self.is_cancelled()})"
