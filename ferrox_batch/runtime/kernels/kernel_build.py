"""Building the CPU kernels in `csrc/` once per process: which compiler, which flags, and why.

The sources are compiled with the system's GCC when first asked
for in a process (side by side, one per core: about 4 s on 2 cores, most of
it the int8 linear's tiles), into a private temporary folder, and loaded with
ctypes; nothing is cached on disk, so there is no stale build to invalidate. The library's `libgomp.so.1` dependency resolves to the OpenMP
runtime torch already loaded (the same soname), so the kernels run on the
calling thread's team instead of starting more threads.

When GCC is missing (clang is not used: its `-fopenmp` brings LLVM's OpenMP
runtime, a second thread pool) or the build fails, `cpu_kernels()` returns
None (logged once) and the decoder keeps torch's ops; the two paths agree to
float rounding (tested).

Instruction sets: `COMPILE_FLAGS` are tried in order and the first set that
compiles wins. On x86-64 that is the first, `-march=native
-mprefer-vector-width=512`: code for the CPU that builds it. On an AVX2-only
machine that is AVX2 + FMA with 256-bit vectors (the 512-bit preference has
nothing to apply to) and glibc's AVX2 `expf`; on an AVX-512 machine, AVX-512
with 512-bit vectors and the AVX-512 `expf`. bf16 is widened and rounded with
integer bit operations (`bf16.h`); the one bf16 instruction used is
`vdpbf16ps`, by the bf16 linear (`bf16_gemm.c`) where `__AVX512BF16__` is
defined (the weight-only quantized linear, `quant_gemm.c`, measured it slower
than float32 FMAs and says why); the int8 one, `quant_int8.c`, uses
`vpdpbusd` where `__AVX512VNNI__` is defined. AMX changes nothing here. The later sets are for compilers
that refuse the earlier flags (the vector-width flag is x86-only); the last
targets the compiler's baseline (SSE2 on x86-64). Building for `native` is safe
because the library is built in the process that runs it, on that machine, and
never cached: no build reaches another CPU (only a process moved live onto an
older CPU would be caught out, as torch's own dispatch would be). Machines do
differ in summation order (vector width, FMA, the `expf` variant), so the
tests compare with bounds derived from the arithmetic, never bits, and build
and check every flag set on whatever machine runs them.

`-ffast-math`: the objects are *compiled* with it, which lets GCC vectorize
the reductions (reassociating the sums), contract into FMA, call glibc's
vector `expf` (within 4 ulps) and compute `1.0f / sqrtf(v)` as `rsqrtss` and
one Newton step; it also assumes finite values, so a norm row holding an
infinity comes out all NaN. The library is *linked* without it, because
linking a shared library with `-ffast-math` adds a constructor that turns on
flush-to-zero for the whole process (a test checks denormals survive).

Two sources opt out of part of it (`SOURCE_FLAGS`): the int8 quantized linear,
`quant_int8.c`, and the bf16 linear, `bf16_gemm.c`, promise the same bits on
every path and at every batch size, so GCC may not reassociate their sums
(nor, in the int8 one, replace divisions by reciprocals: measured, it
regrouped `(D * sc) * dx` on one path only).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

log = logging.getLogger("ferrox_batch.runtime.kernels")

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("paged_decode.c", "prefill_attention.c", "rms_norm.c", "rope_store.c", "f16_gemm.c", "layer_stack.c",
           "quant_gemm.c", "quant_pack.c", "quant_int8.c", "silu_mul.c", "bf16_gemm.c", "packed_moe.c")
#: Flags added after the set's for one source: what its promises need undone of -ffast-math.
SOURCE_FLAGS = {"quant_int8.c": ("-fno-associative-math", "-fno-reciprocal-math"),
                "bf16_gemm.c": ("-fno-associative-math",),
                "packed_moe.c": ("-fno-associative-math", "-fno-reciprocal-math", "-ffp-contract=off")}
#: GCC flag sets tried in order: the first that compiles wins (x86 first, then any target).
COMPILE_FLAGS = (
    ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math"],
    ["-O3", "-march=native", "-ffast-math"],
    ["-O3", "-ffast-math"],
)

Loaded = TypeVar("Loaded")


def build_library(load: Callable[[ctypes.CDLL], Loaded]) -> Loaded | None:
    """`load` applied to the library built from `SOURCES` with the first of `COMPILE_FLAGS` that compiles
    and loads (`load` may raise AttributeError for a missing symbol), or None with the reasons logged."""
    began = time.monotonic()
    compiler = _gnu_compiler()
    if compiler is None:
        log.warning("no GCC found: the decoder uses torch's ops instead")
        return None
    with tempfile.TemporaryDirectory(prefix="ferrox-kernels-") as folder:
        lib = Path(folder) / "libferrox_cpu_kernels.so"
        errors = []
        for flags in COMPILE_FLAGS:
            objects = [Path(folder) / f"{Path(name).stem}.o" for name in SOURCES]
            compiles = [[compiler, *flags, *SOURCE_FLAGS.get(name, ()), "-fopenmp", "-fPIC", "-I", str(CSRC), "-c",
                         str(CSRC / name), "-o", str(obj)] for name, obj in zip(SOURCES, objects)]
            # The sources compile side by side, one per core: a server starts seconds sooner.
            with concurrent.futures.ThreadPoolExecutor(_cores(), thread_name_prefix="ferrox-kernel-build") as pool:
                complaints = list(pool.map(_run, compiles))
            built = next((complaint for complaint in complaints if complaint is not None), None)
            built = built or _run([compiler, "-shared", "-fopenmp", *map(str, objects), "-o", str(lib), "-lm"])
            if built is None:
                try:
                    # Loaded while the file exists; the mapping outlives the folder.
                    loaded = load(ctypes.CDLL(str(lib)))
                    log.info("CPU kernels built with %s %s in %.1f s", compiler, " ".join(flags),
                             time.monotonic() - began)
                    return loaded
                except (OSError, AttributeError) as error:
                    built = f"load failed: {error}"
            errors.append(f"{' '.join(flags)}: {built}")
        log.warning("the CPU kernels did not build; the decoder uses torch's ops instead:\n%s",
                    "\n".join(errors))
        return None


def _cores() -> int:
    """The cores this process may run on (its affinity, where the platform says)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return max(1, len(affinity(0)) if affinity is not None else (os.cpu_count() or 1))


def _gnu_compiler() -> str | None:
    """GCC, as `gcc` or as a `cc` that is GCC. Clang's `-fopenmp` links LLVM's OpenMP runtime,
    which would start a second set of threads beside torch's libgomp."""
    for name in ("gcc", "cc"):
        path = shutil.which(name)
        if path is None:
            continue
        try:
            version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        if "clang" not in version.lower() and ("gcc" in version.lower() or "free software foundation" in version.lower()):
            return path
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
