"""The CPU paged decode-attention kernel (`csrc/paged_decode.c`): building it and calling it.

Why: at batch 32 a decode step spent about a third of its time gathering each
sequence's paged context into a contiguous tensor and reading it again in
SDPA. The kernel reads K and V straight from the pool through the block
tables, once, one sequence per task so that each pass streams whole slots.
Measured inside the real model's decode step (bf16, batch 32, contexts of
70-260, 2 threads): 0.47 ms per layer, and the whole step 56 ms against 67-73
ms with gather + SDPA.

How: the C source is compiled with the system C compiler when first asked
for in a process (about half a second), into a private temporary folder, and
loaded with ctypes; nothing is cached on disk, so there is no stale build to
invalidate. It runs on the calling thread's OpenMP team: its `libgomp.so.1`
dependency resolves to the runtime torch already loaded (the same soname),
so it shares the worker's threads instead of starting more. ctypes drops the
GIL for the call.

When the compiler is missing or the build fails, `paged_decode_kernel()`
returns None (logged once) and the decoder keeps the gather + SDPA path; the
two paths agree to float rounding (tested).

Compile flags: `-ffast-math` lets GCC vectorize the reductions and `expf`
(glibc's libmvec); the object is linked *without* it, because linking a
shared library with `-ffast-math` adds a constructor that turns on
flush-to-zero for the whole process.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("ferrox_batch.models")

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
#: Flag sets tried in order: the first that compiles wins (x86 first, then any GCC/Clang target).
COMPILE_FLAGS = (
    ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math"],
    ["-O3", "-march=native", "-ffast-math"],
    ["-O3", "-ffast-math"],
)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class PagedDecodeKernel:
    """`kernel(q, pool, tables, lo, hi, block_size, scale) -> out`, all CPU tensors.

    q `[n, kv, g, d]` and pool `[slots, 2, kv, d]` in float32 or bfloat16 (the same);
    tables `[n, max_blocks]`, lo and hi `[n]` int64. Sequence i attends to positions
    `lo[i] .. hi[i] - 1`, which its table must cover (the caller's promise: the kernel
    reads the pool through it unchecked).
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.ferrox_paged_decode
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._library = library  # keeps the mapping alive as long as the kernel

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    def __call__(
        self,
        q: torch.Tensor,
        pool: torch.Tensor,
        tables: torch.Tensor,
        lo: torch.Tensor,
        hi: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        n, kv, g, d = q.shape
        if q.dtype != pool.dtype or q.dtype not in _DTYPES:
            raise ValueError(f"paged decode needs q and pool of one dtype in {list(_DTYPES)}; "
                             f"got {q.dtype} and {pool.dtype}")
        if pool.dim() != 4 or pool.shape[1:] != (2, kv, d):
            raise ValueError(f"pool is {tuple(pool.shape)}, expected [slots, 2, {kv}, {d}]")
        for name, t in (("tables", tables), ("lo", lo), ("hi", hi)):
            if t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int64 CPU tensor")
        if tables.dim() != 2 or tables.shape[0] != n or lo.shape != (n,) or hi.shape != (n,):
            raise ValueError(f"tables {tuple(tables.shape)}, lo {tuple(lo.shape)}, hi {tuple(hi.shape)} "
                             f"do not match {n} sequences")
        q = q.contiguous()
        if not pool.is_contiguous() or q.device.type != "cpu" or pool.device.type != "cpu":
            raise ValueError("q and pool must be contiguous CPU tensors")
        out = torch.empty_like(q)
        status = self._fn(q.data_ptr(), pool.data_ptr(), tables.data_ptr(), tables.shape[1], lo.data_ptr(),
                          hi.data_ptr(), out.data_ptr(), n, kv, g, d, block_size, scale, _DTYPES[q.dtype])
        if status != 0:
            raise MemoryError("paged decode attention could not allocate its scratch memory")
        return out


@functools.lru_cache(maxsize=1)  # one build per process; the result never changes
def paged_decode_kernel() -> PagedDecodeKernel | None:
    """The compiled kernel, or None when this machine cannot build it (the reason is logged)."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        log.warning("no C compiler found: decode attention uses gather + SDPA")
        return None
    with tempfile.TemporaryDirectory(prefix="ferrox-kernel-") as folder:
        obj, lib = Path(folder) / "paged_decode.o", Path(folder) / "libferrox_paged_decode.so"
        errors = []
        for flags in COMPILE_FLAGS:
            built = _run([compiler, *flags, "-fopenmp", "-fPIC", "-c", str(SOURCE), "-o", str(obj)])
            if built is None:
                built = _run([compiler, "-shared", "-fopenmp", str(obj), "-o", str(lib), "-lm"])
            if built is None:
                try:
                    # Loaded while the file exists; the mapping outlives the folder.
                    return PagedDecodeKernel(ctypes.CDLL(str(lib)))
                except (OSError, AttributeError) as error:
                    built = f"load failed: {error}"
            errors.append(f"{' '.join(flags)}: {built}")
        log.warning("the paged decode kernel did not build; decode attention uses gather + SDPA:\n%s",
                    "\n".join(errors))
        return None


def _run(argv: list[str]) -> str | None:
    """None on success, else the compiler's complaint (last lines)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    if done.returncode == 0:
        return None
    return "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
