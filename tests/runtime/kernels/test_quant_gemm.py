"""The weight-only quantized kernel (`csrc/quant_gemm.c`): every format's rows decoded bit for bit as
gguf's reference decodes them, products against exact arithmetic over those weights within bounds derived
from the arithmetic, every flag set's build, the bound object, and the refusals."""

from __future__ import annotations

import gc
import platform
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import BASELINE_FLAGS, X86_FLAGS, built_kernels, needs_compiler
from quant_weights import (
    DTYPES,
    assert_exact_sums,
    blocks,
    random_blocks,
    reference,
)

from ferrox_batch.runtime.kernels import cpu_kernels as kernels_module
from ferrox_batch.runtime.kernels import kernel_build as build_module
from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
from ferrox_batch.runtime.kernels.quant_gemm import QuantGemm
from ferrox_batch.runtime.quant.formats import FORMATS, QuantFormat

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return built_kernels()


def check_product(built: CpuKernels, fmt: QuantFormat, m: int, n: int, k: int, dtype: torch.dtype,
                  seed: int) -> None:
    raw = blocks(fmt, n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    assert_exact_sums(built.bind_quant_linear([(fmt, raw)], k)(x), x, reference(fmt, raw))


def block_counts(fmt: QuantFormat) -> tuple[int, ...]:
    """k of 1-3 blocks, and the default model's 576 and 1,536 where the format divides them."""
    return tuple(b * fmt.block_elems for b in (1, 2, 3)) + tuple(k for k in (576, 1536) if k % fmt.block_elems == 0)


@pytest.mark.parametrize("name", FORMATS)
def test_rows_decode_exactly_as_gguf(kernels, name):
    """`quant_rows` against gguf's dequantization, in any order and with repeats: bit for bit in float32
    (every product in the formats is exact in float32 and the only addition is the reference's own), and
    in bf16 as torch rounds that float32 row."""
    fmt = FORMATS[name]
    for raw in (random_blocks(fmt, 37, 2 * fmt.block_elems, 1), blocks(fmt, 9, 3 * fmt.block_elems, 2)):
        want = reference(fmt, raw)
        index = torch.tensor([5, 0, raw.shape[0] - 1, 5, 2], dtype=torch.int64)
        got = kernels.quant_rows(fmt, raw, index, want.shape[1], torch.float32)
        assert torch.equal(got, want[index])
        assert torch.equal(kernels.quant_rows(fmt, raw, index, want.shape[1], torch.bfloat16),
                           want[index].to(torch.bfloat16))
        everything = torch.arange(raw.shape[0])
        assert torch.equal(kernels.quant_rows(fmt, raw, everything, want.shape[1], torch.float32), want)
    assert kernels.quant_rows(fmt, raw, torch.zeros(0, dtype=torch.int64), want.shape[1], torch.float32).shape == (
        0, want.shape[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", FORMATS)
def test_products_are_exact_sums_over_the_decoded_weight(kernels, name, dtype):
    """Row counts across the dot form's register tiles (1-4 rows), the row form's groups of 16 (8 on
    AVX2) alone, in pairs (threes) and followed by dot-form rows, and the x blocks (300 rows at k = 1,536
    is several); widths across the 4-row weight tiles, the row form's 12, and ending inside them; k of
    1-3 blocks and the model's 576 and 1,536."""
    fmt = FORMATS[name]
    counts = block_counts(fmt)
    shapes = [(m, n, counts[i % len(counts)]) for i, (m, n) in
              enumerate(zip((1, 2, 5, 16, 17, 48, 70, 300), (1, 13, 40, 77, 13, 40, 77, 13)))]
    shapes += [(300, 77, counts[-1]), (4, 77, counts[-1]), (1, 40, counts[0])]
    for seed, (m, n, k) in enumerate(shapes):
        check_product(kernels, fmt, m, n, k, dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_segments_of_different_formats_stack_along_the_outputs(kernels, dtype):
    """A fused projection as a GGUF file may store it: Q5_0 rows (q, k), then Q8_0 rows (v), then a third
    format; and K-quant segments, Q4_K then Q6_K, at a k both divide."""
    gen = torch.Generator().manual_seed(3)
    for k, parts in ((576, (("q5_0", 13), ("q8_0", 6), ("q4_0", 3))), (512, (("q4_k", 9), ("q6_k", 7)))):
        segments = [(FORMATS[name], blocks(FORMATS[name], rows, k, i)) for i, (name, rows) in enumerate(parts)]
        weight = torch.cat([reference(fmt, raw) for fmt, raw in segments])
        gemm = kernels.bind_quant_linear(segments, k)
        assert gemm.in_features == k and gemm.out_features == weight.shape[0]
        for m in (1, 7, 70):
            x = torch.randn(m, k, generator=gen).to(dtype)
            assert_exact_sums(gemm(x), x, weight)


def test_a_bound_weight_holds_its_segments_and_takes_any_leading_shape(kernels):
    fmt = FORMATS["q4_1"]
    raw = blocks(fmt, 10, 64, 4)
    weight = reference(fmt, raw)
    gemm = kernels.bind_quant_linear([(fmt, raw.clone())], 64)  # the clone's only owner is the binding
    gc.collect()
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))
    flat = gemm(x)
    assert_exact_sums(flat, x, weight)
    assert torch.equal(gemm(x.view(2, 3, 64)), flat.view(2, 3, 10))
    wide = torch.randn(6, 128)
    assert_exact_sums(gemm(wide[:, ::2]), wide[:, ::2], weight)
    assert gemm(torch.zeros(0, 64)).shape == (0, 10)
    assert gemm(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_results_do_not_depend_on_the_thread_count(kernels, dtype):
    """Each output is one register tile's sum, the same whichever thread computes it: teams of 1, 2 and
    3 threads give the same bits (the suite runs torch with one)."""
    fmt = FORMATS["q8_0"]
    gemm = kernels.bind_quant_linear([(fmt, blocks(fmt, 45, 1536, 6))], 1536)
    x = torch.randn(130, 1536, generator=torch.Generator().manual_seed(7)).to(dtype)
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outs.append(gemm(x))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_bad_bindings_are_refused(kernels):
    fmt = FORMATS["q8_0"]
    raw = blocks(fmt, 4, 64, 8)
    cases = [
        ([], 64, "at least one segment"),
        ([(fmt, raw)], 0, "at least one input feature"),
        ([(fmt, raw)], 48, "a row of 48 is not a whole number"),
        ([(fmt, raw)], 96, "take 102 bytes; got rows of 68"),
        ([(fmt, raw.view(torch.int8))], 64, "2-D uint8 tensor"),
        ([(fmt, raw.flatten())], 64, "2-D uint8 tensor"),
        ([(fmt, torch.empty(68, 4, dtype=torch.uint8).T)], 64, "contiguous CPU tensors"),
        ([(fmt, torch.empty(4, 68, dtype=torch.uint8, device="meta"))], 64, "contiguous CPU tensors"),
        ([(QuantFormat("q5_1", 7, 32, 24), torch.zeros(4, 48, dtype=torch.uint8))], 64, "does not run q5_1"),
        ([(QuantFormat("q8_0", 8, 32, 30), raw)], 64, "does not run q8_0"),  # not the real Q8_0's layout
        ([(fmt, raw), (FORMATS["q4_k"], blocks(FORMATS["q4_k"], 2, 256, 9))], 64, "blocks of 256"),
    ]
    for segments, k, message in cases:
        with pytest.raises(ValueError, match=message):
            kernels.bind_quant_linear(segments, k)


def test_bad_inputs_are_refused(kernels):
    fmt = FORMATS["q4_0"]
    gemm = kernels.bind_quant_linear([(fmt, blocks(fmt, 4, 64, 10))], 64)
    for x, message in ((torch.ones(3, 64, dtype=torch.float64), "float32 or bfloat16 input"),
                       (torch.ones(3, 64, dtype=torch.float16), "float32 or bfloat16 input"),
                       (torch.ones(3, 64, dtype=torch.int64), "float32 or bfloat16 input"),
                       (torch.ones(3, 63), "does not take input"),
                       (torch.tensor(1.0), "does not take input"),
                       (torch.ones(3, 64, device="meta"), "contiguous CPU tensors")):
        with pytest.raises(ValueError, match=message):
            gemm(x)


def test_the_c_sides_refusals_are_value_errors(kernels):
    """The kernel checks its segments too (-1 for a k that is not whole blocks, -2 for a type it does
    not decode); the binding's checks leave them unreachable, so they are reached here by hand."""
    fmt = FORMATS["q8_0"]
    raw = blocks(fmt, 4, 64, 11)
    gemm = kernels.bind_quant_linear([(fmt, raw)], 64)
    x = torch.ones(2, 64)
    gemm._triples[0, 0] = 7  # Q5_1: not decoded here
    with pytest.raises(ValueError, match="not one the kernel decodes"):
        gemm(x)
    gemm._triples[0, 0] = FORMATS["q4_k"].ggml_type  # 64 is not whole 256-weight blocks
    with pytest.raises(ValueError, match="not a whole number"):
        gemm(x)
    out, index = torch.empty(1, 64), torch.zeros(1, dtype=torch.int64)
    assert kernels._quant_rows(7, raw.data_ptr(), 64, index.data_ptr(), 1, out.data_ptr(), 0, 1) == -2
    assert kernels._quant_rows(8, raw.data_ptr(), 48, index.data_ptr(), 1, out.data_ptr(), 0, 1) == -1


def test_bad_row_lookups_are_refused(kernels):
    fmt = FORMATS["q6_k"]
    raw = blocks(fmt, 5, 256, 12)
    good = torch.tensor([0, 4])
    cases = [
        (fmt, raw, torch.tensor([0, 5]), 256, torch.float32, "outside the table's 5 rows"),
        (fmt, raw, torch.tensor([-1]), 256, torch.float32, "outside the table's 5 rows"),
        (fmt, raw, good.int(), 256, torch.float32, "1-D int64"),
        (fmt, raw, good[None], 256, torch.float32, "1-D int64"),
        (fmt, raw, good, 256, torch.float16, "decode to one of"),
        (fmt, raw, good, 512, torch.float32, r"\[rows, 420\] uint8"),
        (fmt, raw, good, 200, torch.float32, "not a whole number"),
        (QuantFormat("q5_1", 7, 32, 24), raw, good, 256, torch.float32, "do not decode q5_1"),
    ]
    for fmt_, raw_, index, k, dtype, message in cases:
        with pytest.raises(ValueError, match=message):
            kernels.quant_rows(fmt_, raw_, index, k, dtype)


X86 = platform.machine() in ("x86_64", "AMD64")
#: Builds that force the narrower paths on an x86 CPU with AVX-512 (a narrower CPU builds what it can: the
#: test asserts the path the compiler's macros call for, whatever it is).
AVX2_FLAGS = X86_FLAGS["avx2"]
SCALAR_FLAGS = X86_FLAGS["scalar"]
EXTRA_FLAGS = [AVX2_FLAGS, SCALAR_FLAGS] if X86 else []


def expected_path(flags: list[str]) -> str:
    """The path `csrc/quant_gemm.c` selects from GCC's predefined macros under `flags`."""
    compiler = build_module._gnu_compiler()
    macros = subprocess.run([compiler, *flags, "-dM", "-E", "-"], input="", capture_output=True, text=True,
                            check=True).stdout
    defined = {name for name in ("AVX512F", "AVX2", "FMA") if f"#define __{name}__ 1" in macros}
    if "AVX512F" in defined:
        return "avx512"
    return "avx2" if {"AVX2", "FMA"} <= defined else "scalar"


@pytest.mark.parametrize("flags", [*build_module.COMPILE_FLAGS, *EXTRA_FLAGS], ids=" ".join)
def test_every_flag_set_builds_kernels_that_decode_and_sum_exactly(kernels_built_with, flags):
    """Each flag set another CPU would get is built and checked here, and on x86 two more that force the
    AVX2 and the scalar loops, so every path runs on this machine (the int8 kernel's paths are checked
    against each other bit for bit in test_packed_quant.py)."""
    built = kernels_built_with(flags)
    if built is None:
        assert not X86 and flags != BASELINE_FLAGS, flags
        return
    assert built.quant_path == expected_path(flags)
    if flags is SCALAR_FLAGS:
        assert built.quant_path == "scalar"
    for seed, fmt in enumerate(FORMATS.values()):
        raw = random_blocks(fmt, 6, fmt.block_elems, seed)
        assert torch.equal(built.quant_rows(fmt, raw, torch.arange(6), fmt.block_elems, torch.float32),
                           reference(fmt, raw))
        for dtype in DTYPES:
            for m, n, blocks_per_row in ((1, 5, 1), (6, 9, 2)):
                check_product(built, fmt, m, n, blocks_per_row * fmt.block_elems, dtype, seed)
    check_product(built, FORMATS["q8_0"], 70, 13, 1536, torch.float32, 1)  # several x blocks
    check_product(built, FORMATS["q8_0"], 130, 13, 1536, torch.bfloat16, 2)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 20), n=st.integers(1, 20), blocks_per_row=st.integers(1, 4), bf16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_any_small_shape_sums_exactly(kernels, m, n, blocks_per_row, bf16, seed):
    check_product(kernels, FORMATS["q5_0"], m, n, 32 * blocks_per_row, torch.bfloat16 if bf16 else torch.float32,
                  seed)


def test_a_bound_gemm_is_the_class_the_layers_use(kernels):
    fmt = FORMATS["q8_0"]
    assert isinstance(kernels.bind_quant_linear([(fmt, blocks(fmt, 2, 32, 13))], 32), QuantGemm)
