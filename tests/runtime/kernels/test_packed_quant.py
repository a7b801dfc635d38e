"""The int8 quantized kernel (`csrc/quant_pack.c`, `csrc/quant_int8.c`, `kernels.packed_quant`): the
packing keeps every format's weights bit for bit (rows decoded from it equal gguf's dequantization), the
product is exact arithmetic over those weights for an x that int8 quantization keeps exactly, and within
the bound of x's quantization for any x; each row's result is independent of the batch it is in, of the
thread count and of the path (the three builds agree bit for bit); the refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import X86_FLAGS, built_kernels, needs_compiler
from quant_weights import (
    DTYPES,
    assert_exact_sums,
    assert_sums_of_quantized_x,
    blocks,
    random_blocks,
    reference,
)

from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
from ferrox_batch.runtime.kernels.packed_quant import PACKED_PATHS, PackedQuant
from ferrox_batch.runtime.quant.formats import FORMATS, QuantFormat

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return built_kernels()


def exact_x(m: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows int8 quantization keeps exactly: each 32-block integers in [-127, 127] with a 127 in it, times a
    power of two (so its scale is that power, and every x a whole number of it). Exact in bf16 too."""
    gen = torch.Generator().manual_seed(seed)
    ints = torch.randint(-127, 128, (m, k), generator=gen).double()
    ints[:, ::32] = 127.0
    return (ints * 2.0 ** -5).to(dtype)


def shapes(fmt: QuantFormat) -> list[tuple[int, int, int]]:
    """(m, n, k): row counts across the 8-row tiles and their 4, 2, 1 tails, weights of part of a 16-row
    group, a k of one, two and three of the format's blocks, and the model's 576 and 1,536 where they divide."""
    e = fmt.block_elems
    out = [(1, 16, e), (2, 5, 2 * e), (3, 33, e), (8, 16, 3 * e), (15, 17, e), (20, 3, 2 * e)]
    return out + [(9, 40, k) for k in (576, 1536) if k % e == 0]


@pytest.mark.parametrize("name", FORMATS)
def test_the_packing_keeps_every_weight_bit_for_bit(kernels, name):
    fmt = FORMATS[name]
    for seed, rows in enumerate((1, 16, 37)):
        raw = random_blocks(fmt, rows, 2 * fmt.block_elems, seed)
        packed = kernels.pack_quant([(fmt, raw)], 2 * fmt.block_elems)
        want = reference(fmt, raw)
        index = torch.arange(rows - 1, -1, -1)
        assert torch.equal(packed.rows(index, torch.float32), want[index])
        assert torch.equal(packed.rows(index, torch.bfloat16), want[index].bfloat16())
        # The file's bytes, but rows padded to 16 and Q4_K's scales unpacked to bytes (+64 per 16 x 256).
        groups = -(-rows // 16)
        extra = 64 * 2 * groups if name == "q4_k" else 0
        assert packed.nbytes == groups * 16 * fmt.row_bytes(2 * fmt.block_elems) + extra


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", FORMATS)
def test_products_are_exact_where_x_quantizes_exactly(kernels, name, dtype):
    fmt = FORMATS[name]
    for seed, (m, n, k) in enumerate(shapes(fmt)):
        raw = blocks(fmt, n, k, seed)
        x = exact_x(m, k, seed, dtype)
        assert_exact_sums(kernels.pack_quant([(fmt, raw)], k)(x), x, reference(fmt, raw))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", FORMATS)
def test_products_of_any_x_are_within_its_quantization(kernels, name, dtype):
    fmt = FORMATS[name]
    for seed, (m, n, k) in enumerate(shapes(fmt)):
        raw = blocks(fmt, n, k, seed)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
        x[:, :32] *= 1000.0  # blocks of very different scales in one row
        assert_sums_of_quantized_x(kernels.pack_quant([(fmt, raw)], k)(x), x, reference(fmt, raw))


def test_segments_of_different_formats_stack_along_the_outputs(kernels):
    k = 512
    segments = [(FORMATS[name], blocks(FORMATS[name], rows, k, seed))
                for seed, (name, rows) in enumerate((("q5_0", 20), ("q8_0", 7), ("q4_k", 16), ("q6_k", 0),
                                                     ("q6_k", 9)))]
    packed = kernels.pack_quant(segments, k)
    assert packed.shape == (52, k) and packed.format_names == ("q5_0", "q8_0", "q4_k", "q6_k", "q6_k")
    weight = torch.cat([reference(fmt, raw) for fmt, raw in segments if raw.shape[0]])
    for dtype in DTYPES:
        x = exact_x(11, k, 3, dtype)
        assert_exact_sums(packed(x), x, weight)
    x = torch.randn(2, 3, k)
    assert packed(x).shape == (2, 3, 52)
    assert packed(torch.zeros(0, k)).shape == (0, 52)
    with pytest.raises(ValueError, match="one format"):
        packed.rows(torch.tensor([0]), torch.float32)


@pytest.mark.parametrize("name", FORMATS)
def test_a_row_is_the_same_alone_batched_and_on_any_thread_count(kernels, name):
    """Bit for bit: a request's answer cannot depend on who shares its step."""
    fmt = FORMATS[name]
    k = 2 * fmt.block_elems
    packed = kernels.pack_quant([(fmt, blocks(fmt, 40, k, 5))], k)
    for dtype in DTYPES:
        x = torch.randn(37, k, generator=torch.Generator().manual_seed(6)).to(dtype)
        batched = packed(x)
        alone = torch.cat([packed(x[i:i + 1]) for i in range(37)])
        assert torch.equal(batched, alone)
        assert torch.equal(batched[5:12], packed(x[5:12]))
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(packed(x), batched)
        finally:
            torch.set_num_threads(threads)


def test_a_row_holding_an_infinity_or_a_nan_is_nan_and_alone(kernels):
    fmt = FORMATS["q8_0"]
    packed = kernels.pack_quant([(fmt, blocks(fmt, 16, 64, 7))], 64)
    x = torch.randn(3, 64)
    clean = packed(x)
    x[0, 40], x[2, 3] = float("inf"), float("nan")
    got = packed(x)
    assert bool(got[0].isnan().all()) and bool(got[2].isnan().all())
    assert torch.equal(got[1], clean[1])
    # A block below 2^-119 quantizes to zero rather than to a subnormal scale.
    x = torch.randn(2, 64)
    x[:, 32:] = 1e-37 * torch.randn(2, 32)
    assert_sums_of_quantized_x(packed(x), x, reference(fmt, blocks(fmt, 16, 64, 7)))


def test_bad_bindings_and_inputs_are_refused(kernels):
    fmt = FORMATS["q8_0"]
    raw = blocks(fmt, 4, 64, 8)
    cases = [
        ([], 64, "at least one segment"),
        ([(fmt, raw)], 0, "at least one input"),
        ([(fmt, raw.view(torch.int8))], 64, "2-D uint8"),
        ([(fmt, raw)], 96, "rows of 96 weights take 102 bytes"),
        ([(FORMATS["q4_k"], blocks(fmt, 4, 256, 8))], 256, "q4_k rows of 256"),
        ([(QuantFormat("q2_k", 10, 256, 84), raw)], 64, "does not run q2_k"),
        ([(fmt, raw.t().contiguous().t())], 64, "contiguous"),
    ]
    for segments, k, message in cases:
        with pytest.raises(ValueError, match=message):
            kernels.pack_quant(segments, k)
    packed = kernels.pack_quant([(fmt, raw)], 64)
    for x, message in ((torch.randn(2, 64).double(), "float32 or bfloat16"), (torch.randn(2, 32), "64 inputs"),
                       (torch.tensor(1.0), "64 inputs")):
        with pytest.raises(ValueError, match=message):
            packed(x)
    for index, dtype, message in ((torch.tensor([4]), torch.float32, "outside"), (torch.tensor([-1]), torch.float32,
                                  "outside"), (torch.tensor([0.0]), torch.float32, "int64"),
                                  (torch.tensor([0]), torch.float16, "decode to one of")):
        with pytest.raises(ValueError, match=message):
            packed.rows(index, dtype)
    packed._triples[0, 0] = 10  # the C side refuses a type it does not pack, too
    with pytest.raises(ValueError, match="not one the kernel decodes"):
        packed(torch.randn(1, 64))


def test_every_path_gives_the_same_bits(forced_kernel_builds):
    """This machine's build and, on x86, the AVX2 and plain-C loops forced: each format, both dtypes,
    rows decoded and products, identical to the last bit (the arithmetic is specified per operation)."""
    builds = forced_kernel_builds
    assert [builds[path].packed_path for path in X86_FLAGS] == list(X86_FLAGS)
    assert builds["native"].packed_path in PACKED_PATHS
    for seed, fmt in enumerate(FORMATS.values()):
        k = 3 * 256
        raw = blocks(fmt, 21, k, seed)
        x = torch.randn(10, k, generator=torch.Generator().manual_seed(seed))
        outs = []
        for built in builds.values():
            packed = built.pack_quant([(fmt, raw)], k)
            outs.append((packed(x), packed(x.bfloat16()), packed.rows(torch.arange(21), torch.bfloat16)))
        for other in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], other)), fmt.name


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 20), n=st.integers(1, 40), blocks_per_row=st.integers(1, 4), bf16=st.booleans(),
       name=st.sampled_from(sorted(FORMATS)), seed=st.integers(0, 2**16))
def test_any_small_shape_is_exact_on_exact_x_and_batch_free(kernels, m, n, blocks_per_row, bf16, name, seed):
    fmt = FORMATS[name]
    k = blocks_per_row * fmt.block_elems
    raw = blocks(fmt, n, k, seed)
    packed = kernels.pack_quant([(fmt, raw)], k)
    x = exact_x(m, k, seed, torch.bfloat16 if bf16 else torch.float32)
    got = packed(x)
    assert_exact_sums(got, x, reference(fmt, raw))
    if m:
        assert torch.equal(got[-1:], packed(x[-1:]))


def test_the_weight_held_is_the_packing(kernels):
    fmt = FORMATS["q4_0"]
    packed = kernels.pack_quant([(fmt, blocks(fmt, 3, 32, 9))], 32)
    assert isinstance(packed, PackedQuant) and packed.out_features == 3 and packed.in_features == 32
