"""How a request leaves the scheduler: with its one reply, after giving back everything it holds.

A waiting request holds a queue slot; an admitted one also holds a KV lease and the blocks the ledger
reserved for it. Every way out but a refusal at admission (`Scheduler._admit`, which hands back the
reservation it has just made) is here, so what is returned, and in which order, is decided in one place:

* `expire`: a waiting request whose queue deadline has passed is refused (`QueueTimeout`), never admitted
  late.
* `cancel`: a waiting request whose abort id arrives is answered at once; an admitted one is marked
  cancelled and leaves by the next flush.
* `fail_step`: a forward that failed fails the requests in it, and only them.
* `flush`: every admitted request that finished (stop, length, cancelled, failed) offers its computed KV to
  the prefix cache (unless it failed), ends its lease, returns its blocks and gets its reply.
* `fail_all`: the worker is dying; every request, wherever it is, is answered with the error, and
  everything is returned even when returning raises.

`check_ledger` is the invariant these keep, checked after every update when there is a block budget: the
blocks the ledger has reserved equal the blocks the KV store leases to the scheduler's requests.

Each function takes the `Scheduler` itself, seen through `SchedulerState`, and changes its collections in
place: the scheduler keeps the only copy of its state, and what an exit may touch is spelled out there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from ferrox_batch.batch.block_budget import BlockBudget
from ferrox_batch.batch.queue import QueueGate
from ferrox_batch.errors import DecodeError, QueueTimeout
from ferrox_batch.scheduler.leases import KvLeases
from ferrox_batch.scheduler.plan import StepPlan
from ferrox_batch.scheduler.request import Request, RequestStatus
from ferrox_batch.scheduler.waiting import WaitingQueue

#: How `fail_all` runs each return: as it is, or (a dying worker's) logging what raises and going on.
Safely = Callable[[Callable[[], None]], None]


class SchedulerState(Protocol):
    """What an exit reads and changes: the `Scheduler`'s collections of requests and what they hold."""

    waiting: WaitingQueue
    prefilling: deque[Request]
    decoding: list[Request]
    carried: set[int]  # abort ids kept one tick for a request not yet drained
    queue_gate: QueueGate
    kv: KvLeases
    budget: BlockBudget

    def admitted(self) -> list[Request]:
        ...


def expire(state: SchedulerState, now: float) -> None:
    """Refuse every waiting request whose deadline is `now` or earlier (`QueueTimeout`)."""
    for request in state.waiting.expired(now):
        state.queue_gate.release()
        assert request.deadline is not None
        limit = request.deadline - request.queued_at
        request.answer(QueueTimeout(round((now - request.queued_at) * 1000), round(limit * 1000)))


def cancel(state: SchedulerState, fresh: Iterable[int]) -> int:
    """Cancel the requests with these abort ids, wherever they are; how many were stopped.

    A request is on the channel before its abort id can be (the cancel hook is registered after
    the send), but the id may be drained first: an unmatched id is carried one tick, by which
    time its request has been drained. An id still unmatched then belongs to a request already
    answered (a cancel that raced its answer) and is dropped, so none pile up.
    """
    ids = set(fresh)
    state.carried |= ids
    if not state.carried:
        return 0
    stopped = 0
    for request in [r for r in state.waiting if r.abort in state.carried]:
        state.waiting.remove(request)
        state.carried.discard(request.abort)
        state.queue_gate.release()
        request.cancel()
        request.reply()
        stopped += 1
    for request in state.admitted():
        if request.abort in state.carried and request.going:
            request.cancel()  # answered by the next flush, which frees what it holds
            state.carried.discard(request.abort)
            stopped += 1
    state.carried &= ids
    return stopped


def fail_step(state: SchedulerState, plan: StepPlan, error: DecodeError) -> None:
    """The forward of `plan` failed: every request in it fails with `error`; the rest go on."""
    for request in plan.requests:
        request.fail(error)
    flush(state)


def flush(state: SchedulerState) -> int:
    """Answer every admitted request that has finished, freeing its lease and blocks; how many left."""
    done = [r for r in state.admitted() if not r.going]
    if not done:
        return 0
    for request in done:
        assert request.seq_id is not None
        # Released while still listed: if releasing raises (a bug), a dying worker still finds the
        # request and answers it.
        if request.error is None:  # a failed request's KV may be partial: never offered to the cache
            state.kv.publish(request.seq_id, request.computed_tokens())
        state.budget.release(state.kv.release(request.seq_id))
        if request.status is RequestStatus.DECODING:
            state.decoding.remove(request)
        else:
            state.prefilling.remove(request)
        request.reply()
    return len(done)


def fail_all(state: SchedulerState, error: DecodeError, safely: Safely) -> None:
    """Answer every request `state` holds with `error` and return everything they hold.

    `safely` runs each release (a crashed worker passes one that logs and goes on: the state may be what
    broke, and answering callers matters more).
    """
    while state.waiting:
        request = state.waiting.popleft()
        safely(state.queue_gate.release)
        request.answer(error)
    for request in state.admitted():
        seq_id = request.seq_id
        # What its lease gives back; what it reserved if the store cannot say (the store may be
        # what broke), so the ledger still comes back whole.
        returned = [request.reserved]

        def release_lease() -> None:
            returned[0] = state.kv.release(seq_id)

        if seq_id is not None:
            safely(release_lease)
        safely(lambda: state.budget.release(returned[0]))
        request.answer(error)
    state.prefilling.clear()
    state.decoding.clear()


def check_ledger(state: SchedulerState) -> None:
    """The ledger and the store agree: blocks reserved == blocks our requests lease (with a budget)."""
    budget = state.budget
    if budget.total is None:
        return
    reserved = budget.total - budget.free()
    # Distinct blocks: a cached prefix block shared by several requests is reserved once.
    held = len({block for r in state.admitted() if r.seq_id is not None for block in state.kv.blocks_of(r.seq_id)})
    if reserved != held:
        raise RuntimeError(f"block ledger says {reserved} blocks are reserved but the KV store leases {held}")
