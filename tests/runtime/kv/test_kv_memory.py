"""Every batcher's KV memory is bounded: a default sized from the machine, and a failed allocation refuses
one request while the worker keeps serving."""

from __future__ import annotations

import logging

import pytest
import torch
from batch_helpers import greedy_params, spawn
from worker_helpers import wait_for

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.errors import KvAllocationFailed, KvPoolExhausted
from ferrox_batch.generation_types import FinishReason
from ferrox_batch.runtime.kv import memory
from ferrox_batch.runtime.kv.memory import (
    CPU_KV_FRACTION,
    CUDA_KV_FRACTION,
    default_kv_memory,
    host_available_memory,
)
from ferrox_batch.runtime.kv.paged_kv import PagedKvStore

MEMINFO = "MemTotal:       24000000 kB\nMemFree:        1000 kB\nMemAvailable:   20000000 kB\n"


def test_the_host_reports_what_it_can_allocate():
    assert host_available_memory(MEMINFO) == 20000000 * 1024
    assert host_available_memory("MemTotal: 1 kB\n") > 0  # no MemAvailable line: free physical pages
    assert host_available_memory() > 0


def test_the_default_is_a_fraction_of_what_is_available_and_says_so():
    cpu = default_kv_memory(torch.device("cpu"), available=8 * 2**30)
    assert cpu.bytes == int(8 * 2**30 * CPU_KV_FRACTION)
    assert "available memory" in cpu.reason and "8.0 GiB" in cpu.reason
    cuda = default_kv_memory(torch.device("cuda"), available=100 * 2**30)
    assert cuda.bytes == int(100 * 2**30 * CUDA_KV_FRACTION) and "free device memory" in cuda.reason


def test_a_batcher_given_no_budget_sizes_one_from_memory_and_logs_it(tiny_batch_model, monkeypatch, caplog):
    monkeypatch.setattr(memory, "host_available_memory", lambda: 64 * 2**20)
    per_block = PagedKvStore.bytes_per_block(tiny_batch_model.config, 16, tiny_batch_model.decoder.kv_dtype)
    want = int(64 * 2**20 * CPU_KV_FRACTION) // per_block
    with caplog.at_level(logging.INFO, logger="ferrox_batch.engine"):
        batcher = spawn(tiny_batch_model, BatcherConfig(kv_block_size=16))
    with batcher:
        assert batcher.stats().kv_blocks_total == want == batcher.store.num_blocks == batcher.config.kv_blocks
        assert any(f"KV budget {want} blocks" in r.getMessage() for r in caplog.records)
        result = batcher.generate([1, 2, 3], greedy_params(4))
        assert result.finish_reason == FinishReason.LENGTH


def test_a_budget_no_block_fits_in_is_a_clear_error_at_start(tiny_batch_model, monkeypatch):
    monkeypatch.setattr(memory, "host_available_memory", lambda: 1024)
    with pytest.raises(MemoryError, match="no KV block of 16 positions"):
        spawn(tiny_batch_model, BatcherConfig(kv_block_size=16))


def test_a_pool_the_device_cannot_hold_fails_at_start_with_its_size(tiny_batch_model, monkeypatch):
    def refuse(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(PagedKvStore, "__init__", refuse)
    with pytest.raises(MemoryError, match=r"could not allocate the KV pool of 8 blocks x 16 positions"):
        spawn(tiny_batch_model, BatcherConfig(kv_block_size=16, kv_blocks=8))


@pytest.mark.parametrize("failure", [torch.OutOfMemoryError("CUDA out of memory (simulated)"),
                                     MemoryError("simulated")])
def test_a_failed_allocation_refuses_that_request_and_the_worker_keeps_serving(tiny_batch_model, failure):
    with spawn(tiny_batch_model, BatcherConfig(kv_block_size=16, kv_blocks=8)) as batcher:
        store = batcher.store
        real = store.add_sequence
        failures = [failure]

        def flaky(seq_id, positions, *prefix, **window):
            if failures:
                raise failures.pop()
            return real(seq_id, positions, *prefix, **window)

        store.add_sequence = flaky
        with pytest.raises(KvAllocationFailed) as refused:
            batcher.generate([1, 2, 3], greedy_params(4))
        assert isinstance(refused.value, KvPoolExhausted)  # busy, retry shortly: a 503 with Retry-After
        assert refused.value.http_status == 503 and refused.value.retry_after_secs == 1
        assert "simulated" in str(refused.value)
        wait_for(lambda: batcher.stats().kv_blocks_free == 8, "the refused request's blocks to come back")
        again = batcher.generate([1, 2, 3], greedy_params(4))
        assert again.finish_reason == FinishReason.LENGTH and len(again.token_ids) == 4
        assert batcher.stats().worker_alive


def test_a_block_table_that_cannot_be_allocated_leaks_no_block(tiny_batch_model, monkeypatch):
    from ferrox_batch.runtime.kv import paged_kv

    with spawn(tiny_batch_model, BatcherConfig(kv_block_size=16, kv_blocks=8)) as batcher:
        real_tensor = torch.tensor
        failures = [torch.OutOfMemoryError("CUDA out of memory (simulated)")]

        def flaky_tensor(*args, **kwargs):
            if failures:
                raise failures.pop()
            return real_tensor(*args, **kwargs)

        monkeypatch.setattr(paged_kv.torch, "tensor", flaky_tensor)
        with pytest.raises(KvAllocationFailed):
            batcher.generate([1, 2, 3], greedy_params(4))
        monkeypatch.setattr(paged_kv.torch, "tensor", real_tensor)
        wait_for(lambda: batcher.stats().kv_blocks_free == 8, "the ledger's blocks to come back")
        assert batcher.store.num_free_blocks == 8, "and the store's: the failed lease returned its blocks"
        assert batcher.generate([1, 2, 3], greedy_params(4)).finish_reason == FinishReason.LENGTH
