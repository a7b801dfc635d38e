"""What a checkpoint's metadata claims sizes nothing at load: each claim is checked against the checkpoint's own
tensors, or the allocation waits for the positions a forward reaches.

A hostile `max_position_embeddings` past what float32 RoPE can serve, a `vocab_size` or `num_hidden_layers`
the tensors do not hold, are `ModelLoadError`s naming the field, never an out-of-memory; a large but servable
context costs nothing until a sequence reaches it (the RoPE tables grow with the sequences).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from batch_helpers import greedy_ids as greedy
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_checkpoint import write_tiny_checkpoint

from ferrox_batch.runtime.architectures.rope import RopeTables, rope_tables
from ferrox_batch.runtime.config import MAX_POSITIONS, ModelConfig
from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.loading.loader import load_model


def edited(source: Path, folder: Path, **fields: Any) -> Path:
    """A copy of the checkpoint at `source` with `fields` set in its config.json (None: removed)."""
    shutil.copytree(source, folder)
    raw = json.loads((folder / "config.json").read_text())
    for key, value in fields.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile")
    return {"llama": write_tiny_checkpoint(root / "llama", seed=51),
            "smollm3": write_tiny_checkpoint(root / "smollm3", arch="smollm3", seed=52),
            "gemma3": write_tiny_checkpoint(root / "gemma3", arch="gemma3_text", seed=53, layers=3, head_dim=32,
                                            sliding_window=6)}


@pytest.mark.parametrize("positions", [10**12, MAX_POSITIONS + 1])
def test_a_context_past_what_float32_rope_serves_is_refused(checkpoints: dict[str, Path], tmp_path: Path,
                                                            positions: int) -> None:
    folder = edited(checkpoints["llama"], tmp_path / "m", max_position_embeddings=positions)
    with pytest.raises(ModelLoadError, match="max_position_embeddings"):
        load_model(folder, device="cpu", dtype="float32")


def test_a_scaling_that_stretches_the_context_past_it_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    for factor in (1e30, float("inf")):
        folder = edited(checkpoints["llama"], tmp_path / str(factor), rope_scaling={"rope_type": "linear",
                                                                                   "factor": factor})
        with pytest.raises(ModelLoadError):
            load_model(folder, device="cpu", dtype="float32")


def test_a_long_servable_context_allocates_nothing_until_reached(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folder = edited(checkpoints["llama"], tmp_path / "m", max_position_embeddings=MAX_POSITIONS)
    model = load_model(folder, device="cpu", dtype="float32")
    assert model.config.max_position_embeddings == MAX_POSITIONS
    assert model.decoder.rope_tables.rows == RopeTables.INITIAL_ROWS
    plain = load_model(checkpoints["llama"], device="cpu", dtype="float32")
    ids = plain.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert greedy(model, ids, 16) == greedy(plain, ids, 16)


@pytest.mark.parametrize("family", ["llama", "smollm3", "gemma3"])
def test_tables_grown_as_sequences_go_give_the_same_answers(checkpoints: dict[str, Path], family: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    whole = load_model(checkpoints[family], device="cpu", dtype="float32")
    monkeypatch.setattr(RopeTables, "INITIAL_ROWS", 2)
    grown = load_model(checkpoints[family], device="cpu", dtype="float32")
    assert grown.decoder.rope_tables.rows == 2
    ids = whole.tokenizer.encode("def forward(self, x): return self.layers(x) + 1")
    assert greedy(grown, ids, 24) == greedy(whole, ids, 24)
    reached = len(ids) + 24
    assert reached <= grown.decoder.rope_tables.rows <= 2 * reached


KINDS = {"plain": None,
         "dynamic": {"rope_type": "dynamic", "factor": 2.0},
         "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
         "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 16,
                      "short_factor": [1.0, 1.5, 2.0, 2.5] * 2, "long_factor": [3.0, 3.5, 4.0, 4.5] * 2}}


@settings(max_examples=25)
@given(kind=st.sampled_from(sorted(KINDS)), tops=st.lists(st.integers(0, 127), min_size=1, max_size=6))
def test_a_grown_table_is_the_whole_tables_prefix(kind: str, tops: list[int]) -> None:
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 32, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64, "rope_theta": 5000.0,
           "rope_scaling": KINDS[kind]}
    config = ModelConfig.from_dict(raw)
    whole = rope_tables(config, "global", torch.device("cpu"), torch.float32)
    tables = RopeTables(config, ["global"], torch.device("cpu"), torch.float32)
    for top in (t % config.max_position_embeddings for t in tops):
        tables.cover(top)
        cos, sin = tables.tables["global"]
        assert top < cos.shape[0] <= config.max_position_embeddings
        assert torch.equal(cos, whole[0][: cos.shape[0]]) and torch.equal(sin, whole[1][: sin.shape[0]])


def test_a_vocabulary_the_embedding_does_not_hold_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    for vocab in (10**12, 1000):
        folder = edited(checkpoints["llama"], tmp_path / str(vocab), vocab_size=vocab)
        with pytest.raises(ModelLoadError, match="vocab_size"):
            load_model(folder, device="cpu", dtype="float32")


@pytest.mark.parametrize("family, fields", [
    # Each builds a list per layer from the layer count alone: SmolLM3's layers without RoPE, Gemma 3's kinds.
    ("smollm3", {"no_rope_layers": None}),
    ("gemma3", {"layer_types": None}),
    ("llama", {}),
])
def test_a_layer_count_the_tensors_do_not_hold_is_refused_before_any_layer_is_built(
        checkpoints: dict[str, Path], tmp_path: Path, family: str, fields: dict[str, Any]) -> None:
    for layers in (10**12, 7):
        folder = edited(checkpoints[family], tmp_path / str(layers), num_hidden_layers=layers, **fields)
        with pytest.raises(ModelLoadError, match=f"num_hidden_layers is {layers}"):
            load_model(folder, device="cpu", dtype="float32")


