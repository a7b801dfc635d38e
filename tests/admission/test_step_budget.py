"""The per-tick token budget (docs/upstream.md, Step budget): upstream unit tests and the
per-tick work invariants for all inputs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.admission import config
from ferrox_batch.admission.step_budget import DEFAULT_MAX_BATCH_TOKENS, MIN_PREFILL_CHUNK, prefill_budget

CHUNK = 128


def test_the_constants_are_the_upstream_ones_and_shared_with_config() -> None:
    assert MIN_PREFILL_CHUNK == 16
    assert DEFAULT_MAX_BATCH_TOKENS == 256
    assert DEFAULT_MAX_BATCH_TOKENS is config.DEFAULT_MAX_BATCH_TOKENS


def test_an_empty_batch_prefills_at_the_configured_chunk() -> None:
    assert prefill_budget(DEFAULT_MAX_BATCH_TOKENS, 0, CHUNK) == CHUNK


def test_a_wider_batch_prefills_less() -> None:
    narrow = prefill_budget(DEFAULT_MAX_BATCH_TOKENS, 8, CHUNK)
    wide = prefill_budget(DEFAULT_MAX_BATCH_TOKENS, 160, CHUNK)
    assert wide < narrow

    def total(rows: int) -> int:
        return rows + prefill_budget(DEFAULT_MAX_BATCH_TOKENS, rows, CHUNK)

    for rows in [0, 1, 8, 64, 128, 200, 1000]:
        assert total(rows) <= rows + CHUNK, "the budget may only ever take work away"
        if rows + MIN_PREFILL_CHUNK <= DEFAULT_MAX_BATCH_TOKENS:
            assert total(rows) <= DEFAULT_MAX_BATCH_TOKENS
        else:
            assert total(rows) == rows + MIN_PREFILL_CHUNK, "a batch wider than the budget degrades to the floor"


def test_a_saturated_batch_still_advances_its_prompts() -> None:
    prompt, done, ticks = 600, 0, 0
    while done < prompt:
        step = prefill_budget(DEFAULT_MAX_BATCH_TOKENS, 100_000, CHUNK)
        assert step > 0, "a saturated batch prefilled nothing"
        done += step
        ticks += 1
        assert ticks < 1000
    assert ticks == math.ceil(prompt / MIN_PREFILL_CHUNK)


def test_the_configured_chunk_is_never_exceeded() -> None:
    for rows in [0, 1, 7, 64]:
        assert prefill_budget(DEFAULT_MAX_BATCH_TOKENS, rows, 32) <= 32


def test_a_chunk_smaller_than_the_floor_does_not_panic() -> None:
    assert prefill_budget(DEFAULT_MAX_BATCH_TOKENS, 0, 4) == MIN_PREFILL_CHUNK
    # The floor wins over the tests' favourite `prefill_chunk = 1` (docs/upstream.md Q1).
    assert prefill_budget(DEFAULT_MAX_BATCH_TOKENS, 0, 1) == MIN_PREFILL_CHUNK
    assert prefill_budget(0, 0, 0) == MIN_PREFILL_CHUNK


sizes = st.integers(min_value=0, max_value=5000)


@settings(max_examples=500, deadline=None)
@given(sizes, sizes, sizes)
def test_per_tick_work_invariants_hold_for_all_inputs(max_batch_tokens: int, rows: int, chunk: int) -> None:
    budget = prefill_budget(max_batch_tokens, rows, chunk)
    ceiling = max(chunk, MIN_PREFILL_CHUNK)
    # The formula itself.
    assert budget == min(max(max(0, max_batch_tokens - rows), MIN_PREFILL_CHUNK), ceiling)
    # Progress: every tick advances a prompt by at least the floor.
    assert budget >= MIN_PREFILL_CHUNK
    # The configured chunk stays a ceiling whenever it is at least the floor.
    assert budget <= ceiling
    if chunk >= MIN_PREFILL_CHUNK:
        assert budget <= chunk
    # Total work never exceeds what a fixed chunk cost.
    assert rows + budget <= rows + ceiling
    # It stays within the budget while the floor fits, else is rows + floor.
    if rows + MIN_PREFILL_CHUNK <= max_batch_tokens:
        assert rows + budget <= max_batch_tokens
    else:
        assert rows + budget == rows + MIN_PREFILL_CHUNK
    # An empty batch gets the whole ceiling when the budget allows it.
    if rows == 0 and max_batch_tokens >= ceiling:
        assert budget == ceiling
    # A wider batch never prefills more.
    assert prefill_budget(max_batch_tokens, rows + 1, chunk) <= budget


@pytest.mark.parametrize("name", ["max_batch_tokens", "decode_rows", "configured_chunk"])
@pytest.mark.parametrize(
    ("bad", "error"),
    [(-1, ValueError), (1.5, TypeError), (16.0, TypeError), (True, TypeError), ("16", TypeError), (None, TypeError)],
)
def test_bad_sizes_are_refused_by_name(name: str, bad: object, error: type) -> None:
    args = {"max_batch_tokens": 256, "decode_rows": 0, "configured_chunk": 128, name: bad}
    with pytest.raises(error, match=name):
        prefill_budget(**args)  # type: ignore[arg-type]
