"""llama.cpp's own name for GPT-2's split, "gpt-2", is read as that split.

llama.cpp's converter writes `tokenizer.ggml.pre` "gpt-2" for a byte-level BPE behind GPT-2's regex (and,
through its fallback for an unrecognised tokenizer, for the test fixture's own). A file carrying it must
load and encode as the tokenizer it was converted from.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

pytest.importorskip("gguf")
from tiny_checkpoint import build_tokenizer, write_tiny_checkpoint  # noqa: E402
from tiny_gguf import SPECIALS, bpe_vocabulary  # noqa: E402
from tiny_gguf_families import write_family_gguf  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from ferrox_batch.runtime.loading.gguf_convert import read_gguf  # noqa: E402

VOCAB = 384
TEXTS = ["Hello world", "two  spaces", "trailing   ", "\n\nnew\nlines\n", "tabs\tand\r\nCRLF",
         "café naïve résumé", "日本語のテキスト", "emoji 😀👍🏽", "x = 12345 + 0.5", "I'm sure they'll say it's fine",
         "    return 42", "The quick brown fox jumps over the lazy dog.", ""]


@pytest.mark.parametrize("pre", ["gpt-2", "gpt2"])
def test_a_gpt2_split_file_encodes_as_its_source_tokenizer(tmp_path: Path, pre: str) -> None:
    source_tokenizer = build_tokenizer(VOCAB)
    source = write_tiny_checkpoint(tmp_path / "source", vocab_size=VOCAB)
    family = write_family_gguf(source, tmp_path / "gguf", "llama",
                               bpe_vocabulary(source_tokenizer, pre, VOCAB, SPECIALS), quantized=False)
    ours = Tokenizer.from_str(read_gguf(family.path).tokenizer_json)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False).ids == source_tokenizer.encode(text).ids, (pre, text)
