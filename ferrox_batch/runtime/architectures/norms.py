"""The RMSNorms every block uses: on the CPU through the C kernel (which takes the residual add before a
norm in the same call, in place), elsewhere torch's ops in the reference's float32 formula."""

from __future__ import annotations

import torch

from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Accumulate in float32 as the reference does; cast back before the weight.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: CpuKernels | None) -> torch.Tensor:
    """`rms_norm(x)`, on a block's output before it joins the residual stream."""
    if kernels is not None:
        return kernels.rms_norm(x.contiguous(), weight, eps)
    return rms_norm(x, weight, eps)


def add_norm(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
             kernels: CpuKernels | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(h + residual, rms_norm(h + residual))`; the CPU kernel adds into `h` in place. Without a norm
    (`weight` None: a block that reads the residual stream itself) both are the sum."""
    if weight is None:
        h = h if residual is None else h + residual
        return h, h
    if kernels is not None:
        return h, kernels.rms_norm(h, weight, eps, residual)
    if residual is not None:
        h = h + residual
    return h, rms_norm(h, weight, eps)


def norm_rows_in_place(x: torch.Tensor, weight: torch.Tensor, span: int, eps: float) -> None:
    """RMSNorm `x` `[rows, width]` in place over each run of `span` values (a head, or the whole width),
    every run by the same `weight` of `span` values (the reference's float32 formula)."""
    rows, width = x.shape
    x.copy_(rms_norm(x.reshape(rows, width // span, span), weight, eps).reshape(rows, width))
