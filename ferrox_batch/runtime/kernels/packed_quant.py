"""`PackedQuant`: a quantized weight repacked once for the int8 kernel (`csrc/quant_int8.c`), and the two
things done with it: `x @ w.T` and looking rows up (an embedding, or a head tied to one).

The packing (`csrc/quant_packed.h`) moves the file's bits into vectors of 16 rows by 4 inputs, the operand
integer dot products take, in the file's bytes (Q4_K's scales, unpacked to bytes, add 2.8%). It is done
once, when a layer binds its weight, and the file's blocks are then no longer needed: the caller drops
them, so the model holds one copy.

Promises: the segments are checked once here (uint8, 2-D, contiguous CPU rows of `format.row_bytes(k)`
bytes, a format the kernel packs); each call checks only its input (float32 or bfloat16, on the CPU, last
dimension k) and returns the input's dtype and leading dimensions. Every row of the product depends on
that row of x alone, whatever the batch and thread count (the kernel's arithmetic); a refusal is a
ValueError and a failed allocation a MemoryError.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from ferrox_batch.runtime.kernels.bound_weight import BoundWeight
from ferrox_batch.runtime.kernels.quant_gemm import (
    DTYPES,
    check_segments,
    check_status,
    input_rows,
)
from ferrox_batch.runtime.quant.formats import QuantFormat

#: `ferrox_packed_path()`'s answer: the loops the int8 kernel was built with.
PACKED_PATHS = ("scalar", "avx2", "avx512-vnni")


class PackedLibrary:
    """The packed kernel's entry points in the compiled library, typed once."""

    __slots__ = ("bytes", "gemm", "gemm_experts", "moe", "pack", "path", "route", "rows")

    def __init__(self, library: ctypes.CDLL) -> None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.bytes = library.ferrox_packed_bytes
        self.bytes.argtypes = [i32, i64, i64]
        self.bytes.restype = i64
        self.pack = library.ferrox_packed_pack
        self.pack.argtypes = [i32, ptr, i64, i64, ptr, i32]
        self.pack.restype = i32
        self.rows = library.ferrox_packed_rows
        self.rows.argtypes = [i32, ptr, i64, ptr, i64, ptr, i32, i32]
        self.rows.restype = i32
        self.gemm = library.ferrox_packed_gemm
        self.gemm.argtypes = [ptr, i32, i64, i64, ptr, i64, ptr, i32]
        self.gemm.restype = i32
        self.gemm_experts = library.ferrox_packed_gemm_experts
        self.gemm_experts.argtypes = [ptr, i32, i64, i64, ptr, ptr, ptr, ptr, i64, i64, ptr, i32]
        self.gemm_experts.restype = i32
        # The routed half of a mixture of experts (`packed_moe`).
        self.route = library.ferrox_moe_route
        self.route.argtypes = [ptr, i32, i64, i64, ptr, i64, i64, i32, ptr, ptr, i32]
        self.route.restype = i32
        self.moe = library.ferrox_packed_moe
        self.moe.argtypes = [ptr, i32, i64, i64, ptr, ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, i32]
        self.moe.restype = i32
        #: "scalar", "avx2" or "avx512-vnni": the same arithmetic, bit for bit, on each.
        self.path = PACKED_PATHS[library.ferrox_packed_path()]


class PackedQuant(BoundWeight):
    """A weight of `in_features` inputs from `(format, [rows, format.row_bytes(k)] uint8)` segments stacked
    along the outputs, repacked; the file's blocks are not kept."""

    __slots__ = ("_count", "_formats", "_lib", "_packed", "_rows", "_triples")

    def __init__(self, lib: PackedLibrary, segments: Sequence[tuple[QuantFormat, torch.Tensor]],
                 in_features: int) -> None:
        check_segments(segments, in_features)
        packed, triples = [], []
        for fmt, data in segments:
            rows = data.shape[0]
            size = lib.bytes(fmt.ggml_type, rows, in_features)
            check_status(f"packing {fmt.name}", int(size) if size < 0 else 0)
            out = torch.empty(int(size), dtype=torch.uint8)
            check_status(f"packing {fmt.name}", lib.pack(fmt.ggml_type, data.data_ptr(), rows, in_features,
                                                         out.data_ptr(), torch.get_num_threads()))
            packed.append(out)
            triples.append((fmt.ggml_type, rows, out.data_ptr()))
        self._lib = lib
        self._packed = tuple(packed)  # own the memory the addresses point into
        self._formats = tuple(fmt for fmt, _ in segments)
        self._rows = tuple(rows for _, rows, _ in triples)
        self._triples = torch.tensor(triples, dtype=torch.int64)
        self._address = self._triples.data_ptr()  # the (type, rows, address) triples the C entry points read
        self._count = len(triples)
        self._k = in_features
        self._n = sum(self._rows)

    @property
    def segment_count(self) -> int:
        return self._count

    @property
    def shape(self) -> tuple[int, int]:
        return (self._n, self._k)

    @property
    def format_names(self) -> tuple[str, ...]:
        """Each segment's format, in row order."""
        return tuple(fmt.name for fmt in self._formats)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self._packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., k]` float32 or bfloat16 CPU input -> `[..., out_features]` in the input's dtype."""
        k, n = self._k, self._n
        rows, flag = input_rows(x, k)
        out = torch.empty(rows.shape[0], n, dtype=x.dtype)
        status = self._lib.gemm(rows.data_ptr(), flag, rows.shape[0], k, self._address, self._count, out.data_ptr(),
                                torch.get_num_threads())
        check_status("the quantized linear", status)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` `[n]` (int64) of a weight of one segment, decoded: `[n, k]` in `dtype`, float32 exactly
        as gguf dequantizes, or that rounded to bfloat16 (nearest even, as torch casts). The kernel reads
        the rows unchecked, so their range is checked here."""
        if self._count != 1:
            raise ValueError(f"rows are looked up in a weight of one format; this one is {'+'.join(self.format_names)}")
        if dtype not in DTYPES:
            raise ValueError(f"quantized rows decode to one of {list(DTYPES)}; got {dtype}")
        if index.dtype != torch.int64 or index.dim() != 1 or not index.is_cpu:
            raise ValueError(f"row indices are a 1-D int64 CPU tensor; got {index.dtype} {tuple(index.shape)}")
        index = index.contiguous()
        n = index.shape[0]
        if n and (int(index.min()) < 0 or int(index.max()) >= self._n):
            raise ValueError(f"a row index is outside the table's {self._n} rows")
        out = torch.empty(n, self._k, dtype=dtype)
        status = self._lib.rows(self._formats[0].ggml_type, self._packed[0].data_ptr(), self._k, index.data_ptr(), n,
                                out.data_ptr(), DTYPES[dtype], torch.get_num_threads())
        check_status("quantized rows", status)
        return out


class PackedExperts:
    """A mixture of experts' weights of one shape (each a `PackedQuant` of `n` outputs over `k` inputs), run
    together: `__call__(x, lo, hi)` multiplies x's rows `lo[e] .. hi[e] - 1` by expert e's weight, every
    expert in one call (`ferrox_packed_gemm_experts`), each row exactly as that weight's own call gives it."""

    __slots__ = ("_addresses", "_counts", "_k", "_lib", "_n", "_weights")

    def __init__(self, weights: Sequence[PackedQuant]) -> None:
        if not weights:
            raise ValueError("a mixture of experts has experts")
        shapes = {w.shape for w in weights}
        if len(shapes) != 1:
            raise ValueError(f"the experts' weights differ in shape: {sorted(shapes)}")
        self._weights = tuple(weights)  # own what the addresses point into
        self._lib = weights[0]._lib
        self._n, self._k = weights[0].shape
        self._addresses = torch.tensor([w._address for w in weights], dtype=torch.int64)
        self._counts = torch.tensor([w._count for w in weights], dtype=torch.int64)

    @property
    def experts(self) -> int:
        return len(self._weights)

    @property
    def shape(self) -> tuple[int, int]:
        """Each expert's `(n, k)`."""
        return (self._n, self._k)

    @property
    def library(self) -> PackedLibrary:
        return self._lib

    @property
    def addresses(self) -> torch.Tensor:
        """int64 `[experts]`: the address of each expert's (type, rows, address) triples."""
        return self._addresses

    @property
    def counts(self) -> torch.Tensor:
        """int64 `[experts]`: each expert's segment count."""
        return self._counts

    def __call__(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """`[m, k]` float32 or bfloat16 rows -> `[m, n]` in x's dtype; `lo`, `hi`: `[experts]` int64, each
        expert's rows (checked in C: within `[0, m]`, `lo <= hi`). Rows no expert names are left unwritten."""
        if lo.shape != (self.experts,) or hi.shape != (self.experts,) or lo.dtype != torch.int64 \
                or hi.dtype != torch.int64:
            raise ValueError(f"lo and hi are [{self.experts}] int64; got {lo.dtype} {tuple(lo.shape)}, "
                             f"{hi.dtype} {tuple(hi.shape)}")
        rows, flag = input_rows(x, self._k)
        lo, hi = lo.contiguous(), hi.contiguous()
        out = torch.empty(rows.shape[0], self._n, dtype=x.dtype)
        status = self._lib.gemm_experts(rows.data_ptr(), flag, rows.shape[0], self._k, self._addresses.data_ptr(),
                                        self._counts.data_ptr(), lo.data_ptr(), hi.data_ptr(), self.experts,
                                        self._n, out.data_ptr(), torch.get_num_threads())
        check_status("the experts' quantized linears", status)
        return out
