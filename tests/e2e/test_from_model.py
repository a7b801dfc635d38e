"""What a batcher built from a loaded checkpoint takes from it: its trained context and its stop tokens.

Pins: a `max_context` above the checkpoint's trained context is capped at it
(positions past it cannot be computed), so a request that long is refused
with the typed context-length error on the caller's thread instead of
failing its forward, and the batcher keeps serving. With no `stop_tokens`
argument a request stops on the model's stop tokens (an EOS forced into the
checkpoint's generation config ends the greedy answer where the reference
decode with those stops ends it); an explicit empty `StopTokens` stops on
none, and a batcher without a tokenizer has none to stop on.
"""

from __future__ import annotations

import json

import pytest
from batch_helpers import greedy_params, identity_decode, sequential_ids
from tiny_checkpoint import write_tiny_checkpoint

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.errors import CONTEXT_LENGTH_EXCEEDED, KvBudgetExceeded
from ferrox_batch.generation_types import FinishReason
from ferrox_batch.runtime.loading.loader import load_model
from ferrox_batch.stop_tokens import StopTokens

#: The trained context of the short checkpoint.
TRAINED = 32
PROMPT = [40, 41, 42]
MAX_TOKENS = 12


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


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory: pytest.TempPathFactory, device: str):
    """A tiny checkpoint whose generation config names the third greedy token after `PROMPT` as an EOS."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("forced-eos"), tie=False, std=0.15, seed=5)
    baseline = sequential_ids(load_model(folder, device=device, dtype="float32"), PROMPT, greedy_params(MAX_TOKENS))
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = [*generation["eos_token_id"], baseline[2]]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    model = load_model(folder, device=device, dtype="float32")
    assert baseline[2] in model.tokenizer.stop_tokens
    return model


def test_no_stop_tokens_argument_means_the_models_stop_tokens(eos_model):
    expected = sequential_ids(eos_model, PROMPT, greedy_params(MAX_TOKENS), eos_model.tokenizer.stop_tokens)
    assert len(expected) <= 2 < MAX_TOKENS
    params = greedy_params(MAX_TOKENS)
    with ContinuousBatcher.from_model(eos_model, BatcherConfig(kv_block_size=8, kv_blocks=64)) as batcher:
        chunks: list[str] = []
        for result in (batcher.generate(PROMPT, params),
                       batcher.generate_streaming(PROMPT, params, None, chunks.append),
                       batcher.submit(PROMPT, params).wait()):
            assert result.finish_reason == FinishReason.STOP and list(result.token_ids) == expected
        # An explicit StopTokens wins: an empty one stops on no token.
        unstopped = batcher.generate(PROMPT, params, StopTokens.default())
    assert unstopped.finish_reason == FinishReason.LENGTH
    assert list(unstopped.token_ids) == sequential_ids(eos_model, PROMPT, params)


def test_a_batcher_without_a_tokenizer_has_no_stop_tokens_to_default_to(eos_model):
    params = greedy_params(MAX_TOKENS)
    with _spawn_with_config(eos_model, BatcherConfig(kv_block_size=8, kv_blocks=64)) as batcher:
        result = batcher.generate(PROMPT, params)
    assert result.finish_reason == FinishReason.LENGTH and len(result.token_ids) == MAX_TOKENS
