"""`KvLeases`: the KV store as the scheduler sees it, the seam between scheduling and the device.

The scheduler leases, measures and releases each request's KV through this protocol and nothing else, so
tests drive it with a fake lease table (`tests/scheduler/scheduler_fakes.py`) and the model runner
(`runtime.runner.ModelRunner`) implements it over the paged store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ferrox_batch.admission.window import WindowPolicy


class KvLeases(Protocol):
    """The KV store as the scheduler sees it: leases by sequence id, counted in blocks and positions.

    With a prefix cache, a lease may start with cached blocks adopted from the longest cached prefix of
    its tokens (read only, shared with other leases); without one, `peek` is `(0, 0)` and `publish`
    does nothing.
    """

    def peek(self, tokens: Sequence[int], salt: str | None) -> tuple[int, int]:
        """`(blocks allocate would adopt for these tokens, how many of them no lease references now)`."""
        ...

    def allocate(self, positions: int, tokens: Sequence[int], salt: str | None,
                 window: WindowPolicy | None = None, every: int | None = None) -> int:
        """Lease room for `positions` positions, adopting what `peek` said; the new sequence's id. Raises a
        typed `DecodeError` (`KvPoolExhausted`, `KvAllocationFailed`) when the store cannot.

        With a `window` the lease holds `positions` at once and slides: the pages behind the window go back
        to it as the sequence grows and hold its new positions, so it writes past `positions`. A sliding
        lease adopts nothing and publishes nothing (`tokens` is empty). `every` (prompt + max_tokens,
        default `positions`) is what a lease holds in the KV groups that keep every position (a model's
        global layers, when others slide)."""
        ...

    def publish(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Offer the sequence's full computed blocks (`tokens` from position 0) to the prefix cache (none
        for a sliding lease)."""
        ...

    def release(self, seq_id: int) -> int:
        """End the lease; how many blocks no lease references any more (what the ledger gets back)."""
        ...

    def length(self, seq_id: int) -> int:
        """Positions whose KV the store holds for this sequence (adopted ones included)."""
        ...

    def blocks_of(self, seq_id: int) -> Sequence[int]: ...

    def window_pool(self) -> tuple[int, int] | None:
        """`(blocks the global KV groups hold, blocks the local ones hold)` for a store with both kinds
        (a hybrid model), else None."""
        ...
