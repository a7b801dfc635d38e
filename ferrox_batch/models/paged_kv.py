"""The paged KV store: per-layer pools of fixed-size blocks, a block allocator and per-sequence block tables.

Why paged: the scheduler's `BlockBudget` prices every request in blocks of
`block_size` positions. The store hands out exactly that many blocks when a
sequence is admitted (`add_sequence`) and takes them back when it is freed,
so the ledger and the memory it stands for can never disagree: the ledger's
arithmetic (`blocks_for`) is the store's arithmetic.

Layout: one pool `[num_layers, num_blocks * block_size, 2, num_kv_heads,
head_dim]` holding K (`[..., 0, ...]`) and V side by side, so that one
`index_copy_` writes a layer's new keys and values and one `index_select`
gathers a batch's whole context (measured: a flat `index_select` is about
1.5x faster than advanced indexing here, and one gather beats two). Position
`p` of a sequence lives in slot `table[p // block_size] * block_size + p %
block_size`. No per-sequence Python work happens inside a layer.

The pool is allocated whole, at its bounded size, when the store is made:
there is no growing store (see `models.memory` for the size a batcher gets
when nobody chose one).

The store is not thread-safe: only the worker thread (or a single test
thread) drives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable

import torch

from ferrox_batch.batch.block_budget import blocks_for
from ferrox_batch.errors import KvPoolExhausted
from ferrox_batch.models.config import ModelConfig


class BlockPoolExhausted(KvPoolExhausted):
    """The store has fewer free blocks than a sequence needs (a 503-like, retryable refusal)."""

    _fields = ("requested", "free")

    def __init__(self, requested: int, free: int) -> None:
        super().__init__()
        self.requested = requested
        self.free = free

    def __str__(self) -> str:  # keep the upstream wording, then the numbers
        return f"{super().__str__()} (needed {self.requested} blocks, {self.free} free)"


class BlockAllocator:
    """Hands out block ids; never the same block twice until it is returned.

    Returned blocks are leased again first, most recently returned first, and a
    block never leased before is taken only when none are waiting. A large,
    uninitialised CPU pool therefore only becomes resident as far as the peak
    use reaches, and the allocator costs nothing per block it has never seen.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._returned: list[int] = []
        self._fresh = 0  # blocks [_fresh, num_blocks) were never leased
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._returned) + self.num_blocks - self._fresh

    def allocate(self, count: int) -> list[int]:
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"block count must be a non-negative integer, got {count!r}")
        if count > self.num_free:
            raise BlockPoolExhausted(count, self.num_free)
        reused = min(count, len(self._returned))
        blocks = [self._returned.pop() for _ in range(reused)]
        blocks += range(self._fresh, self._fresh + count - reused)
        self._fresh += count - reused
        self._used.update(blocks)
        return blocks

    def release(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        for block in blocks:
            if block not in self._used:
                raise ValueError(f"block {block} is not allocated (double free or foreign block)")
        for block in blocks:
            self._used.remove(block)
        self._returned.extend(reversed(blocks))


@dataclass(slots=True)
class SeqKv:
    """One sequence's block table and how many positions it has written."""

    blocks: list[int]
    capacity: int
    length: int = 0
    table: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))


class PagedKvStore:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.config = config
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.device = torch.device(device)
        self.dtype = dtype
        shape = (config.num_layers, num_blocks * block_size, 2, config.num_kv_heads, config.head_dim)
        # Uninitialised, so a large pool costs no resident memory until blocks are used, and
        # never cleared: every reader reads only positions its own sequence has written
        # (`batch_inputs` clamps the decode gather to them), so stale or never-written memory,
        # NaN included, never reaches attention. Zeroing each lease instead cost the worker
        # 6.5 ms per admitted 1,088-position request (SmolLM2 bf16), 42 ms at 8,192.
        self.kv = torch.empty(shape, device=self.device, dtype=dtype)
        self._seqs: dict[Hashable, SeqKv] = {}

    @classmethod
    def bytes_per_block(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem

    @classmethod
    def blocks_in_memory(cls, config: ModelConfig, memory_bytes: int, block_size: int, dtype: torch.dtype) -> int:
        """Whole blocks of `block_size` positions that `memory_bytes` holds for this model (may be 0)."""
        return int(memory_bytes // cls.bytes_per_block(config, block_size, dtype))

    @classmethod
    def from_memory_budget(
        cls,
        config: ModelConfig,
        memory_bytes: int,
        block_size: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> "PagedKvStore":
        """As many whole blocks as fit in `memory_bytes` (at least one, else a clear error)."""
        num_blocks = cls.blocks_in_memory(config, memory_bytes, block_size, dtype)
        if num_blocks < 1:
            raise ValueError(
                f"a KV memory budget of {memory_bytes} bytes holds no block of {block_size} "
                f"positions ({cls.bytes_per_block(config, block_size, dtype)} bytes each)"
            )
        return cls(config, num_blocks, block_size, device=device, dtype=dtype)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_for(self, positions: int) -> int:
        return blocks_for(positions, self.block_size)

    def add_sequence(self, seq_id: Hashable, max_positions: int) -> list[int]:
        """Lease `blocks_for(max_positions)` blocks to a new sequence; raises `BlockPoolExhausted`."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds KV blocks")
        if not isinstance(max_positions, int) or isinstance(max_positions, bool) or max_positions < 0:
            raise ValueError(f"max_positions must be a non-negative integer, got {max_positions!r}")
        blocks = self.allocator.allocate(self.blocks_for(max_positions))
        try:
            table = torch.tensor(blocks, dtype=torch.long, device=self.device)
        except BaseException:  # the device could not hold the table: the blocks were never leased
            self.allocator.release(blocks)
            raise
        self._seqs[seq_id] = SeqKv(blocks, len(blocks) * self.block_size, 0, table)
        return list(blocks)

    def free_sequence(self, seq_id: Hashable) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} holds no KV blocks")
        self.allocator.release(seq.blocks)

    def has_sequence(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def seq(self, seq_id: Hashable) -> SeqKv:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} holds no KV blocks") from None

    def seq_len(self, seq_id: Hashable) -> int:
        """Positions written: the only source of truth for a sequence's next position."""
        return self.seq(seq_id).length

    def seq_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def blocks_held(self) -> int:
        return sum(len(s.blocks) for s in self._seqs.values())


@dataclass(frozen=True, slots=True)
class PagedKvConfig:
    """A paged KV store a batcher is to use instead of allocating its own
    (`ContinuousBatcher.spawn_with_config_paged`): a store shared with another
    user, or one sized by the caller. `batch.wiring` checks it against the
    batcher's config (same block size, at least `kv_blocks` blocks)."""

    store: PagedKvStore
