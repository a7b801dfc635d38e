"""Every expert's int8 product in one call (`ferrox_packed_gemm_experts`, `PackedExperts`): each row is exactly
what its expert's own call (`PackedQuant`) gives it, on every build, whatever the other experts' rows; experts
without rows are skipped, rows no expert names are left alone; the refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import X86_FLAGS, built_kernels, needs_compiler
from quant_weights import blocks

from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
from ferrox_batch.runtime.kernels.packed_quant import PackedExperts
from ferrox_batch.runtime.quant.formats import FORMATS

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return built_kernels()


def experts_of(kernels: CpuKernels, names: list[str], n: int, k: int, seed: int) -> list:
    """One packed weight per expert, each of its own format (a two-format stack where a name holds `+`)."""
    out = []
    for e, name in enumerate(names):
        parts = name.split("+")
        rows = [n // len(parts)] * len(parts)
        rows[-1] += n - sum(rows)
        out.append(kernels.pack_quant([(FORMATS[p], blocks(FORMATS[p], r, k, seed * 97 + e * 7 + i))
                                       for i, (p, r) in enumerate(zip(parts, rows))], k))
    return out


def ranges(counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    hi = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    return hi - torch.tensor(counts, dtype=torch.int64), hi


@settings(max_examples=30, deadline=None)
@given(counts=st.lists(st.integers(0, 11), min_size=1, max_size=9), n=st.integers(1, 40),
       units=st.integers(1, 3), bf16=st.booleans(), seed=st.integers(0, 2**16),
       names=st.lists(st.sampled_from([*sorted(FORMATS), "q8_0+q4_k", "q6_k+mxfp4"]), min_size=9, max_size=9))
def test_each_row_is_its_expert_s_own_product(kernels, counts, n, units, bf16, seed, names):
    k = 256 * units
    weights = experts_of(kernels, names[:len(counts)], n, k, seed)
    m = sum(counts)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x = x.bfloat16() if bf16 else x
    lo, hi = ranges(counts)
    got = PackedExperts(weights)(x, lo, hi)
    assert got.dtype == x.dtype and got.shape == (m, n)
    for e, weight in enumerate(weights):
        if counts[e]:
            part = slice(int(lo[e]), int(hi[e]))
            assert torch.equal(got[part], weight(x[part])), (e, names[e])
            # and the same rows alone, one at a time: a row depends on that row alone
            assert torch.equal(got[part][:1], weight(x[part][:1]))


def test_rows_no_expert_names_are_left_and_empty_experts_skipped(kernels):
    weights = experts_of(kernels, ["q8_0", "q4_0", "q6_k"], 16, 256, 3)
    x = torch.randn(6, 256)
    lo, hi = torch.tensor([0, 2, 2]), torch.tensor([2, 2, 4])  # expert 1 has no rows, rows 4 and 5 no expert
    got = PackedExperts(weights)(x, lo, hi)
    assert torch.equal(got[:2], weights[0](x[:2])) and torch.equal(got[2:4], weights[2](x[2:4]))


def test_every_path_gives_the_same_bits(forced_kernel_builds):
    builds = forced_kernel_builds
    assert [builds[path].packed_path for path in X86_FLAGS] == list(X86_FLAGS)
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(5))
    lo, hi = ranges([4, 0, 7, 2])
    outs = []
    for built in builds.values():
        experts = PackedExperts(experts_of(built, ["q8_0", "q4_k", "mxfp4", "q5_0+q6_k"], 24, 512, 1))
        outs.append((experts(x, lo, hi), experts(x.bfloat16(), lo, hi)))
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def test_bad_ranges_and_weights_are_refused(kernels):
    weights = experts_of(kernels, ["q8_0", "q8_0"], 16, 256, 0)
    experts = PackedExperts(weights)
    x = torch.randn(4, 256)
    for lo, hi in (([0, 3], [3, 5]), ([2, 0], [1, 4]), ([-1, 0], [0, 4])):
        with pytest.raises(ValueError):
            experts(x, torch.tensor(lo), torch.tensor(hi))
    with pytest.raises(ValueError, match="int64"):
        experts(x, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[2\]"):
        experts(x, torch.tensor([0]), torch.tensor([4]))
    with pytest.raises(ValueError, match="shape"):
        PackedExperts([*weights, *experts_of(kernels, ["q8_0"], 8, 256, 1)])
    with pytest.raises(ValueError, match="experts"):
        PackedExperts([])
