"""GGUF -> HF conversion on a tiny llama written here with `gguf.GGUFWriter`.

The tiny model (tests/tiny_gguf.py) has known HF weights; the file stores them
the way llama.cpp's converter does (Q/K rows permuted, some tensors
quantized), so the tests can check the conversion gives the original weights
back.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # never let transformers reach for the hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"

gguf = pytest.importorskip("gguf")
from numerics import assert_logits_close  # noqa: E402
from tiny_gguf import (  # noqa: E402
    CHAT_TEMPLATE,
    FF,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    TRICKY,
    TinyModel,
    llama_cpp_permute,
    write_tiny_gguf,
)
from tokenizers import Tokenizer  # noqa: E402

from ferrox_batch.runtime.config import ModelConfig  # noqa: E402
from ferrox_batch.runtime.errors import ModelLoadError, UnsupportedArchitecture  # noqa: E402
from ferrox_batch.runtime.loading.gguf_convert import (  # noqa: E402
    read_gguf,
    unpermute_rope_rows,
    write_hf_folder,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return write_tiny_gguf(tmp_path_factory.mktemp("untied") / "untied.gguf", tied=False, seed=1)


def test_tensor_names_shapes_and_values(tiny: TinyModel) -> None:
    ckpt = read_gguf(tiny.path)
    assert set(ckpt.tensors) == set(tiny.weights)
    assert "lm_head.weight" not in ckpt.tensors and ckpt.config["tie_word_embeddings"] is True
    for name, expected in tiny.weights.items():
        got = ckpt.tensors[name]
        assert got.dtype == np.float32 and got.shape == expected.shape, name
        # Q/K included: the stored permutation is undone, quantized ones bit-exactly too
        np.testing.assert_array_equal(got, expected, err_msg=name)


def test_untied_keeps_lm_head(tiny_untied: TinyModel) -> None:
    ckpt = read_gguf(tiny_untied.path)
    assert ckpt.config["tie_word_embeddings"] is False
    np.testing.assert_array_equal(ckpt.tensors["lm_head.weight"], tiny_untied.weights["lm_head.weight"])


@pytest.mark.parametrize("rows,n_head,cols", [(64, 4, 8), (32, 2, 3), (192, 3, 5), (8, 1, 1)])
def test_unpermute_inverts_llama_cpp_permute(rows: int, n_head: int, cols: int) -> None:
    w = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    assert not np.array_equal(llama_cpp_permute(w, n_head), w)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, n_head), n_head), w)


def test_config_and_generation_config(tiny: TinyModel) -> None:
    ckpt = read_gguf(tiny.path)
    c = ckpt.config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == \
        (HIDDEN, HEADS, KV_HEADS, HEAD_DIM)
    assert (c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]) == (FF, LAYERS, len(tiny.reference.get_vocab()))
    assert c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 10000.0 and c["max_position_embeddings"] == 256
    assert (c["bos_token_id"], c["eos_token_id"], c["torch_dtype"]) == (1, 2, "float32")
    # <|im_end|> is eos; <|endoftext|> is a control token llama.cpp also stops on
    assert ckpt.generation_config == {"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 2}
    tc = ckpt.tokenizer_config
    assert tc["add_bos_token"] is False and tc["chat_template"] == CHAT_TEMPLATE
    assert (tc["bos_token"], tc["eos_token"], tc["unk_token"], tc["pad_token"]) == \
        ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")


def test_tokenizer_encodes_like_its_source(tiny: TinyModel) -> None:
    ours = Tokenizer.from_str(read_gguf(tiny.path).tokenizer_json)
    for text in TRICKY:
        ids = ours.encode(text).ids
        assert ids == tiny.reference.encode(text).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>x<|im_end|>").ids[0::2] == [1, 2]
    assert ours.encode("12").ids == [ours.token_to_id("1"), ours.token_to_id("2")]  # digits isolated


def test_add_bos_token_from_the_file(tmp_path: Path) -> None:
    ckpt = read_gguf(write_tiny_gguf(tmp_path / "bos.gguf", add_bos=True).path)
    assert ckpt.tokenizer_config["add_bos_token"] is True
    assert Tokenizer.from_str(ckpt.tokenizer_json).encode("hello").ids[0] == 1


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "falcon.gguf", arch="falcon").path
    with pytest.raises(UnsupportedArchitecture, match="falcon") as info:
        read_gguf(path)
    assert info.value.architecture == "falcon"
    assert info.value.supported == ["llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma3", "gemma4", "granite",
                                    "olmo2", "qwen3moe", "qwen2moe", "olmoe", "granitemoe", "gpt-oss"]


def test_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "pre.gguf", pre="mystery").path
    with pytest.raises(ModelLoadError, match="mystery"):
        read_gguf(path)


def test_missing_truncated_and_garbage_files(tiny: TinyModel, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no GGUF file"):
        read_gguf(tmp_path / "absent.gguf")
    data = tiny.path.read_bytes()
    for name, blob in [("half.gguf", data[: len(data) // 2]), ("head.gguf", data[:100]),
                       ("garbage.gguf", b"not a gguf at all" * 100), ("empty.gguf", b"")]:
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(ModelLoadError, match=name):
            read_gguf(tmp_path / name)


def test_written_folder_matches_transformers_gguf_loader(tiny_untied: TinyModel, tmp_path: Path) -> None:
    """An independent check: transformers reads the same GGUF to the same model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    seen: list[str] = []
    written = write_hf_folder(read_gguf(tiny_untied.path), tmp_path / "hf",
                              progress=lambda done, total, name: seen.append(name))
    assert sorted(p.name for p in written) == sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert seen[-1] == "model.safetensors"
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_untied.path.parent, gguf_file=tiny_untied.path.name, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    # Both dequantize the same blocks to the same float32 weights; the two models then differ only in
    # where their tensors lie in memory, which may change how the BLAS blocks its sums: two float32
    # forwards that round in different orders.
    config = ModelConfig.from_file(tmp_path / "hf" / "config.json")
    with torch.no_grad():
        assert_logits_close(ours(ids).logits, theirs(ids).logits, config, ids.shape[1])
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("a b  c")["input_ids"] == tiny_untied.reference.encode("a b  c").ids
