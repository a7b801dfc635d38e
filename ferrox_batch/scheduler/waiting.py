"""`WaitingQueue`: the requests waiting for admission, in the order admission considers them.

It promises:

* **Order.** By priority (lower values first, `GenerationParams.priority`), then arrival. Requests arrive
  in submit order, so within one priority the queue is first come first served, and with one priority in
  use it is exactly the upstream's FIFO. Insertion scans from the back: with one priority it stops at once.
* **Deadlines.** `expired(now)` takes out every request whose queue deadline is `now` or earlier, from
  anywhere in the queue, with a heap so that a tick without expiries costs nothing but a peek.
* **The cache-aware window.** `window(n)`: the first `n` requests of the head's priority, the only ones
  the cache-aware pick may choose among, so a less urgent request never overtakes a more urgent one. A
  request held back (it follows another request's prompt that is not through yet) is passed over, and
  holds nobody up.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice, takewhile

from ferrox_batch.scheduler.request import Request, RequestStatus


class WaitingQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        #: (deadline, abort id, request) of the waiting requests that have a deadline; entries of requests
        #: that left the queue some other way are dropped when they reach the top.
        self._deadlines: list[tuple[float, int, Request]] = []
        self._has_followers = False  # set once any request with `after` arrived: a cheap fast path

    def add(self, request: Request) -> None:
        """Queue `request` after every waiting request of its priority or a more urgent one."""
        at = len(self._queue)
        while at > 0 and self._queue[at - 1].priority > request.priority:
            at -= 1
        self._queue.insert(at, request)
        self._has_followers = self._has_followers or request.after is not None
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.abort, request))

    def extend(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add(request)

    def expired(self, now: float) -> list[Request]:
        """Take out and return every waiting request whose deadline is `now` or earlier, earliest first."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request = heapq.heappop(self._deadlines)
            if request.status is RequestStatus.WAITING:  # else admitted or answered since: no longer queued
                self._queue.remove(request)
                out.append(request)
        return out

    def window(self, size: int, held: Callable[[Request], bool] | None = None) -> list[Request]:
        """The first `size` requests of the head's priority (empty when nothing waits). With `held`, the
        requests it holds back are passed over first: the head is the first one it does not hold."""
        if held is None:
            queue: Iterable[Request] = self._queue
        else:
            queue = (r for r in self._queue if not held(r))
        queue = iter(queue)
        head = next(queue, None)
        if head is None:
            return []
        rest = takewhile(lambda r: r.priority == head.priority, queue)
        return [head, *islice(rest, size - 1)]

    @property
    def followers(self) -> int:
        """Waiting requests that follow another's prompt (`Request.after`)."""
        return sum(1 for r in self._queue if r.after is not None) if self._has_followers else 0

    def remove(self, request: Request) -> None:
        """Take out a request that leaves without expiring (admitted, refused or cancelled)."""
        self._queue.remove(request)

    def popleft(self) -> Request:
        return self._queue.popleft()

    def __getitem__(self, index: int) -> Request:
        return self._queue[index]

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
