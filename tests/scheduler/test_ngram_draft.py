"""The n-gram draft for speculative decoding: the index gives what a plain scan of the sequence gives.

Pins (property tests): for any sequence grown token by token and any k and n range, the draft is the up-to-k
tokens after the latest earlier occurrence of the longest suffix in range that occurred, never the suffix
itself; no occurrence gives no draft; bad ranges are refused.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.scheduler.ngram_draft import NgramIndex, reference_draft


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=60), k=st.integers(0, 6), n_min=st.integers(1, 3),
       extra=st.integers(0, 3), split=st.integers(0, 60))
def test_the_index_drafts_what_a_scan_finds(tokens, k, n_min, extra, split):
    n_max = n_min + extra
    index = NgramIndex(n_min, n_max, tokens[:split])
    for i in range(min(split, len(tokens)), len(tokens) + 1):
        assert index.draft(k) == reference_draft(tokens[:i], k, n_min, n_max), (tokens[:i], k)
        if i < len(tokens):
            index.append(tokens[i])
    assert len(index) == len(tokens)


def test_a_repeated_span_is_drafted_and_a_fresh_one_is_not():
    index = NgramIndex(2, 3, [1, 2, 3, 4, 5, 9, 1, 2])
    assert index.draft(3) == [3, 4, 5]
    assert NgramIndex(2, 3, [1, 2, 3, 4]).draft(3) == []
    assert index.draft(0) == []
    longest = NgramIndex(1, 3, [7, 1, 2, 8, 5, 2, 6, 1, 2])  # "1 2" occurred: its follower wins over "2"'s
    assert longest.draft(1) == [8]


def test_a_recent_occurrence_copies_on_as_a_repeat():
    assert NgramIndex(2, 2, [5, 8, 8, 8]).draft(4) == [8, 8, 8, 8]  # a run of one token goes on
    assert NgramIndex(2, 2, [1, 2, 1, 2, 1]).draft(5) == [2, 1, 2, 1, 2]  # period 2
    assert NgramIndex(2, 3, [4, 1, 2, 3, 1, 2]).draft(5) == [3, 1, 2, 3, 1]


@given(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(1, 5), st.integers(1, 8),
       st.integers(0, 2))
def test_a_periodic_sequence_is_drafted_as_its_continuation(pattern, repeats, k, extra):
    """A sequence that repeats `pattern` is drafted as the repetition going on. With n at least the
    pattern's length, equal n-grams of it lie a whole number of (smallest) periods apart, so whichever
    occurrence is the latest, copying on from it continues the cycle."""
    tokens = pattern * (repeats + 1)
    cycle = pattern * (k // len(pattern) + 2)
    draft = NgramIndex(len(pattern), len(pattern) + extra, tokens).draft(k)
    assert draft == cycle[:k], (tokens, draft)


@pytest.mark.parametrize("n_min, n_max", [(0, 2), (3, 2), (-1, 1)])
def test_bad_ranges_are_refused(n_min, n_max):
    with pytest.raises(ValueError):
        NgramIndex(n_min, n_max)
