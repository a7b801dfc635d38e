"""`PackedBf16`: a bf16 weight packed once for the batch-invariant bf16 kernel (`csrc/bf16_gemm.c`), and
`x @ w.T` with it.

The kernel's promise is the reason it exists: every row of the product is a function of that row of x
alone (a fixed order of float32 steps per output, the same on every path up to subnormal values), so a
request's logits do not move with the batch it shares, as oneDNN's do; and one row streams the weight
once, which the layer stack calls from C.

Promises: the weight is checked and packed once here (2-D bf16 on the CPU, `ceil(n/16)` panels of 16
columns by input pairs, 2 bytes per weight plus padding to whole panels); each call checks only its input
(bfloat16, on the CPU, last dimension k) and returns bf16 (or float32 with `out_f32`) of the input's
leading dimensions. A refusal is a ValueError.
"""

from __future__ import annotations

import ctypes

import torch

from ferrox_batch.runtime.kernels.bound_weight import BoundWeight

#: `ferrox_bf16_path()`'s answer: the loops the bf16 kernel was built with (the same bits on each).
BF16_PATHS = ("scalar", "avx2", "avx512-bf16")
#: Output columns per panel (`csrc/bf16_gemm.c`).
BF16_PANEL = 16


class Bf16Library:
    """The bf16 kernel's entry points in the compiled library, typed once."""

    __slots__ = ("gemm", "pack", "path", "words")

    def __init__(self, library: ctypes.CDLL) -> None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.words = library.ferrox_bf16_packed_words
        self.words.argtypes = [i64, i64]
        self.words.restype = i64
        self.pack = library.ferrox_bf16_pack
        self.pack.argtypes = [ptr, i64, i64, ptr, i32]
        self.pack.restype = i32
        self.gemm = library.ferrox_bf16_gemm
        self.gemm.argtypes = [ptr, i64, i64, ptr, i64, ptr, i32, i32]
        self.gemm.restype = i32
        #: "scalar", "avx2" or "avx512-bf16".
        self.path = BF16_PATHS[library.ferrox_bf16_path()]


class PackedBf16(BoundWeight):
    """An `[n, k]` weight (rounded to bf16 if it is not) in the kernel's panels; the caller may drop its own."""

    __slots__ = ("_lib", "_packed")

    def __init__(self, lib: Bf16Library, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or weight.device.type != "cpu" or not weight.is_floating_point():
            raise ValueError(f"the bf16 kernel packs a 2-D floating-point CPU weight; got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")
        n, k = weight.shape
        if n < 1 or k < 1:
            raise ValueError(f"the bf16 kernel needs at least one input and one output; got {tuple(weight.shape)}")
        source = weight.to(torch.bfloat16).contiguous()
        packed = torch.empty(int(lib.words(n, k)), dtype=torch.int32)
        if lib.pack(source.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads()) != 0:
            raise ValueError(f"the bf16 kernel could not pack {tuple(weight.shape)}")
        self._lib = lib
        self._packed = packed  # owns the memory `_address` points into
        self._address = packed.data_ptr()
        self._n, self._k = n, k

    @property
    def nbytes(self) -> int:
        """Bytes the panels take (the weight's, padded to whole 16-column panels and input pairs)."""
        return self._packed.numel() * self._packed.element_size()

    def __call__(self, x: torch.Tensor, *, out_f32: bool = False) -> torch.Tensor:
        """`[..., k]` bfloat16 CPU input -> `[..., n]` bfloat16 (or float32 with `out_f32`)."""
        k, n = self._k, self._n
        if x.dtype != torch.bfloat16 or not x.is_cpu or x.dim() == 0 or x.shape[-1] != k:
            raise ValueError(f"the bf16 kernel takes bfloat16 CPU input of {k} features; got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
        out = torch.empty(rows.shape[0], n, dtype=torch.float32 if out_f32 else torch.bfloat16)
        self._lib.gemm(rows.data_ptr(), rows.shape[0], k, self._address, n, out.data_ptr(), int(out_f32),
                       torch.get_num_threads())
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
