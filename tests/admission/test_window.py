"""The sliding-window hold arithmetic (docs/upstream.md, Paged KV and held positions; D8).

Pins the upstream's worked examples (window 8, page 4, interval 128, prompt 3, 400 tokens: a bound of 184,
191 held positions, 48 blocks against 101; a decode slide at position 4096 with window 512 and page 64
gives back [0, 3456)) and, as properties, what the ledger and the store rely on: a hold never exceeds the
row's length and grows with its prompt and its length, a slide gives back whole pages only, never one a
query inside the window still reads, never one already given back or locked, and decode slides come only
every interval.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferrox_batch.admission.block_budget import blocks_for
from ferrox_batch.admission.window import (
    DEFAULT_SWA_EVICTION_INTERVAL,
    SWA_RETAIN_GAP,
    Release,
    RowHold,
    SlideRequest,
    WindowPolicy,
    decode_slide,
    paged_hold_positions,
    prefill_slide,
    row_hold,
    slide_hold_bound,
    window_policy,
)

policies = st.builds(WindowPolicy, st.integers(1, 600), st.integers(1, 64), st.integers(1, 300))


def test_the_upstream_example_holds_48_blocks_where_every_position_takes_101():
    policy = WindowPolicy.new(8, 4)
    assert policy.eviction_interval == DEFAULT_SWA_EVICTION_INTERVAL == 128 and SWA_RETAIN_GAP == 16
    assert slide_hold_bound(8, policy) == 184
    assert paged_hold_positions(3 + 400, 3, 4, policy) == 191
    assert blocks_for(191, 4) == 48
    assert paged_hold_positions(3 + 400, 3, 4, None) == 403 and blocks_for(403, 4) == 101
    assert row_hold(3, 403, 4, policy) == RowHold(191, policy)


def test_the_upstream_decode_slide_example():
    policy = WindowPolicy.new(512, 64)
    assert decode_slide(SlideRequest(4096, decode_step=1), policy, 128) == Release(0, 3456)
    assert decode_slide(SlideRequest(4096, decode_step=1), policy, 127) is None, "only every interval"
    assert decode_slide(SlideRequest(4096, decode_step=0), policy, 128) is None, "only once it decodes"
    assert decode_slide(SlideRequest(4096, 3456, decode_step=9), policy, 256) is None, "nothing new to give back"
    assert decode_slide(SlideRequest(4096, 0, 1024, 1), policy, 128) == Release(1024, 3456), "locked stays"
    assert prefill_slide(SlideRequest(4096), policy) == Release(0, 3520)


def test_the_interval_is_at_least_one_step_and_the_policy_is_validated():
    policy = WindowPolicy.new(8, 4)
    assert policy.with_eviction_interval(0).eviction_interval == 1
    assert policy.with_eviction_interval(-5).eviction_interval == 1
    assert policy.with_eviction_interval(32) == WindowPolicy(8, 4, 32)
    for bad in ((0, 4), (8, 0), (8.0, 4), (True, 4)):
        with pytest.raises((TypeError, ValueError)):
            WindowPolicy.new(*bad)
    with pytest.raises(ValueError):
        WindowPolicy(8, 4, 0)


def test_only_a_uniform_window_gives_a_policy():
    assert window_policy(None, 16, 128) is None
    assert window_policy(4096, 16, 64) == WindowPolicy(4096, 16, 64)


def test_a_row_slides_only_when_that_saves_blocks():
    policy = WindowPolicy.new(8, 4)
    assert row_hold(3, 40, 4, policy) == RowHold(40, None), "a short row keeps every page"
    assert row_hold(3, 40, 4, None) == RowHold(40, None)
    # 191 held positions are 48 blocks; a row of 190 positions takes 48 blocks whole: no saving.
    assert row_hold(3, 190, 4, policy) == RowHold(190, None)
    assert row_hold(3, 196, 4, policy) == RowHold(191, policy)


@given(policy=policies, prompt=st.integers(0, 5000), extra=st.integers(0, 5000), block=st.integers(1, 64))
def test_a_hold_never_exceeds_the_row_nor_falls_below_its_prompt(policy, prompt, extra, block):
    length = prompt + extra
    held = paged_hold_positions(length, prompt, block, policy)
    assert prompt <= held <= length
    assert paged_hold_positions(length, prompt, block, None) == length
    hold = row_hold(prompt, length, block, policy)
    assert hold.positions <= length
    if hold.window is not None:
        assert hold.positions == held and blocks_for(held, block) < blocks_for(length, block)
    else:
        assert hold.positions == length


@given(policy=policies, prompt=st.integers(0, 5000), more=st.integers(0, 500), max_tokens=st.integers(0, 5000),
       block=st.integers(1, 64))
def test_a_hold_grows_with_the_prompt(policy, prompt, more, max_tokens, block):
    # For a fixed length, and for a fixed generation budget.
    length = prompt + more + max_tokens
    assert paged_hold_positions(length, prompt, block, policy) <= paged_hold_positions(length, prompt + more, block,
                                                                                      policy)
    assert paged_hold_positions(prompt + max_tokens, prompt, block, policy) <= paged_hold_positions(
        prompt + more + max_tokens, prompt + more, block, policy)
    assert paged_hold_positions(prompt + max_tokens, prompt, block, policy) <= paged_hold_positions(
        prompt + max_tokens + more, prompt, block, policy), "and with the length"


slides = st.builds(
    lambda position, released_pages, locked_pages, step: (position, released_pages, locked_pages, step),
    st.integers(0, 20_000), st.integers(0, 400), st.integers(0, 400), st.integers(0, 1000),
)


@given(policy=policies, slide=slides, forward_iter=st.integers(0, 5000), decode=st.booleans())
def test_a_slide_gives_back_whole_pages_no_query_in_the_window_still_reads(policy, slide, forward_iter, decode):
    position, released_pages, locked_pages, step = slide
    page, window = policy.page_size, policy.sliding_window
    request = SlideRequest(position, released_pages * page, locked_pages * page, step)
    got = decode_slide(request, policy, forward_iter) if decode else prefill_slide(request, policy)
    if decode and (forward_iter % policy.eviction_interval or step < 1):
        assert got is None
    if got is None:
        return
    assert got.start == max(request.already_released, request.locked_prefix) < got.end
    assert got.start % page == 0 and got.end % page == 0, "whole pages"
    # The query at `position` (and every later one) reads positions above `position - window`.
    assert got.end <= position + 1 - window
    assert got.end <= position - window - page - (1 if decode else 0), "a page of margin below the window"
    again = SlideRequest(position, got.end, request.locked_prefix, step)
    repeated = decode_slide(again, policy, policy.eviction_interval) if decode else prefill_slide(again, policy)
    assert repeated is None, "what was given back is not given back again"
