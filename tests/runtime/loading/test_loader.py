"""Loading checkpoints: what is accepted, and a clear error for everything that is not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.errors import ModelLoadError, UnsupportedArchitecture
from ferrox_batch.runtime.loading.loader import load_model


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_folder_loads_with_its_config_tokenizer_and_stop_tokens(tiny_llama_dir):
    model = load_model(tiny_llama_dir, device="cpu", dtype="float32")
    assert model.config.architecture == "LlamaForCausalLM"
    assert model.decoder.dtype == torch.float32
    im_end = model.tokenizer.token_to_id("<|im_end|>")
    eot = model.tokenizer.token_to_id("<|endoftext|>")
    assert model.tokenizer.stop_tokens.ids == {im_end, eot}
    shape = model.kv_shape()
    # 2 layers x (K and V) x 2 kv heads x 16 head_dim x 4 bytes
    assert shape.per_token_kv_bytes() == 2 * 2 * 2 * 16 * 4


def test_a_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no model at"):
        load_model(tmp_path / "nowhere")


def test_a_folder_without_weights_names_the_missing_file(tiny_llama_dir, tmp_path):
    folder = copy(tiny_llama_dir, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing weights file .*model.safetensors"):
        load_model(folder, device="cpu", dtype="float32")


def test_corrupt_weights_are_a_clear_error(tiny_llama_dir, tmp_path):
    folder = copy(tiny_llama_dir, tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_model(folder, device="cpu", dtype="float32")


def test_a_corrupt_config_or_tokenizer_is_a_clear_error(tiny_llama_dir, tmp_path):
    folder = copy(tiny_llama_dir, tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(folder)
    folder2 = copy(tiny_llama_dir, tmp_path / "m2")
    (folder2 / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ModelLoadError, match="tokenizer.json could not be read"):
        load_model(folder2)


def test_a_missing_config_field_is_named(tiny_llama_dir, tmp_path):
    folder = copy(tiny_llama_dir, tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    del raw["hidden_size"]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model(folder)


def test_an_unsupported_architecture_is_refused_by_name(tiny_llama_dir, tmp_path):
    folder = copy(tiny_llama_dir, tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    raw["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedArchitecture) as err:
        load_model(folder)
    message = str(err.value)
    assert "GPTNeoXForCausalLM" in message and "LlamaForCausalLM" in message and "Qwen2ForCausalLM" in message


def test_a_weight_of_the_wrong_shape_is_named(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy(tiny_llama_dir, tmp_path / "m")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model.layers.1.mlp.up_proj.weight.*\(3, 3\)"):
        load_model(folder, device="cpu", dtype="float32")


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy(tiny_llama_dir, tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    raw["vocab_size"] = 100
    (folder / "config.json").write_text(json.dumps(raw))
    weights = load_file(str(folder / "model.safetensors"))  # the (tied) embedding of a 100-id vocabulary
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:100].contiguous()
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="tokenizer has .* ids but the model's vocabulary is 100"):
        load_model(folder, device="cpu", dtype="float32")


@pytest.mark.parametrize(
    "field,value,match",
    [("num_attention_heads", 3, "multiple of"), ("num_hidden_layers", 0, "num_layers"),
     ("rope_scaling", {"rope_type": "su", "factor": 2.0}, "'su' is not supported"),
     ("rope_scaling", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0},
      "yarn rope scaling needs a positive original"),
     ("rope_scaling", {"rope_type": "linear"}, "linear rope scaling needs a factor"),
     ("rope_scaling", {"rope_type": "linear", "factor": -1}, "factor must be positive"),
     ("hidden_act", "relu", "activation 'relu' is not supported")],
)
def test_malformed_configs_are_refused_with_the_reason(tiny_llama_dir, field, value, match):
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    raw[field] = value
    if field == "num_attention_heads":
        raw["head_dim"] = 16
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict(raw)
