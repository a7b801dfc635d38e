"""`BlockBudget`: the integer ledger of KV blocks that admission reserves from.

Admission asks two kinds of question of it:

* *immovable*: could this request ever be served here? (`immovable_refusal`:
  the context ceiling first, then "more blocks than the whole budget"). These
  are answered on the caller's thread, before a queue slot is taken.
* *momentary*: are there enough free blocks right now? (`try_reserve`). A
  no is not a refusal; the job waits at the head of the queue.

Blocks are counted in token positions (`blocks_for` rounds up and never
returns 0), not bytes; bytes appear only in reports. `total is None` means no
block budget at all: everything is admissible and reserve/release are no-ops.

Upstream mutates the ledger only on the worker thread and debug-asserts on a
release of more than was reserved. Here every operation holds the ledger's own
lock, so any thread may call any method, and an over-release raises
ValueError instead of silently clamping: a double release is a scheduler bug
that must not hide as free capacity.
"""

from __future__ import annotations

import threading

from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.checks import check_int
from ferrox_batch.errors import DEVICE_MEMORY_BUDGET_EXCEEDED, DecodeError, KvBudgetExceeded


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks `positions` positions occupy: `max(1, ceil(positions / block_size))`.

    The one place this arithmetic lives: the ledger prices requests with it and
    the paged KV store leases exactly this many blocks.
    """
    check_int("positions", positions)
    check_int("block_size", block_size, minimum=1)
    return max(1, -(-positions // block_size))


class BlockBudget:
    __slots__ = ("_block_size", "_ceiling", "_total", "_free", "_rejected_too_large", "_lock")

    def __init__(self, block_size: int, total: int | None, ceiling: ContextCeiling) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise TypeError(f"kv block size must be an integer, got {block_size!r}")
        if block_size <= 0:
            # Upstream's assert message, verbatim.
            raise ValueError("kv block size must be positive")
        if total is not None:
            check_int("total", total)
        if not isinstance(ceiling, ContextCeiling):
            raise TypeError(f"ceiling must be a ContextCeiling, got {ceiling!r}")
        self._block_size = block_size
        self._ceiling = ceiling
        self._total = total
        self._free = total or 0
        self._rejected_too_large = 0
        self._lock = threading.Lock()

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def total(self) -> int | None:
        """Blocks in the whole ledger; None means there is no block budget."""
        return self._total

    @property
    def ceiling(self) -> ContextCeiling:
        return self._ceiling

    def blocks_for(self, positions: int) -> int:
        """Blocks `positions` positions occupy: `max(1, ceil(positions / block_size))`."""
        return blocks_for(positions, self._block_size)

    def bytes_for(self, positions: int) -> int:
        return self._ceiling.bytes_for(positions)

    def rejected_too_large(self) -> int:
        """Requests refused because they need more blocks than the whole ledger."""
        with self._lock:
            return self._rejected_too_large

    def free(self) -> int:
        """Unreserved blocks (0 when there is no budget)."""
        with self._lock:
            return self._free

    def immovable_refusal(self, requested: int, held: int | None = None, *,
                          blocks: int | None = None) -> DecodeError | None:
        """The refusal no amount of waiting would lift, or None.

        `requested` (prompt + max_tokens) is checked against the context
        ceiling, then `held` (the positions the row holds at once: `requested`
        unless its lease slides a window, `admission.window`) against the
        whole ledger. The context ceiling is reported first when both bind,
        and only its counter moves. `blocks`: what the row takes when that is
        not `blocks_for(held)` (a store of several KV groups prices each,
        `admission.kv_groups`).
        """
        check_int("requested", requested)
        positions = requested if held is None else check_int("held", held)
        refusal = self._ceiling.refusal(requested)
        if refusal is not None:
            return refusal
        total = self._total
        if total is None:
            return None
        if blocks is None:
            blocks = self.blocks_for(positions)
        check_int("blocks", blocks)
        if blocks <= total:
            return None
        with self._lock:
            self._rejected_too_large += 1
        capacity = total * self._block_size
        return KvBudgetExceeded(
            binding=DEVICE_MEMORY_BUDGET_EXCEEDED,
            estimated_bytes=self.bytes_for(positions),
            limit_bytes=self.bytes_for(capacity),
            positions=positions,
            positions_limit=capacity,
            detail=(
                f"request needs {blocks} KV blocks ({positions} token positions at {self._block_size} "
                f"per block) but this server's whole KV budget is {total} blocks; an idle server "
                "would refuse it identically"
            ),
        )

    def try_reserve(self, blocks: int) -> bool:
        """Take `blocks` if that many are free (all or nothing); always True without a budget."""
        check_int("blocks", blocks)
        if self._total is None:
            return True
        with self._lock:
            if blocks > self._free:
                return False
            self._free -= blocks
            return True

    def release(self, blocks: int) -> None:
        """Give back `blocks` reserved earlier; a no-op without a budget.

        Raises ValueError (and changes nothing) if that would leave more free
        blocks than the ledger has: something released twice.
        """
        check_int("blocks", blocks)
        total = self._total
        if total is None:
            return
        with self._lock:
            if self._free + blocks > total:
                raise ValueError(
                    f"kv block over-release: releasing {blocks} blocks with {self._free} of {total} "
                    "already free (a reservation was returned twice)"
                )
            self._free += blocks

    def __repr__(self) -> str:
        return f"BlockBudget(block_size={self._block_size}, total={self._total!r}, free={self.free()})"
