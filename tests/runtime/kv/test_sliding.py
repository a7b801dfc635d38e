"""Sliding leases (`runtime.kv.sliding`, `PagedKvStore` with a window): the pages behind the window go back
to the lease and hold its new positions, within the blocks the ledger priced it at.

Pins, as a property over windows, pages, intervals, prompts, prompt chunkings and lengths: a lease of
`blocks_for(row_hold(...))` blocks always has a page for every position it writes (the hold bound is
enough), never gives back a page a query inside the window reads, never maps two pages to one block, and
keeps every block it leased (the ledger's count). Then the store around it: leasing, the table's `RELEASED`
entries, what a sliding lease refuses (a cached prefix, a page or window that is not the store's), that it
publishes nothing, and that the decode kernel's range check only looks at the entries a range reads.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.admission.block_budget import blocks_for
from ferrox_batch.admission.window import WindowPolicy, row_hold
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
from ferrox_batch.runtime.kv.paged_kv import PagedKvStore
from ferrox_batch.runtime.kv.sliding import RELEASED, SlidingPages

WINDOWED = ModelConfig(
    architecture="MistralForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=32,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, sliding_window=8,
)


def writes(prompt: int, chunks: list[int], max_tokens: int) -> list[int]:
    """A row's writes: its prompt (the stand-in token when empty) in `chunks`' sizes (cycled), then one
    token per decode step up to `max_tokens` positions past the prompt."""
    out, left, i = [], max(prompt, 1), 0
    while left:
        out.append(min(left, chunks[i % len(chunks)]))
        left -= out[-1]
        i += 1
    return out + [1] * (prompt + max_tokens - max(prompt, 1))


@settings(max_examples=300)
@given(window=st.integers(1, 64), page=st.integers(1, 16), interval=st.integers(1, 200),
       prompt=st.integers(0, 300), max_tokens=st.integers(1, 700),
       chunks=st.lists(st.integers(1, 300), min_size=1, max_size=6))
def test_a_lease_at_the_hold_bound_always_has_the_pages_its_window_reads(window, page, interval, prompt,
                                                                         max_tokens, chunks):
    policy = WindowPolicy(window, page, interval)
    hold = row_hold(prompt, prompt + max_tokens, page, policy)
    if hold.window is None:
        return  # an ordinary lease: every position keeps its page
    leased = list(range(blocks_for(hold.positions, page)))
    pages = SlidingPages(policy, spare=leased[::-1])
    length = 0
    for count in writes(prompt, chunks, max_tokens):
        pages.before_write(length, count)
        # Every position written now and every key its queries read has a page, none given back.
        first = max(0, length + 1 - window)
        assert first >= pages.released
        read = pages.pages[first // page:(length + count - 1) // page + 1]
        assert len(read) == (length + count - 1) // page - first // page + 1 and RELEASED not in read
        held = [b for b in pages.pages if b != RELEASED]
        assert len(set(held)) == len(held), "two pages in one block"
        assert sorted(held + pages.spare) == leased, "the lease keeps exactly the blocks it was priced at"
        assert all(b == RELEASED for b in pages.pages[:pages.released // page])
        length += count
    assert pages.decode_steps == prompt + max_tokens - max(prompt, 1) + sum(1 for c in writes(prompt, chunks, 0)
                                                                              if c == 1)


def test_a_long_row_slides_every_interval_and_reuses_the_pages_it_gave_back():
    policy = WindowPolicy(8, 4, 16)
    pages = SlidingPages(policy, spare=list(range(10))[::-1])
    pages.before_write(0, 3)  # the prompt
    assert pages.pages == [0] and pages.released == 0
    for length in range(3, 200):  # one decode step each
        pages.before_write(length, 1)
    assert pages.released > 150 and pages.released % 4 == 0
    assert len(pages.pages) == 50 and sum(1 for b in pages.pages if b != RELEASED) <= 10
    assert sorted([b for b in pages.pages if b != RELEASED] + pages.spare) == list(range(10))


def test_a_write_past_what_the_lease_holds_is_refused_and_changes_nothing():
    pages = SlidingPages(WindowPolicy(8, 4, 128), spare=[1, 0])
    pages.before_write(0, 8)
    before = (list(pages.pages), list(pages.spare), pages.released, pages.decode_steps)
    with pytest.raises(ValueError, match="would reach 9 positions but its sliding KV lease holds 2 pages"):
        pages.before_write(8, 1)
    assert (pages.pages, pages.spare, pages.released, pages.decode_steps) == before


def test_the_store_leases_a_sliding_sequence_its_hold_and_marks_the_pages_it_gave_back():
    store = PagedKvStore(WINDOWED, 20, 4)
    policy = WindowPolicy(8, 4, 4)
    blocks = store.add_sequence("s", 40, window=policy)
    assert len(blocks) == 10 and store.blocks_held() == 10 and store.num_free_blocks == 10
    assert store.seq("s").table.numel() == 0, "pages are installed as positions are written"
    seq = store.before_write("s", 20)
    assert seq.table.tolist() == blocks[:5]
    seq.length = 20
    for _ in range(40):
        seq = store.before_write("s", 1)
        seq.length += 1
    assert seq.table.tolist()[:seq.sliding.released // 4] == [RELEASED] * (seq.sliding.released // 4)
    assert seq.sliding.released >= 40 and seq.table.numel() == 15
    assert sorted(seq.blocks) == sorted(blocks) and store.blocks_held() == 10, "the ledger's count never moves"
    assert store.publish("s", list(range(60))) == 0, "a sliding lease publishes nothing"
    assert store.free_sequence("s") == 10 and store.num_free_blocks == 20


def test_the_store_refuses_what_a_sliding_lease_cannot_do():
    store = PagedKvStore(WINDOWED, 20, 4, prefix_cache=True)
    with pytest.raises(ValueError, match="adopts no cached prefix"):
        store.add_sequence("s", 40, [1, 2, 3, 4, 5], window=WindowPolicy(8, 4))
    with pytest.raises(ValueError, match="must be this store's blocks"):
        store.add_sequence("s", 40, window=WindowPolicy(8, 8))
    with pytest.raises(ValueError, match="the window its local layers slide by"):
        store.add_sequence("s", 40, window=WindowPolicy(16, 4))
    unwindowed = PagedKvStore(dataclasses.replace(WINDOWED, sliding_window=None), 20, 4)
    with pytest.raises(ValueError, match="the window its local layers slide by"):
        unwindowed.add_sequence("s", 40, window=WindowPolicy(8, 4))
    assert store.num_free_blocks == 20 and store.seq_ids() == []
    store.add_sequence("s", 8)
    with pytest.raises(ValueError, match="would reach 9 positions but its KV lease holds 8"):
        store.before_write("s", 9)


def test_the_decode_range_check_reads_only_the_entries_a_range_covers():
    tables = torch.tensor([[RELEASED, RELEASED, 5, 6], [1, 2, 0, 0]])
    lo, hi = torch.tensor([8, 0]), torch.tensor([14, 7])
    CpuKernels.check_decode_ranges(tables, lo, hi, 4, 8)  # the released pages and the padding are not read
    with pytest.raises(ValueError, match="outside the KV pool"):
        CpuKernels.check_decode_ranges(tables, torch.tensor([7, 0]), hi, 4, 8)
    with pytest.raises(ValueError, match="outside the KV pool"):
        CpuKernels.check_decode_ranges(tables, lo, hi, 4, 6)
