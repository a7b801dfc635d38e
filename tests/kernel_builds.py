"""What the C kernels' tests share: the skip where no C compiler is, the baseline flag set, the build."""

from __future__ import annotations

import platform
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


#: Flag sets that force the narrower loops on x86, whatever this machine has.
X86_FLAGS = {
    "avx2": ["-O3", "-ffast-math", "-mavx2", "-mfma", "-mf16c", "-mno-avx512f"],
    "scalar": ["-O3", "-ffast-math", "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx512f"],
}


def build_with(flags: list[str]) -> CpuKernels | None:
    """A fresh build of the kernels with `flags` alone (None where that set does not compile)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_module, "COMPILE_FLAGS", (flags,))
        return cpu_kernels.__wrapped__()


class BuildsByFlags:
    """`build_with` once per flag set: a whole build is seconds, and four kernels' tests check each set."""

    def __init__(self) -> None:
        self.builds: dict[tuple[str, ...], CpuKernels | None] = {}

    def __call__(self, flags: list[str]) -> CpuKernels | None:
        key = tuple(flags)
        if key not in self.builds:
            self.builds[key] = build_with(flags)
        return self.builds[key]


def forced_builds(builds_by_flags: BuildsByFlags) -> dict[str, CpuKernels]:
    """This machine's build, then (on x86) one built with each of `X86_FLAGS` alone, by name; skips
    elsewhere (the narrower paths are forced with x86 flags)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the narrower paths are forced with x86 flags")
    builds = {"native": built_kernels()}
    for path, flags in X86_FLAGS.items():
        built = builds_by_flags(flags)
        assert built is not None, f"the {path} flags must build"
        builds[path] = built
    return builds
