"""The CPU RoPE-and-store kernel against torch's ops: the rotation, the K/V write, the rounding to the pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import BASELINE_FLAGS, built_kernels, needs_compiler
from numerics import gamma, steps

from ferrox_batch.runtime.architectures.rope import apply_rope
from ferrox_batch.runtime.kernels import cpu_kernels as kernels_module
from ferrox_batch.runtime.kernels import kernel_build as build_module
from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels

pytestmark = needs_compiler

POOL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return built_kernels()


def case(seed: int, n: int, heads: int, kv: int, d: int, dtype: torch.dtype, pool_dtype: torch.dtype,
         positions: int = 50):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kv) * d, generator=gen).to(dtype)
    angles = torch.rand(positions, d // 2, generator=gen) * 6.3
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    pos = torch.randint(0, positions, (n,), generator=gen)
    slots = torch.randperm(2 * n + 3, generator=gen)[:n]
    pool = torch.full((2 * n + 3, 2, kv, d), 7.0, dtype=pool_dtype)  # never a value the kernel writes
    return qkv, cos, sin, pos, slots, pool


def torch_rope_store(qkv, cos, sin, pos, slots, pool, heads):
    """The decoder's torch path: rotate q and k, then stack K and V, cast and index_copy_ them."""
    n, kv, d = qkv.shape[0], pool.shape[2], pool.shape[3]
    qk = apply_rope(qkv[:, : (heads + kv) * d].view(n, heads + kv, d), cos[pos][:, None], sin[pos][:, None])
    v = qkv[:, (heads + kv) * d:].view(n, kv, d)
    pool = pool.clone()
    pool.index_copy_(0, slots, torch.stack((qk[:, heads:], v), dim=1).to(pool.dtype))
    return qk.reshape(n, -1), pool


def rotation_bound(qkv, cos, sin, pos, heads, kv, d):
    """Each side computes x c + r s (r the rotated-half element) with two products and a sum, or one
    FMA and a product: each within gamma(2) (|x c| + |r s|) of the exact value, so twice that apart."""
    n = qkv.shape[0]
    x = qkv[:, : (heads + kv) * d].double().view(n, heads + kv, d)
    r = torch.cat((x[..., d // 2:], x[..., : d // 2]), -1)
    c, s = cos.double()[pos][:, None], sin.double()[pos][:, None]
    return (2 * gamma(2) * (x.abs() * c.abs() + r.abs() * s.abs())).reshape(n, -1)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**20), n=st.integers(1, 40), kv=st.sampled_from([1, 2, 3]), g=st.sampled_from([1, 3]),
       d=st.sampled_from([2, 6, 16, 64]), pool_dtype=st.sampled_from(POOL_DTYPES))
def test_float32_rotates_like_torch_and_writes_kv_rounded_to_the_pool(kernels, seed, n, kv, g, d, pool_dtype):
    check_float32(kernels, seed, n, kv, g, d, pool_dtype)


def check_float32(kernels: CpuKernels, seed: int, n: int, kv: int, g: int, d: int, pool_dtype: torch.dtype) -> None:
    heads = kv * g
    qkv, cos, sin, pos, slots, pool = case(seed, n, heads, kv, d, torch.float32, pool_dtype)
    want_qk, want_pool = torch_rope_store(qkv, cos, sin, pos, slots, pool, heads)
    bound = rotation_bound(qkv, cos, sin, pos, heads, kv, d)
    v = qkv[:, (heads + kv) * d:].clone()
    got_pool = pool.clone()
    kernels.rope_store(qkv, cos, sin, pos, slots, got_pool, heads)
    got_qk = qkv[:, : (heads + kv) * d]
    assert bool(((got_qk.double() - want_qk.double()).abs() <= bound).all())
    assert torch.equal(qkv[:, (heads + kv) * d:], v)  # V is read, never rotated
    # K: the pool's rounding of a float32 within `bound` of torch's, so within that plus half a step.
    k_bound = bound[:, heads * d:].view(n, kv, d)
    k_want = want_qk[:, heads * d:].view(n, kv, d).double()
    k_got = got_pool[slots, 0].double()
    assert bool(((k_got - k_want).abs() <= k_bound + steps(0.5, k_want.abs() + k_bound, pool_dtype)).all())
    # V: the same float32 values rounded the same way: exactly torch's cast.
    assert torch.equal(got_pool[slots, 1], want_pool[slots, 1])
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert bool((got_pool[untouched] == 7.0).all())


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_bfloat16_is_torch_bit_for_bit(kernels, pool_dtype) -> None:
    check_bfloat16(kernels, pool_dtype)


def check_bfloat16(kernels: CpuKernels, pool_dtype: torch.dtype) -> None:
    heads, kv, d = 9, 3, 64
    qkv, cos, sin, pos, slots, pool = case(3, 33, heads, kv, d, torch.bfloat16, pool_dtype)
    want_qk, want_pool = torch_rope_store(qkv, cos, sin, pos, slots, pool, heads)
    kernels.rope_store(qkv, cos, sin, pos, slots, pool, heads)
    assert torch.equal(qkv[:, : (heads + kv) * d], want_qk)
    assert torch.equal(pool, want_pool)


@pytest.mark.parametrize("d", [6, 64])  # 6: 4 of a slot's 12 elements through the scalar routine
def test_fp16_rounding_is_torchs_over_the_whole_float32_range(kernels, d) -> None:
    check_fp16_rounding(kernels, d)


def check_fp16_rounding(kernels: CpuKernels, d: int) -> None:
    """V goes to the pool as it is: every float32 class (normal, fp16-subnormal, tiny, past 65504, ties
    between fp16 values, infinities, NaN) must round as torch's cast does."""
    gen = torch.Generator().manual_seed(5)
    bits = torch.randint(-2**31, 2**31 - 1, (4096,), generator=gen, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([65504.0, 65519.99, 65520.0, 65536.0, 1e30, float("inf"), 2.0**-24, 2.0**-25,
                            3 * 2.0**-26, 2.0**-14 - 2.0**-25, 6.1e-5, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 0.0,
                            -0.0, float("nan"), 2.0**-14, 5.96e-8, 1e-10])
    values = torch.cat([bits.view(torch.float32), special, -special])
    rows = -(-values.numel() // d)
    v = torch.zeros(rows * d)
    v[: values.numel()] = values
    qkv = torch.cat([torch.zeros(rows, 2 * d), v.view(rows, d)], 1)  # one q head, one KV head
    cos, sin = torch.ones(1, d), torch.zeros(1, d)
    pool = torch.zeros(rows, 2, 1, d, dtype=torch.float16)
    kernels.rope_store(qkv, cos, sin, torch.zeros(rows, dtype=torch.long), torch.arange(rows), pool, 1)
    got, want = pool[:, 1, 0].reshape(-1), v.to(torch.float16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_positions_slots_and_shapes_are_checked(kernels) -> None:
    qkv, cos, sin, pos, slots, pool = case(1, 4, 3, 1, 8, torch.float32, torch.float16, positions=10)
    with pytest.raises(ValueError, match="outside the rope tables' 10"):
        kernels.rope_store(qkv, cos, sin, torch.tensor([0, 1, 10, 2]), slots, pool, 3)
    with pytest.raises(ValueError, match="outside the KV pool's 11"):
        kernels.rope_store(qkv, cos, sin, pos, torch.tensor([0, 1, 11, 2]), pool, 3)
    with pytest.raises(ValueError, match="outside the KV pool"):
        kernels.rope_store(qkv, cos, sin, pos, torch.tensor([0, -1, 3, 2]), pool, 3)
    with pytest.raises(ValueError, match=r"expected \[n, 48\]"):
        kernels.rope_store(qkv, cos, sin, pos, slots, pool, 4)
    with pytest.raises(ValueError, match="int64"):
        kernels.rope_store(qkv, cos, sin, pos.int(), slots, pool, 3)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.rope_store(qkv, cos.double(), sin, pos, slots, pool, 3)
    with pytest.raises(ValueError, match="pool in one of"):
        kernels.rope_store(qkv, cos, sin, pos, slots, pool.double(), 3)
    with pytest.raises(ValueError, match="rope tables"):
        kernels.rope_store(qkv, cos[:, :4], sin[:, :4], pos, slots, pool, 3)
    with pytest.raises(ValueError, match="at least one query head"):  # -1 + 2 * 3 heads of 8 fit the width
        kernels.rope_store(qkv, cos, sin, pos, slots, pool.expand(-1, -1, 3, -1).contiguous(), -1)
    with pytest.raises(ValueError, match="the same KV slot"):
        kernels.rope_store(qkv, cos, sin, pos, torch.tensor([0, 1, 1, 2]), pool, 3)


def test_a_team_of_threads_gives_the_same_bits(kernels) -> None:
    """Enough rows for the kernel to split them over torch's team: each row is one thread's work."""
    qkv, cos, sin, pos, slots, pool = case(8, 300, 9, 3, 64, torch.float32, torch.float16)
    alone_qkv, alone_pool = qkv.clone(), pool.clone()
    kernels.rope_store(alone_qkv, cos, sin, pos, slots, alone_pool, 9)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kernels.rope_store(qkv, cos, sin, pos, slots, pool, 9)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(qkv, alone_qkv) and torch.equal(pool, alone_pool)


@pytest.mark.parametrize("flags", build_module.COMPILE_FLAGS, ids=" ".join)
def test_every_flag_set_builds_a_kernel_that_rounds_and_rotates_like_torch(kernels_built_with, flags) -> None:
    """As for the other kernels (test_cpu_kernels): each flag set another CPU would get is built and
    checked here; the last has no F16C, so fp16 goes through the scalar rounding alone."""
    built = kernels_built_with(flags)
    if built is None:
        assert flags != BASELINE_FLAGS, flags
        return
    for d in (6, 64):
        check_fp16_rounding(built, d)
    for pool_dtype in POOL_DTYPES:
        check_bfloat16(built, pool_dtype)
    check_float32(built, seed=4, n=17, kv=3, g=3, d=64, pool_dtype=torch.float16)
