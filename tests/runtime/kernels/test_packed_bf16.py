"""The batch-invariant bf16 kernel (`csrc/bf16_gemm.c`, `kernels.packed_bf16`): its result is, bit for bit,
the arithmetic its source specifies (per output, over input pairs in order: the odd product added, then the
even one, each sum rounded to float32; the output rounded once to bf16), so each row's result is independent
of the batch it is in, of the thread count and of the path; the refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import X86_FLAGS, built_kernels, needs_compiler

from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
from ferrox_batch.runtime.kernels.packed_bf16 import BF16_PATHS, PackedBf16

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return built_kernels()


def specified(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`[m, n]` float32 sums in the kernel's specified order, from bf16 x `[m, k]` and w `[n, k]`.

    Each product of two bf16 values is exact in float32 (8-bit significands), so torch's float32 `a + b * c`
    rounds once, as a fused multiply-add or `vdpbf16ps` does: the same bits for values whose products and
    sums are normal (random data here)."""
    m, k = x.shape
    xf = x.float()
    wf = w.float()
    if k % 2:  # the pair past an odd k is (x[k - 1], 0)
        xf = torch.cat([xf, torch.zeros(m, 1)], dim=1)
        wf = torch.cat([wf, torch.zeros(w.shape[0], 1)], dim=1)
    acc = torch.zeros(m, w.shape[0])
    for t in range(xf.shape[1] // 2):
        acc = acc + xf[:, 2 * t + 1, None] * wf[None, :, 2 * t + 1]
        acc = acc + xf[:, 2 * t, None] * wf[None, :, 2 * t]
    return acc


def random_bf16(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).bfloat16()


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 70), n=st.integers(1, 80), k=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_any_small_shape_is_the_specified_arithmetic(kernels, m, n, k, seed):
    w, x = random_bf16(n, k, seed), random_bf16(m, k, seed + 1)
    packed = kernels.pack_bf16(w)
    want = specified(x, w)
    assert torch.equal(packed(x, out_f32=True), want)
    assert torch.equal(packed(x), want.bfloat16())  # rounded once, to nearest even, as torch casts


def test_long_rows_span_k_without_changing_a_bit(kernels):
    """k beyond one span of the weight (512 inputs): the running sums are saved between spans in float32."""
    w, x = random_bf16(37, 1201, 3), random_bf16(9, 1201, 4)
    assert torch.equal(kernels.pack_bf16(w)(x, out_f32=True), specified(x, w))


def test_a_row_alone_equals_it_in_any_batch_and_thread_count(kernels):
    w = random_bf16(300, 576, 5)
    packed = kernels.pack_bf16(w)
    batch = random_bf16(130, 576, 6)  # more than two 64-row blocks, a 4-row tile tail
    together = packed(batch)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single_thread = packed(batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, single_thread)
    for row in (0, 63, 64, 129):
        assert torch.equal(packed(batch[row:row + 1]), together[row:row + 1])


def test_every_path_gives_the_same_bits(forced_kernel_builds):
    builds = forced_kernel_builds
    assert [builds[path].bf16_path for path in X86_FLAGS] == list(X86_FLAGS)
    assert builds["native"].bf16_path in BF16_PATHS
    w, x = random_bf16(70, 515, 7), random_bf16(11, 515, 8)
    outs = [built.pack_bf16(w)(x, out_f32=True) for built in builds.values()]
    assert all(torch.equal(outs[0], other) for other in outs[1:])


def test_leading_dimensions_and_a_float_weight(kernels):
    w = torch.randn(5, 8)
    packed = kernels.pack_bf16(w)  # rounded to bf16 at packing
    assert isinstance(packed, PackedBf16) and (packed.out_features, packed.in_features) == (5, 8)
    assert packed.nbytes == 16 * 4 * 4  # one panel of 16 columns by 4 pairs of 4 bytes
    x = random_bf16(6, 8, 9).view(2, 3, 8)
    got = packed(x)
    assert got.shape == (2, 3, 5) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(6, 5), specified(x.reshape(6, 8), w.bfloat16()).bfloat16())


def test_refusals(kernels):
    for weight, message in ((torch.randn(3), "2-D"), (torch.zeros(3, 4, dtype=torch.int32), "floating-point"),
                            (torch.randn(0, 4), "at least one")):
        with pytest.raises(ValueError, match=message):
            kernels.pack_bf16(weight)
    packed = kernels.pack_bf16(torch.randn(4, 6))
    for x in (torch.randn(2, 6), torch.randn(2, 5).bfloat16(), torch.tensor(1.0).bfloat16()):
        with pytest.raises(ValueError, match="bfloat16 CPU input of 6 features"):
            packed(x)
