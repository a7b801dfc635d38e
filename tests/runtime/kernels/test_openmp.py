"""runtime.kernels.openmp: finding the OpenMP runtime and releasing one thread's helper pool."""

from __future__ import annotations

import ctypes.util
import os
import threading
import time

import pytest
import torch

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.runtime.kernels import openmp
from ferrox_batch.runtime.kernels.openmp import (
    loaded_openmp_runtimes,
    release_thread_pool,
)

MAPS = """\
7f00aa000000-7f00aa022000 r--p 00000000 08:01 1234 /venv/lib/torch/lib/libgomp.so.1
7f00aa022000-7f00aa044000 r-xp 00022000 08:01 1234 /venv/lib/torch/lib/libgomp.so.1
7f00ab000000-7f00ab010000 rw-p 00000000 00:00 0
7f00ac000000-7f00ac010000 r-xp 00000000 08:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6
7f00ad000000-7f00ad010000 r-xp 00000000 08:01 77 /opt/intel/lib/libiomp5.so
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
"""


def test_gnu_runtimes_are_found_once_each_and_nothing_else() -> None:
    # Intel's (and LLVM's) runtime is left alone: a hard pause there releases the whole runtime.
    assert loaded_openmp_runtimes(MAPS) == ["/venv/lib/torch/lib/libgomp.so.1"]


def test_no_runtime_in_an_empty_map() -> None:
    assert loaded_openmp_runtimes("") == []


def test_this_process_has_torchs_runtime() -> None:
    if not torch.backends.openmp.is_available():
        pytest.skip("this torch build has no OpenMP")
    assert loaded_openmp_runtimes(), "torch is imported, so its OpenMP runtime is mapped"


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_release_frees_the_calling_threads_helpers_only() -> None:
    """A thread that ran a 2-thread kernel holds one helper; releasing it ends that helper."""
    if not torch.backends.openmp.is_available():
        pytest.skip("this torch build has no OpenMP")
    counts: dict[str, int | bool] = {}

    def body() -> None:
        torch.set_num_threads(2)  # process-wide in torch; restored below
        torch.ones(4_000_000).add_(1)  # big enough to run in parallel
        counts["with_pool"] = _os_threads()
        counts["released"] = release_thread_pool()
        deadline = time.monotonic() + 30  # threads exit asynchronously; a loaded machine is slow
        while counts["released"] and _os_threads() >= counts["with_pool"] and time.monotonic() < deadline:
            time.sleep(0.01)
        counts["after"] = _os_threads()
        counts["again"] = release_thread_pool()  # no pool now: still fine
        torch.ones(4_000_000).add_(1)  # and the thread can run kernels afterwards

    before = _os_threads()
    threads = torch.get_num_threads()
    worker = threading.Thread(target=body)
    worker.start()
    worker.join(60)
    assert not worker.is_alive()
    torch.set_num_threads(threads)  # torch's count is process-wide: give the suite its own back
    assert counts["with_pool"] > before  # the thread itself plus its helper
    if not _pausable():
        # An OpenMP runtime older than 5.0 (torch 2.5's wheels ship one) has no pause call: the
        # release is a no-op that says so, and nothing breaks.
        assert counts["released"] is False and counts["again"] is False
        return
    assert counts["released"] is True
    assert counts["after"] < counts["with_pool"]
    assert counts["again"] is True


def _pausable() -> bool:
    """Whether a GNU OpenMP runtime in this process has `omp_pause_resource_all` (OpenMP 5.0)."""
    return any(hasattr(ctypes.CDLL(path), "omp_pause_resource_all") for path in loaded_openmp_runtimes())


def test_spawning_on_the_cpu_releases_the_callers_pool(monkeypatch, tiny_batch_model) -> None:
    calls: list[str] = []
    monkeypatch.setattr("ferrox_batch.engine.handle.release_thread_pool",
                        lambda: calls.append(threading.current_thread().name) or True)
    config = BatcherConfig(kv_blocks=8, kv_block_size=4, max_context=32)
    with ContinuousBatcher.spawn_with_config(tiny_batch_model.decoder, lambda ids: bytes(ids), config):
        pass
    assert calls == [threading.current_thread().name]


def test_without_openmp_nothing_is_released(monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.openmp, "is_available", lambda: False)
    assert release_thread_pool() is False


def test_a_runtime_without_the_call_or_that_cannot_load_is_skipped(monkeypatch) -> None:
    libc = ctypes.util.find_library("c")
    assert libc is not None
    monkeypatch.setattr(openmp, "loaded_openmp_runtimes", lambda: [libc])  # loads, has no such call
    assert release_thread_pool() is False
    monkeypatch.setattr(openmp, "loaded_openmp_runtimes", lambda: ["/nonexistent/libgomp.so.1"])
    assert release_thread_pool() is False
