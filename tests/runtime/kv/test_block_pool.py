"""The KV block pool and its prefix cache (`runtime.kv.block_pool`), property-tested on block ids alone.

Pins:
* the ledger: under any interleaving of starts (adopting the cached prefix of the prompt, capped so its last
  token is computed, and reserving `fresh + unreferenced(adopted)` only when the model ledger has room, as the
  scheduler does), live publishes and finishes (a failed one publishes nothing), the ledger's reservation
  equals the store's referenced blocks, every block is in exactly one state, the pool refuses exactly when
  the ledger would (and a refusal changes nothing), refcounts are the number of live tables holding a block,
  the cache index is a bijection, a block in use is never handed out fresh or evicted, allocation evicts the
  least recently released cached blocks, and every block a sequence adopts or the cache names holds the KV
  its key says (a content model written only by the sequence computing it);
* block keys: chained over the prefix (a prefix's keys lead its extensions'), namespaced by the salt, changed
  from a differing token onwards, capped by `limit`;
* eviction order: free blocks first, then the least recently released cached block, a tail before its parent;
* a publishing race: whoever publishes a key first keeps it, the other's copy is freed, both release cleanly;
* `caching=False`: nothing is matched or cached, and the pool hands out exactly what the plain allocator does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.admission.block_budget import blocks_for
from ferrox_batch.runtime.kv.block_pool import BlockAllocator, BlockPool, BlockPoolExhausted, block_keys

SALTS = (None, "tenant-a", "tenant-b")


def adoptable_keys(prompt: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """What `PagedKvStore` offers to `match`: the prompt's full blocks before its last token."""
    return block_keys(prompt, block_size, salt, limit=max(0, len(prompt) - 1) // block_size)


def snapshot(pool: BlockPool) -> tuple:
    return (dict(pool.refs), dict(pool.index), dict(pool.key_of), list(pool.evictable), pool.allocator.num_free)


# ----------------------------------------------------------------------------- the ledger model


@dataclass
class Live:
    table: list[int]
    adopted: int  # leading blocks of `table` adopted from the cache
    keys: list[bytes]  # the key of each full block of its tokens (prompt and generated) that its table holds
    computed: int  # leading blocks whose KV is written (the adopted ones included)


class Ledger:
    """A `BlockPool` driven the way the scheduler and `PagedKvStore` drive it, next to a model of both."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, caching=True)
        self.total = num_blocks
        self.block_size = block_size
        self.reserved = 0  # the scheduler's ledger (BlockBudget) in blocks
        self.live: list[Live] = []
        self.prompts: list[list[int]] = []
        # What each block physically holds: the key of the block of KV last written into it, or junk.
        self.content: dict[int, object] = {}
        self.junk = 0

    def write(self, seq: Live, upto: int) -> None:
        for i in range(seq.computed, upto):
            self.content[seq.table[i]] = seq.keys[i]
        seq.computed = max(seq.computed, upto)

    def start(self, prompt: list[int], generated: list[int], slack: int, salt: str | None) -> None:
        pool, bs = self.pool, self.block_size
        wanted = adoptable_keys(prompt, bs, salt)
        adopted = pool.match(wanted)
        assert len(adopted) <= len(wanted) <= max(0, len(prompt) - 1) // bs  # the last token is computed
        assert len(adopted) == len(wanted) or wanted[len(adopted)] not in pool.index  # the longest run
        for block, key in zip(adopted, wanted):
            assert pool.index[key] == block
        tokens = prompt + generated
        positions = len(tokens) + slack
        fresh = blocks_for(positions, bs) - len(adopted)
        assert fresh >= 0
        need = fresh + pool.unreferenced(adopted)
        if self.reserved + need > self.total:  # the ledger says wait: the pool would refuse too
            before = snapshot(pool)
            with pytest.raises(BlockPoolExhausted):
                pool.acquire(adopted, fresh)
            assert snapshot(pool) == before, "a refused acquire changed the pool"
            return
        in_use = {b for s in self.live for b in s.table}
        older = [b for b in pool.evictable if b not in adopted]
        evicted = older[:max(0, fresh - pool.allocator.num_free)]
        table = pool.acquire(adopted, fresh)
        self.reserved += need
        assert table[:len(adopted)] == adopted and len(table) == len(adopted) + fresh
        new = table[len(adopted):]
        assert not set(new) & in_use, "a block in use was handed out fresh"
        # Free blocks go first; then the least recently released cached ones, and nothing else leaves the cache.
        assert set(evicted) <= set(new)
        assert not set(new) & set(pool.key_of)
        assert set(older[len(evicted):]) <= set(pool.key_of)
        keys = block_keys(tokens, bs, salt, limit=len(table))
        assert keys[:len(adopted)] == wanted[:len(adopted)]
        self.live.append(Live(table, len(adopted), keys, len(adopted)))
        self.prompts.append(prompt)

    def publish(self, seq: Live, advance: int) -> None:
        pool = self.pool
        self.write(seq, min(len(seq.keys), seq.computed + advance))
        keys = seq.keys[:seq.computed]
        expected = sum(1 for b, k in zip(seq.table, keys) if k not in pool.index and b not in pool.key_of)
        assert pool.publish(seq.table, keys) == expected
        for key in keys:
            assert key in pool.index  # someone (this sequence or an earlier one) holds every published key

    def finish(self, seq: Live, failed: bool, advance: int) -> None:
        pool = self.pool
        if failed:  # partial KV, never offered to the cache; the rest of its blocks hold junk
            self.write(seq, min(len(seq.keys), seq.computed + advance))
            for block in seq.table[seq.computed:]:
                self.junk += 1
                self.content[block] = ("junk", self.junk)
        else:
            self.publish(seq, len(seq.keys))
        refs = Counter(b for s in self.live for b in s.table)
        dropped = [b for b in reversed(seq.table) if refs[b] == 1]  # tail first
        returned = pool.release(seq.table)
        assert returned == len(dropped)
        self.live.remove(seq)
        self.reserved -= returned
        cached = [b for b in dropped if b in pool.key_of]
        assert list(pool.evictable)[len(pool.evictable) - len(cached):] == cached, "not released tail first"

    def check(self) -> None:
        pool, n = self.pool, self.total
        # The ledger is the store: shared blocks counted once.
        assert 0 <= self.reserved <= n
        assert self.reserved == pool.num_referenced
        # Every block in exactly one state.
        assert pool.allocator.num_free + len(pool.evictable) + len(pool.refs) == n
        assert not set(pool.refs) & set(pool.evictable)
        assert pool.num_free == n - pool.num_referenced
        assert all(0 <= b < n for b in [*pool.refs, *pool.key_of])
        assert pool.refs == Counter(b for s in self.live for b in s.table)
        # The cache index is a bijection; unreferenced cached blocks are exactly the evictable ones.
        assert {b: k for k, b in pool.index.items()} == pool.key_of
        assert len(pool.index) == len(pool.key_of) == pool.num_cached
        assert set(pool.evictable) <= set(pool.key_of)
        assert set(pool.key_of) - set(pool.refs) == set(pool.evictable)
        # A fresh block belongs to one live sequence; another may hold it only by adopting it from the cache.
        owner: dict[int, int] = {}
        for i, seq in enumerate(self.live):
            assert len(set(seq.table)) == len(seq.table)
            for block in seq.table[seq.adopted:]:
                assert block not in owner, "one block handed out fresh to two live sequences"
                owner[block] = i
        for i, seq in enumerate(self.live):
            for block in seq.table[:seq.adopted]:
                if owner.get(block, i) != i:
                    assert block in pool.key_of  # published by its owner, then adopted
        # What a sequence reads is what its prompt says; what the cache names is what the block holds.
        for seq in self.live:
            for i, block in enumerate(seq.table[:seq.adopted]):
                assert pool.key_of.get(block) == seq.keys[i]
                assert self.content.get(block) == seq.keys[i]
        for block, key in pool.key_of.items():
            assert self.content.get(block) == key, "a cached block holds other KV than its key names"


# A prompt starts from nothing, a shared system prompt, or an earlier prompt (a re-send, or the chat so far
# plus a turn), then goes on in a two-token alphabet: prefixes repeat often.
SYSTEM = ([0, 1, 1, 0, 1, 0, 0, 1], [1, 1, 0, 0])
base_st = st.one_of(st.none(), st.tuples(st.just("system"), st.integers(0, 1)),
                    st.tuples(st.just("earlier"), st.integers(0, 15)))
start_op = st.tuples(st.just("start"), base_st, st.lists(st.integers(0, 1), max_size=6),
                     st.lists(st.integers(0, 1), max_size=4), st.integers(0, 3), st.sampled_from((None, *SALTS)))
publish_op = st.tuples(st.just("publish"), st.integers(0, 15), st.integers(0, 4))
finish_op = st.tuples(st.just("finish"), st.integers(0, 15), st.booleans(), st.integers(0, 4))
script_st = st.lists(st.one_of(start_op, start_op, publish_op, finish_op, finish_op), min_size=4, max_size=40)


@settings(max_examples=400, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.integers(1, 4), script=script_st)
def test_the_ledger_equals_the_store_under_any_interleaving(num_blocks, block_size, script):
    ledger = Ledger(num_blocks, block_size)
    for op, *args in script:
        if op == "start":
            base, tail, generated, slack, salt = args
            if base is None:
                prompt = []
            elif base[0] == "system":
                prompt = list(SYSTEM[base[1]])
            else:
                prompt = list(ledger.prompts[base[1] % len(ledger.prompts)]) if ledger.prompts else []
            prompt += tail
            ledger.start(prompt, generated, slack, salt)
        elif ledger.live:
            seq = ledger.live[args[0] % len(ledger.live)]
            if op == "publish":
                ledger.publish(seq, args[1])
            else:
                ledger.finish(seq, args[1], args[2])
        ledger.check()
    for seq in list(ledger.live):
        ledger.finish(seq, False, 0)
        ledger.check()
    # Everything comes back: the ledger is whole, and every block is free or cached.
    assert ledger.reserved == 0 and ledger.pool.num_free == num_blocks


# ----------------------------------------------------------------------------- identity of keys

tokens_st = st.lists(st.integers(0, 3), max_size=14)
salt_st = st.one_of(st.none(), st.text(min_size=1, max_size=4))


@settings(max_examples=200, deadline=None)
@given(tokens=tokens_st, extension=tokens_st, block_size=st.integers(1, 4), salt=salt_st)
def test_the_keys_of_a_prefix_lead_the_keys_of_any_extension(tokens, extension, block_size, salt):
    keys = block_keys(tokens, block_size, salt)
    assert len(keys) == len(tokens) // block_size  # full blocks only
    assert all(len(key) == 16 for key in keys)
    longer = block_keys(tokens + extension, block_size, salt)
    assert longer[:len(keys)] == keys
    assert len(set(longer)) == len(longer)  # a key names a position too: equal blocks further on differ


@settings(max_examples=200, deadline=None)
@given(a=tokens_st, b=tokens_st, block_size=st.integers(1, 4), salts=st.lists(salt_st, min_size=2, max_size=2,
                                                                              unique=True))
def test_different_salts_never_share_a_key(a, b, block_size, salts):
    assert not set(block_keys(a, block_size, salts[0])) & set(block_keys(b, block_size, salts[1]))


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=14), block_size=st.integers(1, 4), salt=salt_st,
       data=st.data())
def test_a_different_token_changes_its_block_key_and_every_key_after_it(tokens, block_size, salt, data):
    at = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[at] = data.draw(st.integers(0, 3).filter(lambda t: t != tokens[at]))
    keys, other = block_keys(tokens, block_size, salt), block_keys(changed, block_size, salt)
    first = at // block_size
    assert other[:first] == keys[:first]
    assert not set(other[first:]) & set(keys)  # nothing from the changed block on can match the original


@settings(max_examples=200, deadline=None)
@given(tokens=tokens_st, block_size=st.integers(1, 4), salt=salt_st, limit=st.integers(0, 6))
def test_limit_caps_the_number_of_keys(tokens, block_size, salt, limit):
    capped = block_keys(tokens, block_size, salt, limit=limit)
    assert len(capped) == min(limit, len(tokens) // block_size)
    assert capped == block_keys(tokens, block_size, salt)[:limit]


# ----------------------------------------------------------------------------- eviction order


@settings(max_examples=150, deadline=None)
@given(block_size=st.integers(1, 3), lengths=st.lists(st.integers(1, 3), min_size=1, max_size=5),
       partial=st.booleans(), spare=st.integers(0, 3), data=st.data())
def test_eviction_takes_the_least_recently_released_and_a_tail_before_its_parent(
        block_size, lengths, partial, spare, data):
    # Sequence i's tokens start with i + 1, so no two share a block; `partial` adds a token past the full
    # blocks, whose block is never cached and is freed at release.
    prompts = [[i + 1] * (n * block_size) + [0] * partial for i, n in enumerate(lengths)]
    num_blocks = sum(blocks_for(len(p), block_size) for p in prompts) + spare
    pool = BlockPool(num_blocks, caching=True)
    tables = [pool.acquire([], blocks_for(len(p), block_size)) for p in prompts]
    keys = [block_keys(p, block_size, None) for p in prompts]
    for table, ks in zip(tables, keys):
        assert pool.publish(table, ks) == len(ks)
    order: list[int] = []  # the policy: least recently released first, each table released tail first

    def released(table: list[int]) -> None:
        for block in reversed(table):
            if block in pool.key_of:
                if block in order:
                    order.remove(block)
                order.append(block)

    for i in data.draw(st.permutations(range(len(prompts)))):
        pool.release(tables[i])
        released(tables[i])
    assert list(pool.evictable) == order
    # Adopting a cached prefix again and releasing it makes those blocks the most recently released.
    for _ in range(data.draw(st.integers(0, 2))):
        i = data.draw(st.integers(0, len(prompts) - 1))
        run = data.draw(st.integers(1, lengths[i]))
        adopted = pool.match(keys[i][:run])
        assert adopted == tables[i][:run]
        pool.release(pool.acquire(adopted, 0))
        released(adopted)
        assert list(pool.evictable) == order
    # Free blocks go first and evict nothing ...
    cached = pool.num_cached
    pool.acquire([], pool.allocator.num_free)
    assert pool.num_cached == cached and pool.allocator.num_free == 0
    # ... then each allocation evicts the oldest cached block, and its key leaves the index.
    for block in order:
        key = pool.key_of[block]
        assert pool.acquire([], 1) == [block]
        assert key not in pool.index and block not in pool.key_of and pool.refs[block] == 1
    assert pool.num_free == 0 and pool.num_cached == 0
    with pytest.raises(BlockPoolExhausted):
        pool.acquire([], 1)


def test_eviction_order_by_hand():
    pool = BlockPool(4, caching=True)
    first, second = pool.acquire([], 2), pool.acquire([], 2)
    pool.publish(first, block_keys([1, 1, 1, 1], 2, None))
    pool.publish(second, block_keys([2, 2, 2, 2], 2, None))
    pool.release(second)
    pool.release(first)
    # second released first, its tail (block 3) before its parent (block 2); then first's tail and parent.
    assert (first, second) == ([0, 1], [2, 3])
    assert [pool.acquire([], 1)[0] for _ in range(4)] == [3, 2, 1, 0]


# ----------------------------------------------------------------------------- a publishing race


# Each sequence publishes before it releases; the winner publishes before the loser.
RACES = [
    ("publish winner", "publish loser", "release winner", "release loser"),
    ("publish winner", "publish loser", "release loser", "release winner"),
    ("publish winner", "release winner", "publish loser", "release loser"),
]


@settings(max_examples=150, deadline=None)
@given(block_size=st.integers(1, 4), data=st.data(), partial=st.booleans(), loser_extra=st.integers(0, 2),
       race=st.sampled_from(RACES), winner=st.integers(0, 1), salt=st.sampled_from(SALTS))
def test_the_first_publisher_keeps_the_cache_entry_and_the_other_copy_is_freed(
        block_size, data, partial, loser_extra, race, winner, salt):
    full = data.draw(st.integers(1, 3))
    prompt = data.draw(st.lists(st.integers(0, 3), min_size=full * block_size, max_size=full * block_size))
    tail = [9] * (block_size - 1) * partial  # a partial last block: computed, never cached
    loser = 1 - winner
    tokens = {winner: prompt + tail, loser: prompt + [7] * (loser_extra * block_size) + tail}
    pool = BlockPool(32, caching=True)
    tables, keys = {}, {}
    for s in (0, 1):  # both start before either publishes: neither finds anything cached
        assert pool.match(adoptable_keys(tokens[s], block_size, salt)) == []
        tables[s] = pool.acquire([], blocks_for(len(tokens[s]), block_size))
        keys[s] = block_keys(tokens[s], block_size, salt)
    assert not set(tables[0]) & set(tables[1])
    shared = keys[winner]  # the loser's leading keys are the same ones
    assert keys[loser][:full] == shared
    for event in race:
        what, who = event.split()
        s = winner if who == "winner" else loser
        if what == "publish":
            added = pool.publish(tables[s], keys[s])
            assert added == (full if s == winner else loser_extra)
        else:
            assert pool.release(tables[s]) == len(tables[s])  # nothing shared: every block comes back
    # The winner's blocks hold the shared keys; the loser's copies are free, its own extra blocks cached.
    for i, key in enumerate(shared):
        assert pool.index[key] == tables[winner][i]
    assert not set(tables[loser][:full]) & set(pool.key_of)
    assert pool.num_cached == full + loser_extra and pool.num_referenced == 0
    assert set(pool.evictable) == set(tables[winner][:full]) | set(tables[loser][full:full + loser_extra])
    assert pool.allocator.num_free == pool.num_blocks - pool.num_cached
    # A later prompt with the same prefix adopts the winner's blocks (and the loser's extra ones after them).
    later = tokens[loser] + [5]
    assert pool.match(adoptable_keys(later, block_size, salt)) == (
        tables[winner][:full] + tables[loser][full:full + loser_extra])
    # In another namespace nothing is found.
    other = "tenant-c" if salt is None else None
    assert pool.match(adoptable_keys(later, block_size, other)) == []


def test_a_block_keeps_the_first_key_it_was_published_under():
    pool = BlockPool(4, caching=True)
    table = pool.acquire([], 2)
    first, second = block_keys([1, 2, 3, 4], 2, None), block_keys([1, 2, 3, 4], 2, "tenant-a")
    assert pool.publish(table, first) == 2
    assert pool.publish(table, first) == 0  # publishing twice adds nothing
    assert pool.publish(table, second) == 0  # nor does another key for a block already cached
    assert pool.index == dict(zip(first, table)) and pool.key_of == dict(zip(table, first))


def test_a_child_whose_parent_was_evicted_is_not_matched():
    # The race's loser caches its second block under the winner's first: after the winner's block is
    # evicted, that child is unreachable (it holds space until evicted in turn), and `match` stops at the gap.
    pool = BlockPool(4, caching=True)
    keys = block_keys([1, 1, 2, 2], 2, None)
    winner, loser = pool.acquire([], 1), pool.acquire([], 2)
    assert pool.publish(winner, keys[:1]) == 1 and pool.publish(loser, keys) == 1
    pool.release(winner)
    pool.release(loser)  # its first block is a private copy: freed; its second stays cached
    assert list(pool.evictable) == [winner[0], loser[1]] and pool.allocator.num_free == 2
    pool.acquire([], 3)  # the two free blocks, then the oldest cached one: the parent
    assert pool.key_of == {loser[1]: keys[1]}
    assert pool.match(keys) == [] and pool.match(keys[1:]) == [loser[1]]


# ----------------------------------------------------------------------------- caching=False

plain_ops = st.lists(st.one_of(st.tuples(st.just("acquire"), st.integers(0, 6), tokens_st),
                               st.tuples(st.just("release"), st.integers(0, 15), tokens_st)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 16), block_size=st.integers(1, 3), script=plain_ops)
def test_without_caching_the_pool_is_the_plain_allocator(num_blocks, block_size, script):
    pool, plain = BlockPool(num_blocks, caching=False), BlockAllocator(num_blocks)
    held: list[tuple[list[int], list[int]]] = []
    published: list[list[int]] = []
    for op, n, tokens in script:
        keys = block_keys(tokens, block_size, None)
        assert pool.match(keys) == []
        assert all(pool.match(p) == [] for p in published)
        if op == "acquire":
            if n > plain.num_free:
                with pytest.raises(BlockPoolExhausted) as err:
                    pool.acquire([], n)
                assert (err.value.requested, err.value.free) == (n, plain.num_free)
                continue
            table = pool.acquire([], n)
            assert table == plain.allocate(n)  # the same blocks, in the same order
            held.append((table, tokens))
        elif held:
            table, tokens = held.pop(n % len(held))
            keys = block_keys(tokens, block_size, None, limit=len(table))
            assert pool.publish(table, keys) == 0
            published.append(keys)
            assert pool.release(table) == len(table)  # every released block is free again
            plain.release(table)
        assert pool.num_cached == 0 and not pool.index and not pool.key_of and not pool.evictable
        assert pool.num_free == pool.allocator.num_free == plain.num_free
        assert pool.num_referenced == sum(len(t) for t, _ in held)
    for table, _ in held:
        pool.release(table)
    assert pool.num_free == num_blocks
