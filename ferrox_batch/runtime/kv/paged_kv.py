"""The paged KV store: per-layer pools of fixed-size blocks, a block allocator and per-sequence block tables.

Why paged: the scheduler's `BlockBudget` prices every request in blocks of
`block_size` positions. The store hands out exactly that many blocks when a
sequence is admitted (`add_sequence`) and takes them back when it is freed,
so the ledger and the memory it stands for can never disagree: the ledger's
arithmetic (`blocks_for`) is the store's arithmetic.

Layout: the layers are split into KV groups of one cache kind each (`admission.kv_groups`, the kinds from
each layer's window, `admission.cache_kinds`: a model whose layers are all of one kind, full attention or
one sliding window, is one group of all its layers), and one pool
`[group_size, num_blocks * block_size, 2, num_kv_heads, head_dim]` of uniform blocks serves every group
(each group viewing it with its own head shape where the groups' differ: `pool_layout`): a block holds
`group_size` layers' K (`[..., 0, ...]`) and V for `block_size` positions, and layer `i` reads and writes
`layer_pool(i)` (its group's pool at its index within the group) through its group's tables. Only the
layers that write K/V have a place; a layer that attends over another's reads that one's. K and V side by
side, so that one `index_copy_` writes a layer's new keys and values and one `index_select` gathers a
batch's whole context (measured: a flat `index_select` is about 1.5x faster than advanced indexing here,
and one gather beats two). Position `p` of a sequence lives in slot `table[p // block_size] * block_size
+ p % block_size` of its group's table. No per-sequence Python work happens inside a layer.

The pool is allocated whole, at its bounded size, when the store is made:
there is no growing store (see `runtime.kv.memory` for the size a batcher gets
when nobody chose one).

With `prefix_cache=True` a sequence adopts the cached blocks of its prompt's
longest cached prefix instead of computing them, and publishes its own full
blocks when it is freed (`runtime.kv.block_pool` keeps which block holds what).

A sequence leased with a `WindowPolicy` slides the groups whose kind slides by it (`runtime.kv.sliding`):
each leases the blocks of what it holds at once, gives the pages behind its window back to its own spares
before each write (its table marks them `RELEASED`) and writes its new positions into them, so it may write
far more positions than it holds; its full-attention groups hold every position. Its pages are recycled in
place, so it adopts and publishes nothing. Every write goes through `before_write`, which slides and
installs pages, or refuses a write past an ordinary lease. Each group's lease takes exactly what
`admission.kv_groups.GroupPricing` priced it at (`cache_kinds.lease_blocks`, the one rule both use), so
the ledger equals the store.

The store is not thread-safe: only the worker thread (or a single test
thread) drives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from ferrox_batch.admission.cache_kinds import FULL_ATTENTION, SLIDING_WINDOW, layer_kind, lease_blocks
from ferrox_batch.admission.kv import KvElem, KvShape
from ferrox_batch.admission.kv_groups import KvGroups
from ferrox_batch.admission.window import WindowPolicy
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.kv.block_pool import BlockAllocator, BlockPool, BlockPoolExhausted, block_keys
from ferrox_batch.runtime.kv.group_lease import GroupTable, SeqKv
from ferrox_batch.runtime.kv.pool_layout import block_width, group_head_shapes, pool_views, position_width
from ferrox_batch.runtime.kv.sliding import SlidingPages

__all__ = ["BlockAllocator", "BlockPoolExhausted", "PagedKvConfig", "PagedKvStore", "SeqKv", "model_groups"]


def model_groups(config: ModelConfig) -> KvGroups:
    """The KV groups of `config`'s layers that write K/V (`ModelConfig.kv_layers`: a layer that reads another's
    holds none), each of the kind its window makes it (`cache_kinds.layer_kind`); the groups number those
    layers in order (`ModelConfig.kv_index`)."""
    return KvGroups.of([layer_kind(config.window(layer)) for layer in config.kv_layers])


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
        self.groups = model_groups(config)
        self.pool = BlockPool(num_blocks, caching=prefix_cache)
        self.device = torch.device(device)
        self.dtype = dtype
        # Uninitialised, so a large pool costs no resident memory until blocks are used, and
        # never cleared: every reader reads only positions its own sequence has written
        # (`batch_inputs` clamps the decode gather to them), so stale or never-written memory,
        # NaN included, never reaches attention. Zeroing each lease instead cost the worker
        # 6.5 ms per admitted 1,088-position request (SmolLM2 bf16), 42 ms at 8,192.
        #: Per group, how many of its own blocks one block spans (1 but where the groups' head shapes differ),
        #: and its pool `[group_size, slots, 2, kv_heads, head_dim]` (`pool_layout`).
        self.block_scale, self.pools = pool_views(config, self.groups, num_blocks, block_size, self.device, dtype)
        #: The first group's pool: every group's where the layers are of one head shape.
        self.kv = self.pools[0]
        self._layer_slots = tuple(self.groups.slots[config.kv_index(layer)] for layer in range(config.num_layers))
        self._seqs: dict[Hashable, SeqKv] = {}
        # Blocks the live sequences' groups reference, each counted once, per kind label (`_label[k]` is
        # group k's index in `_labels`): plain ints in a list that never changes size, so another thread
        # may read them (`blocks_by_label`, `blocks_by_kind`) while the worker drives the store.
        self._labels = tuple(dict.fromkeys((FULL_ATTENTION, SLIDING_WINDOW,
                                            *(kind.label for kind in self.groups.kinds))))
        self._label = tuple(self._labels.index(kind.label) for kind in self.groups.kinds)
        self._held = [0] * len(self._labels)

    def layer_slot(self, layer: int) -> tuple[int, int]:
        """`(group, index within it)` of the K/V model layer `layer` attends over (a sharing layer's source's)."""
        return self._layer_slots[layer]

    def layer_pool(self, layer: int) -> torch.Tensor:
        """The pool `[slots, 2, kv_heads, head_dim]` of the K/V `layer` attends over."""
        group, slot = self._layer_slots[layer]
        return self.pools[group][slot]

    @staticmethod
    def kv_shape(config: ModelConfig, dtype: torch.dtype) -> KvShape:
        """What one position costs in a store holding `dtype` (fp32, or a 16-bit type): over the layers that
        write K/V, each as wide as a block's layer slot holds a position (`pool_layout.position_width`)."""
        elem = KvElem.F32 if dtype == torch.float32 else KvElem.F16
        if config.kv_layers == tuple(range(config.num_layers)) and config.global_head_dim is None:
            return KvShape.from_config(config, elem)
        return KvShape(len(config.kv_layers), position_width(config), elem)

    @classmethod
    def bytes_per_block(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """A block holds one KV group's layers (`model_groups(config).size`) for `block_size` positions, each
        layer slot as wide as the widest group's (`block_width`)."""
        elem = torch.empty((), dtype=dtype).element_size()
        groups = model_groups(config)
        return groups.size * block_width(group_head_shapes(config, groups), block_size) * elem

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

    def blocks_by_kind(self) -> tuple[int, int]:
        """`(blocks the global groups reference, blocks the local groups reference)`, each once: the
        full-attention and the sliding-window groups' (`blocks_by_label`)."""
        return self._held[0], self._held[1]

    def blocks_by_label(self) -> dict[str, int]:
        """Blocks each cache kind's groups reference (by its label, 0 where none), each once."""
        return dict(zip(self._labels, self._held))

    def _keys(self, tokens: Sequence[int], salt: str | None, group: int, limit: int) -> list[bytes]:
        # Each group caches in its own namespace (the same tokens are other layers' K/V there); a store of
        # one group keeps `salt`'s own, as before groups.
        if len(self.groups.layers) > 1:
            salt = f"{salt or ''}\0kv-group-{group}"
        return block_keys(tokens, self.block_size, salt, limit=limit)

    def _adoptable_keys(self, prefix: Sequence[int], salt: str | None, group: int) -> list[bytes]:
        # At most the blocks before the prompt's last token: that token is always computed here, so a
        # fully cached prompt still gets the logits its first sampled token comes from.
        return self._keys(prefix, salt, group, max(0, len(prefix) - 1) // self.block_size)

    def _matches(self, prefix: Sequence[int], salt: str | None) -> list[list[int]]:
        """Each group's cached blocks for `prefix`, cut to the run every group has."""
        if not self.pool.caching or not len(prefix):
            return [[] for _ in self.groups.layers]
        found = [self.pool.match(self._adoptable_keys(prefix, salt, group)) for group in range(len(self.groups.layers))]
        run = min(len(blocks) for blocks in found)
        return [blocks[:run] for blocks in found]

    def peek(self, prefix: Sequence[int], salt: str | None = None) -> tuple[int, int]:
        """`(blocks add_sequence would adopt for this prefix, how many of them nobody references now)`."""
        matches = self._matches(prefix, salt)
        return sum(len(m) for m in matches), sum(self.pool.unreferenced(m) for m in matches)

    def add_sequence(self, seq_id: Hashable, max_positions: int, prefix: Sequence[int] = (),
                     salt: str | None = None, *, window: WindowPolicy | None = None,
                     every: int | None = None) -> list[int]:
        """Lease a new sequence its blocks in every group; raises `BlockPoolExhausted`, leasing nothing.

        Each group that keeps every position leases `blocks_for(every)` blocks (`every` defaults to
        `max_positions`). Without a `window` so does every other group; with the prefix cache, the leading
        blocks of `prefix` cached in every group (in the namespace `salt`) are adopted instead of leased
        fresh: the sequence starts with them written (`length`). With a `window` (pages of this store's
        block size) the groups whose kind slides by it (the local groups) slide and lease
        `blocks_for(max_positions)`, what each holds at once;
        such a sequence adopts nothing (a `prefix` is an error). The blocks are what
        `GroupPricing.blocks` prices; all of them are returned, in group order.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds KV blocks")
        for name, value in (("max_positions", max_positions), ("every", max_positions if every is None else every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if window is not None:
            self._check_window(window, prefix)
        positions = max_positions if every is None else every
        held = max_positions if window is not None else positions
        adopted = self._matches(prefix, salt)
        groups: list[GroupTable] = []
        counts = [0] * len(self._held)
        try:
            for group, kind in enumerate(self.groups.kinds):
                needed = lease_blocks(kind, window, positions, held, self.block_size)
                new_refs = self.pool.unreferenced(adopted[group]) + max(0, needed - len(adopted[group]))
                blocks = self.pool.acquire(adopted[group], max(0, needed - len(adopted[group])))
                counts[self._label[group]] += new_refs
                slides = window is not None and kind.slides_by(window)
                sliding = SlidingPages(window, spare=blocks[::-1]) if slides else None
                groups.append(GroupTable(blocks, torch.empty(0, dtype=torch.long), sliding))
                groups[-1].table = torch.tensor(blocks if sliding is None else [], dtype=torch.long,
                                                device=self.device)
        except BaseException:  # a group the pool or the device could not hold: nothing was leased
            for group in groups:
                self.pool.release(group.blocks)
            raise
        capacity = len(groups[0].blocks) * self.block_size if groups[0].sliding is None else positions
        run = len(adopted[0])
        self._seqs[seq_id] = SeqKv(groups, capacity, run * self.block_size, salt)
        for index, count in enumerate(counts):
            self._held[index] += count
        return list(self._seqs[seq_id].blocks)

    def _check_window(self, window: WindowPolicy, prefix: Sequence[int]) -> None:
        if window.page_size != self.block_size:
            raise ValueError(f"a sliding lease's pages ({window.page_size} positions) must be this store's "
                             f"blocks ({self.block_size})")
        slides = any(kind.slides_by(window) for kind in self.groups.kinds)
        if not slides or window.sliding_window != self.config.sliding_window:
            # A layer that looked further back would read the pages it gives back.
            raise ValueError(f"a lease slides only by the window its local layers slide by "
                             f"({self.config.sliding_window if self.groups.local_groups else None}), "
                             f"not {window.sliding_window}")
        if len(prefix):
            raise ValueError("a sliding lease adopts no cached prefix: it recycles its own pages")

    def before_write(self, seq_id: Hashable, count: int) -> SeqKv:
        """Make room for the sequence's next `count` positions: its sliding groups slide and install their
        pages; raises ValueError, changing nothing, past what its lease holds."""
        seq = self.seq(seq_id)
        seq.before_write(seq_id, count, self.device)
        return seq

    def publish(self, seq_id: Hashable, tokens: Sequence[int]) -> int:
        """Cache the full blocks of `tokens` (the sequence's tokens from position 0) that its KV holds, in
        every group (none of a sliding sequence's: its pages are recycled in place)."""
        seq = self.seq(seq_id)
        if not self.pool.caching or seq.sliding is not None:
            return 0
        published = 0
        for index, group in enumerate(seq.groups):
            keys = self._keys(tokens, seq.salt, index, seq.length // self.block_size)
            published += self.pool.publish(group.blocks, keys)
        return published

    def free_sequence(self, seq_id: Hashable) -> int:
        """Drop the sequence; how many of its blocks nobody references any more (what the ledger gets back)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} holds no KV blocks")
        returned = 0
        for group, label in zip(seq.groups, self._label):
            back = self.pool.release(group.blocks)
            self._held[label] -= back
            returned += back
        return returned

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
