"""Asking for AMX tile state: granted, refused, or not asked where there are no tiles."""

from __future__ import annotations

import errno
import platform

import pytest

from ferrox_batch.runtime.kernels.amx import (
    ARCH_REQ_XCOMP_PERM,
    SYS_ARCH_PRCTL,
    XFEATURE_XTILEDATA,
    amx_permission,
    request_amx_tiles,
)

AMX_CPU = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
PLAIN_CPU = "processor\t: 0\nflags\t\t: fpu avx2 fma\n"
x86_linux = pytest.mark.skipif(platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"),
                               reason="AMX tile state is asked for on x86-64 Linux")


@x86_linux
def test_a_cpu_with_tiles_asks_the_kernel_for_them() -> None:
    calls = []

    def granting(number: int, code: int, argument: int) -> tuple[int, int]:
        calls.append((number, code, argument))
        return 0, 0

    assert request_amx_tiles(AMX_CPU, granting).granted
    assert calls == [(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)]


@x86_linux
def test_a_refusal_falls_back_and_says_why() -> None:
    refused = request_amx_tiles(AMX_CPU, lambda *_: (-1, errno.EPERM))
    assert not refused.granted and "refused" in refused.reason and "EPERM" in refused.reason


@x86_linux
def test_a_cpu_without_tiles_never_asks() -> None:
    def never(*_: int) -> tuple[int, int]:
        raise AssertionError("asked for tiles on a CPU without them")

    answer = request_amx_tiles(PLAIN_CPU, never)
    assert not answer.granted and "no AMX" in answer.reason


def test_this_process_gets_an_answer_without_raising() -> None:
    answer = amx_permission()
    assert isinstance(answer.granted, bool) and answer.reason
    assert amx_permission() is answer  # asked once


@x86_linux
def test_the_real_kernel_answers_as_the_cpu_allows() -> None:
    """Told the CPU has tiles, the real system call is made: Linux grants them where the CPU has them and
    refuses them (EOPNOTSUPP, or EINVAL on an older kernel) where it has not; either way nothing raises."""
    from pathlib import Path

    has_tiles = "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    answer = request_amx_tiles(AMX_CPU)
    assert answer.granted == has_tiles, answer.reason
