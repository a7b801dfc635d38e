"""The block allocator and the paged store's bookkeeping (no model needed beyond a config)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.admission.block_budget import blocks_for
from ferrox_batch.errors import KvPoolExhausted
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.kv.paged_kv import BlockAllocator, BlockPoolExhausted, PagedKvStore

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=32,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
)

ops = st.lists(
    st.one_of(st.tuples(st.just("alloc"), st.integers(0, 12)), st.tuples(st.just("free"), st.integers(0, 50))),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(total=st.integers(1, 40), script=ops)
def test_blocks_are_never_handed_out_twice_and_all_come_back(total, script):
    alloc = BlockAllocator(total)
    held: list[list[int]] = []
    for op, n in script:
        if op == "alloc":
            if n > alloc.num_free:
                before = alloc.num_free
                with pytest.raises(BlockPoolExhausted) as err:
                    alloc.allocate(n)
                assert err.value.requested == n and err.value.free == before
                assert alloc.num_free == before  # a refused allocation changes nothing
            else:
                held.append(alloc.allocate(n))
        elif held:
            alloc.release(held.pop(n % len(held)))
        flat = [b for blocks in held for b in blocks]
        assert len(flat) == len(set(flat)), "a block was handed out twice"
        assert all(0 <= b < total for b in flat)
        assert alloc.num_free + len(flat) == total
    for blocks in held:
        alloc.release(blocks)
    assert alloc.num_free == total


def test_exhaustion_is_the_typed_retryable_pool_error():
    alloc = BlockAllocator(2)
    alloc.allocate(2)
    with pytest.raises(KvPoolExhausted) as err:
        alloc.allocate(1)
    assert err.value.retry_after_secs == 1 and err.value.http_status == 503
    assert "no free blocks" in str(err.value) and "needed 1 blocks, 0 free" in str(err.value)


def test_double_free_and_foreign_blocks_are_refused():
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(2)
    alloc.release(blocks)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.release(blocks)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.release([99])
    assert alloc.num_free == 4


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_bad_pool_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(bad)
    with pytest.raises(ValueError, match="block_size"):
        PagedKvStore(CONFIG, 4, bad)


@settings(max_examples=200, deadline=None)
@given(positions=st.integers(0, 10_000), block_size=st.integers(1, 300))
def test_the_store_leases_what_the_ledger_prices(positions, block_size):
    assert blocks_for(positions, block_size) == max(1, math.ceil(positions / block_size))


def test_sequences_lease_blocks_and_give_them_back():
    store = PagedKvStore(CONFIG, 10, 4)
    assert store.add_sequence("a", 9) == [0, 1, 2]
    store.add_sequence("b", 0)
    assert store.num_free_blocks == 6 and store.blocks_held() == 4
    assert store.seq("a").capacity == 12 and store.seq_len("a") == 0
    with pytest.raises(ValueError, match="already holds"):
        store.add_sequence("a", 1)
    with pytest.raises(BlockPoolExhausted):
        store.add_sequence("c", 40)
    assert store.num_free_blocks == 6
    store.free_sequence("a")
    store.free_sequence("b")
    assert store.num_free_blocks == 10 and store.seq_ids() == []
    with pytest.raises(KeyError):
        store.free_sequence("a")


def test_a_store_sized_from_a_memory_budget_holds_whole_blocks():
    per_block = PagedKvStore.bytes_per_block(CONFIG, 4, torch.float32)
    assert per_block == 2 * 2 * 4 * 2 * 4 * 4  # K and V x layers x positions x kv heads x head_dim x 4 bytes
    store = PagedKvStore.from_memory_budget(CONFIG, per_block * 5 + per_block // 2, 4)
    assert store.num_blocks == 5
    with pytest.raises(ValueError, match="holds no block"):
        PagedKvStore.from_memory_budget(CONFIG, per_block - 1, 4)
    assert store.kv.shape == (2, 20, 2, 2, 4)


def test_returned_blocks_are_leased_first_and_fresh_ones_cost_nothing_until_used():
    # A pool far larger than could ever be listed block by block: the allocator only tracks what it leased.
    alloc = BlockAllocator(10**12)
    first = alloc.allocate(3)
    assert first == [0, 1, 2] and alloc.num_free == 10**12 - 3
    alloc.release([0, 1])
    assert alloc.allocate(3) == [0, 1, 3], "the returned blocks first, in their order, then a fresh one"
    assert alloc.num_free == 10**12 - 4


def test_a_freed_block_is_leased_again_as_it_is():
    """Leases are not cleared (readers only read what their own sequence wrote: test_decoder)."""
    store = PagedKvStore(CONFIG, 3, 4)
    blocks = store.add_sequence("a", 8)
    store.kv.fill_(float("nan"))
    store.free_sequence("a")
    again = store.add_sequence("b", 8)
    assert sorted(again) == sorted(set(again)) and len(again) == 2
    assert set(again) & set(blocks), "the freed blocks are reused"
    assert bool(store.kv.isnan().all()), "and were not rewritten at lease time"
