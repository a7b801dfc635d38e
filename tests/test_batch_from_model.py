"""What a batcher built from a loaded checkpoint takes from it: its trained context and its stop tokens.

Pins: a `max_context` above the checkpoint's trained context is capped at it
(positions past it cannot be computed), so a request that long is refused
with the typed context-length error on the caller's thread instead of
failing its forward, and the batcher keeps serving.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from batch_helpers import greedy_params, identity_decode
from tiny_checkpoint import write_tiny_checkpoint

from ferrox_batch.batch.config import BatcherConfig
from ferrox_batch.batch.handle import ContinuousBatcher
from ferrox_batch.errors import CONTEXT_LENGTH_EXCEEDED, KvBudgetExceeded
from ferrox_batch.generate import FinishReason
from ferrox_batch.models.loader import load_model

#: The trained context of the short checkpoint.
TRAINED = 32


@pytest.fixture(scope="module")
def short_model(tmp_path_factory: pytest.TempPathFactory, device: str):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("short-context"), max_positions=TRAINED, seed=7)
    return load_model(folder, device=device, dtype="float32")


def _spawn_from_model(model, config: BatcherConfig) -> ContinuousBatcher:
    return ContinuousBatcher.from_model(model, config)


def _spawn_with_config(model, config: BatcherConfig) -> ContinuousBatcher:
    return ContinuousBatcher.spawn_with_config(model.decoder, identity_decode, config)


@pytest.mark.parametrize("spawn", [_spawn_from_model, _spawn_with_config])
def test_a_max_context_above_the_trained_context_is_capped_at_it(short_model, spawn):
    config = BatcherConfig(kv_block_size=8, kv_blocks=64, max_context=4 * TRAINED)
    with spawn(short_model, config) as batcher:
        assert batcher.ceiling.limit() == TRAINED
        with pytest.raises(KvBudgetExceeded) as refused:
            batcher.generate(list(range(1, TRAINED + 9)), greedy_params(4))
        assert refused.value.binding == CONTEXT_LENGTH_EXCEEDED
        assert (refused.value.positions, refused.value.positions_limit) == (TRAINED + 8, TRAINED)
        # A budget past the trained context is clamped to it, and the request is served.
        clamped = batcher.generate(list(range(1, 11)), greedy_params(10 * TRAINED, ignore_eos=True))
        assert clamped.finish_reason == FinishReason.LENGTH and len(clamped.token_ids) == TRAINED - 10
        stats = batcher.stats()
        assert stats.kv_rejected_context_length == 1 and stats.worker_alive
        assert stats.queue_depth == 0 and stats.kv_blocks_free == 64


def test_a_max_context_below_the_trained_context_is_kept(short_model):
    config = BatcherConfig(kv_block_size=8, kv_blocks=64, max_context=TRAINED // 2)
    with _spawn_from_model(short_model, config) as batcher:
        assert batcher.ceiling.limit() == TRAINED // 2
    with _spawn_with_config(short_model, BatcherConfig(kv_block_size=8, kv_blocks=64)) as batcher:
        assert batcher.ceiling.limit() == TRAINED
