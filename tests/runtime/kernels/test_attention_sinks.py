"""Attention sinks (gpt-oss) in the CPU attention kernels: each query head's learned logit joins its softmax's max and
denominator and has no value. Both kernels against a float64 reference within a bound derived from the arithmetic,
on every path (this machine's build, and on x86 the AVX2 one and the scalar one: the tiled loops for head sizes that
are a multiple of 8 where AVX2 is, the generic loop for the rest), with a distinct sink per query head so that a head
read with another's sink is caught; no sinks are the same bits as before; bad sinks are refused."""

from __future__ import annotations

import platform
import random

import pytest
import torch
from attention_reference import KERNEL_EXP_ULPS, context, prefill_as_decode, prefill_case, random_case
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import built_kernels, needs_compiler
from numerics import gamma, steps, unit_roundoff

from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
from ferrox_batch.runtime.kv.prefill_plan import PrefillPlan

pytestmark = needs_compiler

BUILDS = ("native", "avx2", "scalar")
POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(scope="module")
def builds(request: pytest.FixtureRequest) -> dict[str, CpuKernels]:
    """This machine's build, and on x86 the AVX2-only and scalar ones (`kernel_builds.X86_FLAGS`)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return {"native": built_kernels()}
    return request.getfixturevalue("forced_kernel_builds")


def sinks_for(gen: torch.Generator, heads: int, spread: float, offset: float) -> torch.Tensor:
    """One float32 sink logit per query head, all distinct (so a head given another's sink is caught)."""
    return (torch.randn(heads, generator=gen, dtype=torch.float64) * spread + offset).float()


def with_sink(q, pool, tables, lo, hi, block, scale, sinks, i):
    """Sequence i's exact scores with each head's sink as one more position (`[kv, g, L + 1]`), its values with a
    zero value for the sink (`[kv, L + 1, d]`), and its query and keys in float64."""
    k, v = context(pool, tables, lo, hi, block, i)  # [kv, L, d]
    kv, g, d = q.shape[1:]
    qi = q[i].double()
    scores = torch.cat([torch.einsum("hgd,hld->hgl", qi, k) * scale, sinks.double().view(kv, g, 1)], -1)
    values = torch.cat([v, torch.zeros(kv, 1, d, dtype=torch.float64)], 1)
    return scores, values, qi, k


def sink_reference(q, pool, tables, lo, hi, block, scale, sinks) -> torch.Tensor:
    """Exact attention with sinks: softmax over the scores and the sink logit, the sink's value zero; a sequence
    with no keys gets zeros."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        if hi[i] > lo[i]:
            scores, values, _, _ = with_sink(q, pool, tables, lo, hi, block, scale, sinks, i)
            out[i] = torch.einsum("hgl,hld->hgd", torch.softmax(scores, -1), values)
    return out


def sink_error_bound(q, pool, tables, lo, hi, block, scale, sinks) -> torch.Tensor:
    """`attention_reference.decode_error_bound` with the sink as one more position: its score read exactly (a
    float32 input, no products), its value zero. Per output element, to first order, u = 2**-24:
    * a score: gamma_{d+1} * |scale| * sum_e |q_e k_te|; the sink's: 0;
    * a weight, relative: its score's error and the max's (the largest score error), u * (max - s_t) from the
      subtraction (the max now over the sink too) and exp's KERNEL_EXP_ULPS (2u each), moving the output by
      p_t * eps_t * |v_t - out| (for the sink, p_sink * eps_sink * |out|);
    * the sums: the values' over L positions, the denominator's over L + 1: gamma_{L+1} * (sum_t p_t |v_t| + |out|);
    * 1 / sum and the final product: 2u * |out|.
    A sequence with no keys gets exact zeros: bound 0."""
    u = unit_roundoff(torch.float32)
    d = q.shape[3]
    bound = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        if hi[i] == lo[i]:
            continue
        scores, values, qi, k = with_sink(q, pool, tables, lo, hi, block, scale, sinks, i)
        key_error = gamma(d + 1) * abs(scale) * torch.einsum("hgd,hld->hgl", qi.abs(), k.abs())
        score_error = torch.cat([key_error, torch.zeros_like(key_error[..., :1])], -1)
        p = torch.softmax(scores, -1)  # [kv, g, L + 1]
        out = torch.einsum("hgl,hld->hgd", p, values)
        weight_error = (score_error + score_error.amax(-1, keepdim=True)
                        + u * (scores.amax(-1, keepdim=True) - scores) + 2 * KERNEL_EXP_ULPS * u)
        spread = (values[:, None, :, :] - out[:, :, None, :]).abs()  # [kv, g, L + 1, d]
        moved = torch.einsum("hgl,hgld->hgd", p * weight_error, spread)
        summed = gamma(scores.shape[-1]) * (torch.einsum("hgl,hld->hgd", p, values.abs()) + out.abs())
        bound[i] = moved + summed + 2 * u * out.abs()
    return bound


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    """Within the float32 bound, and for a bf16 result also within half a bf16 step of where that lies."""
    if got.dtype == torch.bfloat16:
        bound = bound + steps(0.5, want.abs() + bound, torch.bfloat16)
    assert bool(((got.double() - want).abs() <= bound).all()), float(((got.double() - want).abs() - bound).max())


sink_cases = dict(
    build=st.sampled_from(BUILDS),
    seed=st.integers(0, 2**20),
    kv=st.integers(1, 3),
    g=st.integers(1, 5),  # the tiled loops take a KV head's query heads 3 at a time: 1-3, then 3 + 1, 3 + 2
    d=st.sampled_from([6, 12, 8, 16, 40, 64]),  # 6, 12: the generic loop; 8 at a time, 32, 32 + 8
    window=st.one_of(st.none(), st.integers(1, 12)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    pool_dtype=st.sampled_from(POOL_DTYPES),
    # The sinks' size against the scores (about unit normal at scale d**-0.5): from negligible to dominant.
    offset=st.sampled_from([-6.0, 0.0, 2.0, 8.0]),
)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 5), block=st.sampled_from([1, 4, 16]), **sink_cases)
def test_decode_with_sinks_matches_the_reference(builds, build, seed, n, kv, g, d, block, window, dtype, pool_dtype,
                                                 offset) -> None:
    """One sequence with several KV heads is split into a task per KV head (the suite's team is one thread, fewer
    than two sequences per thread); more sequences are one task each."""
    kernels = builds.get(build, builds["native"])
    rng = random.Random(seed)
    q, pool, tables, lo, hi = random_case(rng, n, kv, g, d, block, window, dtype)
    pool = pool.to(pool_dtype)
    sinks = sinks_for(torch.Generator().manual_seed(seed), kv * g, 2.0, offset)
    got = kernels.paged_decode(q, pool, tables, lo, hi, block, d ** -0.5, sinks=sinks)
    assert got.dtype == dtype and got.shape == q.shape
    want = sink_reference(q, pool, tables, lo, hi, block, d ** -0.5, sinks)
    assert_within(got, want, sink_error_bound(q, pool, tables, lo, hi, block, d ** -0.5, sinks))


@settings(max_examples=60, deadline=None)
@given(**sink_cases)
def test_prefill_with_sinks_matches_the_reference(builds, build, seed, kv, g, d, window, dtype, pool_dtype,
                                                  offset) -> None:
    kernels = builds.get(build, builds["native"])
    q, pool, chunks = prefill_case(random.Random(seed), kv, g, d, dtype, pool_dtype=pool_dtype)
    sinks = sinks_for(torch.Generator().manual_seed(seed), kv * g, 2.0, offset)
    got = kernels.prefill_attention(q, pool, PrefillPlan.of(chunks), d ** -0.5, window, sinks=sinks)
    assert got.dtype == dtype and got.shape == (q.shape[0], q.shape[1] * d)
    qd, tables, lo, hi = prefill_as_decode(q, pool, chunks, window)
    want = sink_reference(qd, pool, tables, lo, hi, 1, d ** -0.5, sinks)
    assert_within(got.view(qd.shape), want, sink_error_bound(qd, pool, tables, lo, hi, 1, d ** -0.5, sinks))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("d", [12, 64])
def test_a_decode_split_over_kv_heads_gets_the_bits_it_gets_unsplit(builds, build, d) -> None:
    """Alone, a sequence's KV heads are separate tasks, each given its own heads' sinks; among enough sequences one
    task takes them all: the same operations on the same sinks, so the same bits."""
    kernels = builds.get(build, builds["native"])
    n = 2 * torch.get_num_threads() + 1
    q, pool, tables, lo, hi = random_case(random.Random(d), n, 3, 4, d, 4, None, torch.float32)
    sinks = sinks_for(torch.Generator().manual_seed(d), 12, 2.0, 1.0)
    together = kernels.paged_decode(q, pool, tables, lo, hi, 4, d ** -0.5, sinks=sinks)
    assert_within(together, sink_reference(q, pool, tables, lo, hi, 4, d ** -0.5, sinks),
                  sink_error_bound(q, pool, tables, lo, hi, 4, d ** -0.5, sinks))
    for i in range(n):
        alone = kernels.paged_decode(q[i:i + 1], pool, tables[i:i + 1], lo[i:i + 1], hi[i:i + 1], 4, d ** -0.5,
                                     sinks=sinks)
        assert torch.equal(alone, together[i:i + 1])


@pytest.mark.parametrize("d", [12, 64])
def test_a_sequence_with_no_keys_still_gets_zeros(builds, d) -> None:
    kernels = builds["native"]
    q, pool, tables, lo, hi = random_case(random.Random(7), 4, 2, 3, d, 4, None, torch.float32)
    lo[1], lo[3] = hi[1], hi[3]
    sinks = sinks_for(torch.Generator().manual_seed(7), 6, 2.0, 0.0)
    got = kernels.paged_decode(q, pool, tables, lo, hi, 4, d ** -0.5, sinks=sinks)
    assert not bool(got[1].any()) and not bool(got[3].any())
    assert_within(got, sink_reference(q, pool, tables, lo, hi, 4, d ** -0.5, sinks),
                  sink_error_bound(q, pool, tables, lo, hi, 4, d ** -0.5, sinks))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("d", [12, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_sinks_and_negligible_sinks_are_the_bits_without(builds, build, d, dtype) -> None:
    """`sinks=None` is the call without the argument. A sink far below every score adds exp(sink - max) = 0 to the
    denominator and leaves the max alone, so it too changes no bit (a sink read into a value, the max or the
    wrong place would)."""
    kernels = builds.get(build, builds["native"])
    q, pool, tables, lo, hi = random_case(random.Random(d), 3, 2, 3, d, 4, 9, dtype)
    plain = kernels.paged_decode(q, pool, tables, lo, hi, 4, d ** -0.5)
    assert torch.equal(kernels.paged_decode(q, pool, tables, lo, hi, 4, d ** -0.5, sinks=None), plain)
    far = torch.full((6,), -1e4)
    assert torch.equal(kernels.paged_decode(q, pool, tables, lo, hi, 4, d ** -0.5, sinks=far), plain)
    qp, pool, chunks = prefill_case(random.Random(d), 2, 3, d, dtype)
    plan = PrefillPlan.of(chunks)
    plain = kernels.prefill_attention(qp, pool, plan, d ** -0.5, 9)
    assert torch.equal(kernels.prefill_attention(qp, pool, plan, d ** -0.5, 9, sinks=None), plain)
    assert torch.equal(kernels.prefill_attention(qp, pool, plan, d ** -0.5, 9, sinks=far), plain)
    # Not vacuous: sinks within the scores' range move the results.
    near = torch.zeros(6)
    assert not torch.equal(kernels.prefill_attention(qp, pool, plan, d ** -0.5, 9, sinks=near), plain)


def bad_sinks(heads: int) -> list[object]:
    return [torch.zeros(heads, dtype=torch.float64), torch.zeros(heads, dtype=torch.bfloat16),
            torch.zeros(heads + 1), torch.zeros(heads - 1), torch.zeros(1, heads), torch.zeros(2 * heads)[::2],
            torch.zeros(heads, device="meta"), [0.0] * heads]


def test_bad_sinks_are_refused(builds) -> None:
    kernels = builds["native"]
    q, pool, tables, lo, hi = random_case(random.Random(3), 2, 2, 3, 8, 4, None, torch.float32)
    qp, pool_p, chunks = prefill_case(random.Random(3), 2, 3, 8, torch.float32)
    plan = PrefillPlan.of(chunks)
    for sinks in bad_sinks(6):
        with pytest.raises(ValueError, match="sinks"):
            kernels.paged_decode(q, pool, tables, lo, hi, 4, 0.25, sinks=sinks)
        with pytest.raises(ValueError, match="sinks"):
            kernels.prefill_attention(qp, pool_p, plan, 0.25, None, sinks=sinks)
    # The same sinks, well formed, are taken.
    kernels.paged_decode(q, pool, tables, lo, hi, 4, 0.25, sinks=torch.zeros(6))
    kernels.prefill_attention(qp, pool_p, plan, 0.25, None, sinks=torch.zeros(6))
