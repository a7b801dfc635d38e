"""Asking Linux for AMX tile state before any kernel touches the tiles.

An AMX instruction in a process that has not asked the kernel for the tile data state (`arch_prctl`
with `ARCH_REQ_XCOMP_PERM` for `XFEATURE_XTILEDATA`) dies with SIGILL: llama.cpp's server, built
native on an AMX Xeon, did exactly that loading a Q8_0 file. A kernel of ours that uses tiles must
therefore be guarded by `amx_permission()`, asked once per process, and take the AVX-512 path when the
answer is no: a CPU without AMX, a kernel older than 5.16 or one that refuses the larger signal frame,
or a platform that is not x86-64 Linux. No kernel of ours uses tiles yet (the machines this was built
on expose none to test one on); oneDNN asks for itself on torch's behalf.

Promises: `request_amx_tiles` never raises; it returns whether tiles may be used, and why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: Linux's arch_prctl codes and the tile data's state component (arch/x86/include/uapi/asm/prctl.h).
ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 0x1022, 0x1023, 18
#: The arch_prctl system call's number on x86-64.
SYS_ARCH_PRCTL = 158

#: `syscall(number, code, argument) -> (result, errno)`: the system call, replaceable in tests.
Syscall = Callable[[int, int, int], tuple[int, int]]


@dataclass(frozen=True, slots=True)
class AmxPermission:
    granted: bool
    reason: str


def request_amx_tiles(cpuinfo: str | None = None, syscall: Syscall | None = None) -> AmxPermission:
    """Whether this process may use AMX tiles (asking the kernel for them if the CPU has them)."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return AmxPermission(False, f"AMX tiles are requested on x86-64 Linux; this is {platform.system()} "
                                    f"{platform.machine()}")
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = next((line.partition(":")[2].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    if "amx_tile" not in flags:
        return AmxPermission(False, "this CPU has no AMX tiles")
    call = syscall or _libc_syscall()
    if call is None:
        return AmxPermission(False, "the C library's syscall() is not reachable from Python")
    result, error = call(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if result != 0:
        name = errno.errorcode.get(error, str(error))
        return AmxPermission(False, f"the kernel refused AMX tile state (arch_prctl: {name}: {os.strerror(error)})")
    return AmxPermission(True, "the kernel granted AMX tile state")


@functools.lru_cache(maxsize=1)  # asked once per process: a grant lasts for the process's life
def amx_permission() -> AmxPermission:
    """`request_amx_tiles` for this process, asked once."""
    return request_amx_tiles()


def _libc_syscall() -> Syscall | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        raw = libc.syscall
    except (OSError, AttributeError, TypeError):
        return None
    raw.restype = ctypes.c_long

    def call(number: int, code: int, argument: int) -> tuple[int, int]:
        result = raw(ctypes.c_long(number), ctypes.c_long(code), ctypes.c_ulong(argument))
        return int(result), ctypes.get_errno() if result != 0 else 0

    return call
