"""BatcherConfig defaults, FERROX_CB_* parsing and validation, and the reply-channel events."""

from __future__ import annotations

import dataclasses

import pytest

from ferrox_batch.admission import config as cfgmod
from ferrox_batch.admission.config import (
    DEFAULT_DECODE_LOG_INTERVAL,
    DEFAULT_KV_BLOCK_SIZE,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PREFILL_CHUNK,
    PREFILL_CHUNK_ENV_KEYS,
    BatcherConfig,
    decode_log_interval_from_env,
)
from ferrox_batch.checks import UNLIMITED
from ferrox_batch.errors import QueueFull
from ferrox_batch.generation_types import FinishReason, GenerationResult
from ferrox_batch.replies import Chunk, Finished
from ferrox_batch.usage import Usage


def test_the_defaults_are_upstreams():
    assert (DEFAULT_PREFILL_CHUNK, DEFAULT_KV_BLOCK_SIZE, DEFAULT_MAX_QUEUE) == (128, 256, 512)
    assert DEFAULT_MAX_BATCH_TOKENS == 256 and DEFAULT_DECODE_LOG_INTERVAL == 40
    c = BatcherConfig.default()
    assert c == BatcherConfig()
    assert (c.max_seqs, c.prefill_chunk, c.max_batch_tokens, c.max_queue) == (UNLIMITED, 128, 256, 512)
    assert (c.kv_block_size, c.kv_blocks, c.max_context) == (256, None, None)
    assert c.unlimited_seqs


def test_an_empty_environment_gives_the_defaults():
    assert BatcherConfig.from_env({}) == BatcherConfig()


def test_every_variable_sets_its_field():
    env = {
        "FERROX_CB_MAX_SEQS": "4",
        "FERROX_CB_PREFILL_CHUNK": "32",
        "FERROX_CB_MAX_BATCH_TOKENS": "512",
        "FERROX_CB_MAX_QUEUE": "9",
        "FERROX_CB_KV_BLOCK_SIZE": "16",
        "FERROX_CB_KV_BLOCKS": "100",
        "FERROX_CB_MAX_CONTEXT": "2048",
    }
    assert BatcherConfig.from_env(env) == BatcherConfig(4, 32, 512, 9, 16, 100, 2048)


def test_the_batch_chunk_variable_wins_over_the_private_paths():
    assert PREFILL_CHUNK_ENV_KEYS == ("FERROX_CHUNKED_PREFILL", "FERROX_CB_PREFILL_CHUNK")
    assert BatcherConfig.from_env({"FERROX_CHUNKED_PREFILL": "7"}).prefill_chunk == 7
    both = {"FERROX_CHUNKED_PREFILL": "7", "FERROX_CB_PREFILL_CHUNK": "64"}
    assert BatcherConfig.from_env(both).prefill_chunk == 64


def test_the_upstream_frink_prefix_is_not_read():
    assert BatcherConfig.from_env({"FRINK_CB_MAX_SEQS": "2"}) == BatcherConfig()


@pytest.mark.parametrize(
    "name",
    [
        "FERROX_CB_MAX_SEQS",
        "FERROX_CB_PREFILL_CHUNK",
        "FERROX_CB_MAX_BATCH_TOKENS",
        "FERROX_CB_MAX_QUEUE",
        "FERROX_CB_KV_BLOCK_SIZE",
        "FERROX_CB_KV_BLOCKS",
        "FERROX_CB_MAX_CONTEXT",
        "FERROX_CHUNKED_PREFILL",
    ],
)
@pytest.mark.parametrize("raw", ["0", "-1", "", " 4", "4 ", "1.5", "four", "1_000", "0x10", str(2**64), "٣"])
def test_a_malformed_variable_stops_startup_with_upstreams_message(name, raw):
    with pytest.raises(ValueError) as info:
        BatcherConfig.from_env({name: raw})
    assert str(info.value) == f"{name} must be a positive integer"


def test_a_leading_plus_and_the_largest_word_parse_like_rust():
    assert BatcherConfig.from_env({"FERROX_CB_MAX_QUEUE": "+3"}).max_queue == 3
    assert BatcherConfig.from_env({"FERROX_CB_MAX_SEQS": str(UNLIMITED)}).max_seqs == UNLIMITED
    assert BatcherConfig.from_env({"FERROX_CB_KV_BLOCKS": "007"}).kv_blocks == 7


def test_from_env_reads_the_process_environment_when_given_none(monkeypatch):
    monkeypatch.setenv("FERROX_CB_MAX_QUEUE", "3")
    monkeypatch.delenv("FERROX_CB_MAX_SEQS", raising=False)
    assert BatcherConfig.from_env().max_queue == 3
    monkeypatch.setenv("FERROX_DECODE_LOG_INTERVAL", "5")
    assert decode_log_interval_from_env() == 5


@pytest.mark.parametrize(("raw", "expected"), [(None, 40), ("7", 7), ("0", 0), ("nope", 40), ("-3", 40), ("", 40)])
def test_the_decode_log_interval_never_fails(raw, expected):
    env = {} if raw is None else {"FERROX_DECODE_LOG_INTERVAL": raw}
    assert decode_log_interval_from_env(env) == expected


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("max_seqs", 0),
        ("max_seqs", -1),
        ("max_seqs", UNLIMITED + 1),
        ("prefill_chunk", 0),
        ("prefill_chunk", 1.0),
        ("max_batch_tokens", 0),
        ("max_queue", -1),
        ("max_queue", True),
        ("kv_block_size", 0),
        ("kv_block_size", "256"),
        ("kv_blocks", 0),
        ("kv_blocks", 2.5),
        ("max_context", 0),
        ("max_context", -8),
    ],
)
def test_a_config_built_directly_is_validated_by_field(field, bad):
    with pytest.raises(ValueError) as info:
        BatcherConfig(**{field: bad})
    assert f"BatcherConfig.{field}" in str(info.value) and repr(bad) in str(info.value)


def test_a_zero_queue_is_a_valid_config_that_refuses_everything():
    assert BatcherConfig(max_queue=0).max_queue == 0


def test_configs_are_immutable_values():
    c = BatcherConfig(max_seqs=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_seqs = 3  # type: ignore[misc]
    assert dataclasses.replace(c, prefill_chunk=1) == BatcherConfig(max_seqs=2, prefill_chunk=1)


def test_events_carry_text_or_a_result():
    result = GenerationResult(FinishReason.STOP, [1], "a", Usage.new(1, 1))
    assert Chunk("a").text == "a"
    assert Finished(result).result is result
    assert Finished(QueueFull(1, 1)).result == QueueFull(1, 1)
    assert Chunk("x") == Chunk("x")


def test_the_config_module_keeps_no_mutable_state():
    mutable = [
        name for name, value in vars(cfgmod).items()
        if not name.startswith("__") and isinstance(value, (list, dict, set))
    ]
    assert mutable == []
