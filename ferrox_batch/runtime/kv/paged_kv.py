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
there is no growing store (see `runtime.kv.memory` for the size a batcher gets
when nobody chose one).

With `prefix_cache=True` a sequence adopts the cached blocks of its prompt's
longest cached prefix instead of computing them, and publishes its own full
blocks when it is freed (`runtime.kv.block_pool` keeps which block holds what).

A sequence leased with a `WindowPolicy` slides (`runtime.kv.sliding`): it
leases the blocks of what it holds at once, gives the pages behind its window
back to its own spares before each write (its table marks them `RELEASED`) and
writes its new positions into them, so it may write far more positions than
it holds. Its pages are recycled in place, so it adopts and publishes nothing.
Every write goes through `before_write`, which slides and installs pages, or
refuses a write past an ordinary lease.

The store is not thread-safe: only the worker thread (or a single test
thread) drives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

from ferrox_batch.admission.block_budget import blocks_for
from ferrox_batch.admission.kv import KvElem, KvShape
from ferrox_batch.admission.window import WindowPolicy
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.kv.block_pool import BlockAllocator, BlockPool, BlockPoolExhausted, block_keys
from ferrox_batch.runtime.kv.sliding import SlidingPages

__all__ = ["BlockAllocator", "BlockPoolExhausted", "PagedKvConfig", "PagedKvStore", "SeqKv"]


@dataclass(slots=True)
class SeqKv:
    """One sequence's block table and how many positions it has written (adopted ones included).

    `blocks` are every block its lease holds (what the ledger counts); `table` maps its pages to them (a
    sliding one's pages behind the window are `sliding.RELEASED`, and its spare blocks are in no page)."""

    blocks: list[int]
    capacity: int  # positions its blocks hold at once
    length: int = 0
    table: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    salt: str | None = None  # the prefix-cache namespace it adopts from and publishes to
    sliding: SlidingPages | None = None  # how its pages slide; None: every position keeps its page


class PagedKvStore:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        prefix_cache: bool = False,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.config = config
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, caching=prefix_cache)
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

    @staticmethod
    def kv_shape(config: ModelConfig, dtype: torch.dtype) -> KvShape:
        """What one position costs in a store holding `dtype` (fp32, or a 16-bit type)."""
        return KvShape.from_config(config, KvElem.F32 if dtype == torch.float32 else KvElem.F16)

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
        prefix_cache: bool = False,
    ) -> "PagedKvStore":
        """As many whole blocks as fit in `memory_bytes` (at least one, else a clear error)."""
        num_blocks = cls.blocks_in_memory(config, memory_bytes, block_size, dtype)
        if num_blocks < 1:
            raise ValueError(
                f"a KV memory budget of {memory_bytes} bytes holds no block of {block_size} "
                f"positions ({cls.bytes_per_block(config, block_size, dtype)} bytes each)"
            )
        return cls(config, num_blocks, block_size, device=device, dtype=dtype, prefix_cache=prefix_cache)

    @property
    def allocator(self) -> BlockAllocator:
        return self.pool.allocator

    @property
    def prefix_cache(self) -> bool:
        return self.pool.caching

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new lease can take: free ones and cached ones nobody references."""
        return self.pool.num_free

    def _adoptable_keys(self, prefix: Sequence[int], salt: str | None) -> list[bytes]:
        # At most the blocks before the prompt's last token: that token is always computed here, so a
        # fully cached prompt still gets the logits its first sampled token comes from.
        return block_keys(prefix, self.block_size, salt, limit=max(0, len(prefix) - 1) // self.block_size)

    def peek(self, prefix: Sequence[int], salt: str | None = None) -> tuple[int, int]:
        """`(blocks add_sequence would adopt for this prefix, how many of them nobody references now)`."""
        if not self.pool.caching:
            return 0, 0
        adopted = self.pool.match(self._adoptable_keys(prefix, salt))
        return len(adopted), self.pool.unreferenced(adopted)

    def add_sequence(self, seq_id: Hashable, max_positions: int, prefix: Sequence[int] = (),
                     salt: str | None = None, *, window: WindowPolicy | None = None) -> list[int]:
        """Lease `blocks_for(max_positions)` blocks to a new sequence; raises `BlockPoolExhausted`.

        With the prefix cache, the leading blocks of `prefix` that are cached (in the namespace `salt`)
        are adopted instead of leased fresh: the sequence starts with them written (`length`). With a
        `window` (pages of this store's block size) the sequence slides and `max_positions` is what it holds
        at once; it adopts nothing (a `prefix` is an error).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds KV blocks")
        if not isinstance(max_positions, int) or isinstance(max_positions, bool) or max_positions < 0:
            raise ValueError(f"max_positions must be a non-negative integer, got {max_positions!r}")
        if window is not None and window.page_size != self.block_size:
            raise ValueError(f"a sliding lease's pages ({window.page_size} positions) must be this store's "
                             f"blocks ({self.block_size})")
        if window is not None and window.sliding_window != self.config.uniform_window:
            # A layer that looked further back would read the pages it gives back.
            raise ValueError(f"a lease slides only by the window every layer of the model slides by "
                             f"({self.config.uniform_window}), not {window.sliding_window}")
        if window is not None and len(prefix):
            raise ValueError("a sliding lease adopts no cached prefix: it recycles its own pages")
        adopted = self.pool.match(self._adoptable_keys(prefix, salt)) if self.pool.caching else []
        needed = blocks_for(max_positions, self.block_size)
        blocks = self.pool.acquire(adopted, max(0, needed - len(adopted)))
        sliding = None if window is None else SlidingPages(window, spare=blocks[::-1])
        try:
            table = torch.tensor(blocks if sliding is None else [], dtype=torch.long, device=self.device)
        except BaseException:  # the device could not hold the table: the blocks were never leased
            self.pool.release(blocks)
            raise
        self._seqs[seq_id] = SeqKv(blocks, len(blocks) * self.block_size, len(adopted) * self.block_size, table,
                                   salt, sliding)
        return list(blocks)

    def before_write(self, seq_id: Hashable, count: int) -> SeqKv:
        """Make room for the sequence's next `count` positions: a sliding one slides and installs their
        pages; raises ValueError, changing nothing, past what its lease holds."""
        seq = self.seq(seq_id)
        end = seq.length + count
        if seq.sliding is None:
            if end > seq.capacity:
                raise ValueError(f"sequence {seq_id!r} would reach {end} positions but its KV lease "
                                 f"holds {seq.capacity}")
            return seq
        try:
            changed = seq.sliding.before_write(seq.length, count)
        except ValueError as short:
            raise ValueError(f"sequence {seq_id!r} {short}") from None
        # Also when an earlier rebuild failed part way: a table short of pages must never be read.
        if changed or seq.table.numel() != len(seq.sliding.pages):
            seq.table = torch.tensor(seq.sliding.pages, dtype=torch.long, device=self.device)
        return seq

    def publish(self, seq_id: Hashable, tokens: Sequence[int]) -> int:
        """Cache the full blocks of `tokens` (the sequence's tokens from position 0) that its KV holds
        (none of a sliding sequence's: its pages are recycled in place)."""
        seq = self.seq(seq_id)
        if not self.pool.caching or seq.sliding is not None:
            return 0
        keys = block_keys(tokens, self.block_size, seq.salt, limit=seq.length // self.block_size)
        return self.pool.publish(seq.blocks, keys)

    def free_sequence(self, seq_id: Hashable) -> int:
        """Drop the sequence; how many of its blocks nobody references any more (what the ledger gets back)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} holds no KV blocks")
        return self.pool.release(seq.blocks)

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
        """Distinct blocks the live sequences reference (a shared prefix block counts once)."""
        return self.pool.num_referenced


@dataclass(frozen=True, slots=True)
class PagedKvConfig:
    """A paged KV store a batcher is to use instead of allocating its own
    (`ContinuousBatcher.spawn_with_config_paged`): a store shared with another
    user, or one sized by the caller. `engine.wiring` checks it against the
    batcher's config (same block size, at least `kv_blocks` blocks)."""

    store: PagedKvStore
