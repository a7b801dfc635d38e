"""KV groups (`admission.kv_groups`) and the store over them: the grouping rule, the pricing the ledger and
the store share, and that no attention path of a hybrid model reads a page its local groups gave back.

Pinned as properties over random layer kinds, prompts, lengths, windows and block sizes: the groups cover
every layer exactly once, each group holds one kind and at most `size` layers (only a kind's last group
short), and what `GroupPricing` prices a row at is exactly what the store leases it. Then Gemma 3's tiny
checkpoint with NaN in every spare and free block, on the C kernels and torch's gather path: the logits
equal, step for step, those of an ordinary lease keeping every position.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.admission.block_budget import blocks_for
from ferrox_batch.admission.kv_groups import GroupPricing, KvGroups
from ferrox_batch.admission.window import WindowPolicy
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.kv.paged_kv import PagedKvStore, model_groups
from ferrox_batch.runtime.loading.loader import load_model

BASE = ModelConfig(
    architecture="Gemma3ForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=32,
    num_layers=6, num_heads=2, num_kv_heads=1, head_dim=4, sliding_window=8,
    window_layers=(True, True, True, True, True, False),
)


@settings(max_examples=300)
@given(kinds=st.lists(st.booleans(), min_size=1, max_size=40))
def test_groups_cover_every_layer_once_with_one_kind_each(kinds):
    groups = KvGroups.of(kinds)
    flat = [layer for members in groups.layers for layer in members]
    assert sorted(flat) == list(range(len(kinds))), "every layer in exactly one group"
    counts = [kinds.count(kind) for kind in (False, True) if kinds.count(kind)]
    assert groups.size == min(counts)
    for members, local in zip(groups.layers, groups.local):
        assert {kinds[layer] for layer in members} == {local}, "one kind per group"
        assert 1 <= len(members) <= groups.size
    for kind in (False, True):  # only a kind's last group may be short (padded)
        sizes = [len(m) for m, local in zip(groups.layers, groups.local) if local == kind]
        assert all(size == groups.size for size in sizes[:-1])
        assert len(sizes) == -(-kinds.count(kind) // groups.size)
    for layer in range(len(kinds)):
        group, slot = groups.slot(layer)
        assert groups.layers[group][slot] == layer
    if len(set(kinds)) == 1:
        assert groups.layers == (tuple(range(len(kinds))),), "one kind: one group of every layer, as before"


def test_gemma3_270m_is_five_local_groups_and_one_global_of_three_layers():
    kinds = [(layer + 1) % 6 != 0 for layer in range(18)]
    groups = KvGroups.of(kinds)
    assert groups.size == 3 and (groups.global_groups, groups.local_groups) == (1, 5)
    assert groups.layers[0] == (5, 11, 17) and groups.layers[1] == (0, 1, 2)


@settings(max_examples=200, deadline=None)
@given(kinds=st.lists(st.booleans(), min_size=1, max_size=8), prompt=st.integers(0, 200),
       max_tokens=st.integers(1, 400), window=st.integers(1, 40), block=st.integers(1, 8),
       interval=st.integers(1, 64))
def test_the_store_leases_exactly_what_a_row_is_priced_at(kinds, prompt, max_tokens, window, block, interval):
    config = dataclasses.replace(BASE, num_layers=len(kinds), window_layers=tuple(kinds), sliding_window=window)
    store = PagedKvStore(config, 4096, block)
    policy = WindowPolicy(window, block, interval) if any(kinds) else None
    pricing = store.groups.pricing(policy)
    hold = pricing.hold(prompt, prompt + max_tokens, block)
    assert hold.blocks == (pricing.global_groups * blocks_for(prompt + max_tokens, block)
                           + pricing.local_groups * blocks_for(hold.held, block))
    leased = store.add_sequence("s", hold.held, window=hold.window, every=prompt + max_tokens)
    assert len(leased) == len(set(leased)) == hold.blocks == store.blocks_held() == sum(store.blocks_by_kind())
    assert store.blocks_by_kind() == (pricing.global_groups * blocks_for(prompt + max_tokens, block),
                                      pricing.local_groups * blocks_for(hold.held, block))
    if hold.window is not None:
        assert hold.held < prompt + max_tokens and store.seq("s").sliding is not None
    assert store.free_sequence("s") == hold.blocks and store.blocks_by_kind() == (0, 0)


def test_one_kind_of_layer_keeps_the_layout_and_numbers_of_a_store_without_groups():
    plain = dataclasses.replace(BASE, sliding_window=None, window_layers=None)
    uniform = dataclasses.replace(BASE, window_layers=None)
    for config in (plain, uniform):
        assert model_groups(config).layers == (tuple(range(6)),)
        assert PagedKvStore(config, 10, 4).kv.shape == (6, 40, 2, 1, 4)
        assert PagedKvStore.bytes_per_block(config, 4, torch.float32) == 2 * 6 * 4 * 1 * 4 * 4
    assert GroupPricing.uniform(None) == PagedKvStore(plain, 10, 4).groups.pricing(None)
    hybrid = PagedKvStore(BASE, 10, 4)
    assert hybrid.kv.shape == (1, 40, 2, 1, 4), "five local groups and one global, of one layer each"
    assert PagedKvStore.bytes_per_block(BASE, 4, torch.float32) == 2 * 1 * 4 * 1 * 4 * 4


def test_a_hybrid_row_that_keeps_every_page_adopts_and_publishes_in_every_group():
    store = PagedKvStore(BASE, 64, 4, prefix_cache=True)
    prompt = list(range(13))
    store.add_sequence("a", 16, prompt)
    store.seq("a").length = 13
    assert store.publish("a", prompt) == 6 * 3, "three full blocks in each of six groups"
    assert store.peek(prompt) == (18, 0)
    store.add_sequence("b", 16, prompt)
    assert store.seq_len("b") == 12 and store.blocks_held() == 6 * 4 + 6 * 1
    assert store.free_sequence("a") == 6 and store.free_sequence("b") == 6 * 4


PROMPT = [(7 * i + 3) % 200 for i in range(23)]
STEPS = 60


@pytest.mark.parametrize("kernels", [True, False])
def test_spare_and_free_blocks_of_a_hybrid_store_are_never_read(tiny_variant_dirs, device, kernels):
    if kernels and (device != "cpu" or cpu_kernels() is None):
        pytest.skip("the C kernels run on a CPU that has them")
    model = load_model(tiny_variant_dirs["gemma3"], device=device, dtype="float32")
    if not kernels:
        model.decoder.kernels = None  # torch's gather path, as on CUDA
    decoder, window = model.decoder, model.config.sliding_window
    plain = decoder.new_store(2, num_blocks=3 * 48)
    plain.add_sequence("s", len(PROMPT) + STEPS)
    hybrid = decoder.new_store(2, num_blocks=3 * 48)
    hybrid.kv.fill_(float("nan"))
    policy = WindowPolicy(window, 2, 4)
    hybrid.add_sequence("s", 20, window=policy, every=len(PROMPT) + STEPS)  # 10 blocks per local group

    def poison() -> None:
        used = {b for group in hybrid.seq("s").groups for b in group.table.tolist() if b >= 0}
        for block in range(hybrid.num_blocks):
            if block not in used:
                hybrid.kv[:, block * 2:(block + 1) * 2] = float("nan")

    def step(tokens: list[int]) -> torch.Tensor:
        want = decoder.forward([SeqChunk("s", tokens)], plain)[0]
        got = decoder.forward([SeqChunk("s", tokens)], hybrid)[0]
        poison()
        assert bool(got.isfinite().all())
        assert torch.equal(got, want)
        return want

    for start in range(0, len(PROMPT), 5):
        logits = step(PROMPT[start:start + 5])
    for _ in range(STEPS - 1):
        logits = step([int(logits.argmax())])
    seq = hybrid.seq("s")
    assert seq.length == len(PROMPT) + STEPS - 1 and seq.sliding.released > 40
    assert seq.groups[0].sliding is None and len(seq.groups[0].blocks) == 42
