"""What the C kernels' tests share: the skip where no C compiler is, the baseline flag set, the build."""

from __future__ import annotations

import shutil

import pytest

from ferrox_batch.runtime.kernels import kernel_build as build_module
from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels, cpu_kernels

#: The kernels are compiled with the system's C compiler: without one there is nothing to test.
needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="the kernels are built with the system C compiler")
#: The last flag set (the compiler's baseline), read before a test narrows the list to one set.
BASELINE_FLAGS = build_module.COMPILE_FLAGS[-1]


def built_kernels() -> CpuKernels:
    """This process's kernels, which must build where a C compiler is on PATH."""
    built = cpu_kernels()
    assert built is not None, "a C compiler is on PATH, so the kernels must build"
    return built
