"""Linear layers with CPU weights prepacked once at load: for oneDNN, or in fp16 (our kernel or fbgemm's).

On the CPU, `F.linear` goes to MKL's GEMM, which lays the weight out anew
(packs it) on every call. For the small batches of decoding that packing is
most of the work: measured here (2-core AVX2 EPYC, fp32, cold weights), a
3072x576 projection took as long at 2 rows as at 8, twice as long as at 1
row, and a 32-row decode forward of the 135M model spent 90% of its time in
`mm`. Packing once at load for oneDNN (what torch's own inductor does for
frozen weights) measured 2-3x faster per projection at 2-32 rows and 1.1-1.4x
at 64-256 rows in fp32, and 1.4-1.7x at every batch size in bf16 (the
avx512_bf16 path). MKL's own packed fp32 GEMM does not help: it runs packed
only when the batch has exactly the packing hint's rows.

The packed kernel is a private torch op, so each layer checks at load that
it gives `F.linear`'s result on a probe input, within what the two summation
orders can differ by, and falls back to `F.linear` if the op is missing or
disagrees. CUDA weights stay plain (cuBLAS needs no packing).

fp16 weights (`weights="fp16"`, for CPUs without native bf16): the weight is
stored in fp16 and widened to fp32 inside the GEMM; activations, accumulation
and the result stay fp32. Two kernels can run it: our own
(`cpu_kernels.CpuKernels.f16_linear`, "fp16_panels"), where the C kernels
built with AVX2, FMA and F16C, else fbgemm's (`quantized::linear_dynamic_fp16`,
"fbgemm_fp16"). A forward's linears measured 1.07-1.20x fbgemm's at 32-1,024
rows and 0.99-1.24x at one row on a 2-core AVX2 EPYC
(`scripts/bench_weight_formats.py`); fbgemm's
was itself 1.1-1.7x packed fp32 at 1-1024 rows, for half the weight bytes.
The load-time check compares either with `F.linear` over the fp16-rounded
weight; where neither loads or agrees, the layer falls back to the fp32
kernels above with the weight unrounded.

bf16 weights under `batch_invariant` run our bf16 kernel instead of oneDNN's
(`cpu_kernels.CpuKernels.pack_bf16`, "bf16_panels"): oneDNN picks its kernel,
and with it each output's summation order, by the batch's row count, so a
request's logits move with the batch it shares; ours sums each output in one
fixed order whatever the rows. On a 2-core Zen 4 EPYC (avx512_bf16) its
projections of the default model ran 0.91-1.15x oneDNN's at 1-256 rows
(faster at one row; `scripts/bench_bf16_gemm.py`), and shape (a) over HTTP
was no slower.

`narrow_panels` holds a bf16 weight twice: packed for oneDNN, which runs the layer, and in our kernel's
panels, which the layer stack runs for steps of few rows (`layer_stack.NARROW_STEP_ROWS`). That is for
AMX CPUs, where oneDNN's tile kernels win at prefill sizes but a step of one or a few rows is bound by
the weights' bytes and the Python between oneDNN's calls: there the stack's one C call over our panels
is the faster way through the layers, at the cost of a second copy of their weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
    from ferrox_batch.runtime.kernels.packed_bf16 import PackedBf16
    from ferrox_batch.runtime.kernels.packed_gemm import PackedF16Gemm

# Batch-size hint for the packing; the packed weight serves every batch size.
_PACK_HINT = 32
_PACKED_DTYPES = (torch.float32, torch.bfloat16)
#: How a layer may store its weight: in the model's dtype, or (fp32 models on the CPU) in fp16.
WEIGHT_FORMATS = ("dtype", "fp16")
#: Rows of the input each layer is checked on at load (`probe_input`).
PROBE_ROWS = 7
#: The kernels that run fp16 weights (`Linear.kind`), ours first.
FP16_KINDS = ("fp16_panels", "fbgemm_fp16")
#: The dense kernels whose every output row depends on that input row alone, whatever the batch.
BATCH_INVARIANT_KINDS = ("fp16_panels", "bf16_panels")


class Linear:
    __slots__ = ("_dtype_size", "_in_features", "_kernels", "_kind", "_narrow", "_out_features", "_packed", "bias",
                 "weight")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True, keep_weight: bool = False,
        weights: str = "dtype", kernels: CpuKernels | None = None, batch_invariant: bool = False,
        narrow_panels: bool = False,
    ) -> None:
        """`keep_weight=False` lets a packed layer drop its plain weight (half the memory or less);
        pass True when the tensor is shared (a tied embedding). `weights` is one of `WEIGHT_FORMATS`;
        `kernels` (the compiled CPU kernels, when built) may run fp16 weights, and bf16 weights where
        `batch_invariant` asks for our kernel over oneDNN's. `narrow_panels` also packs a bf16 weight that
        oneDNN runs, with no bias, in our kernel's panels, for the layer stack's narrow steps (module
        docstring)."""
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {weights!r}; use one of {', '.join(WEIGHT_FORMATS)}")
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self._packed: torch.Tensor | None = None
        self._narrow: PackedBf16 | None = None
        self._kind = "plain"
        self._kernels = kernels
        self._out_features = weight.shape[0]
        self._in_features = weight.shape[1]
        self._dtype_size = weight.element_size()
        on_cpu = pack and weight.device.type == "cpu"
        if on_cpu and weights == "fp16" and weight.dtype == torch.float32:
            self._try_pack_fp16()
        if on_cpu and batch_invariant and weight.dtype == torch.bfloat16 and kernels is not None:
            self._try_pack_bf16()
        if on_cpu and self._kind == "plain" and weight.dtype in _PACKED_DTYPES:
            self._try_pack()
        if narrow_panels and self._kind == "mkldnn" and weight.dtype == torch.bfloat16 and bias is None \
                and kernels is not None:
            self._narrow = self._checked_bf16_panels()
        if self._kind != "plain" and not keep_weight:
            self.weight = None

    @property
    def nbytes(self) -> int:
        """Bytes its weight is stored in: fp16 panels 2 per weight, else the weight's dtype (packed or not),
        and the bias, and the narrow steps' copy where it holds one."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        narrow = 0 if self._narrow is None else self._narrow.nbytes
        if self._kind == "bf16_panels":
            return self._packed.nbytes + bias
        per_weight = 2 if self._kind in FP16_KINDS else self._dtype_size
        return self._out_features * self._in_features * per_weight + bias + narrow

    @property
    def kind(self) -> str:
        """Which kernel runs: "fp16_panels" (fp16 weight, our kernel), "fbgemm_fp16" (fp16 weight,
        fbgemm), "bf16_panels" (bf16 weight, our batch-invariant kernel), "mkldnn" (packed for oneDNN) or
        "plain" (`F.linear`)."""
        return self._kind

    def _try_pack_fp16(self) -> None:
        if not fits_fp16(self.weight):
            return
        rounded = self.weight.half().float()
        if preferred_fp16_kind(self._kernels) == "fp16_panels":
            panels = self._kernels.pack_f16_panels(self.weight)
            self._packed = self._kernels.bind_f16_linear(panels, self._out_features)
            self._kind = "fp16_panels"
            probe = probe_input(self.weight)
            if _agree(self(probe), probe, rounded, self.bias):
                return
            self._packed, self._kind = None, "plain"
        try:
            # fbgemm's prepack clamps the tensor it is given in place: give it a copy, so a shared
            # weight (a tied embedding) and the fp32 fallback keep the caller's values.
            packed = torch.ops.quantized.linear_prepack_fp16(self.weight.clone(), self.bias)
            self._packed, self._kind = packed, "fbgemm_fp16"
            probe = probe_input(self.weight)
            if not _agree(self(probe), probe, rounded, self.bias):
                raise RuntimeError("fbgemm's fp16 linear disagrees with F.linear")
        except (AttributeError, RuntimeError, NotImplementedError):
            self._packed, self._kind = None, "plain"

    def _try_pack_bf16(self) -> None:
        packed = self._checked_bf16_panels()
        if packed is not None:
            self._packed, self._kind = packed, "bf16_panels"

    def _checked_bf16_panels(self) -> PackedBf16 | None:
        """The weight in our bf16 kernel's panels, if that kernel gives `F.linear`'s result on the probe."""
        packed = self._kernels.pack_bf16(self.weight)
        probe = probe_input(self.weight)
        got = packed(probe, out_f32=self.bias is not None)
        if self.bias is not None:  # as `__call__` adds it: to the float32 sums, rounded once
            got = got.add_(self.bias).to(torch.bfloat16)
        return packed if _agree(got, probe, self.weight, self.bias) else None

    def _try_pack(self) -> None:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, _PACK_HINT)
            probe = probe_input(self.weight)
            self._packed, self._kind = packed, "mkldnn"
            if not _agree(self(probe), probe, self.weight, self.bias):
                raise RuntimeError("packed linear disagrees with F.linear")
        except (AttributeError, RuntimeError, NotImplementedError):
            self._packed, self._kind = None, "plain"

    @property
    def f16_panels(self) -> PackedF16Gemm | None:
        """The bound fp16-weight kernel when this layer runs it with no bias (the whole layer is that one
        call), else None."""
        return self._packed if self._kind == "fp16_panels" and self.bias is None else None

    @property
    def bf16_panels(self) -> PackedBf16 | None:
        """Our bf16 kernel's panels of this layer's weight, with no bias: the weight it runs, or the copy
        held for narrow steps (`narrow_panels`); else None."""
        if self.bias is not None:
            return None
        return self._packed if self._kind == "bf16_panels" else self._narrow

    @property
    def narrow_only(self) -> bool:
        """Whether its bf16 panels are only the narrow steps' copy (oneDNN runs the layer itself)."""
        return self._narrow is not None

    def drop_narrow(self) -> None:
        """Let the narrow steps' copy go: for a decoder whose layer stack will not run it."""
        self._narrow = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kind == "bf16_panels":  # a `PackedBf16`: the weight was checked when it was packed
            if self.bias is None:
                return self._packed(x)
            # The bias joins the float32 sums and the result rounds once, as oneDNN's fused bias does.
            return self._packed(x, out_f32=True).add_(self.bias).to(torch.bfloat16)
        if self._kind == "fp16_panels":
            out = self._packed(x)  # a `PackedF16Gemm`: the weight was checked when it was bound
            return out if self.bias is None else out.add_(self.bias)
        if self._kind == "fbgemm_fp16":
            return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)
        if self._kind == "mkldnn":
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def preferred_fp16_kind(kernels: CpuKernels | None) -> str:
    """The kernel an fp16-weight layer tries first: ours where `kernels` were built vectorised (AVX2,
    FMA and F16C), else fbgemm's. Either falls back when it does not load or disagrees."""
    return "fp16_panels" if kernels is not None and kernels.f16_gemm_vectorised else "fbgemm_fp16"


def fits_fp16(weight: torch.Tensor) -> bool:
    """Whether fp16 holds the weight without saturating (magnitudes up to 65504); a weight past that stays
    in its own dtype rather than lose its large entries."""
    return not bool((weight.abs() > torch.finfo(torch.float16).max).any())


def probe_input(weight: torch.Tensor) -> torch.Tensor:
    """The input a layer of this weight is checked on at load, in the weight's dtype."""
    # Seven rows: a 4-row tile and a 3-row tail of the fp16-weight kernel both run at load.
    # A generator of its own: loading a model must not move the caller's global RNG.
    return torch.randn(PROBE_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)


def _agree(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `got` is `F.linear(x, weight, bias)` up to summation order and output rounding.

    Both sides accumulate the K products (and the bias) in float32, each in its own order: each is
    within gamma(K + 1) of the magnitudes `|x| |w| + |b|` of the exact sum, so they differ by at most
    twice that, plus two rounding steps of the output dtype at the value (each side rounds once to it
    and once more if the bias is added after). A broken kernel misses by far more than this.
    """
    want = F.linear(x, weight, bias).double()
    if not bool(want.isfinite().all()):  # no bound is meaningful past the format's range
        return False
    k = x.shape[-1] + 1
    u = torch.finfo(torch.float32).eps / 2
    gamma = k * u / (1 - k * u)
    magnitudes = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitudes = magnitudes + bias.double().abs()
    out_step = torch.finfo(got.dtype).eps * want.abs().clamp(min=torch.finfo(got.dtype).tiny)
    bound = 2 * gamma * magnitudes + 2 * out_step
    return bool(((got.double() - want).abs() <= bound).all())
