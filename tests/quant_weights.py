"""Quantized test weights and the bounds a quantized product is checked against, shared by the tests of
the weight-only kernel (`csrc/quant_gemm.c`) and the int8 one (`csrc/quant_int8.c`)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from numerics import gamma, unit_roundoff

from ferrox_batch.runtime.quant.formats import QuantFormat

#: The formats gguf's numpy code can quantize: their test weights are quantized normals, the K-quants'
#: random blocks.
QUANTIZABLE = ("q8_0", "q4_0", "q4_1", "q5_0")
#: Where each format keeps its fp16 scales (Q4_1's fp16 minimum, Q4_K's dmin too) within a block.
SCALE_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}
#: Where a format with a power-of-two E8M0 scale (one byte) keeps it within a block.
E8M0_OFFSETS = {"mxfp4": 0}
DTYPES = (torch.float32, torch.bfloat16)


def random_blocks(fmt: QuantFormat, n: int, k: int, seed: int) -> torch.Tensor:
    """n rows of k weights of random bytes, so every bit pattern of the quants, Q5_0's fifth bits and the
    K-quants' packed sub-block scales and mins occurs, with each fp16 scale replaced by a finite one of
    either sign between 2^-20 and 2^-4 (fp16 subnormals included: they must widen exactly too). Random
    bytes there would put infinities and NaNs in the weights. MXFP4's one E8M0 byte is drawn so its
    scale 2^(e - 128) lies between 2^-24 and 2^-8 (its weights, up to 12 times that, the same range)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // fmt.block_elems, fmt.block_bytes), dtype=np.uint8)
    if fmt.name in E8M0_OFFSETS:
        raw[:, :, E8M0_OFFSETS[fmt.name]] = rng.integers(128 - 24, 128 - 8, size=raw.shape[:2], endpoint=True)
        return torch.from_numpy(raw.reshape(n, fmt.row_bytes(k)))
    for offset in SCALE_OFFSETS[fmt.name]:
        scales = rng.choice([-1.0, 1.0], size=raw.shape[:2]) * 2.0 ** rng.uniform(-20, -4, size=raw.shape[:2])
        raw[:, :, offset:offset + 2] = scales.astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(n, fmt.row_bytes(k)))


def blocks(fmt: QuantFormat, n: int, k: int, seed: int) -> torch.Tensor:
    """A test weight: gguf's quantization of random normals where gguf quantizes the format, else random
    blocks (`random_blocks`)."""
    if fmt.name not in QUANTIZABLE:
        return random_blocks(fmt, n, k, seed)
    weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(quantize(weights, GGMLQuantizationType(fmt.ggml_type))))


def reference(fmt: QuantFormat, raw: torch.Tensor) -> torch.Tensor:
    """gguf's dequantization (float32, the formats' reference semantics)."""
    return torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType(fmt.ggml_type)))


def assert_exact_sums(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """`got` is `x @ weight.T` as the kernel may compute it, within bounds from its arithmetic.

    float32 x: the kernel multiplies the exact float32 decodes (the weights gguf computes, bit for bit:
    `test_rows_decode_exactly_as_gguf` checks the decoder both entry points share), so the only error is
    the float32 sum of each output's k products, once each, in some order, fused or not: within gamma(k)
    of their magnitudes |x| |w| (no term for the weights, which are exact).

    bfloat16 x (x itself exact in bf16): widened exactly, so the float32 sum is within the same gamma(k);
    the output is then rounded to bf16 once, within u = 2^-8 (bf16 keeps 8 significant bits) of that sum.
    """
    x64, w64 = x.double(), weight.double()
    exact = x64 @ w64.T
    magnitudes = x64.abs() @ w64.abs().T
    k = x.shape[-1]
    if got.dtype == torch.float32:
        bound = gamma(k) * magnitudes
    else:
        summed = gamma(k) * magnitudes
        bound = summed + unit_roundoff(torch.bfloat16) * (exact.abs() + summed)
    assert got.dtype == x.dtype and got.shape == exact.shape
    error = (got.double() - exact).abs()
    worst = float((error / bound.clamp(min=1e-300)).max()) if exact.numel() else 0.0
    assert bool((error <= bound).all()), f"{worst:.3g} times the bound"


def assert_sums_of_quantized_x(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """`got` is `x @ weight.T` as the int8-activation kernel may compute it.

    Each 32-block of a row of x, of largest magnitude a, is quantized with dx = a / 127 and q = nearest(x
    * (127 / a)). Forming dx and 127 / a (a division each, or a reciprocal and a product under
    -freciprocal-math) errs by at most 2u each and the product x * (127 / a) by u more, so that product is
    within 127 * 5u (|x| <= a) of x / dx, the quant within 1/2 + 635u of it, and x' = dx * q within
    dx * (1/2 + 636u) of x, dx at most (a / 127)(1 + 2u): the step below. (A block with a below 2^-119
    quantizes to zero, each x moved by at most a.) The weight's quants and x's multiply exactly in int32;
    what is summed in float32 is, per output, at most k/4 + 1 lane sums of 4 products (or k/32 block
    sums) each times its dx * dw (one rounding more), then reduced across 16 lanes: within gamma(k) of
    the magnitudes |x'| |w| <= (|x| + step) |w|. bf16 output adds one rounding (u of bf16) of the float32
    sum, as in `assert_exact_sums`."""
    u = unit_roundoff(torch.float32)
    x64, w64 = x.double(), weight.double()
    m, k = x.shape
    amax = x64.view(m, k // 32, 32).abs().amax(-1, keepdim=True)
    step = torch.where(amax < 2.0**-119, amax, amax / 127 * (1 + 2 * u) * (0.5 + 636 * u))
    step = step.expand(m, k // 32, 32).reshape(m, k)
    exact = x64 @ w64.T
    summed = step @ w64.abs().T + gamma(k) * ((x64.abs() + step) @ w64.abs().T)
    bound = summed if got.dtype == torch.float32 else summed + unit_roundoff(torch.bfloat16) * (exact.abs() + summed)
    assert got.dtype == x.dtype and got.shape == exact.shape
    error = (got.double() - exact).abs()
    worst = float((error / bound.clamp(min=1e-300)).max()) if exact.numel() else 0.0
    assert bool((error <= bound).all()), f"{worst:.3g} times the bound"
