"""Which KV block holds what: the free blocks, the blocks sequences reference, and the prefix cache.

Pure Python over block ids (no torch), so its arithmetic is property-tested
on its own; `paged_kv.PagedKvStore` owns one and keeps the tensors.

A block is in exactly one of three states:
* free: never leased, or given back holding nothing anyone can reuse
  (`BlockAllocator`);
* referenced: in the block table of at least one live sequence (`refs`);
* cached and unreferenced: it holds a published prefix block that no live
  sequence uses; it stays until its space is needed (`evictable`, oldest
  first).

**The prefix cache.** A full block of tokens is keyed by a hash chained over
its tokens and its parent's key, rooted in a namespace (the request's
`cache_salt`), so a key names the whole prefix up to the block's end, not
just the block's own tokens: two prompts share a block only when they agree
on every token before it too. blake2b (16 bytes) makes a collision as unlikely
as a hardware fault, and is fast in C; chaining on block *ids* instead would
let a reused id match stale children. A sequence publishes its full blocks
when it finishes (`publish`); a later sequence adopts the longest run of
leading blocks whose keys are cached (`match`, `acquire`), reading them and
never writing them: its own writes start after the adopted positions.

**Eviction.** Blocks nobody references stay cached until an allocation finds
no free block; then the least recently released go first. A sequence's blocks
are released tail first, so within one sequence a child block is evicted
before its parent (a parent evicted first would leave its children
unreachable but still holding space).

Why this shape (and not a radix tree): a hash per full block gives the same
sharing for block-aligned prefixes with a flat dict, and the ledger only ever
counts whole blocks. It is the design of vLLM's v1 block pool and nano-vllm's
block manager; SGLang's radix tree shares at token granularity, which a
paged store of 16-position blocks cannot use below a block anyway.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from ferrox_batch.errors import KvPoolExhausted

BlockKey = bytes


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


def block_keys(tokens: Sequence[int], block_size: int, salt: str | None, limit: int | None = None) -> list[BlockKey]:
    """The chained key of each full block of `tokens` (at most `limit` of them), in the namespace `salt`."""
    full = len(tokens) // block_size
    if limit is not None:
        full = min(full, limit)
    parent = hashlib.blake2b(b"ferrox-prefix\0" + (salt or "").encode(), digest_size=16).digest()
    keys = []
    for i in range(full):
        chunk = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        keys.append(parent)
    return keys


class BlockPool:
    """Free, referenced and cached blocks (module docstring). `caching=False` never caches anything."""

    def __init__(self, num_blocks: int, *, caching: bool) -> None:
        self.allocator = BlockAllocator(num_blocks)
        self.caching = caching
        self.refs: dict[int, int] = {}  # referenced block -> how many sequences reference it
        self.index: dict[BlockKey, int] = {}  # published key -> block
        self.key_of: dict[int, BlockKey] = {}  # cached block -> its key
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached and unreferenced, oldest first

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones nobody references."""
        return self.allocator.num_free + len(self.evictable)

    @property
    def num_referenced(self) -> int:
        return len(self.refs)

    @property
    def num_cached(self) -> int:
        return len(self.key_of)

    def match(self, keys: Sequence[BlockKey]) -> list[int]:
        """The cached blocks of the longest leading run of `keys` (read only)."""
        blocks = []
        if self.caching:
            for key in keys:
                block = self.index.get(key)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def unreferenced(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` no sequence references now (adopting them takes them out of the free count)."""
        return sum(1 for block in blocks if block not in self.refs)

    def acquire(self, adopted: Sequence[int], fresh: int) -> list[int]:
        """A block table: reference the `adopted` cached blocks, then allocate `fresh` new ones after them."""
        if fresh > self.num_free - self.unreferenced(adopted):
            raise BlockPoolExhausted(fresh + self.unreferenced(adopted), self.num_free)
        for block in adopted:
            if block in self.refs:
                self.refs[block] += 1
            else:
                del self.evictable[block]
                self.refs[block] = 1
        new = self._allocate(fresh)
        for block in new:
            self.refs[block] = 1
        return [*adopted, *new]

    def _allocate(self, count: int) -> list[int]:
        taken = self.allocator.allocate(min(count, self.allocator.num_free))
        while len(taken) < count:  # evict the least recently released cached block
            block, _ = self.evictable.popitem(last=False)
            del self.index[self.key_of.pop(block)]
            taken.append(block)
        return taken

    def release(self, table: Sequence[int]) -> int:
        """Drop one sequence's references (tail first); how many blocks nobody references any more."""
        unreferenced = 0
        for block in reversed(table):
            count = self.refs[block] - 1
            if count:
                self.refs[block] = count
                continue
            del self.refs[block]
            unreferenced += 1
            if block in self.key_of:
                self.evictable[block] = None
            else:
                self.allocator.release([block])
        return unreferenced

    def publish(self, table: Sequence[int], keys: Sequence[BlockKey]) -> int:
        """Cache `table[i]` under `keys[i]` (full, computed blocks only); how many blocks were newly cached.

        A key already cached under another block keeps that block (whoever published first wins; this
        sequence's copy stays private and is freed with it).
        """
        if not self.caching:
            return 0
        added = 0
        for block, key in zip(table, keys):
            if key in self.index or block in self.key_of:
                continue
            self.index[key] = block
            self.key_of[block] = key
            added += 1
        return added
