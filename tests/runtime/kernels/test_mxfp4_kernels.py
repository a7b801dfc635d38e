"""MXFP4 in both quantized kernels: the weight-only one (`csrc/quant_gemm.c`, blocks decoded to float32)
and the int8-activation one (`csrc/quant_pack.c`, `csrc/quant_int8.c`, codes repacked and looked up as
integers). Rows decode exactly as gguf at every exponent byte, subnormal scales and 2^128 included, on
every path; products are within the bounds `quant_weights` derives, over scales far from the test
weights' usual ones; both kernels' paths agree with their own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import built_kernels, needs_compiler
from quant_weights import assert_exact_sums, assert_sums_of_quantized_x, random_blocks, reference

from ferrox_batch.runtime.quant.formats import FORMATS

pytestmark = [needs_compiler, pytest.mark.filterwarnings("ignore:overflow encountered")]  # gguf's, at e >= 253

MXFP4 = FORMATS["mxfp4"]


@pytest.fixture(scope="module")
def kernels():
    return built_kernels()


def every_exponent(seed: int, blocks_per_row: int = 2) -> torch.Tensor:
    """256 rows: row e's blocks all have exponent byte e, their codes random."""
    raw = random_blocks(MXFP4, 256, 32 * blocks_per_row, seed).reshape(256, blocks_per_row, MXFP4.block_bytes)
    raw[:, :, 0] = torch.arange(256, dtype=torch.uint8)[:, None]
    return raw.reshape(256, -1).contiguous()


def wide_blocks(n: int, k: int, seed: int, low: int = 96, high: int = 160) -> torch.Tensor:
    """n rows of k weights, random codes, exponent bytes in [low, high]: scales 2^-32 .. 2^32."""
    raw = random_blocks(MXFP4, n, k, seed).reshape(n, k // 32, MXFP4.block_bytes)
    raw[:, :, 0] = torch.randint(low, high + 1, (n, k // 32), generator=torch.Generator().manual_seed(seed),
                                 dtype=torch.uint8)
    return raw.reshape(n, -1).contiguous()


def exact_x(m: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows int8 quantization keeps exactly (each 32-block integers up to 127, one of them 127, times 2^-5)."""
    ints = torch.randint(-127, 128, (m, k), generator=torch.Generator().manual_seed(seed)).double()
    ints[:, ::32] = 127.0
    return (ints * 2.0**-5).to(dtype)


def check_rows(built, raw: torch.Tensor) -> None:
    """Both kernels' row decodes of `raw` against gguf's: float32 bit for bit (infinities included), bf16 as
    torch rounds it."""
    k = raw.shape[1] // MXFP4.block_bytes * 32
    want = reference(MXFP4, raw)
    index = torch.arange(raw.shape[0] - 1, -1, -1)
    packed = built.pack_quant([(MXFP4, raw)], k)
    for got in (built.quant_rows(MXFP4, raw, index, k, torch.float32), packed.rows(index, torch.float32)):
        assert torch.equal(got, want[index])
    for got in (built.quant_rows(MXFP4, raw, index, k, torch.bfloat16), packed.rows(index, torch.bfloat16)):
        assert torch.equal(got, want[index].bfloat16())


def test_rows_decode_as_gguf_at_every_exponent(kernels) -> None:
    raw = every_exponent(0)
    assert not bool(reference(MXFP4, raw).isfinite().all())  # e >= 253 reaches the infinities
    check_rows(kernels, raw)
    check_rows(kernels, every_exponent(1, blocks_per_row=3)[::7].contiguous())


def test_the_packing_is_the_file_s_size(kernels) -> None:
    """16 exponent bytes and 256 bytes of codes per 16 rows by 32 inputs: 17 bytes a row and block, as stored."""
    for rows in (1, 16, 37):
        packed = kernels.pack_quant([(MXFP4, random_blocks(MXFP4, rows, 96, rows))], 96)
        assert packed.nbytes == -(-rows // 16) * 16 * MXFP4.row_bytes(96)


SHAPES = [(1, 16, 32), (2, 5, 64), (3, 33, 32), (8, 16, 96), (15, 17, 32), (20, 3, 64), (9, 40, 576), (70, 40, 1536)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_only_products_are_exact_sums(kernels, dtype) -> None:
    for seed, (m, n, k) in enumerate(SHAPES):
        raw = wide_blocks(n, k, seed)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
        assert_exact_sums(kernels.bind_quant_linear([(MXFP4, raw)], k)(x), x, reference(MXFP4, raw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_products_are_exact_on_exact_x_and_bounded_on_any(kernels, dtype) -> None:
    for seed, (m, n, k) in enumerate(SHAPES):
        raw = wide_blocks(n, k, seed)
        weight, packed = reference(MXFP4, raw), kernels.pack_quant([(MXFP4, raw)], k)
        x = exact_x(m, k, seed, dtype)
        assert_exact_sums(packed(x), x, weight)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
        x[:, :32] *= 1000.0
        assert_sums_of_quantized_x(packed(x), x, weight)


def test_mxfp4_segments_stack_with_other_formats(kernels) -> None:
    """A fused projection of MXFP4 rows between Q8_0 and Q4_0 ones, in both kernels."""
    k = 128
    segments = [(FORMATS["q8_0"], random_blocks(FORMATS["q8_0"], 5, k, 1)), (MXFP4, wide_blocks(19, k, 2)),
                (FORMATS["q4_0"], random_blocks(FORMATS["q4_0"], 4, k, 3))]
    weight = torch.cat([reference(fmt, raw) for fmt, raw in segments])
    x = exact_x(6, k, 4, torch.float32)
    assert_exact_sums(kernels.bind_quant_linear(segments, k)(x), x, weight)
    assert_exact_sums(kernels.pack_quant(segments, k)(x), x, weight)


def test_every_path_decodes_exactly_and_agrees(forced_kernel_builds) -> None:
    """This machine's build and, on x86, the AVX2 and plain-C loops forced: the weight-only decoders and the
    packing exact at every exponent (the AVX2 loops form the subnormal scales by a blend of their own), and
    the int8 products identical to the last bit across the paths."""
    builds = forced_kernel_builds
    raw = every_exponent(2)
    wide = wide_blocks(21, 768, 5)
    x = torch.randn(10, 768, generator=torch.Generator().manual_seed(6))
    outs = []
    for built in builds.values():
        check_rows(built, raw)
        assert_exact_sums(built.bind_quant_linear([(MXFP4, wide)], 768)(x), x, reference(MXFP4, wide))
        packed = built.pack_quant([(MXFP4, wide)], 768)
        outs.append((packed(x), packed(x.bfloat16())))
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 20), n=st.integers(1, 40), blocks_per_row=st.integers(1, 4), bf16=st.booleans(),
       low=st.integers(10, 235), seed=st.integers(0, 2**16))
def test_any_small_shape_and_scale_is_exact_on_exact_x(kernels, m, n, blocks_per_row, bf16, low, seed) -> None:
    """Exponent bytes in any window of 6 powers of two where every product with x (2^-5 .. 4) and every
    sum of them stays a normal float32 (a subnormal product rounds outside a relative bound, in any
    kernel): 2^(e - 133) >= 2^-126, and k * 4 * 12 * 2^(e - 128) < 2^128."""
    k = 32 * blocks_per_row
    raw = wide_blocks(n, k, seed, low, low + 5)
    weight = reference(MXFP4, raw)
    x = exact_x(m, k, seed, torch.bfloat16 if bf16 else torch.float32)
    got = kernels.pack_quant([(MXFP4, raw)], k)(x)
    assert_exact_sums(got, x, weight)
    assert_exact_sums(kernels.bind_quant_linear([(MXFP4, raw)], k)(x), x, weight)
    if m:
        assert torch.equal(got[-1:], kernels.pack_quant([(MXFP4, raw)], k)(x[-1:]))
