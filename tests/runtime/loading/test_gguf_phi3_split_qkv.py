"""Phi-3 GGUFs whose attention stores Q, K and V as three tensors, which llama.cpp's phi3 architecture reads
beside the fused `attn_qkv` its converter writes.

The three become the HF checkpoint's one `self_attn.qkv_proj.weight`, stacked in Q, K, V order (unpermuted:
Phi-3 rotates halves, in llama.cpp as in HF), and the file must load as the source checkpoint transformers
loads (last logits within float32 rounding, 32 greedy ids identical). Quantized parts stay as stored, one
segment per format. A layer with both forms, or only some of the parts, is refused by the tensor's name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

os.environ["HF_HUB_OFFLINE"] = "1"  # never let transformers reach for the hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"

gguf = pytest.importorskip("gguf")
import torch  # noqa: E402
from test_gguf_families import PROMPTS, VOCAB, assert_as_transformers, rewrite, vocabulary  # noqa: E402
from tiny_checkpoint import write_tiny_checkpoint  # noqa: E402
from tiny_gguf_families import FamilyGguf, write_family_gguf  # noqa: E402

from ferrox_batch.runtime.errors import ModelLoadError  # noqa: E402
from ferrox_batch.runtime.loading.gguf_convert import read_gguf  # noqa: E402
from ferrox_batch.runtime.loading.loader import load_model  # noqa: E402
from ferrox_batch.runtime.quant.weight import QuantizedWeight  # noqa: E402

QKV = "model.layers.{}.self_attn.qkv_proj.weight"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[bool, FamilyGguf]]:
    """A tiny Phi-3 checkpoint, and it as a GGUF with separate Q/K/V tensors, in f32 and quantized."""
    root = tmp_path_factory.mktemp("phi3-split")
    source = write_tiny_checkpoint(root / "source", arch="phi3", vocab_size=VOCAB, std=0.15, intermediate=256,
                                   seed=45)
    return source, {quantized: write_family_gguf(source, root / str(quantized), "phi3", vocabulary("spm"),
                                                 quantized=quantized, seed=45, split_qkv=True)
                    for quantized in (False, True)}


def test_the_file_holds_the_parts_and_not_the_fused_tensor(files: tuple[Path, dict[bool, FamilyGguf]]) -> None:
    names = {t.name for t in gguf.GGUFReader(files[1][True].path).tensors}
    assert {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"} <= names
    assert not any("attn_qkv" in name for name in names)


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q4_k_m-mix"])
def test_the_parts_stack_into_the_fused_projection(files: tuple[Path, dict[bool, FamilyGguf]],
                                                   quantized: bool) -> None:
    family = files[1][quantized]
    ckpt = read_gguf(family.path)
    assert ckpt.tensors.keys() == family.weights.keys()
    for name, want in family.weights.items():
        np.testing.assert_array_equal(ckpt.tensors[name], want, err_msg=name)
    # A part the file keeps in floats (V in F16, as a Q4_K_M file keeps rows shorter than a K-quant block)
    # widens the fused projection to fp32.
    kept = read_gguf(family.path, keep_quantized=True).tensors[QKV.format(0)]
    np.testing.assert_array_equal(kept, family.weights[QKV.format(0)])


def test_quantized_parts_stay_as_stored(files: tuple[Path, dict[bool, FamilyGguf]], tmp_path: Path) -> None:
    family = files[1][True]
    fused = family.weights[QKV.format(0)]
    v_rows = quantize(fused[96:], Q.Q8_0)
    path = rewrite(family, tmp_path / "q8-v.gguf", tensors={"blk.0.attn_v.weight": (v_rows, Q.Q8_0)})
    kept = read_gguf(path, keep_quantized=True).tensors[QKV.format(0)]
    # Q and K in Q5_0 (one segment: stacked rows of one format merge), V in Q8_0, each the file's own blocks.
    assert isinstance(kept, QuantizedWeight)
    assert [(s.format.name, s.rows) for s in kept.segments] == [("q5_0", 64 + 32), ("q8_0", 32)]
    want = np.concatenate([fused[:96], dequantize(v_rows, Q.Q8_0).reshape(32, 64)])
    np.testing.assert_array_equal(kept.dequantize().numpy(), want)
    np.testing.assert_array_equal(read_gguf(path).tensors[QKV.format(0)], want)


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q4_k_m-mix"])
def test_the_model_is_the_source_checkpoint_transformers_loads(files: tuple[Path, dict[bool, FamilyGguf]],
                                                               quantized: bool) -> None:
    transformers = pytest.importorskip("transformers")
    source, family = files[0], files[1][quantized]
    # The f32 file holds the source's weights exactly; the quantized one what its blocks hold (the twin folder).
    folder = family.hf_folder if quantized else source
    ours = load_model(family.path, device="cpu", dtype="float32", int8_activations=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    assert_as_transformers(ours, theirs, PROMPTS, PROMPTS)


@pytest.mark.parametrize("change,message", [
    ({"tensors": {"blk.1.attn_qkv.weight": np.zeros((128, 64), np.float32)}},
     r"blk.1.attn_k.weight beside blk.1.attn_qkv.weight: a file holds the fused tensor or its parts, not both"),
    ({"skip_tensors": {"blk.1.attn_k.weight"}}, r"blk.1.attn_k.weight is missing beside blk.1.attn_q.weight"),
    ({"skip_tensors": {"blk.0.attn_q.weight"}}, r"blk.0.attn_q.weight is missing beside blk.0.attn_k.weight"),
    ({"skip_tensors": {"blk.0.attn_q.weight", "blk.0.attn_k.weight"}},
     r"blk.0.attn_q.weight is missing beside blk.0.attn_v.weight"),
])
def test_a_layer_with_both_forms_or_some_parts_is_refused(files: tuple[Path, dict[bool, FamilyGguf]],
                                                          tmp_path: Path, change: dict[str, Any], message: str) -> None:
    path = rewrite(files[1][True], tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelLoadError, match=message) as info:
        read_gguf(path)
    assert "bad.gguf" in str(info.value)
