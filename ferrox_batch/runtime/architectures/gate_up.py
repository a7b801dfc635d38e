"""The gated MLP's input projection, `act(x @ gate.T) * (x @ up.T)`, as one call where a kernel allows.

The activation is SiLU (SwiGLU: Llama, Qwen, Phi) or tanh-approximated GELU (GeGLU: Gemma 3); only SiLU
has a fused kernel.

Llama-family MLPs project the input twice (gate and up, held fused as one `[2n, k]` weight) and
multiply the SiLU of one by the other. Through `Linear` that is a `[rows, 2n]` product written out,
split, and read back by two elementwise kernels. Under `fp16w` with the C kernels built vectorised,
`CpuKernels.f16_gated_linear` instead forms the product in registers, tile by tile, and writes only
the `[rows, n]` result. Under `batch_invariant` a bf16 weight runs our bf16 kernel (`Linear`'s
"bf16_panels") and its SiLU and product run in C (`CpuKernels.silu_mul`), as the layer stack runs them.
Everywhere else (fp32, bf16, CUDA, fbgemm) the projection is a `Linear` followed by torch's `silu` and
product. At load the fused kernel is checked against that
reference on a probe input, within the bound its arithmetic allows, and dropped if it disagrees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ferrox_batch.runtime.architectures.linear import (
    Linear,
    fits_fp16,
    preferred_fp16_kind,
    probe_input,
)
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear
from ferrox_batch.runtime.kernels.packed_quant import PackedQuant
from ferrox_batch.runtime.quant.weight import QuantizedWeight, Weight

if TYPE_CHECKING:
    from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
    from ferrox_batch.runtime.kernels.packed_bf16 import PackedBf16
    from ferrox_batch.runtime.kernels.packed_gemm import PackedF16Gemm

#: What the fused path reports as its kernel (`GateUp.kind`).
FUSED_KIND = "fp16_panels"


class GateUp:
    """`act(gate(x)) * up(x)` for a fused `[2n, k]` weight (gate rows first)."""

    __slots__ = ("_fused", "_gelu", "_half", "_kernels", "_linear")

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None, *, weights: str = "dtype",
                 kernels: CpuKernels | None = None, activation: str = "silu", int8_activations: bool = True,
                 batch_invariant: bool = False, narrow_panels: bool = False) -> None:
        """`weights`, `kernels`, `batch_invariant` and `narrow_panels` as for `Linear`; a bias, or the GELU
        activation, keeps the unfused path. A quantized weight runs the quantized kernel (`QuantizedLinear`'s
        `int8_activations`), then the activation and product in C (SiLU) or torch (GELU)."""
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"a gated projection's activation is silu or gelu_pytorch_tanh; got {activation!r}")
        self._gelu = activation == "gelu_pytorch_tanh"
        if len(weight.shape) != 2 or weight.shape[0] % 2:
            raise ValueError(f"a gated projection's weight has an even number of rows; got {tuple(weight.shape)}")
        self._half = weight.shape[0] // 2
        self._fused: PackedF16Gemm | None = None
        self._linear: Linear | QuantizedLinear | None = None
        self._kernels: CpuKernels | None = None  # set where the SiLU and product run in C (`CpuKernels.silu_mul`)
        if isinstance(weight, QuantizedWeight):
            if kernels is None:
                raise ValueError("a quantized projection runs on the CPU kernels; widen it where they are not")
            self._linear = QuantizedLinear(weight, bias, kernels, int8_activations)
            self._kernels = None if self._gelu else kernels
            return
        fusable = (bias is None and not self._gelu and weights == "fp16" and weight.dtype == torch.float32
                   and weight.device.type == "cpu" and preferred_fp16_kind(kernels) == FUSED_KIND
                   and fits_fp16(weight))
        if fusable:
            self._fused = kernels.bind_f16_gated_linear(kernels.pack_f16_gated(weight), self._half)
            probe = probe_input(weight)
            if gated_agrees(self(probe), probe, weight.half().float()):
                return
            self._fused = None
        self._linear = Linear(weight, bias, weights=weights, kernels=kernels, batch_invariant=batch_invariant,
                              narrow_panels=narrow_panels and not self._gelu)
        if self._linear.kind == "bf16_panels" and not self._gelu:
            self._kernels = kernels

    @property
    def kind(self) -> str:
        """The kernel that runs the projection (`Linear.kind`'s names)."""
        return FUSED_KIND if self._fused is not None else self._linear.kind

    @property
    def nbytes(self) -> int:
        """Bytes its weight is stored in (`Linear.nbytes`)."""
        if self._fused is not None:
            return 2 * self._half * self._fused.in_features * 2  # both halves in fp16 panels
        return self._linear.nbytes

    @property
    def fused(self) -> bool:
        """Whether the SiLU and the product run inside the projection's kernel."""
        return self._fused is not None

    @property
    def fused_gemm(self) -> PackedF16Gemm | None:
        """The bound fused kernel when the projection and its SiLU gate run in it, else None."""
        return self._fused

    @property
    def packed_gemm(self) -> PackedQuant | None:
        """The int8 kernel's packed weight when the projection runs it and its SiLU and product run in C
        (`CpuKernels.silu_mul`, as the layer stack runs them), with no bias; else None."""
        linear = self._linear
        if self._kernels is None or not isinstance(linear, QuantizedLinear) or linear.bias is not None:
            return None
        return linear.stored if isinstance(linear.stored, PackedQuant) else None

    @property
    def bf16_gemm(self) -> PackedBf16 | None:
        """The bf16 kernel's panels (`Linear.bf16_panels`: the weight it runs, or the narrow steps' copy) when
        the activation is SiLU (the layer stack runs it in C) and there is no bias; else None."""
        linear = self._linear
        if self._gelu or not isinstance(linear, Linear):
            return None
        return linear.bf16_panels

    def drop_narrow(self) -> None:
        """Let the narrow steps' copy go (`Linear.drop_narrow`), where there is one."""
        if isinstance(self._linear, Linear):
            self._linear.drop_narrow()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return self._fused(x)  # a `PackedF16Gemm`, checked when it was bound
        if self._kernels is not None:
            projected = self._linear(x)
            return self._kernels.silu_mul(projected.reshape(-1, projected.shape[-1])).view(
                *projected.shape[:-1], self._half)
        gate, up = self._linear(x).chunk(2, dim=-1)
        if self._gelu:
            return F.gelu(gate, approximate="tanh") * up
        return F.silu(gate) * up


def gated_agrees(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `got` is `silu(x @ gate.T) * (x @ up.T)` over `weight` (float32, gate rows first), up to
    how `got` may round.

    The reference is computed in float64 over the float32 inputs, exact to far below float32's steps, so
    only `got`'s side rounds: each half's float32 sum of k products (with FMA or without) is within
    e = gamma(k) |x| |w| of the exact sum. SiLU's slope is at most 1.1 in magnitude, so the products
    differ by at most 1.1 e_g (|u| + e_u) + |silu(g)| e_u, plus the roundings after the sums: exp within
    4 ulps, the sum, the quotient and the product one each, 8 steps of float32 at the value in all.
    """
    gate_w, up_w = weight.double().chunk(2)
    xd = x.double()
    g, u = xd @ gate_w.T, xd @ up_w.T
    want = F.silu(g) * u
    k = x.shape[-1]
    unit = torch.finfo(torch.float32).eps / 2
    gamma = k * unit / (1 - k * unit)
    e_g, e_u = gamma * (xd.abs() @ gate_w.abs().T), gamma * (xd.abs() @ up_w.abs().T)
    silu_g = F.silu(g).abs()
    bound = 1.1 * e_g * (u.abs() + e_u) + silu_g * e_u + 8 * (2 * unit) * (silu_g * u.abs())
    return bool(((got.double() - want).abs() <= bound).all())
