"""The fp16-weight linear kernel and its gated variant: the panel layout, their sums against exact
arithmetic, the layers that choose them, and their refusals."""

from __future__ import annotations

import platform
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import BASELINE_FLAGS, X86_FLAGS, built_kernels, needs_compiler
from numerics import assert_same_linear, gamma

from ferrox_batch.runtime.architectures.gate_up import GateUp, gated_agrees
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.kernels import cpu_kernels as kernels_module
from ferrox_batch.runtime.kernels import kernel_build as build_module
from ferrox_batch.runtime.kernels.cpu_kernels import F16_PANEL, CpuKernels

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return built_kernels()


def case(seed: int, m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)


def assert_sums_of_the_rounded_weight(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """The kernel sums the k products of each output in float32, once each and in order (FMA or not):
    within gamma(k) of their magnitudes from the exact sum over the fp16-rounded weight."""
    rounded = weight.half().double()
    exact = x.double() @ rounded.T
    bound = gamma(x.shape[-1]) * (x.double().abs() @ rounded.abs().T)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert bool(((got.double() - exact).abs() <= bound).all())


def check_kernel(built: CpuKernels, seed: int, m: int, k: int, n: int) -> None:
    x, weight = case(seed, m, k, n)
    assert_sums_of_the_rounded_weight(built.f16_linear(x, built.pack_f16_panels(weight), n), x, weight)


def test_panels_hold_the_weight_rounded_to_fp16_eight_columns_at_a_time(kernels):
    weight = torch.randn(19, 5) * 1000  # rounds visibly in fp16
    panels = kernels.pack_f16_panels(weight)
    assert panels.dtype == torch.float16 and panels.shape == (3, 5, F16_PANEL)
    for column in range(19):
        assert torch.equal(panels[column // F16_PANEL, :, column % F16_PANEL], weight[column].half())
    assert not bool(panels[2, :, 3:].any())  # columns 19-23 do not exist: zeros


@settings(max_examples=60, deadline=None)
@given(m=st.integers(0, 70), k=st.integers(1, 90), n=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_every_shape_sums_like_exact_arithmetic(kernels, m, k, n, seed):
    """Row counts across the 4-row tiles and the 64-row blocks, widths across the 8-column panels and
    the 24-column slices, and a last panel that ends early."""
    check_kernel(kernels, seed, m, k, n)


@pytest.mark.parametrize("m, k, n", [(1, 576, 960), (32, 576, 3072), (150, 1536, 61), (200, 64, 8)])
def test_the_model_shapes_and_more_rows_than_a_block(kernels, m, k, n):
    check_kernel(kernels, 3, m, k, n)


def test_leading_dimensions_and_strided_inputs(kernels):
    x, weight = case(5, 12, 40, 24)
    panels = kernels.pack_f16_panels(weight)
    got = kernels.f16_linear(x.view(3, 4, 40), panels, 24)
    assert got.shape == (3, 4, 24)
    assert_sums_of_the_rounded_weight(got.view(12, 24), x, weight)
    wide = torch.randn(12, 80)
    assert_sums_of_the_rounded_weight(kernels.f16_linear(wide[:, :40], panels, 24), wide[:, :40], weight)


@pytest.mark.parametrize("n", [8, 20, 200])  # one slice (fewer than the threads), one partial, nine
def test_results_do_not_depend_on_the_thread_count(kernels, n):
    """Each output is one thread's sum, in the order of k, whatever the split of columns: both kernels
    give the same bits on teams of 1, 2 and 3 threads (the suite runs torch with one)."""
    x, weight = case(6, 70, 100, 2 * n)
    panels, gated = kernels.pack_f16_panels(weight), kernels.pack_f16_gated(weight)
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outs.append((kernels.f16_linear(x, panels, 2 * n), kernels.f16_gated_linear(x, gated, n)))
    finally:
        torch.set_num_threads(threads)
    for plain, fused in outs[1:]:
        assert torch.equal(plain, outs[0][0]) and torch.equal(fused, outs[0][1])
    assert_sums_of_the_rounded_weight(outs[1][0], x, weight)
    assert gated_agrees(outs[1][1], x, weight.half().float())


def test_a_bound_weight_computes_what_the_checked_call_does(kernels):
    """A layer binds its packed weight once (`bind_f16_linear`, `bind_f16_gated_linear`); each call then
    checks only its input. Same results, bit for bit, on 2-D, 3-D and strided input."""
    x, weight = case(11, 6, 40, 2 * 24)
    panels, gated = kernels.pack_f16_panels(weight), kernels.pack_f16_gated(weight)
    linear, fused = kernels.bind_f16_linear(panels, 48), kernels.bind_f16_gated_linear(gated, 24)
    assert linear.in_features == fused.in_features == 40
    wide = torch.randn(6, 80)
    for given_x in (x, x.view(2, 3, 40), wide[:, ::2]):
        assert torch.equal(linear(given_x), kernels.f16_linear(given_x, panels, 48))
        assert torch.equal(fused(given_x), kernels.f16_gated_linear(given_x, gated, 24))
        rows = given_x.reshape(-1, 40)
        assert_sums_of_the_rounded_weight(linear(given_x).reshape(-1, 48), rows, weight)
        assert gated_agrees(fused(given_x).reshape(-1, 24), rows, weight.half().float())
    assert linear(x.view(2, 3, 40)).shape == (2, 3, 48)
    with pytest.raises(ValueError, match="do not hold input of 39 features"):
        linear(x[:, :39])
    with pytest.raises(ValueError, match="float32 input"):
        fused(x.half())
    with pytest.raises(ValueError, match="at least one feature"):
        linear(torch.tensor(1.0))
    with pytest.raises(ValueError, match="do not hold"):
        kernels.bind_f16_gated_linear(gated, 25)  # one slice a half: 24 outputs, not 25


def test_bad_inputs_are_refused(kernels):
    x, weight = case(7, 4, 16, 9)
    panels = kernels.pack_f16_panels(weight)
    with pytest.raises(ValueError, match="float32 input"):
        kernels.f16_linear(x.double(), panels, 9)
    with pytest.raises(ValueError, match="float32 input"):
        kernels.f16_linear(x, panels.float(), 9)
    with pytest.raises(ValueError, match="do not hold"):
        kernels.f16_linear(x[:, :15], panels, 9)
    with pytest.raises(ValueError, match="do not hold"):
        kernels.f16_linear(x, panels, 17)  # three panels' worth, two given
    for bad_x, outputs in ((torch.tensor(1.0), 9), (torch.ones(4, 0), 9), (x, 0), (x, -3)):
        with pytest.raises(ValueError, match="at least one feature and at least one output"):
            kernels.f16_linear(bad_x, panels, outputs)
    with pytest.raises(ValueError, match="2-D floating-point CPU weight"):
        kernels.pack_f16_panels(torch.ones(3, 4, 5))
    with pytest.raises(ValueError, match="2-D floating-point CPU weight"):
        kernels.pack_f16_panels(torch.ones(3, 4, dtype=torch.int64))


X86 = platform.machine() in ("x86_64", "AMD64")
#: A build without AVX2, FMA and F16C on x86, whatever the compiler's default target: the scalar loops.
SCALAR_FLAGS = X86_FLAGS["scalar"]


def compiler_vectorises(flags: list[str]) -> bool:
    """Whether GCC defines AVX2, FMA and F16C under `flags` (what `f16_gemm_vectorised` must report)."""
    compiler = build_module._gnu_compiler()
    macros = subprocess.run([compiler, *flags, "-dM", "-E", "-"], input="", capture_output=True, text=True,
                            check=True).stdout
    return all(f"#define __{name}__ 1" in macros for name in ("AVX2", "FMA", "F16C"))


@pytest.mark.parametrize("flags", [*build_module.COMPILE_FLAGS, *([SCALAR_FLAGS] if X86 else [])], ids=" ".join)
def test_every_flag_set_builds_a_kernel_that_sums_like_exact_arithmetic(kernels_built_with, flags):
    """As for the other kernels: each flag set another CPU would get is built and checked here, and on
    x86 one more without AVX2, FMA and F16C, so the scalar loops are checked even where the compiler's
    baseline has them. Each build says which loops it has (a layer prefers fbgemm over scalar ones)."""
    built = kernels_built_with(flags)
    if built is None:
        assert not X86 and flags != BASELINE_FLAGS, flags
        return
    assert built.f16_gemm_vectorised == compiler_vectorises(flags)
    if flags is SCALAR_FLAGS:
        assert not built.f16_gemm_vectorised
    for m, k, n in ((1, 7, 5), (9, 64, 61), (70, 33, 24)):
        check_kernel(built, 8, m, k, n)
        check_gated(built, 12, m, k, n)
    check_gated(built, 13, 5, 16, 8, scale=30.0)


def test_a_layer_runs_the_kernel_where_it_is_vectorised(kernels):
    gen = torch.Generator().manual_seed(9)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    layer = Linear(weight, bias, weights="fp16", kernels=kernels)
    assert layer.kind == ("fp16_panels" if kernels.f16_gemm_vectorised else
                          "fbgemm_fp16" if "fbgemm" in torch.backends.quantized.supported_engines else layer.kind)
    if layer.kind != "fp16_panels":
        pytest.skip("the kernel was built without AVX2, FMA and F16C here: layers prefer fbgemm")
    assert layer.weight is None  # the panels are the only copy
    x = torch.randn(5, 24, generator=gen)
    got = layer(x)
    # The bias is added after the sum: one more float32 rounding of the result.
    exact = x.double() @ weight.half().double().T + bias.double()
    bound = gamma(25) * (x.double().abs() @ weight.half().double().abs().T + bias.double().abs())
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_a_layer_whose_kernel_disagrees_falls_back_to_fbgemm(kernels, monkeypatch):
    if not kernels.f16_gemm_vectorised:
        pytest.skip("the kernel was built without AVX2, FMA and F16C here: layers never pick it")
    broken = CpuKernels.__new__(CpuKernels)
    broken.f16_gemm_vectorised = True
    broken.pack_f16_panels = kernels.pack_f16_panels
    broken.bind_f16_linear = lambda panels, n: lambda x: torch.zeros(*x.shape[:-1], n)  # wrong sums
    weight = torch.randn(16, 8) + 3
    layer = Linear(weight, weights="fp16", kernels=broken)
    assert layer.kind in ("fbgemm_fp16", "mkldnn", "plain")
    x = torch.randn(5, 8)
    used = weight.half().float() if layer.kind == "fbgemm_fp16" else weight
    assert_same_linear(layer(x), x, used, None)


def test_weights_past_fp16s_range_keep_the_fp32_kernels(kernels):
    """fp16 saturates at 65504: such a weight is neither packed in fp16 nor fused, and runs unrounded."""
    weight = torch.randn(16, 8)
    weight[3, 2] = 1e5
    layer, gated = Linear(weight, weights="fp16", kernels=kernels), GateUp(weight, weights="fp16", kernels=kernels)
    assert layer.kind in ("mkldnn", "plain") and not gated.fused and gated.kind in ("mkldnn", "plain")
    x = torch.randn(5, 8)
    assert_same_linear(layer(x), x, weight, None)
    assert gated_agrees(gated(x), x, weight)


def check_gated(built: CpuKernels, seed: int, m: int, k: int, n: int, scale: float = 1.0) -> None:
    x, weight = case(seed, m, k, 2 * n)
    weight = weight * scale
    got = built.f16_gated_linear(x, built.pack_f16_gated(weight), n)
    assert got.shape == (m, n)
    assert gated_agrees(got, x, weight.half().float())


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 70), k=st.integers(1, 70), n=st.integers(1, 60), seed=st.integers(0, 2**16))
def test_the_gated_kernel_is_silu_of_the_gate_times_the_up(kernels, m, k, n, seed):
    check_gated(kernels, seed, m, k, n)


def test_the_gated_kernel_past_exps_range(kernels):
    """Gate sums of +-hundreds (tens of the hypothesis cases' scale past exp's range): silu goes to g, and
    to 0 (within 1e-35; torch's exp overflows to a signed zero there), never NaN."""
    check_gated(kernels, 11, 9, 64, 40, scale=30.0)
    x = torch.ones(2, 1)
    weight = torch.tensor([[-200.0], [200.0], [3.0], [3.0]])  # gates -200 and 200, ups 3 and 3
    got = kernels.f16_gated_linear(x, kernels.pack_f16_gated(weight), 2)
    assert bool((got[:, 0].abs() < 1e-35).all()) and torch.equal(got[:, 1], torch.tensor([600.0, 600.0]))


def test_gated_panels_hold_each_half_in_whole_slices(kernels):
    weight = torch.randn(2 * 30, 4)  # 30 columns a half: 4 panels, padded to 6 (two slices)
    panels = kernels.pack_f16_gated(weight)
    assert panels.shape == (12, 4, F16_PANEL)
    assert torch.equal(panels[:6], kernels.pack_f16_panels(weight[:30], slices=True))
    assert torch.equal(panels[6:], kernels.pack_f16_panels(weight[30:], slices=True))
    assert not bool(panels[3, :, 6:].any()) and not bool(panels[4:6].any())
    with pytest.raises(ValueError, match="even number of rows"):
        kernels.pack_f16_gated(torch.randn(5, 4))
    with pytest.raises(ValueError, match="do not hold"):
        kernels.f16_gated_linear(torch.randn(2, 4), panels, 50)  # three slices a half, two given


def test_a_gate_up_projection_fuses_where_the_kernel_is_vectorised(kernels):
    gen = torch.Generator().manual_seed(14)
    weight = torch.randn(2 * 40, 24, generator=gen)
    fused = GateUp(weight, weights="fp16", kernels=kernels)
    plain = GateUp(weight)  # fp32 weights: a Linear, then torch's silu and product
    assert not plain.fused and plain.kind in ("mkldnn", "plain")
    x = torch.randn(7, 24, generator=gen)
    assert gated_agrees(plain(x), x, weight)  # the Linear's sums, then torch's silu and product
    if not kernels.f16_gemm_vectorised:
        assert not fused.fused
        return
    assert fused.fused and fused.kind == "fp16_panels"
    assert gated_agrees(fused(x), x, weight.half().float())
    assert fused(x.view(7, 1, 24)).shape == (7, 1, 40)
    # A bias keeps the unfused path (the kernel has none).
    assert not GateUp(weight, torch.randn(80), weights="fp16", kernels=kernels).fused


def test_a_gate_up_whose_kernel_disagrees_keeps_the_unfused_path(kernels):
    if not kernels.f16_gemm_vectorised:
        pytest.skip("the kernel was built without AVX2, FMA and F16C here: nothing fuses")
    broken = CpuKernels.__new__(CpuKernels)
    broken.f16_gemm_vectorised = True
    broken.pack_f16_gated = kernels.pack_f16_gated
    broken.pack_f16_panels = kernels.pack_f16_panels
    broken.bind_f16_linear = kernels.bind_f16_linear
    broken.bind_f16_gated_linear = lambda panels, n: lambda x: torch.zeros(*x.shape[:-1], n)  # wrong products
    layer = GateUp(torch.randn(16, 8) + 3, weights="fp16", kernels=broken)
    assert not layer.fused and layer.kind == "fp16_panels"  # the Linear underneath still runs ours
    with pytest.raises(ValueError, match="even number of rows"):
        GateUp(torch.randn(5, 8))
