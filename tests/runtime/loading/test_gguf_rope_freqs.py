"""Llama 3.1-style GGUFs: llama3 RoPE scaling stored as llama.cpp stores it, the `rope_freqs` tensor.

llama.cpp's converter writes no scaling metadata for a llama3-scaled Llama, only the per-frequency factors it
computed (`tests/tiny_gguf_families.py` computes them as its converter does); its rope op divides each
frequency's angle by its factor. The file must load as the source checkpoint transformers loads (last logits
within float32 rounding, 32 greedy ids identical), and factors that are not one finite, positive value per
rotated frequency are refused by the tensor's name.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ["HF_HUB_OFFLINE"] = "1"  # never let transformers reach for the hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"

gguf = pytest.importorskip("gguf")
import torch  # noqa: E402
from test_gguf_families import PROMPTS, VOCAB, assert_as_transformers, rewrite, vocabulary  # noqa: E402
from tiny_gguf_families import FamilyGguf, llama3_rope_factors, write_family_gguf  # noqa: E402

from ferrox_batch.runtime.architectures.rope import angles, rope_tables  # noqa: E402
from ferrox_batch.runtime.config import ModelConfig  # noqa: E402
from ferrox_batch.runtime.errors import ModelLoadError  # noqa: E402
from ferrox_batch.runtime.families.rope_scaling import RopeScaling  # noqa: E402
from ferrox_batch.runtime.loading.gguf_convert import read_gguf  # noqa: E402
from ferrox_batch.runtime.loading.loader import load_model  # noqa: E402

SOURCE = "llama-untied-llama3-rope"
HALF = 8  # the tiny checkpoint's head of 16: 8 rotated frequencies


@pytest.fixture(scope="module")
def files(tiny_variant_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[bool, FamilyGguf]:
    """The llama3-scaled tiny checkpoint as a GGUF, in f32 and quantized as a Q4_K_M file mixes types."""
    source, root = tiny_variant_dirs[SOURCE], tmp_path_factory.mktemp("rope-freqs")
    return {quantized: write_family_gguf(source, root / str(quantized), "llama", vocabulary("bpe"),
                                         quantized=quantized, seed=41)
            for quantized in (False, True)}


def test_the_factors_are_read_back_as_stored(files: dict[bool, FamilyGguf]) -> None:
    family = files[False]
    stored = llama3_rope_factors(family.config)
    # The tiny checkpoint reaches every branch of llama3: kept, slowed by the whole factor, and smoothed between.
    assert stored[0] == 1 and stored[-1] == 8 and ((stored > 1) & (stored < 8)).any()
    ckpt = read_gguf(family.path)
    assert ckpt.config["rope_scaling"]["rope_type"] == "frequency_factors"
    np.testing.assert_array_equal(np.array(ckpt.config["rope_scaling"]["factors"], np.float32), stored)
    assert ckpt.tensors.keys() == family.weights.keys()  # rope_freqs is config, not a weight
    config = ModelConfig.from_dict(ckpt.config)
    assert config.rope_scaling is not None
    np.testing.assert_array_equal(np.array(config.rope_scaling.frequency_factors, np.float32), stored)
    assert config.max_position_embeddings == family.config["max_position_embeddings"]


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q4_k_m-mix"])
def test_the_model_is_the_source_checkpoint_transformers_loads(files: dict[bool, FamilyGguf], tiny_variant_dirs:
                                                               dict[str, Path], quantized: bool) -> None:
    transformers = pytest.importorskip("transformers")
    family = files[quantized]
    # The f32 file holds the source's weights exactly; the quantized one what its blocks hold (the twin folder).
    folder = family.hf_folder if quantized else tiny_variant_dirs[SOURCE]
    ours = load_model(family.path, device="cpu", dtype="float32", int8_activations=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    assert theirs.config.rope_parameters["rope_type"] == "llama3"
    assert_as_transformers(ours, theirs, PROMPTS, PROMPTS)


def _with(factors: np.ndarray) -> dict[str, Any]:
    return {"tensors": {"rope_freqs.weight": factors.astype(np.float32)}}


def _one(value: float) -> np.ndarray:
    factors = np.linspace(1, 8, HALF, dtype=np.float32)
    factors[3] = value
    return factors


@pytest.mark.parametrize("change,message", [
    (_with(np.ones(HALF - 1)), r"rope_freqs.weight has shape \(7,\), expected \(8,\)"),
    (_with(np.ones(HALF + 1)), r"rope_freqs.weight has shape \(9,\), expected \(8,\)"),
    (_with(np.ones((2, HALF // 2))), r"rope_freqs.weight has shape \(2, 4\), expected \(8,\)"),
    (_with(_one(0.0)), "rope_freqs.weight holds factors that are not finite and positive: \\[0.0\\]"),
    (_with(_one(-2.0)), "rope_freqs.weight holds factors that are not finite and positive: \\[-2.0\\]"),
    (_with(_one(float("nan"))), "rope_freqs.weight holds factors that are not finite and positive: \\[nan\\]"),
    (_with(_one(float("inf"))), "rope_freqs.weight holds factors that are not finite and positive: \\[inf\\]"),
    # llama.cpp would apply both; no converted checkpoint has both, so neither is guessed at.
    ({"changes": {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}},
     "rope_freqs.weight beside llama.rope.scaling.type 'linear'"),
])
def test_bad_frequency_factors_are_refused_by_the_tensor_name(files: dict[bool, FamilyGguf], tmp_path: Path,
                                                              change: dict[str, Any], message: str) -> None:
    path = rewrite(files[False], tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelLoadError, match=message) as info:
        read_gguf(path)
    assert "bad.gguf" in str(info.value)


def test_a_folder_whose_factors_do_not_fit_the_head_is_refused(files: dict[bool, FamilyGguf]) -> None:
    config = dict(read_gguf(files[False].path).config)
    config["rope_scaling"] = {"rope_type": "frequency_factors", "factors": [1.0] * (HALF - 2)}
    with pytest.raises(ModelLoadError, match="6 frequency factors for the 8 frequencies"):
        ModelConfig.from_dict(config)
    for bad in (0.0, -1.0, math.nan, math.inf):
        config["rope_scaling"] = {"rope_type": "frequency_factors", "factors": [1.0] * (HALF - 1) + [bad]}
        with pytest.raises(ModelLoadError, match="finite positive factors"):
            ModelConfig.from_dict(config)


@settings(max_examples=50, deadline=None)
@given(half=st.integers(1, 64), theta=st.floats(2.0, 1e7),
       factors=st.lists(st.floats(1 / 64, 64, allow_subnormal=False), min_size=64, max_size=64))
def test_each_angle_is_divided_by_its_factor(half: int, theta: float, factors: list[float]) -> None:
    """llama.cpp's rope op: angle_i = pos * theta^(-2i/d) / factor_i, and no attention factor on the tables."""
    dim, chosen = 2 * half, tuple(float(np.float32(f)) for f in factors[:half])
    scaling = RopeScaling("frequency_factors", frequency_factors=chosen)
    plain = angles(dim, theta, None, 300)
    got = angles(dim, theta, scaling, 300)
    # The same float32 operations as the plain angles, then one division each (what llama.cpp rounds too).
    torch.testing.assert_close(got, plain / torch.tensor(chosen, dtype=torch.float32), rtol=0, atol=0)
    config = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 8, "hidden_size": dim, "intermediate_size": 8,
                                    "num_hidden_layers": 1, "num_attention_heads": 1, "max_position_embeddings": 300,
                                    "rope_theta": theta,
                                    "rope_scaling": {"rope_type": "frequency_factors", "factors": list(chosen)}})
    cos, sin = rope_tables(config, "global", torch.device("cpu"), torch.float32)
    torch.testing.assert_close(cos, torch.cat((got, got), dim=-1).cos(), rtol=0, atol=0)
    torch.testing.assert_close(sin, torch.cat((got, got), dim=-1).sin(), rtol=0, atol=0)
