"""ContextCeiling: prompt refusal, overflow refusal, the clamp, and the whole-request refusal.

Also the admission order the caller's thread runs before taking a queue slot
(fit, then the block ledger's immovable refusal), as a property over every
(prompt, max_tokens, ceiling, budget): the right refusal comes back and
exactly one counter moves by exactly one; a clamp moves none.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.admission.block_budget import BlockBudget
from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.admission.kv import KvElem, KvShape
from ferrox_batch.checks import UNLIMITED
from ferrox_batch.errors import DecodeError, KvBudgetExceeded


def shape() -> KvShape:
    """2 layers, 1 kv head, head_dim 4, f32: 64 bytes per token."""
    return KvShape(2, 8, KvElem.F32)


def test_a_request_past_the_ceiling_is_refused_in_bytes_and_is_not_retryable():
    ceiling = ContextCeiling(100, shape())
    assert ceiling.refusal(100) is None, "exactly at the limit fits"
    err = ceiling.refusal(101)
    assert isinstance(err, KvBudgetExceeded)
    assert err.binding == "context_length_exceeded"
    assert (err.estimated_bytes, err.limit_bytes) == (101 * 64, 100 * 64)
    assert (err.positions, err.positions_limit) == (101, 100)
    assert err.detail == (
        "request asks for 101 token positions (prompt + max_tokens) but this deployment admits "
        "100 per request; shorten the prompt or lower max_tokens"
    )
    assert err.retry_after_secs is None
    assert ceiling.refused() == 1


def test_no_ceiling_refuses_nothing():
    ceiling = ContextCeiling(None, shape())
    assert ceiling.refusal(UNLIMITED // 2) is None
    assert ceiling.prompt_refusal(UNLIMITED) is None
    assert ceiling.fit(10**9, 10**9) == 10**9
    assert ceiling.refused() == 0
    assert ceiling.limit() is None


def test_a_prompt_longer_than_the_ceiling_names_that_ceiling():
    ceiling = ContextCeiling(6, shape())
    err = ceiling.fit(8, 2)
    assert isinstance(err, KvBudgetExceeded)
    assert err.binding == "context_length_exceeded"
    assert (err.positions, err.positions_limit) == (8, 6)
    assert (err.estimated_bytes, err.limit_bytes) == (8 * 64, 6 * 64)
    assert err.detail == "prompt is too long: 8 tokens > 6 maximum"
    assert "prompt is too long" in str(err)
    assert ceiling.refused() == 1
    assert ceiling.fit(4, 2) == 2, "exactly at the ceiling is admitted"
    assert ceiling.refused() == 1


def test_a_prompt_exactly_at_the_ceiling_is_refused_with_upstreams_wording():
    ceiling = ContextCeiling(6, shape())
    err = ceiling.prompt_refusal(6)
    assert err is not None and err.detail == "prompt is too long: 6 tokens > 6 maximum"
    assert ceiling.prompt_refusal(5) is None


def test_an_output_budget_past_the_ceiling_is_clamped_rather_than_refused():
    ceiling = ContextCeiling(6, shape())
    assert ceiling.fit(4, 10**12) == 2
    assert ceiling.fit(4, UNLIMITED - 4) == 2
    assert ceiling.refused() == 0, "a clamp is not a refusal"


def test_a_max_tokens_that_wraps_the_position_sum_is_refused():
    ceiling = ContextCeiling(100, shape())
    err = ceiling.overflow_refusal(10, UNLIMITED)
    assert isinstance(err, KvBudgetExceeded)
    assert "max_tokens" in str(err)
    assert err.detail == (
        f"prompt of 10 tokens plus max_tokens of {UNLIMITED} overflows the position counter, so "
        "this request cannot be served by any deployment. Send a max_tokens that fits the model's context"
    )
    assert (err.estimated_bytes, err.limit_bytes) == (0, 0)
    assert (err.positions, err.positions_limit) == (UNLIMITED, 100)
    assert ceiling.refused() == 1


def test_a_wrapping_sum_is_refused_even_with_no_ceiling_configured():
    ceiling = ContextCeiling(None, shape())
    err = ceiling.overflow_refusal(10, UNLIMITED)
    assert err is not None and err.positions_limit == UNLIMITED
    assert ceiling.overflow_refusal(10, 100) is None
    assert ceiling.overflow_refusal(1, UNLIMITED - 1) is None, "exactly 2**64 - 1 is representable"
    assert isinstance(ceiling.fit(1, UNLIMITED), KvBudgetExceeded)
    assert ceiling.refused() == 2


def test_an_ordinary_request_past_the_ceiling_is_left_for_the_clamp():
    ceiling = ContextCeiling(100, shape())
    assert ceiling.overflow_refusal(10, 50) is None
    assert ceiling.overflow_refusal(10, 200) is None
    assert ceiling.refused() == 0


def test_a_huge_but_representable_max_tokens_reports_bytes_instead_of_raising():
    ceiling = ContextCeiling(100, shape())
    positions = 10 + UNLIMITED // 64
    assert ceiling.bytes_for(positions) > UNLIMITED // 2
    err = ceiling.refusal(positions)
    assert err is not None and "100" in str(err)


def test_the_prompt_refusal_is_reported_before_the_overflow():
    ceiling = ContextCeiling(6, shape())
    err = ceiling.fit(9, UNLIMITED)
    assert isinstance(err, KvBudgetExceeded) and err.detail.startswith("prompt is too long")
    assert ceiling.refused() == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "6"])
def test_a_ceiling_must_be_a_positive_integer_or_none(bad):
    with pytest.raises((TypeError, ValueError), match="max_context"):
        ContextCeiling(bad, shape())


def test_a_ceiling_needs_a_shape_and_refuses_bad_counts_without_counting():
    with pytest.raises(TypeError, match="shape"):
        ContextCeiling(10, None)  # type: ignore[arg-type]
    ceiling = ContextCeiling(10, shape())
    for call in (
        lambda: ceiling.fit(-1, 1),
        lambda: ceiling.fit(20, -1),
        lambda: ceiling.fit(1, 2.0),
        lambda: ceiling.prompt_refusal(True),
        lambda: ceiling.overflow_refusal(1, None),
        lambda: ceiling.refusal(-5),
    ):
        with pytest.raises((TypeError, ValueError)):
            call()
    assert ceiling.refused() == 0


def test_the_refusal_counter_is_exact_under_concurrent_refusals():
    ceiling = ContextCeiling(4, shape())
    barrier = threading.Barrier(8)

    def refuse() -> None:
        barrier.wait()
        for _ in range(500):
            ceiling.refusal(5)

    threads = [threading.Thread(target=refuse) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ceiling.refused() == 8 * 500


# --- the admission order, as a property ------------------------------------------------------

counts = st.integers(0, 2000)
huge = st.sampled_from([UNLIMITED, UNLIMITED - 1, UNLIMITED // 2, 2**63])


def admission(ceiling: ContextCeiling, budget: BlockBudget, prompt: int, max_tokens: int) -> int | DecodeError:
    """What the caller's thread does before it takes a queue slot (docs/upstream.md, Admission): fit, then the immovable check."""
    fitted = ceiling.fit(prompt, max_tokens)
    if isinstance(fitted, DecodeError):
        return fitted
    refusal = budget.immovable_refusal(prompt + fitted)
    return refusal if refusal is not None else fitted


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.one_of(counts, huge),
    max_tokens=st.one_of(counts, huge),
    limit=st.one_of(st.none(), st.integers(1, 2500)),
    block=st.integers(1, 64),
    total=st.one_of(st.none(), st.integers(0, 100)),
)
def test_admission_returns_the_refusal_the_spec_orders_and_moves_exactly_one_counter(
    prompt, max_tokens, limit, block, total
):
    ceiling = ContextCeiling(limit, shape())
    budget = BlockBudget(block, total, ceiling)
    free_before = budget.free()
    outcome = admission(ceiling, budget, prompt, max_tokens)
    moved = (ceiling.refused(), budget.rejected_too_large())

    if limit is not None and prompt >= limit:
        assert isinstance(outcome, KvBudgetExceeded)
        assert outcome.detail == f"prompt is too long: {prompt} tokens > {limit} maximum"
        assert moved == (1, 0)
    elif prompt + max_tokens > UNLIMITED:
        assert isinstance(outcome, KvBudgetExceeded)
        assert "overflows the position counter" in outcome.detail
        assert outcome.positions_limit == (UNLIMITED if limit is None else limit)
        assert moved == (1, 0)
    else:
        served = max_tokens if limit is None else min(max_tokens, limit - prompt)
        held = prompt + served
        blocks = max(1, -(-held // block))
        if total is not None and blocks > total:
            assert isinstance(outcome, KvBudgetExceeded)
            assert outcome.binding == "device_memory_budget_exceeded"
            assert (outcome.positions, outcome.positions_limit) == (held, total * block)
            assert moved == (0, 1)
        else:
            assert outcome == served, "a clamp (or nothing) is not a refusal"
            assert moved == (0, 0)
    assert budget.free() == free_before, "refusing never reserves"


@settings(max_examples=300, deadline=None)
@given(
    positions=st.integers(0, 5000),
    limit=st.one_of(st.none(), st.integers(1, 5000)),
    block=st.integers(1, 64),
    total=st.one_of(st.none(), st.integers(0, 200)),
)
def test_the_context_ceiling_is_checked_before_the_whole_budget(positions, limit, block, total):
    ceiling = ContextCeiling(limit, shape())
    budget = BlockBudget(block, total, ceiling)
    err = budget.immovable_refusal(positions)
    if limit is not None and positions > limit:
        assert isinstance(err, KvBudgetExceeded) and err.binding == "context_length_exceeded"
        assert (ceiling.refused(), budget.rejected_too_large()) == (1, 0)
    elif total is not None and max(1, -(-positions // block)) > total:
        assert isinstance(err, KvBudgetExceeded) and err.binding == "device_memory_budget_exceeded"
        assert (ceiling.refused(), budget.rejected_too_large()) == (0, 1)
    else:
        assert err is None
        assert (ceiling.refused(), budget.rejected_too_large()) == (0, 0)
