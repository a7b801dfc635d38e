"""The tokenizers we build from a GGUF's vocabulary encode like transformers' GGUF tokenizer.

Four vocabularies as llama.cpp stores them (tests/tiny_gguf.py): byte-level BPE behind Qwen2's split
(`tokenizer.ggml.pre` "qwen2"), and SentencePiece three ways: Gemma 3's (no prefix space, ranks by
position, runs of spaces stored as spaces), Phi-3's (a prefix space from the normalizer) and Llama 2's (a
prefix space from the pre-tokenizer). Each text must encode to the same ids (BOS included where the file
asks for it), through the `tokenizer.json` we write and through the runtime's `Tokenizer`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # never let transformers reach for the hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"

pytest.importorskip("gguf")
from tiny_checkpoint import write_tiny_checkpoint  # noqa: E402
from tiny_gguf import SPECIALS, bpe_vocabulary, qwen2_tokenizer, spm_vocabulary  # noqa: E402
from tiny_gguf_families import FamilyGguf, write_family_gguf  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from ferrox_batch.runtime.loading.gguf_convert import read_gguf  # noqa: E402
from ferrox_batch.runtime.loading.loader import load_model  # noqa: E402
from ferrox_batch.runtime.loading.tokenizer import Tokenizer as RuntimeTokenizer  # noqa: E402

VOCAB = 384
TEXTS = ["Hello world", "the quick brown fox", " leading space", "two  spaces", "three   spaces", "trailing   ",
         "\n\nnew\nlines\n", "tabs\tand\r\nCRLF", "café naïve résumé, ¿qué tal?", "Ελληνικά", "日本語のテキスト",
         "emoji 😀👍🏽 🇫🇷", "x = 12345 + 0.5", "in 2024,  7 items", "I'm sure they'll say it's fine",
         "    return 42", "a\n  1\n", "<b>bold</b>", "zero\u200bwidth", "", " ", "  ", "\n"]
SPECIAL_TEXTS = {
    "qwen2": ["<|im_start|>user\nHi<|im_end|>\n", "<|endoftext|>"],
    "gemma3": ["<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<bos>x<eos>"],
    "phi3": ["<|user|>\nHi<|end|>\n<|assistant|>", "<s>x</s>"],
    "llama": ["<s>x</s>", "<unk>"],
}
#: vocabulary -> (llama.cpp architecture, the tiny checkpoint it rides on)
CASES = {
    "qwen2": ("qwen2", dict(arch="qwen2")),
    "gemma3": ("gemma3", dict(arch="gemma3_text", layers=2, head_dim=32)),
    "phi3": ("phi3", dict(arch="phi3")),
    "llama": ("llama", dict(arch="llama")),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FamilyGguf]:
    out = {}
    for name, (arch, checkpoint) in CASES.items():
        root = tmp_path_factory.mktemp(name)
        source = write_tiny_checkpoint(root / "source", vocab_size=VOCAB, **checkpoint)
        vocab = (bpe_vocabulary(qwen2_tokenizer(), "qwen2", VOCAB, SPECIALS) if name == "qwen2"
                 else spm_vocabulary(VOCAB, gemma=name == "gemma3"))
        out[name] = write_family_gguf(source, root / "gguf", arch, vocab, quantized=False)
    return out


@pytest.mark.parametrize("name", CASES)
def test_our_tokenizer_encodes_like_transformers_gguf_tokenizer(files: dict[str, FamilyGguf], name: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = files[name].path
    ckpt = read_gguf(path)
    ours = Tokenizer.from_str(ckpt.tokenizer_json)
    runtime = RuntimeTokenizer.from_parts(ckpt.tokenizer_json, tokenizer_config=ckpt.tokenizer_config,
                                          generation_config=ckpt.generation_config, model_config=ckpt.config)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS + SPECIAL_TEXTS[name]:
        want = theirs(text)["input_ids"]
        assert ours.encode(text).ids == want, (name, text)
        # The runtime adds no second BOS to a text that starts with one (transformers does).
        doubled = runtime.add_bos and len(want) > 1 and want[0] == want[1] == runtime.token_to_id(runtime.bos_token)
        assert runtime.encode(text) == (want[1:] if doubled else want), (name, text)
    if name in ("qwen2", "gemma3"):  # no prefix space to strip: the bytes give the text back
        for text in TEXTS:
            assert runtime.decode(runtime.encode(text, add_special_tokens=False)).decode() == text, (name, text)


def test_qwen2_splits_every_digit_and_keeps_its_chat_tokens(files: dict[str, FamilyGguf]) -> None:
    ours = Tokenizer.from_str(read_gguf(files["qwen2"].path).tokenizer_json)
    assert [ours.decode([i]) for i in ours.encode("x 2024").ids][-4:] == ["2", "0", "2", "4"]
    assert ours.encode("<|im_start|><|im_end|>").ids == [1, 2]


def test_gemma3_vocabulary_settings(files: dict[str, FamilyGguf]) -> None:
    ckpt = read_gguf(files["gemma3"].path)
    ids = {t: i for i, t in enumerate(spm_vocabulary(VOCAB, gemma=True).tokens)}
    assert ckpt.tokenizer_config["add_bos_token"] is True and ckpt.tokenizer_config["bos_token"] == "<bos>"
    assert ckpt.generation_config["eos_token_id"] == [ids["<eos>"], ids["<end_of_turn>"]]
    ours = Tokenizer.from_str(ckpt.tokenizer_json)
    assert ours.encode("hi").ids[0] == ids["<bos>"]
    # a character the pieces lack falls back to its UTF-8 bytes
    assert ours.encode("☃", add_special_tokens=False).ids == [ids["<0xE2>"], ids["<0x98>"], ids["<0x83>"]]


def test_the_runtime_loads_a_gemma_gguf_with_its_stop_tokens(files: dict[str, FamilyGguf], tmp_path: Path) -> None:
    model = load_model(files["gemma3"].path, device="cpu", dtype="float32")
    ids = {t: i for i, t in enumerate(spm_vocabulary(VOCAB, gemma=True).tokens)}
    assert model.tokenizer.stop_tokens.ids == {ids["<eos>"], ids["<end_of_turn>"]}
    assert model.tokenizer.encode("hi")[0] == ids["<bos>"]
    assert model.tokenizer.decode([ids["<end_of_turn>"]]) == b""
