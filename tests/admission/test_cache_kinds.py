"""Layer cache kinds (`admission.cache_kinds`) and the KV groups and pricing over them (`admission.kv_groups`).

Pinned as properties over random layer kinds, among them two sliding widths and `FixedState`, a kind made
up here (a constant number of state slots per sequence, as a recurrent layer keeps) that the library has
never heard of: the groups cover every layer once with one kind each, in the kinds' order and the layers'
order; a row's price is the sum of each group's kind's lease; "is local" flags and the kinds they stand
for give the same groups and the same prices; and the store leases, group by group, what the pricing
prices. Then worked examples: Gemma 3 270M's groups from kinds, and a three-kind model priced by hand.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.admission.block_budget import blocks_for
from ferrox_batch.admission.cache_kinds import (
    FULL_ATTENTION,
    MODEL_WINDOW,
    SLIDING_WINDOW,
    CacheKind,
    FullAttention,
    SlidingWindow,
    layer_kind,
    lease_blocks,
)
from ferrox_batch.admission.kv_groups import GroupPricing, KvGroups, group_blocks
from ferrox_batch.admission.window import WindowPolicy, row_hold
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.kv.paged_kv import PagedKvStore, model_groups


@dataclass(frozen=True, slots=True)
class FixedState:
    """A kind the library does not define: `slots` state slots per sequence, however long it runs."""

    slots: int

    @property
    def label(self) -> str:
        return "fixed_state"

    @property
    def order(self) -> tuple[int, ...]:
        return (2, self.slots)

    def slides_by(self, window: WindowPolicy | None) -> bool:
        return False

    def blocks(self, positions: int, held: int, block_size: int) -> int:
        return blocks_for(self.slots, block_size)


@dataclass(frozen=True, slots=True)
class Impostor:
    """Another made-up kind, claiming `FixedState(3)`'s place in the order."""

    @property
    def label(self) -> str:
        return "impostor"

    @property
    def order(self) -> tuple[int, ...]:
        return (2, 3)

    def slides_by(self, window: WindowPolicy | None) -> bool:
        return False

    def blocks(self, positions: int, held: int, block_size: int) -> int:
        return 1


NARROW, WIDE = 8, 24
KINDS = (FullAttention(), SlidingWindow(NARROW), SlidingWindow(WIDE), FixedState(3))
layer_kinds = st.lists(st.sampled_from(KINDS), min_size=1, max_size=40)
rows = st.tuples(st.integers(0, 200), st.integers(1, 400), st.integers(1, 8))  # prompt, max_tokens, block


def expected_lease(kind: CacheKind, hold_window: WindowPolicy | None, positions: int, held: int, block: int) -> int:
    """One group's lease, by hand for each kind of this file: what every other formula must agree with."""
    if isinstance(kind, FullAttention):
        return blocks_for(positions, block)
    if isinstance(kind, SlidingWindow):
        slides = hold_window is not None and kind.window in (None, hold_window.sliding_window)
        return blocks_for(held if slides else positions, block)
    assert isinstance(kind, FixedState)
    return blocks_for(kind.slots, block)


def test_every_kind_of_this_file_is_a_cache_kind_with_its_label():
    for kind in (*KINDS, Impostor(), MODEL_WINDOW):
        assert isinstance(kind, CacheKind)
    assert FullAttention().label == FULL_ATTENTION == "full_attention"
    assert SlidingWindow(NARROW).label == MODEL_WINDOW.label == SLIDING_WINDOW == "sliding_window"
    assert not isinstance(True, CacheKind)


def test_a_window_slides_only_by_a_policy_of_its_width():
    policy = WindowPolicy.new(NARROW, 4)
    assert SlidingWindow(NARROW).slides_by(policy) and not SlidingWindow(WIDE).slides_by(policy)
    assert MODEL_WINDOW.slides_by(policy), "the model's one window slides by any lease's policy"
    assert not any(kind.slides_by(None) for kind in (*KINDS, MODEL_WINDOW))
    assert not FullAttention().slides_by(policy)
    for bad in (0, -1, 2.0, True):
        with pytest.raises((TypeError, ValueError)):
            SlidingWindow(bad)


@settings(max_examples=300)
@given(kinds=layer_kinds)
def test_groups_cover_every_layer_once_with_one_kind_each_in_the_kinds_order(kinds):
    groups = KvGroups.of(kinds)
    present = sorted(set(kinds), key=lambda kind: kind.order)
    assert sorted(layer for members in groups.layers for layer in members) == list(range(len(kinds)))
    assert len(groups.kinds) == len(groups.layers)
    assert groups.size == min(kinds.count(kind) for kind in present)
    for members, kind in zip(groups.layers, groups.kinds):
        assert {kinds[layer] for layer in members} == {kind}, "one kind per group"
        assert 1 <= len(members) <= groups.size
    # Each kind's groups together, in the kinds' order, its layers in layer order, only its last group short.
    assert list(dict.fromkeys(groups.kinds)) == present
    assert (groups.kinds[0] == FullAttention()) == (FullAttention() in kinds), "full attention first"
    for kind in present:
        mine = [members for members, of in zip(groups.layers, groups.kinds) if of == kind]
        assert [layer for members in mine for layer in members] == [i for i, k in enumerate(kinds) if k == kind]
        assert all(len(members) == groups.size for members in mine[:-1])
        assert len(mine) == -(-kinds.count(kind) // groups.size)
    for layer in range(len(kinds)):
        group, index = groups.slot(layer)
        assert groups.layers[group][index] == layer
    # The two counts first written count their own kinds only; a third kind adds groups of its own.
    fixed = sum(isinstance(kind, FixedState) for kind in groups.kinds)
    assert groups.global_groups + groups.local_groups + fixed == len(groups.layers)
    assert groups.local == tuple(isinstance(kind, SlidingWindow) for kind in groups.kinds)


@settings(max_examples=300)
@given(kinds=layer_kinds, row=rows, width=st.sampled_from([None, NARROW, WIDE, 5]), interval=st.integers(1, 64))
def test_a_row_costs_the_sum_of_each_groups_kinds_lease(kinds, row, width, interval):
    prompt, max_tokens, block = row
    policy = None if width is None else WindowPolicy(width, block, interval)
    pricing = KvGroups.of(kinds).pricing(policy)
    slides = policy is not None and any(kind.slides_by(policy) for kind in kinds)
    assert pricing.window == (policy if slides else None), "a policy no group slides by is dropped"
    assert pricing.kinds == KvGroups.of(kinds).kinds
    hold = pricing.hold(prompt, prompt + max_tokens, block)
    bound = row_hold(prompt, prompt + max_tokens, block, pricing.window)
    assert (hold.positions, hold.held, hold.window) == (prompt + max_tokens, bound.positions, bound.window)
    assert hold.blocks == sum(expected_lease(kind, hold.window, prompt + max_tokens, hold.held, block)
                              for kind in pricing.kinds)
    assert hold.blocks == sum(lease_blocks(kind, hold.window, prompt + max_tokens, hold.held, block)
                              for kind in pricing.kinds)


@settings(max_examples=300)
@given(flags=st.lists(st.booleans(), min_size=1, max_size=40), row=rows, width=st.integers(1, 40),
       interval=st.integers(1, 64), slide=st.booleans())
def test_flags_and_the_kinds_they_stand_for_give_the_same_groups_and_prices(flags, row, width, interval, slide):
    prompt, max_tokens, block = row
    old = KvGroups.of(flags)
    assert old == KvGroups.of([MODEL_WINDOW if flag else FullAttention() for flag in flags])
    assert old == KvGroups(old.size, old.layers, old.local), "a group's kind given as a flag"
    new = KvGroups.of([layer_kind(width if flag else None) for flag in flags])
    assert (new.size, new.layers, new.slots, new.local) == (old.size, old.layers, old.slots, old.local)
    assert (new.global_groups, new.local_groups) == (old.global_groups, old.local_groups)
    policy = WindowPolicy(width, block, interval) if slide else None
    legacy = GroupPricing(old.global_groups, old.local_groups, policy if old.local_groups else None)
    assert old.pricing(policy) == legacy
    assert (legacy.global_groups, legacy.local_groups) == (old.global_groups, old.local_groups)
    holds = {pricing.hold(prompt, prompt + max_tokens, block) for pricing in (legacy, new.pricing(policy))}
    assert len(holds) == 1, "the same positions, hold, policy and blocks"
    (hold,) = holds
    assert hold.blocks == (old.global_groups * blocks_for(prompt + max_tokens, block)
                           + old.local_groups * blocks_for(hold.held, block))
    lease = (prompt + max_tokens, hold.held, block)
    assert group_blocks(True, *lease) == group_blocks(SlidingWindow(width), *lease) == blocks_for(hold.held, block)
    assert group_blocks(False, *lease) == group_blocks(FullAttention(), *lease) == blocks_for(lease[0], block)


BASE = ModelConfig(
    architecture="Gemma3ForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=32,
    num_layers=6, num_heads=2, num_kv_heads=1, head_dim=4, sliding_window=8,
    window_layers=(True, True, True, True, True, False),
)


@settings(max_examples=150)
@given(flags=st.lists(st.booleans(), min_size=1, max_size=8), row=rows, window=st.integers(1, 40),
       interval=st.integers(1, 64))
def test_the_store_leases_each_group_what_its_kind_is_priced_at(flags, row, window, interval):
    prompt, max_tokens, block = row
    config = dataclasses.replace(BASE, num_layers=len(flags), window_layers=tuple(flags), sliding_window=window)
    store = PagedKvStore(config, 4096, block)
    assert store.groups == model_groups(config) == KvGroups.of([layer_kind(config.window(i))
                                                                for i in range(len(flags))])
    assert set(store.groups.kinds) == {layer_kind(window if flag else None) for flag in flags}
    pricing = store.groups.pricing(WindowPolicy(window, block, interval))
    hold = pricing.hold(prompt, prompt + max_tokens, block)
    leased = store.add_sequence("s", hold.held, window=hold.window, every=prompt + max_tokens)
    each = [expected_lease(kind, hold.window, prompt + max_tokens, hold.held, block) for kind in pricing.kinds]
    assert [len(group.blocks) for group in store.seq("s").groups] == each
    assert len(leased) == len(set(leased)) == sum(each) == hold.blocks == store.blocks_held()
    by_label = {label: sum(n for n, kind in zip(each, pricing.kinds) if kind.label == label)
                for label in (FULL_ATTENTION, SLIDING_WINDOW)}
    assert store.blocks_by_label() == by_label
    assert store.blocks_by_kind() == (by_label[FULL_ATTENTION], by_label[SLIDING_WINDOW])
    for group, kind in zip(store.seq("s").groups, pricing.kinds):
        assert (group.sliding is not None) == (hold.window is not None and kind.slides_by(hold.window))
    assert store.free_sequence("s") == hold.blocks
    assert store.blocks_by_label() == dict.fromkeys((FULL_ATTENTION, SLIDING_WINDOW), 0)


def test_gemma3_270m_from_its_kinds_is_one_full_attention_group_and_five_sliding_ones_of_three():
    kinds = [layer_kind(None if (layer + 1) % 6 == 0 else 512) for layer in range(18)]
    groups = KvGroups.of(kinds)
    assert groups.size == 3 and groups.kinds == (FullAttention(),) + (SlidingWindow(512),) * 5
    assert groups.layers[0] == (5, 11, 17) and groups.layers[1] == (0, 1, 2)
    assert (groups.global_groups, groups.local_groups) == (1, 5)
    assert groups.layers == KvGroups.of([kind != FullAttention() for kind in kinds]).layers


def test_a_three_kind_model_by_hand():
    # 4 full-attention layers, 8 sliding over 8 positions, 2 with fixed state: groups of 2 layers.
    kinds = [FixedState(3)] * 2 + [SlidingWindow(NARROW)] * 8 + [FullAttention()] * 4
    groups = KvGroups.of(kinds)
    assert groups.size == 2
    assert groups.kinds == (FullAttention(),) * 2 + (SlidingWindow(NARROW),) * 4 + (FixedState(3),)
    assert groups.layers[:2] == ((10, 11), (12, 13)) and groups.layers[-1] == (0, 1)
    # The upstream's example row (prompt 3, 400 tokens, window 8, page 4): 191 held, 48 blocks a sliding
    # group, 101 a full one, and the fixed state 1 block whatever the length.
    hold = groups.pricing(WindowPolicy.new(NARROW, 4)).hold(3, 403, 4)
    assert (hold.held, hold.blocks) == (191, 2 * 101 + 4 * 48 + 1)
    assert groups.pricing(None).hold(3, 403, 4).blocks == 6 * 101 + 1
    assert groups.pricing(WindowPolicy.new(WIDE, 4)).window is None, "no group slides by another width"


def test_the_kinds_order_whatever_the_layers_order():
    kinds = [FixedState(3), SlidingWindow(WIDE), SlidingWindow(NARROW), FullAttention(), MODEL_WINDOW]
    expected = (FullAttention(), MODEL_WINDOW, SlidingWindow(NARROW), SlidingWindow(WIDE), FixedState(3))
    assert KvGroups.of(kinds).kinds == KvGroups.of(kinds[::-1]).kinds == expected
    assert KvGroups.of(kinds).layers == ((3,), (4,), (2,), (1,), (0,))


def test_what_is_refused():
    with pytest.raises(ValueError, match="at least one layer"):
        KvGroups.of([])
    with pytest.raises(ValueError, match="share the order"):
        KvGroups.of([FixedState(3), Impostor()])
    with pytest.raises(ValueError, match="only local groups slide"):
        GroupPricing(kinds=(FullAttention(), SlidingWindow(WIDE)), window=WindowPolicy.new(NARROW, 4))
    with pytest.raises(ValueError, match="only local groups slide"):
        GroupPricing(1, 0, WindowPolicy.new(NARROW, 4))
    with pytest.raises(ValueError, match="not both"):
        GroupPricing(1, kinds=(FullAttention(),))
    with pytest.raises(ValueError, match="at least one KV group"):
        GroupPricing(0, 0)
    with pytest.raises(ValueError, match="one kind each"):
        KvGroups(1, ((0,), (1,)), (FullAttention(),))


def test_the_kinds_and_the_groups_import_without_torch():
    code = ("import sys\n"
            "import ferrox_batch.admission.cache_kinds, ferrox_batch.admission.kv_groups\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
