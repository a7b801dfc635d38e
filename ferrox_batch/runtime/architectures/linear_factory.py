"""`LinearFactory`: the one place a decoder's blocks get their linear layers and their weights' formats.

A linear layer's kernel follows from a handful of load-time choices: the dense weights' format (the
compute dtype, or fp16 panels for an fp32 model), the C kernels built here (or none), which kernel runs
quantized weights (int8 activations or weight-only), whether dense bf16 layers prefer our batch-invariant
kernel, whether they also hold the layer stack's narrow-step panels, and which quantized formats are
served as stored or quantized to at load. The factory is built once per decoder from those choices and
every block asks it for its layers (`linear`, `gate_up`, `embedding`, and per expert of a stacked
weight, `experts` and `gate_up_experts`) and for its weights' format (`prepare`), so no block re-derives
a choice and the same weight always gets the same kernel.

Promises: `linear`, `gate_up` and `embedding` construct exactly the layers the decoder constructed before
the factory existed (same arguments, so the same kernels and bits); `prepare` keeps a quantized weight
as stored only where all its formats run here, widens the rest, and quantizes dense 2-D weights (and
stacked experts' 3-D ones) to `quantize_to` where their rows split into its blocks; `build` refuses a
`quantize_to` the kernels do not serve here (ModelLoadError).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ferrox_batch.runtime.architectures.embedding import Embedding
from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.linear import BATCH_INVARIANT_KINDS, Linear
from ferrox_batch.runtime.architectures.quantized_linear import (
    QuantizedLinear,
    formats_that_run,
    is_quantized_kind,
)
from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.kernels.packed_quant import PackedQuant
from ferrox_batch.runtime.quant.formats import QuantFormat
from ferrox_batch.runtime.quant.quantize import quantizable, quantize
from ferrox_batch.runtime.quant.weight import QuantizedWeight, Weight

if TYPE_CHECKING:
    from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels


@dataclass(frozen=True, slots=True)
class LinearFactory:
    """A decoder's linear layers and weight formats, from its load-time choices (module docstring).

    `weights_format` is `Linear`'s `weights` ("dtype" or "fp16"); `prefer_invariant` is `Linear`'s
    `batch_invariant` (ask for our bf16 kernel over oneDNN's); `narrow_panels` holds the narrow steps'
    copy of dense bf16 layers; `keep` is the quantized formats served as stored; `quantize_to` the format
    dense weights are quantized to at load (its name is in the formats that run here)."""

    device: torch.device
    dtype: torch.dtype
    kernels: CpuKernels | None
    weights_format: str = "dtype"
    int8_activations: bool = True
    prefer_invariant: bool = False
    narrow_panels: bool = False
    keep: frozenset[str] = frozenset()
    quantize_to: QuantFormat | None = None

    @classmethod
    def build(
        cls, *, device: torch.device | str, dtype: torch.dtype, kernels: CpuKernels | None,
        weights_format: str = "dtype", keep_quantized: bool = False, quantize_to: QuantFormat | None = None,
        int8_activations: bool = True, batch_invariant: bool = False, narrow_panels: bool = False,
    ) -> LinearFactory:
        """The factory for a decoder built with `Decoder`'s knobs of these names; `kernels` are the C kernels
        that decoder runs (`Decoder.kernels_for`). The quantized formats are checked here, once."""
        wanted = keep_quantized or quantize_to is not None
        runs = formats_that_run(kernels, dtype, int8_activations) if wanted else frozenset()
        if quantize_to is not None and quantize_to.name not in runs:
            raise ModelLoadError(f"weights cannot be served in {quantize_to.name} here: the quantized kernels run on "
                                 f"the CPU with float32 or bf16 activations, and "
                                 f"{'did not build' if kernels is None else 'did not pass their check'}")
        return cls(torch.device(device), dtype, kernels, weights_format, int8_activations, batch_invariant,
                   narrow_panels, runs if keep_quantized else frozenset(), quantize_to)

    def prepare(self, tensor: Weight) -> Weight:
        """A checkpoint's tensor in the format the decoder holds it in: a quantized weight whose formats are
        all kept, as stored; any other widened to `dtype` on `device`, or, with `quantize_to`, a 2-D weight
        (the linears and the embedding; norms and biases are 1-D) or a 3-D one (stacked experts) whose rows
        split into its blocks quantized from its float32 values."""
        if isinstance(tensor, QuantizedWeight):
            if set(tensor.format_names) <= self.keep:
                return tensor
            tensor = tensor.dequantize()
        if self.quantize_to is not None and tensor.dim() in (2, 3) and quantizable(tensor, self.quantize_to):
            return quantize(tensor, self.quantize_to)
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def linear(self, weight: Weight | PackedQuant, bias: torch.Tensor | None = None, *,
               keep_weight: bool = False, narrow: bool = True) -> Linear | QuantizedLinear:
        """`x @ weight.T (+ bias)` on the kernel this factory's choices give. `keep_weight` keeps a dense
        weight alongside its packing (a shared tensor: a tied embedding); `narrow=False` holds no narrow
        steps' copy (a layer the layer stack never runs: the head)."""
        _refuse_stacked(weight, "experts")
        if isinstance(weight, (QuantizedWeight, PackedQuant)):
            assert self.kernels is not None  # `prepare` keeps weights quantized only where they run
            return QuantizedLinear(weight, bias, self.kernels, self.int8_activations)
        return Linear(weight, bias, keep_weight=keep_weight, weights=self.weights_format, kernels=self.kernels,
                      batch_invariant=self.prefer_invariant, narrow_panels=narrow and self.narrow_panels)

    def gate_up(self, weight: Weight, activation: str, *, narrow: bool = True) -> GateUp:
        """The gated MLP's fused `[2n, k]` input projection (gate rows first) with `activation` ("silu" or
        "gelu_pytorch_tanh"), fused into one kernel where this factory's choices allow."""
        _refuse_stacked(weight, "gate_up_experts")
        return GateUp(weight, weights=self.weights_format, kernels=self.kernels, activation=activation,
                      int8_activations=self.int8_activations, batch_invariant=self.prefer_invariant,
                      narrow_panels=narrow and self.narrow_panels)

    def embedding(self, weight: Weight) -> Embedding:
        """The token embedding over `weight` (a quantized one packed for the int8 kernel where it runs)."""
        return Embedding(weight, self.dtype, self.kernels, self.int8_activations)

    def experts(self, weight: Weight, bias: torch.Tensor | None = None) -> tuple[Linear | QuantizedLinear, ...]:
        """One linear per expert of a stacked `[experts, out, in]` weight (dense, or quantized: each expert's
        blocks as stored, never requantized), with its row of a stacked `[experts, out]` bias. Each is the
        layer `linear` builds from that expert's 2-D weight; none holds a narrow steps' copy (the layer
        stack runs no experts)."""
        count = _expert_count(weight)
        if bias is not None and (bias.dim() != 2 or bias.shape[0] != count):
            raise ValueError(f"a stacked bias is [experts, out] for {count} experts; got {tuple(bias.shape)}")
        return tuple(self.linear(weight[e], None if bias is None else bias[e], narrow=False) for e in range(count))

    def gate_up_experts(self, weight: Weight, activation: str) -> tuple[GateUp, ...]:
        """One gated projection per expert of a stacked `[experts, 2n, k]` gate/up weight (`gate_up`'s
        layer for each expert's 2-D weight, with no narrow steps' copy)."""
        return tuple(self.gate_up(weight[e], activation, narrow=False) for e in range(_expert_count(weight)))

    def batch_invariant_over(self, kinds: Iterable[str]) -> bool:
        """Whether layers running these kernels (`Linear.kind`, `QuantizedLinear.kind`) each give output rows
        that depend on that input row alone: ours for fp16 or bf16 weights, or the int8 quantized kernel,
        on the CPU with the C kernels built."""
        if self.device.type != "cpu" or self.kernels is None:
            return False
        return all(kind in BATCH_INVARIANT_KINDS or (is_quantized_kind(kind) and self.int8_activations)
                   for kind in kinds)


def _expert_count(weight: Weight) -> int:
    """The experts a stacked weight holds; ValueError for a 2-D one."""
    if isinstance(weight, QuantizedWeight):
        if weight.experts is None:
            raise ValueError(f"a {weight.shape} weight stacks no experts")
        return weight.experts
    if weight.dim() != 3:
        raise ValueError(f"a stacked weight is [experts, out, in]; got {tuple(weight.shape)}")
    return weight.shape[0]


def _refuse_stacked(weight: Weight | PackedQuant, instead: str) -> None:
    """A stacked weight builds one layer per expert (`instead`), never one layer over all of them."""
    if len(weight.shape) == 3:
        raise ValueError(f"a stacked {tuple(weight.shape)} weight builds one layer per expert; use `{instead}`")
