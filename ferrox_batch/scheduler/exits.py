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
* `refuse_waiting`: a waiting request that cannot be admitted (a step of its admission raised) is
  answered with its error.
* `fail_admitted`: a tick failed in a way no one request can be blamed for; every admitted request fails
  and leaves by a flush, while waiting requests stay queued.
* `fail_all`: the worker is dying; every request, wherever it is, is answered with the error, and
  everything is returned even when returning raises.

A step of one request's exit that raises (publishing to the prefix cache, ending its lease, replying) is
that request's failure alone (`isolation`): the others still leave, and the ledger is brought back in
line with the store (`reconcile`). A lease that could not be ended is an orphan: its blocks stay counted
as held (by the ledger check too) until a later flush ends it or the store says it is gone.

`check_ledger` is the invariant these keep, checked after every update when there is a block budget: the
blocks the ledger has reserved equal the blocks the KV store leases to the scheduler's requests.

Each function takes the `Scheduler` itself, seen through `SchedulerState`, and changes its collections in
place: the scheduler keeps the only copy of its state, and what an exit may touch is spelled out there.
They are the exits' one interface: the scheduler calls them on itself, the worker calls them on its
scheduler (a failed forward, a failed tick, a cancel, a dying worker), and neither forwards them.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from ferrox_batch.admission.block_budget import BlockBudget
from ferrox_batch.admission.queue import QueueGate
from ferrox_batch.errors import DecodeError, QueueTimeout
from ferrox_batch.scheduler.isolation import failure
from ferrox_batch.scheduler.leases import KvLeases
from ferrox_batch.scheduler.plan import StepPlan
from ferrox_batch.scheduler.request import Request
from ferrox_batch.scheduler.waiting import WaitingQueue

log = logging.getLogger("ferrox_batch.scheduler")

#: How `fail_all` runs each return: as it is, or (a dying worker's) logging what raises and going on.
Safely = Callable[[Callable[[], None]], None]


class SchedulerState(Protocol):
    """What an exit reads and changes: the `Scheduler`'s collections of requests and what they hold."""

    waiting: WaitingQueue
    prefilling: deque[Request]
    decoding: list[Request]
    carried: set[int]  # abort ids kept one tick for a request not yet drained
    orphans: set[int]  # leases of answered requests that could not be ended: their blocks stay counted
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
        _reply(request)
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
    drifted = _retry_orphans(state)
    if not done:
        if drifted:
            reconcile(state)
        return 0
    for request in done:
        assert request.seq_id is not None
        if request.error is None:  # a failed request's KV may be partial: never offered to the cache
            try:
                state.kv.publish(request.seq_id, request.computed_tokens())
            except Exception as bad:  # the cache misses these blocks; the answer itself stands
                failure("publishing its blocks to the prefix cache", bad)
        try:
            state.budget.release(state.kv.release(request.seq_id))
        except Exception as bad:  # logged; the answer stands, and the ledger is reconciled below
            failure("ending its KV lease", bad)
            # Whether the store still holds it is unknown: its blocks stay counted until a retry ends it
            # or the store says it is gone, so the ledger never promises blocks the store still holds.
            state.orphans.add(request.seq_id)
            drifted = True
        if request in state.decoding:
            state.decoding.remove(request)
        else:
            state.prefilling.remove(request)
        _reply(request)
    if drifted:
        reconcile(state)
    return len(done)


def _retry_orphans(state: SchedulerState) -> bool:
    """Try again to end the leases that could not be ended; whether any was (the ledger must follow)."""
    ended = False
    for seq_id in list(state.orphans):
        try:
            state.kv.release(seq_id)
        except Exception:
            continue  # still held, or gone: `reconcile` asks the store which
        state.orphans.discard(seq_id)
        ended = True
    return ended


def _reply(request: Request) -> None:
    """Send the request's reply; if building it raises, the request is answered with that failure instead."""
    try:
        request.reply()
    except Exception as bad:
        request.answer(failure("replying", bad))


def refuse_waiting(state: SchedulerState, request: Request, error: DecodeError) -> None:
    """Take a waiting request out of the queue and answer it with `error` (it holds only its queue slot)."""
    state.waiting.remove(request)
    state.queue_gate.release()
    request.answer(error)


def fail_admitted(state: SchedulerState, error: DecodeError) -> None:
    """A tick failed and no one request can be blamed: every admitted request still going fails with
    `error` and leaves now (one that finished keeps its answer); the waiting ones stay queued. The ledger
    is then brought back in line with the store."""
    for request in state.admitted():
        if request.going:
            request.fail(error)
    flush(state)
    reconcile(state)


def reconcile(state: SchedulerState) -> int:
    """Make the ledger agree with the store again after a failed exit; how many blocks it was off by.

    The store is the truth: what the ledger has reserved beyond the blocks the admitted requests lease is
    released, and what they lease beyond it is reserved. Raises `RuntimeError` only when the ledger cannot
    cover what the store leases (it would over-commit).
    """
    budget = state.budget
    if budget.total is None:
        return 0
    held: set[int] = set()
    for request in state.admitted():
        if request.seq_id is None:
            continue
        try:
            held.update(state.kv.blocks_of(request.seq_id))
        except Exception as bad:  # its lease is gone: nothing of it is held
            request.fail(failure("reading its KV lease", bad))
    for seq_id in list(state.orphans):
        try:
            held.update(state.kv.blocks_of(seq_id))
        except Exception:  # the store holds it no more
            state.orphans.discard(seq_id)
    reserved = budget.total - budget.free()
    drift = reserved - len(held)
    if drift > 0:
        budget.release(drift)
    elif drift < 0 and not budget.try_reserve(-drift):
        raise RuntimeError(f"the KV store leases {len(held)} blocks but the ledger can reserve only "
                           f"{reserved + budget.free()}")
    if drift:
        log.error("block ledger was %d blocks off the KV store's leases; brought back in line", drift)
    return drift


def fail_all(state: SchedulerState, error: DecodeError, safely: Safely = lambda action: action()) -> None:
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
    seqs = [r.seq_id for r in state.admitted() if r.seq_id is not None] + sorted(state.orphans)
    held = len({block for seq_id in seqs for block in state.kv.blocks_of(seq_id)})
    if reserved != held:
        raise RuntimeError(f"block ledger says {reserved} blocks are reserved but the KV store leases {held}")
