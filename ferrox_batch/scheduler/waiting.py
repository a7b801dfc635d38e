"""`WaitingQueue`: the requests waiting for admission, in the order admission considers them.

It promises:

* **Order.** By priority (lower values first, `GenerationParams.priority`), then arrival. Requests arrive
  in submit order, so within one priority the queue is first come first served, and with one priority in
  use it is exactly the upstream's FIFO. Insertion scans from the back: with one priority it stops at once.
* **Aging.** With `aging_s` set, a request that has waited that long is *aged*: it moves ahead of every
  request not yet aged, behind those aged before it (so aged requests keep arrival order). A request of
  the least urgent priority therefore waits at most `aging_s` plus what the requests aged before it take,
  however many more urgent ones keep arriving. While only one priority has ever been queued, aging moves
  nothing (the oldest requests are already first), so this costs nothing then.
* **Deadlines.** `expired(now)` takes out every request whose queue deadline is `now` or earlier, from
  anywhere in the queue, with a heap so that a tick without expiries costs nothing but a peek. The heap
  holds ids, never requests, and is rebuilt from the waiting requests once most of its entries belong to
  requests that left some other way: a request that left holds no memory here, and the heap stays within
  a constant factor of the requests waiting.
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

from ferrox_batch.scheduler.request import Request

#: The deadline heap is rebuilt once it holds more than twice the live entries plus this many.
_STALE_SLACK = 32


class WaitingQueue:
    def __init__(self, aging_s: float | None = None) -> None:
        self._queue: deque[Request] = deque()
        self._aging_s = aging_s
        self._aged = 0  # the first `_aged` requests of `_queue` are aged, in arrival order
        self._priority: int | None = None  # the one priority queued so far; None once two were seen
        self._mixed = False
        #: (deadline, abort id) of waiting requests with a deadline, plus stale entries of ones that left.
        self._deadlines: list[tuple[float, int]] = []
        self._with_deadline: dict[int, Request] = {}  # abort id -> the waiting request, live entries only
        self._has_followers = False  # set once any request with `after` arrived: a cheap fast path

    def add(self, request: Request) -> None:
        """Queue `request` after every waiting request of its priority or a more urgent one (and after every
        aged one)."""
        at = len(self._queue)
        while at > self._aged and self._queue[at - 1].priority > request.priority:
            at -= 1
        self._queue.insert(at, request)
        if not self._mixed:
            if self._priority is None:
                self._priority = request.priority
            elif request.priority != self._priority:
                self._mixed = True
        self._has_followers = self._has_followers or request.after is not None
        if request.deadline is not None:
            self._with_deadline[request.abort] = request
            heapq.heappush(self._deadlines, (request.deadline, request.abort))

    def extend(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add(request)

    def age(self, now: float) -> int:
        """Move every request that has waited `aging_s` or longer ahead of the ones not aged yet; how many."""
        if self._aging_s is None or not self._mixed:
            return 0
        cutoff = now - self._aging_s
        fresh = [r for r in islice(self._queue, self._aged, None) if r.queued_at <= cutoff]
        if not fresh:
            return 0
        # Everything aged earlier arrived before `cutoff` moved past these, so they go after it.
        fresh.sort(key=lambda r: (r.queued_at, r.abort))
        for request in fresh:
            self._queue.remove(request)
        for offset, request in enumerate(fresh):
            self._queue.insert(self._aged + offset, request)
        self._aged += len(fresh)
        return len(fresh)

    def expired(self, now: float) -> list[Request]:
        """Take out and return every waiting request whose deadline is `now` or earlier, earliest first."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, abort = heapq.heappop(self._deadlines)
            request = self._with_deadline.get(abort)
            if request is not None:  # else it left the queue some other way
                self._take(request)
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

    @property
    def deadline_entries(self) -> int:
        """Entries the deadline heap holds, stale ones included (bounded by the requests waiting)."""
        return len(self._deadlines)

    def remove(self, request: Request) -> None:
        """Take out a request that leaves without expiring (admitted, refused or cancelled)."""
        self._take(request)

    def popleft(self) -> Request:
        request = self._queue[0]
        self._take(request)
        return request

    def _take(self, request: Request) -> None:
        index = self._queue.index(request)
        del self._queue[index]
        if index < self._aged:
            self._aged -= 1
        if self._with_deadline.pop(request.abort, None) is not None:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the deadline heap from the live entries once stale ones dominate it."""
        if len(self._deadlines) > 2 * len(self._with_deadline) + _STALE_SLACK:
            self._deadlines = [(r.deadline, abort) for abort, r in self._with_deadline.items()
                               if r.deadline is not None]
            heapq.heapify(self._deadlines)

    def __getitem__(self, index: int) -> Request:
        return self._queue[index]

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
