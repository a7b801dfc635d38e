"""BlockBudget: the block ledger admission reserves from, and its immovable refusal."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.admission.block_budget import BlockBudget
from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.admission.kv import KvElem, KvShape
from ferrox_batch.checks import UNLIMITED
from ferrox_batch.errors import KvBudgetExceeded


def shape() -> KvShape:
    return KvShape(2, 8, KvElem.F32)  # 64 bytes per token


def budget(block: int, total: int | None, max_context: int | None = None) -> BlockBudget:
    return BlockBudget(block, total, ContextCeiling(max_context, shape()))


def test_blocks_are_counted_in_positions_and_always_round_up():
    b = budget(4, 8)
    assert [b.blocks_for(p) for p in (0, 1, 4, 5, 8, 9)] == [1, 1, 1, 2, 2, 3]


def test_an_unconfigured_budget_admits_everything():
    b = budget(4, None)
    assert b.total is None
    assert b.immovable_refusal(UNLIMITED) is None
    assert b.try_reserve(1_000_000)
    b.release(1_000_000)
    assert b.free() == 0, "no budget reports zero free, as upstream's stats do"
    assert b.rejected_too_large() == 0


def test_a_request_larger_than_the_whole_budget_is_refused_rather_than_queued():
    b = budget(4, 2)
    err = b.immovable_refusal(6 + 8)
    assert isinstance(err, KvBudgetExceeded)
    assert err.binding == "device_memory_budget_exceeded"
    assert (err.positions, err.positions_limit) == (14, 8)
    assert (err.estimated_bytes, err.limit_bytes) == (shape().kv_bytes_for_tokens(14), shape().kv_bytes_for_tokens(8))
    assert err.detail == (
        "request needs 4 KV blocks (14 token positions at 4 per block) but this server's whole KV "
        "budget is 2 blocks; an idle server would refuse it identically"
    )
    assert "14" in str(err)
    assert err.retry_after_secs is None
    assert b.rejected_too_large() == 1 and b.ceiling.refused() == 0
    assert b.free() == 2, "a refusal reserves nothing"
    assert b.immovable_refusal(4 + 4) is None, "a fitting request still fits"
    assert b.try_reserve(2) and b.free() == 0


def test_the_context_ceiling_is_reported_before_the_device_ceiling():
    b = budget(4, 2, max_context=6)
    err = b.immovable_refusal(20)
    assert isinstance(err, KvBudgetExceeded) and err.binding == "context_length_exceeded"
    assert b.ceiling.refused() == 1 and b.rejected_too_large() == 0


def test_without_ceilings_nothing_is_refused_as_too_large():
    b = budget(4, None)
    assert b.immovable_refusal(10**12) is None
    assert b.ceiling.refused() == 0 and b.rejected_too_large() == 0


def test_a_row_is_priced_by_every_position_it_requests():
    b = budget(4, 48, max_context=1000)
    assert isinstance(b.immovable_refusal(403), KvBudgetExceeded), "403 positions need 101 blocks"


def test_a_sliding_row_is_priced_by_what_it_holds_and_ceilinged_by_what_it_requests():
    """Upstream's two counts: the context ceiling sees prompt + max_tokens, the ledger the held positions."""
    b = budget(4, 48, max_context=1000)
    assert b.immovable_refusal(403, 191) is None, "191 held positions take 48 blocks"
    err = b.immovable_refusal(403, 193)
    assert isinstance(err, KvBudgetExceeded) and err.positions == 193 and "needs 49 KV blocks" in err.detail
    narrow = budget(4, 48, max_context=400)
    err = narrow.immovable_refusal(403, 191)
    assert isinstance(err, KvBudgetExceeded) and err.binding == "context_length_exceeded"
    assert narrow.rejected_too_large() == 0 and b.rejected_too_large() == 1


def test_a_zero_block_budget_refuses_every_request_as_too_large():
    b = budget(4, 0)
    err = b.immovable_refusal(0)
    assert isinstance(err, KvBudgetExceeded) and "whole KV budget is 0 blocks" in err.detail


def test_reserve_is_all_or_nothing_and_release_gives_back():
    b = budget(4, 4)
    assert b.try_reserve(3) and b.free() == 1
    assert not b.try_reserve(2), "more than free is refused"
    assert b.free() == 1, "a refused reserve changes nothing"
    assert b.try_reserve(0) and b.free() == 1
    b.release(3)
    assert b.free() == 4


def test_releasing_more_than_was_reserved_is_an_error_and_changes_nothing():
    b = budget(4, 4)
    assert b.try_reserve(2)
    with pytest.raises(ValueError, match="over-release"):
        b.release(3)
    assert b.free() == 2
    b.release(2)
    with pytest.raises(ValueError, match="over-release"):
        b.release(1)
    assert b.free() == 4


def test_the_block_size_must_be_positive():
    with pytest.raises(ValueError, match="kv block size must be positive"):
        budget(0, 4)
    with pytest.raises(ValueError, match="kv block size must be positive"):
        budget(-4, 4)
    with pytest.raises(TypeError, match="kv block size"):
        budget(4.0, 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="kv block size"):
        budget(True, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "call",
    [
        lambda b: BlockBudget(4, -1, b.ceiling),
        lambda b: BlockBudget(4, 2.0, b.ceiling),
        lambda b: BlockBudget(4, 2, None),
        lambda b: b.blocks_for(-1),
        lambda b: b.blocks_for(1.5),
        lambda b: b.blocks_for(False),
        lambda b: b.try_reserve(-1),
        lambda b: b.try_reserve(1.0),
        lambda b: b.release(-1),
        lambda b: b.release(True),
        lambda b: b.immovable_refusal(-1),
        lambda b: b.immovable_refusal("1"),
        lambda b: b.immovable_refusal(4, -1),
        lambda b: b.immovable_refusal(4, 1.0),
    ],
)
def test_bad_input_is_an_error_never_a_wrong_number(call):
    b = budget(4, 4)
    with pytest.raises((TypeError, ValueError)):
        call(b)
    assert b.free() == 4 and b.rejected_too_large() == 0


# --- properties ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(positions=st.integers(0, UNLIMITED), block=st.integers(1, 10**6))
def test_blocks_for_is_the_ceiling_division_and_never_zero(positions, block):
    b = budget(block, None)
    expected = max(1, -(-positions // block))
    assert b.blocks_for(positions) == expected
    assert b.blocks_for(positions) * block >= positions
    assert positions == 0 or (b.blocks_for(positions) - 1) * block < positions


ops = st.lists(st.tuples(st.sampled_from(["reserve", "release"]), st.integers(0, 12)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 40), script=ops)
def test_any_interleaving_keeps_the_ledger_between_zero_and_total(total, script):
    b = budget(4, total)
    held: list[int] = []
    for op, n in script:
        before = b.free()
        if op == "reserve":
            ok = b.try_reserve(n)
            assert ok == (n <= before)
            if ok:
                held.append(n)
            else:
                assert b.free() == before, "a refused reserve changes nothing"
        elif held:
            b.release(held.pop(n % len(held)))
        else:
            if n > 0:
                with pytest.raises(ValueError):
                    b.release(n)
            assert b.free() == before
        assert 0 <= b.free() <= total
        assert b.free() == total - sum(held)
    for n in held:
        b.release(n)
    assert b.free() == total


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), total=st.integers(1, 64))
def test_sixteen_threads_of_random_reserve_and_release_leave_the_ledger_where_the_arithmetic_says(seed, total):
    b = budget(16, total)
    barrier = threading.Barrier(16)
    kept: list[int] = [0] * 16
    violations: list[int] = []

    def worker(index: int) -> None:
        rng = random.Random(seed + index)
        mine: list[int] = []
        barrier.wait()
        for _ in range(300):
            if mine and rng.random() < 0.5:
                b.release(mine.pop(rng.randrange(len(mine))))
            else:
                n = rng.randint(0, 5)
                if b.try_reserve(n):
                    mine.append(n)
            free = b.free()
            if not 0 <= free <= total:
                violations.append(free)
        # Keep a random part of what this thread holds, to check the final arithmetic.
        while mine and rng.random() < 0.7:
            b.release(mine.pop())
        kept[index] = sum(mine)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert violations == []
    assert b.free() == total - sum(kept)
