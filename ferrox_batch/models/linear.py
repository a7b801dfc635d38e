"""Linear layers with CPU weights prepacked for oneDNN.

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Batch-size hint for the packing; the packed weight serves every batch size.
_PACK_HINT = 32
_PACKED_DTYPES = (torch.float32, torch.bfloat16)


class Linear:
    __slots__ = ("weight", "bias", "_packed", "_kind")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True, keep_weight: bool = False
    ) -> None:
        """`keep_weight=False` lets a oneDNN-packed layer drop its plain weight (half the memory);
        pass True when the tensor is shared (a tied embedding)."""
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self._packed: torch.Tensor | None = None
        self._kind = "plain"
        if pack and weight.device.type == "cpu" and weight.dtype in _PACKED_DTYPES:
            self._try_pack()
        if self._kind == "mkldnn" and not keep_weight:
            self.weight = None

    @property
    def kind(self) -> str:
        """Which kernel runs: "mkldnn" (packed for oneDNN) or "plain" (`F.linear`)."""
        return self._kind

    def _try_pack(self) -> None:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, _PACK_HINT)
            # A generator of its own: loading a model must not move the caller's global RNG.
            probe = torch.randn(3, self.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(self.weight.dtype)
            self._packed, self._kind = packed, "mkldnn"
            if not _agree(self(probe), probe, self.weight, self.bias):
                raise RuntimeError("packed linear disagrees with F.linear")
        except (AttributeError, RuntimeError, NotImplementedError):
            self._packed, self._kind = None, "plain"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kind == "mkldnn":
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _agree(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `got` is `F.linear(x, weight, bias)` up to summation order and output rounding.

    Both sides accumulate the K products (and the bias) in float32, each in its own order: each is
    within gamma(K + 1) of the magnitudes `|x| |w| + |b|` of the exact sum, so they differ by at most
    twice that, plus two rounding steps of the output dtype at the value (each side rounds once to it
    and once more if the bias is added after). A broken kernel misses by far more than this.
    """
    want = F.linear(x, weight, bias).double()
    k = x.shape[-1] + 1
    u = torch.finfo(torch.float32).eps / 2
    gamma = k * u / (1 - k * u)
    magnitudes = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitudes = magnitudes + bias.double().abs()
    out_step = torch.finfo(got.dtype).eps * want.abs().clamp(min=torch.finfo(got.dtype).tiny)
    bound = 2 * gamma * magnitudes + 2 * out_step
    return bool(((got.double() - want).abs() <= bound).all())
