"""`PackedF16Gemm`: the fp16-weight GEMM kernel bound to one packed weight, its checks done once; and
the packing of weights into the kernel's panels.

A layer's packed panels never change after load, yet the checked entry points
(`CpuKernels.f16_linear`, `f16_gated_linear`) validate them on every call. A
32-row decode step of the default model makes about 150 such calls, and the
checks, the reshape and the argument conversion cost about 13 us of Python
each against about 2 us for the C call itself (2-core AVX2 EPYC). A layer
therefore binds its weight once, at load: the panels' dtype, layout and
size are checked here, and each call checks only what can change, the input
(float32, on the CPU, its last dimension the weight's k). The panels'
address is taken once; the bound object holds the tensor, so it stays valid.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferrox_batch.runtime.kernels.bound_weight import BoundWeight

#: Output columns per panel of an fp16 weight (`csrc/f16_gemm.c`: one AVX2 vector).
F16_PANEL = 8


class PackedF16Gemm(BoundWeight):
    """`fn` (a `csrc/f16_gemm.c` entry point) over `panels` for `out_features` outputs; `panel_count` is
    how many panels that many outputs take in the entry point's layout."""

    __slots__ = ("_fn", "_panels")

    def __init__(self, fn: Callable[..., int], panels: torch.Tensor, out_features: int, panel_count: int) -> None:
        if panels.dtype != torch.float16 or panels.dim() != 3:
            raise ValueError(f"the fp16-weight linear takes float32 input and fp16 panels; got {panels.dtype} "
                             f"{tuple(panels.shape)}")
        k = panels.shape[1]
        if k == 0 or out_features < 1:
            raise ValueError(f"the fp16-weight linear needs input of at least one feature and at least one output; "
                             f"got panels of {k} inputs and {out_features} outputs")
        if panels.shape[2] != F16_PANEL or panels.shape[0] != panel_count:
            raise ValueError(f"panels {tuple(panels.shape)} do not hold {out_features} outputs of {k} inputs")
        if panels.device.type != "cpu" or not panels.is_contiguous():
            raise ValueError("the CPU kernels take contiguous CPU tensors")
        self._fn = fn
        self._panels = panels  # owns the memory `_address` points into
        self._address = panels.data_ptr()
        self._k = k
        self._n = out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., k]` float32 CPU input -> `[..., out_features]` float32."""
        k, n = self._k, self._n
        if x.dtype != torch.float32:
            raise ValueError(f"the fp16-weight linear takes float32 input and fp16 panels; got {x.dtype} input")
        if x.dim() == 0 or x.shape[-1] == 0:
            raise ValueError(f"the fp16-weight linear needs input of at least one feature and at least one output; "
                             f"got input {tuple(x.shape)}")
        if x.shape[-1] != k:
            raise ValueError(f"panels of {k} inputs do not hold input of {x.shape[-1]} features")
        if not x.is_cpu:
            raise ValueError("the CPU kernels take contiguous CPU tensors")
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
        out = torch.empty(rows.shape[0], n, dtype=torch.float32)
        self._fn(rows.data_ptr(), rows.shape[0], k, self._address, n, out.data_ptr(), torch.get_num_threads())
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def slice_panels(n: int) -> int:
    """Panels of n columns rounded up to whole slices of three (`csrc/f16_gemm.c`'s `slice_panels`)."""
    return -(-n // (3 * F16_PANEL)) * 3


def pack_f16_panels(weight: torch.Tensor, *, slices: bool = False) -> torch.Tensor:
    """A `[n, k]` weight in the layout the fp16-weight linear reads: rounded to fp16 (to nearest, as torch
    casts), as `[panels, k, 8]` panels of 8 output columns, zero past column n. `panels` is
    ceil(n / 8), or with `slices` that rounded up to whole 24-column slices (a gated half)."""
    if weight.dim() != 2 or weight.device.type != "cpu" or not weight.is_floating_point():
        raise ValueError(f"fp16 panels pack a 2-D floating-point CPU weight; got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    n, k = weight.shape
    panels = slice_panels(n) if slices else -(-n // F16_PANEL)
    padded = torch.zeros(panels * F16_PANEL, k, dtype=torch.float16)
    padded[:n] = weight
    return padded.view(panels, F16_PANEL, k).transpose(1, 2).contiguous()


def pack_f16_gated(weight: torch.Tensor) -> torch.Tensor:
    """A gated MLP's `[2n, k]` input weight (gate rows, then up rows) in the layout the gated kernel
    reads: each half packed by `pack_f16_panels(..., slices=True)`, gate first."""
    if weight.dim() != 2 or weight.shape[0] % 2:
        raise ValueError(f"a gated weight has an even number of rows (gate, then up); got {tuple(weight.shape)}")
    gate, up = weight.chunk(2)
    return torch.cat([pack_f16_panels(gate, slices=True), pack_f16_panels(up, slices=True)])
