"""Sliding-window hold arithmetic: WindowPolicy, slide_hold_bound, paged_hold_positions, paged_window_policy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.generate import PagedKvConfig, paged_hold_positions, paged_window_policy
from ferrox_batch.policy.window import (
    DEFAULT_SWA_EVICTION_INTERVAL,
    SWA_RETAIN_GAP,
    WindowPolicy,
    slide_hold_bound,
)


def blocks_for(positions: int, block: int) -> int:
    return max(1, -(-positions // block))


def test_the_constants_are_upstreams():
    assert DEFAULT_SWA_EVICTION_INTERVAL == 128
    assert SWA_RETAIN_GAP == 16


def test_a_new_policy_slides_every_128_steps_and_an_interval_of_zero_means_every_step():
    policy = WindowPolicy.new(512, 64)
    assert policy == WindowPolicy(512, 64, 128)
    assert policy.with_eviction_interval(32).eviction_interval == 32
    assert policy.with_eviction_interval(0).eviction_interval == 1
    assert policy.with_eviction_interval(1).eviction_interval == 1
    assert policy.eviction_interval == 128, "with_eviction_interval returns a copy"


def test_the_hold_bound_is_two_windows_plus_gaps_an_interval_and_two_pages():
    assert slide_hold_bound(8, WindowPolicy(8, 4, 128)) == 2 * (8 + 16) + 128 + 2 * 4 == 184
    assert slide_hold_bound(512, WindowPolicy(512, 64, 1)) == 2 * 528 + 1 + 128


def test_a_windowed_row_reserves_for_its_slide_bound_not_its_whole_length():
    """Upstream's example: window 8, page 4, interval 128, prompt 3, max_tokens 400."""
    policy = WindowPolicy.new(8, 4).with_eviction_interval(128)
    held = paged_hold_positions(3 + 400, 3, 4, policy)
    assert held == 191
    assert blocks_for(held, 4) == 48
    assert blocks_for(paged_hold_positions(403, 3, 4, None), 4) == 101


def test_the_window_policy_comes_from_the_models_window_and_the_paged_config():
    paged = PagedKvConfig(store=None, slide_interval=16)
    assert paged_window_policy(8, paged, 4) == WindowPolicy(8, 4, 16)
    assert paged_window_policy(None, paged, 4) is None, "no window, no policy"
    assert paged_window_policy(8, None, 4) is None, "contiguous rows never slide"
    assert paged_window_policy(8, PagedKvConfig(store=None, slide_interval=0), 4).eviction_interval == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"sliding_window": 0, "page_size": 4}, ValueError, "sliding_window"),
        ({"sliding_window": 8, "page_size": 0}, ValueError, "page_size"),
        ({"sliding_window": 8, "page_size": 4, "eviction_interval": 0}, ValueError, "eviction_interval"),
        ({"sliding_window": 8.0, "page_size": 4}, TypeError, "sliding_window"),
        ({"sliding_window": True, "page_size": 4}, TypeError, "sliding_window"),
        ({"sliding_window": 8, "page_size": "4"}, TypeError, "page_size"),
    ],
)
def test_a_policy_refuses_sizes_that_are_not_positive_integers(kwargs, error, name):
    with pytest.raises(error, match=name):
        WindowPolicy(**kwargs)


def test_the_hold_functions_refuse_bad_input_by_name():
    policy = WindowPolicy.new(8, 4)
    with pytest.raises(TypeError, match="eviction_interval"):
        policy.with_eviction_interval(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window"):
        slide_hold_bound(0, policy)
    with pytest.raises(TypeError, match="policy"):
        slide_hold_bound(8, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_seq_len"):
        paged_hold_positions(-1, 0, 4, None)
    with pytest.raises(ValueError, match="prompt_len"):
        paged_hold_positions(10, -1, 4, None)
    with pytest.raises(ValueError, match="block_size"):
        paged_hold_positions(10, 1, 0, None)
    with pytest.raises(TypeError, match="block_size"):
        paged_hold_positions(10, 1, True, None)
    with pytest.raises(TypeError, match="window"):
        paged_hold_positions(10, 1, 4, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sliding_window"):
        paged_window_policy(0, PagedKvConfig(None), 4)
    with pytest.raises(ValueError, match="block_size"):
        paged_window_policy(8, PagedKvConfig(None), 0)
    with pytest.raises(TypeError, match="paged"):
        paged_window_policy(8, {"slide_interval": 1}, 4)  # type: ignore[arg-type]


policies = st.builds(
    WindowPolicy,
    sliding_window=st.integers(1, 4096),
    page_size=st.integers(1, 256),
    eviction_interval=st.integers(1, 512),
)


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.integers(0, 10_000),
    max_tokens=st.integers(0, 10_000),
    block=st.integers(1, 256),
    window=st.one_of(st.none(), policies),
)
def test_a_hold_never_exceeds_the_sequence_and_is_the_whole_sequence_without_a_window(prompt, max_tokens, block, window):
    max_seq_len = prompt + max_tokens
    held = paged_hold_positions(max_seq_len, prompt, block, window)
    assert held <= max_seq_len
    if window is None:
        assert held == max_seq_len
    else:
        bound = slide_hold_bound(window.sliding_window, window)
        assert held == min(prompt + bound + block, max_seq_len)
        # A windowed row always keeps its prompt, or the whole sequence if that is shorter.
        assert held >= min(prompt, max_seq_len)
