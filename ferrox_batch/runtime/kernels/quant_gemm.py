"""`QuantGemm`: the quantized-weight linear kernel (`csrc/quant_gemm.c`) bound to one weight, its checks
done once.

A layer's quantized segments never change after load, and a decode step calls each layer's kernel
once per projection, so what can be checked once is checked here, when the layer binds its weight:
each segment's dtype (uint8 bytes), shape (2-D, rows of exactly `format.row_bytes(k)` bytes),
layout (contiguous, on the CPU) and format (one the kernel decodes). The segments' (type, rows,
address) triples are packed once into an int64 tensor, the argument the C entry point takes. Each
call then checks only what can change, the input: float32 or bfloat16, on the CPU, its last
dimension the weight's k.

Promises: the bound object holds the segment tensors, so the addresses it passes stay valid as long
as it lives; the output has the input's dtype and leading dimensions; a refusal is a ValueError that
says what was wrong (the C side's -1 and -2 included, though the checks here leave them unreachable)
and a failed allocation a MemoryError.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ferrox_batch.runtime.kernels.bound_weight import BoundWeight
from ferrox_batch.runtime.quant.formats import BY_GGML_TYPE, QuantFormat

#: The activation dtypes the quantized kernels take, by the `x_bf16` flag they pass.
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class QuantGemm(BoundWeight):
    """The quantized linear kernel bound to one weight: segments checked once (dtype uint8, 2-D, contiguous,
    CPU, row_bytes == format.row_bytes(k), supported type), their addresses packed once into an int64 tensor.

    `fn` is `ferrox_quant_gemm` (or an entry point of its signature); `segments` are `(format, rows)` pairs
    stacked in order along the outputs; `in_features` is k."""

    __slots__ = ("_count", "_fn", "_segments", "_triples")

    def __init__(self, fn: Callable[..., int], segments: Sequence[tuple[QuantFormat, torch.Tensor]],
                 in_features: int) -> None:
        check_segments(segments, in_features)
        triples = [(fmt.ggml_type, data.shape[0], data.data_ptr()) for fmt, data in segments]
        self._fn = fn
        self._segments = tuple(data for _, data in segments)  # own the memory the addresses point into
        self._triples = torch.tensor(triples, dtype=torch.int64)
        self._address = self._triples.data_ptr()  # the (type, rows, address) triples the C entry points read
        self._count = len(triples)
        self._k = in_features
        self._n = sum(rows for _, rows, _ in triples)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., k]` float32 or bfloat16 CPU input -> `[..., out_features]` in the input's dtype."""
        k, n = self._k, self._n
        rows, flag = input_rows(x, k)
        out = torch.empty(rows.shape[0], n, dtype=x.dtype)
        status = self._fn(rows.data_ptr(), flag, rows.shape[0], k, self._address, self._count, out.data_ptr(),
                          torch.get_num_threads())
        check_status("the quantized linear", status)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def check_segments(segments: Sequence[tuple[QuantFormat, torch.Tensor]], in_features: int) -> None:
    """What both quantized kernels check of a weight once, when it is bound: at least one segment, k >= 1,
    and each segment a contiguous CPU 2-D uint8 tensor of whole rows of a format the kernels run."""
    if not segments:
        raise ValueError("a quantized linear needs at least one segment of rows")
    if in_features < 1:
        raise ValueError(f"a quantized linear needs at least one input feature; got {in_features}")
    for fmt, data in segments:
        if BY_GGML_TYPE.get(fmt.ggml_type) != fmt:
            raise ValueError(f"the quantized linear does not run {fmt.name} (GGML type {fmt.ggml_type})")
        row_bytes = fmt.row_bytes(in_features)  # raises unless k is a whole number of blocks
        if data.dtype != torch.uint8 or data.dim() != 2:
            raise ValueError(f"a quantized segment is a 2-D uint8 tensor of blocks; got {data.dtype} "
                             f"{tuple(data.shape)}")
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError("the CPU kernels take contiguous CPU tensors")
        if data.shape[1] != row_bytes:
            raise ValueError(f"{fmt.name} rows of {in_features} weights take {row_bytes} bytes; got rows of "
                             f"{data.shape[1]}")


def input_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
    """What both quantized kernels check of each call's input: `[..., k]` float32 or bfloat16 on the CPU,
    as contiguous `[rows, k]`, and the `x_bf16` flag the C entry points take."""
    flag = DTYPES.get(x.dtype)
    if flag is None:
        raise ValueError(f"the quantized linear takes float32 or bfloat16 input; got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"a quantized weight of {k} inputs does not take input {tuple(x.shape)}")
    if not x.is_cpu:
        raise ValueError("the CPU kernels take contiguous CPU tensors")
    return (x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()), flag


def check_status(what: str, status: int) -> None:
    """The C entry points' return values (`csrc/quant_gemm.c`) as exceptions."""
    if status == 0:
        return
    if status == -1:
        raise ValueError(f"{what}: k is not a whole number of a format's blocks")
    if status == -2:
        raise ValueError(f"{what}: a segment's type is not one the kernel decodes")
    if status == -3:
        raise MemoryError(f"{what} could not allocate its scratch memory")
    raise RuntimeError(f"{what} returned {status}")
