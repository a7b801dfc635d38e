"""How a batcher is wired: its context ceiling, its KV store, and the worker with the parts it shares.

`ContinuousBatcher.spawn_with_ceiling` builds its worker here, and so do the
tests that drive a worker tick by tick, so both run exactly the production
wiring: one `BlockBudget` priced like the store leases, one store (the
caller's paged store, checked against the config, or one of the config's
size) inside the `ModelRunner`, the `Scheduler` over them, and the channel,
lifecycle, counters, queue gate and abort inbox that the handle and the
worker share.
"""

from __future__ import annotations

import dataclasses
import logging
import queue

import torch

from ferrox_batch.admission.block_budget import BlockBudget
from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.admission.counters import Counters
from ferrox_batch.admission.queue import AbortInbox, QueueGate
from ferrox_batch.admission.window import window_policy
from ferrox_batch.engine.lifecycle import Lifecycle
from ferrox_batch.engine.worker import Worker
from ferrox_batch.runtime.kv.memory import default_kv_memory
from ferrox_batch.runtime.kv.paged_kv import PagedKvConfig, PagedKvStore
from ferrox_batch.runtime.runner import ModelRunner
from ferrox_batch.runtime.sampling.grammar import Grammars
from ferrox_batch.runtime.sampling.sampler import BatchSampler
from ferrox_batch.scheduler.request import DecodeFn
from ferrox_batch.scheduler.scheduler import Scheduler

log = logging.getLogger("ferrox_batch.engine")


def config_ceiling(decoder, config: BatcherConfig) -> ContextCeiling:
    """`config.max_context` capped at the trained context (positions past it cannot be computed),
    priced with the model's `KvShape` in the bytes its KV store holds."""
    limit = config.context_limit(decoder.config.max_position_embeddings)
    return ContextCeiling(limit, PagedKvStore.kv_shape(decoder.config, decoder.kv_dtype))


def build_worker(
    decoder, decode: DecodeFn, config: BatcherConfig, ceiling: ContextCeiling, paged: PagedKvConfig | None = None,
    *, log_interval: int, grammars: Grammars | None = None,
) -> Worker:
    """The worker and the parts it shares with the handle, wired as `spawn_with_ceiling` runs them.

    Every batcher has a block budget: `config.kv_blocks`, else the paged store's size, else as many
    blocks as the device's default budget holds (`with_kv_budget`); the worker's config carries the
    resolved count. The runner carries the model's slide policy (`runner.window`) and the store's KV groups
    priced with it (`runner.pricing`), which the handle prices requests with.
    """
    if paged is None:
        config = with_kv_budget(config, None, decoder)
    store = _store_for(decoder, config, paged)
    total = config.kv_blocks if config.kv_blocks is not None else store.num_blocks
    # A model with local layers gives the pages behind their window back (D8): their KV groups are priced
    # at the hold bound, and their leases slide every `slide_interval` decode steps.
    local = decoder.config.sliding_window if store.groups.local_groups else None
    if local is not None and config.speculative:
        # A local group's pages are recycled behind its window: a rejected draft's positions could land in
        # pages another position still needs. Such models decode without drafts.
        config = dataclasses.replace(config, speculative=False)
    window = window_policy(local, store.block_size, config.slide_interval)
    runner = ModelRunner(decoder, store, BatchSampler(decoder.vocab_size, store.device, grammars), window)
    scheduler = Scheduler(
        config=config, budget=BlockBudget(config.kv_block_size, total, ceiling), queue_gate=QueueGate(config.max_queue),
        counters=Counters(), kv=runner, vocab_size=decoder.vocab_size, decode=decode, log_interval=log_interval,
    )
    return Worker(scheduler=scheduler, runner=runner, jobs=queue.SimpleQueue(), lifecycle=Lifecycle(),
                  aborts=AbortInbox())


def _store_for(decoder, config: BatcherConfig, paged: PagedKvConfig | None) -> PagedKvStore:
    if paged is not None:
        store = paged.store
        if not isinstance(store, PagedKvStore):
            raise TypeError(f"PagedKvConfig.store must be a PagedKvStore, got {type(store).__name__}")
        if store.block_size != config.kv_block_size:
            raise ValueError(
                f"the paged store's block size ({store.block_size}) must equal kv_block_size "
                f"({config.kv_block_size}): the ledger and the store count the same blocks"
            )
        if store.dtype != decoder.kv_dtype:
            raise ValueError(f"the paged store holds {store.dtype} but the decoder's KV cache is {decoder.kv_dtype}")
        if config.kv_blocks is not None and config.kv_blocks > store.num_blocks:
            raise ValueError(
                f"kv_blocks ({config.kv_blocks}) is more than the paged store holds ({store.num_blocks})"
            )
        return store
    assert config.kv_blocks is not None  # build_worker resolved it
    try:
        return decoder.new_store(config.kv_block_size, num_blocks=config.kv_blocks, prefix_cache=config.prefix_cache)
    except (MemoryError, torch.OutOfMemoryError) as failed:
        size = config.kv_blocks * PagedKvStore.bytes_per_block(decoder.config, config.kv_block_size, decoder.kv_dtype)
        raise MemoryError(f"could not allocate the KV pool of {config.kv_blocks} blocks x {config.kv_block_size} "
                          f"positions ({size / 2**30:.2f} GiB) on {decoder.device}: {failed}; give a smaller "
                          "kv_blocks (or --kv-memory)") from failed


def kv_blocks_in_budget(decoder, block_size: int, memory_bytes: int) -> int:
    """Whole KV blocks of `block_size` positions that `memory_bytes` holds for the decoder's model, stored
    in its KV dtype; ValueError when not even one does."""
    per_block = PagedKvStore.bytes_per_block(decoder.config, block_size, decoder.kv_dtype)
    if memory_bytes < per_block:
        raise ValueError(f"a KV memory budget of {memory_bytes / 2**20:,.1f} MiB holds no block of {block_size} "
                         f"positions ({per_block / 2**20:,.2f} MiB each for this model)")
    return int(memory_bytes // per_block)


def with_model_drafts(config: BatcherConfig, decoder, *, speculative_given: bool) -> BatcherConfig:
    """`config` with the serving default for drafts resolved for this model: a mixture-of-experts model
    decodes without drafts unless speculation was asked for (`speculative_given`).

    A drafted position costs a dense model a share of a step (its weights are read once for every row), but
    a sparse layer reads each row's own k experts: verifying a draft of d tokens reads up to d + 1 rows'
    experts, several times a plain step's bytes, so a draft pays only when most of it is kept. vLLM and
    llama.cpp do not draft by default either; `--speculative` still turns it on.
    """
    if speculative_given or not config.speculative or decoder.config.moe is None:
        return config
    log.info("mixture of experts: decoding without drafts (each drafted position reads its own experts); "
             "--speculative turns them on")
    return dataclasses.replace(config, speculative=False)


def with_kv_budget(config: BatcherConfig, memory_bytes: int | None, decoder, *, share: int = 1) -> BatcherConfig:
    """`config` with its block count resolved: the one memory-to-blocks sizing every entry point uses (the
    engine's own default, `ferrox-batch serve`, each Ray Serve replica).

    A block count in `config` wins; else `memory_bytes`; else the device's default budget
    (`kv.memory.default_kv_memory`) split `share` ways, for replicas that share one machine. The result is
    logged with its reason. A budget that holds no block is a ValueError when it was asked for, and a
    MemoryError when it is the machine's (nothing to change but the machine).
    """
    if config.kv_blocks is not None:
        return config
    per_block = PagedKvStore.bytes_per_block(decoder.config, config.kv_block_size, decoder.kv_dtype)
    if memory_bytes is None:
        budget = default_kv_memory(decoder.device)
        memory_bytes = budget.bytes // share
        reason = budget.reason if share == 1 else f"1/{share} of {budget.reason}"
        if memory_bytes < per_block:
            raise MemoryError(f"no KV block of {config.kv_block_size} positions ({per_block} bytes) fits in "
                              f"{reason}")
    else:
        reason = f"the {memory_bytes / 2**30:.2f} GiB asked for"
    blocks = kv_blocks_in_budget(decoder, config.kv_block_size, memory_bytes)
    log.info("KV budget %d blocks x %d positions (%.2f GiB): %s", blocks, config.kv_block_size,
             blocks * per_block / 2**30, reason)
    return dataclasses.replace(config, kv_blocks=blocks)
