"""Keeping the worker thread the only OpenMP team on the CPU.

torch's CPU kernels run on OpenMP, and GNU OpenMP (libgomp, which the torch
wheels ship) keeps one pool of helper threads per thread that ever ran a
parallel region. Between regions its helpers spin for a few milliseconds
before sleeping, which is what makes a decode step's hundreds of small
kernels fast. But once the process holds more OpenMP threads than CPUs,
libgomp stops spinning altogether ("throttled" waits): every kernel then pays
a futex wake-up per helper.

That is exactly the shape of a batcher: the caller's thread loads the model
(a pool), then the worker thread runs every forward (a second pool). Measured
on the 2-core development machine, a batch-32 decode step took 70-80 ms on
the thread that loaded the model and 100-106 ms on a fresh worker thread;
releasing the loading thread's pool (below) brought the worker back to
70 ms. So the handle releases the pool of the thread that spawns it, the
thread that most likely built the model.

`omp_pause_resource_all(omp_pause_hard)` is the OpenMP 5.0 call for this; in
libgomp it frees the *calling* thread's pool only. If that thread runs torch
kernels again later, its pool comes back (nothing breaks; the worker is just
slower while both exist).

Only GNU OpenMP is touched. In LLVM's and Intel's runtimes a hard pause
releases the whole runtime, not one thread's pool, which would be unsafe
while another batcher's worker is inside a parallel region; those runtimes
(and torch builds without OpenMP) make this a no-op.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

log = logging.getLogger("ferrox_batch.runtime.kernels")

#: `omp_pause_hard` in OpenMP 5.0's `omp_pause_resource_t`.
OMP_PAUSE_HARD = 2
_RUNTIME_NAMES = ("libgomp",)  # GNU only: see the module docstring


def loaded_openmp_runtimes(maps: str | None = None) -> list[str]:
    """Paths of the GNU OpenMP runtimes mapped into this process (read from `/proc/self/maps`)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    found: list[str] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
        path = fields[5].strip() if len(fields) == 6 else ""
        if path.startswith("/") and Path(path).name.startswith(_RUNTIME_NAMES) and path not in found:
            found.append(path)
    return found


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP helper threads; True when a runtime did so.

    Safe to call from any thread outside a parallel region, any number of times; it never
    touches another thread's pool. Call it on a thread that is done with torch work.
    """
    import torch  # the runtime must be the one torch loaded, so torch is loaded first

    if not torch.backends.openmp.is_available():
        return False
    released = False
    for path in loaded_openmp_runtimes():
        try:
            runtime = ctypes.CDLL(path)  # already mapped: the same instance torch uses
            pause = runtime.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        if pause(OMP_PAUSE_HARD) == 0:
            released = True
        else:
            log.debug("omp_pause_resource_all refused in %s", path)
    return released
