"""The CPU prefill-attention kernel (`csrc/prefill_attention.c`): against the float64 reference within the
derived bound, in float32 and bf16, over fp16/bf16 pools, with windows; its plan's checks; its threads."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from attention_reference import (
    decode_error_bound,
    prefill_as_decode,
    prefill_case,
    reference,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import built_kernels, needs_compiler
from numerics import rounds_alike, steps

from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
from ferrox_batch.runtime.kv.batch_inputs import PrefillChunk
from ferrox_batch.runtime.kv.prefill_plan import PrefillPlan

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return built_kernels()


def attend(kernels: CpuKernels, q, pool, chunks, window, scale):
    out = kernels.prefill_attention(q, pool, PrefillPlan.of(chunks), scale, window)
    assert out.dtype == q.dtype and out.shape == (q.shape[0], q.shape[1] * q.shape[2])
    return out.view(q.shape)


def expected(q, pool, chunks, window, scale):
    """The exact attention and the kernel's bound, `[rows, kv, g, d]` each, through the decode reference."""
    qd, tables, lo, hi = prefill_as_decode(q, pool, chunks, window)
    bound = decode_error_bound(qd, pool, tables, lo, hi, 1, scale).view(q.shape)
    return reference(qd, pool, tables, lo, hi, 1, scale).view(q.shape), bound


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    kv=st.integers(1, 3),
    g=st.integers(1, 7),  # pass 2 takes a row's heads 3 at a time: 1-3, then 3 + 1, 3 + 2, 3 + 3 + 1
    d=st.sampled_from([4, 12, 16, 24, 40, 64]),  # 4 and 12: the generic path; values 8 at a time, 32, 32 + 8
    window=st.one_of(st.none(), st.integers(1, 12)),
)
def test_float32_matches_the_reference(kernels, seed, kv, g, d, window) -> None:
    q, pool, chunks = prefill_case(random.Random(seed), kv, g, d, torch.float32)
    got = attend(kernels, q, pool, chunks, window, d ** -0.5)
    want, bound = expected(q, pool, chunks, window, d ** -0.5)
    assert bool(((got.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("keys", [112, 128, 129, 256])
def test_long_chunks_whose_keys_fill_whole_blocks_or_one_past(kernels, keys) -> None:
    """Chunks whose keys fill whole 16-key blocks, or one past (a last block of one key and 15 of
    padding): the padding is scored but never read."""
    gen = torch.Generator().manual_seed(keys)
    rows = min(keys, 100)
    pool = torch.randn(keys + 7, 2, 3, 64, generator=gen).half()
    chunks = [PrefillChunk(torch.randperm(keys + 7, generator=gen)[:keys], rows, None)]
    q = torch.randn(rows, 9, 64, generator=gen)
    for window in (None, 50):
        got = attend(kernels, q, pool, chunks, window, 0.125)
        want, bound = expected(q, pool.float(), chunks, window, 0.125)
        assert bool(((got.double() - want).abs() <= bound).all()), window


@pytest.mark.parametrize("seed", range(6))
def test_bfloat16_matches_the_reference_to_bf16_rounding(kernels, seed) -> None:
    q, pool, chunks = prefill_case(random.Random(seed), 3, 3, 64, torch.bfloat16)
    window = None if seed % 2 else 9
    got = attend(kernels, q, pool, chunks, window, 0.125)
    want, bound = expected(q, pool, chunks, window, 0.125)
    # float32 sums within `bound` of the exact value, then one rounding to bf16 (as the decode kernel's test).
    assert bool(((got.double() - want).abs() <= bound + steps(0.5, want.abs() + bound, torch.bfloat16)).all())
    alike = rounds_alike(want, bound, torch.bfloat16)
    assert torch.equal(got[alike], want.to(torch.bfloat16)[alike])
    assert alike.double().mean() > 0.5


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    pool_dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    d=st.sampled_from([4, 24, 64]),
    tiny=st.booleans(),
)
def test_a_narrower_pool_is_widened_exactly(kernels, seed, pool_dtype, d, tiny) -> None:
    """fp16 or bf16 K/V under float32 queries: the float32 result over the widened values (fp16
    subnormals included), within the same bound."""
    q, pool, chunks = prefill_case(random.Random(seed), 2, 3, d, torch.float32)
    narrow = (pool * (1e-5 if tiny else 1.0)).to(pool_dtype)
    if tiny and pool_dtype == torch.float16:
        assert bool(((narrow != 0) & (narrow.abs() < torch.finfo(torch.float16).tiny)).any())
    got = attend(kernels, q, narrow, chunks, None, d ** -0.5)
    want, bound = expected(q, narrow.float(), chunks, None, d ** -0.5)
    assert bool(((got.double() - want).abs() <= bound).all())


def test_the_window_and_the_causal_edge_are_exact(kernels) -> None:
    """A zero scale averages the values each row may see: position s + i sees exactly s + i + 1 of them
    (or the last `window`), so a key one past its range would move the mean."""
    q, pool, chunks = prefill_case(random.Random(4), 2, 2, 16, torch.float32, chunks=2, longest=30)
    for window in (None, 1, 5):
        got = attend(kernels, q, pool, chunks, window, 0.0)
        want, bound = expected(q, pool, chunks, window, 0.0)
        assert bool(((got.double() - want).abs() <= bound).all()), window
        row = 0
        for chunk in chunks:
            start = chunk.ctx_slots.numel() - chunk.length
            for i in range(chunk.length):
                lo = 0 if window is None else max(0, start + i + 1 - window)
                values = pool.double()[chunk.ctx_slots[lo:start + i + 1]][:, 1]  # [keys, kv, d]
                mean = values.mean(0)[:, None, :].expand(2, 2, 16).reshape(4, 16)
                assert bool(((got[row].double() - mean).abs() <= bound[row]).all())
                row += 1


def test_bad_inputs_and_plans_are_clear_errors(kernels) -> None:
    q, pool, chunks = prefill_case(random.Random(2), 2, 2, 8, torch.float32, chunks=2)
    plan = PrefillPlan.of(chunks)
    with pytest.raises(ValueError, match="a pool in one of"):
        kernels.prefill_attention(q, pool.double(), plan, 1.0, None)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.prefill_attention(q.double(), pool, plan, 1.0, None)
    with pytest.raises(ValueError, match="expected"):
        kernels.prefill_attention(q, pool[..., :4], plan, 1.0, None)
    with pytest.raises(ValueError, match="query rows"):
        kernels.prefill_attention(q[1:], pool, plan, 1.0, None)
    with pytest.raises(ValueError, match="sliding window"):
        kernels.prefill_attention(q, pool, plan, 1.0, 0)
    # The pool is read through the plan's slots unchecked: anything out of range is refused first.
    outside = PrefillPlan(plan.slots + pool.shape[0], plan.chunks, plan.rows)
    with pytest.raises(ValueError, match="outside the KV pool"):
        kernels.prefill_attention(q, pool, outside, 1.0, None)
    with pytest.raises(ValueError, match="outside the KV pool"):
        kernels.prefill_attention(q, pool, PrefillPlan(plan.slots - pool.shape[0], plan.chunks, plan.rows), 1.0, None)
    shifted = plan.chunks.clone()
    shifted[1, 3] += 1  # the second chunk's slots would run past the list
    with pytest.raises(ValueError, match="does not match"):
        kernels.prefill_attention(q, pool, PrefillPlan(plan.slots, shifted, plan.rows), 1.0, None)
    longer = plan.chunks.clone()
    longer[0, 1] += 1
    with pytest.raises(ValueError, match="does not match"):
        PrefillPlan(plan.slots, longer, plan.rows).check(pool.shape[0])
    with pytest.raises(ValueError, match="int64"):
        PrefillPlan(plan.slots.int(), plan.chunks, plan.rows).check(pool.shape[0])
    with pytest.raises(ValueError, match="at least one chunk"):
        PrefillPlan.of([])
    with pytest.raises(ValueError, match="cannot attend"):
        PrefillPlan.of([PrefillChunk(torch.arange(2), 3, None)])


def test_a_strided_or_contiguous_query_gives_the_same_bits(kernels) -> None:
    q, pool, chunks = prefill_case(random.Random(3), 2, 3, 16, torch.float32)
    assert not q.is_contiguous()
    assert torch.equal(attend(kernels, q, pool, chunks, None, 0.25), attend(kernels, q.contiguous(), pool, chunks, None, 0.25))


def test_results_do_not_depend_on_the_thread_count(kernels) -> None:
    """Each task (rows x one KV head) is one thread's work in a fixed order, so a team of two, and two
    callers at once, give the bits one thread gives."""
    q, pool, chunks = prefill_case(random.Random(9), 3, 3, 64, torch.bfloat16, chunks=3, longest=70)
    alone = attend(kernels, q, pool, chunks, None, 0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results: list = []
        workers = [threading.Thread(target=lambda: results.append(attend(kernels, q, pool, chunks, None, 0.125)))
                   for _ in range(2)]
        for w in workers:
            w.start()
        results.append(attend(kernels, q, pool, chunks, None, 0.125))
        for w in workers:
            w.join(30)
    finally:
        torch.set_num_threads(threads)
    assert len(results) == 3 and all(torch.equal(got, alone) for got in results)
