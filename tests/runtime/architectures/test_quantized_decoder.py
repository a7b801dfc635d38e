"""A model whose weights stay in their quantized blocks is the model its dequantized weights define.

Tiny checkpoints of three families are written as GGUFs the way llama.cpp writes a Q4_K_M file (Q8_0,
Q5_0, Q4_1, Q4_K, Q6_K, and f16/bf16 where a row is not whole 256-weight blocks): Llama with its Q/K rows
permuted and an untied head, Phi-3 with partial RoPE (each head's rows reordered inside the fused
projection) and Gemma 3 (a Q5_0 + Q4_1 fused gate/up projection, GeGLU, local layers). Served as stored, each must
give the logits and the greedy tokens of the same file widened to float32: in float32 the two sides differ
only in where and in what order they round (`numerics.logits_tolerance`); in bf16, by bf16's own roundings
against float32, as any bf16 model does. Quantizing a dense checkpoint at load must give the model of the
blocks gguf's quantizer writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from numerics import assert_decisive, assert_logits_close
from safetensors.numpy import load_file
from tiny_checkpoint import build_tokenizer, write_tiny_checkpoint
from tiny_gguf import SPECIALS, bpe_vocabulary, spm_vocabulary
from tiny_gguf_families import FamilyGguf, write_family_gguf

from ferrox_batch.runtime.architectures.decoder import Decoder
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.loading.loader import load_model
from ferrox_batch.runtime.quant.formats import FORMATS

VOCAB = 384
GEMMA = dict(arch="gemma3_text", layers=6, heads=2, kv_heads=1, head_dim=256, intermediate=256, sliding_window=8)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("llama", dict(arch="llama", tie=False, intermediate=256, seed=41), "bpe"),
    "phi3-partial": ("phi3", dict(arch="phi3", partial_rotary_factor=0.75, seed=42), "spm"),
    "gemma3": ("gemma3", dict(GEMMA, seed=43), "gemma"),
}
PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on."
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FamilyGguf]:
    out = {}
    for name, (arch, checkpoint, vocab) in CASES.items():
        root = tmp_path_factory.mktemp(name)
        source = write_tiny_checkpoint(root / "source", vocab_size=VOCAB, std=0.15, **checkpoint)
        words = bpe_vocabulary(build_tokenizer(VOCAB), "gpt2", VOCAB, SPECIALS) if vocab == "bpe" else \
            spm_vocabulary(VOCAB, gemma=vocab == "gemma")
        out[name] = write_family_gguf(source, root / "gguf", arch, words, seed=checkpoint["seed"])
    return out


def run(model: Any, ids: list[int], new_tokens: int) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """The prompt's last logits, then `new_tokens` greedy tokens with the logits each was picked from."""
    store = model.decoder.new_store(4, num_blocks=8 * (-(-(len(ids) + new_tokens) // 4)))
    store.add_sequence(0, len(ids) + new_tokens)
    logits = model.decoder.forward([SeqChunk(0, ids)], store)
    first, out, steps = logits[0].clone(), [], []
    for _ in range(new_tokens):
        steps.append(logits[0].clone())
        out.append(int(logits[0].argmax()))
        logits = model.decoder.forward([SeqChunk(0, [out[-1]])], store)
    return first, out, steps


@pytest.mark.parametrize("name", CASES)
def test_a_file_served_as_stored_is_the_file_widened(files: dict[str, FamilyGguf], name: str) -> None:
    path = files[name].path
    stored = load_model(path, device="cpu", dtype="float32", int8_activations=False)
    widened = load_model(path, device="cpu", dtype="float32", weights="widen")
    kinds = stored.decoder.linear_kinds
    assert all(kind.split("+")[0] in FORMATS or kind in ("mkldnn", "plain") for kind in kinds), kinds
    # every layer keeps its quantized projections (a fused one with an f16 part is widened whole)
    assert sum(count for kind, count in kinds.items() if kind not in ("mkldnn", "plain")) >= 3 * len(
        stored.decoder.layers), kinds
    assert set(widened.decoder.weight_formats) == {"dense"}
    if name == "gemma3":  # gate in Q5_0, up in Q4_1: one fused projection over two formats
        assert "q5_0+q4_1" in kinds
    ids = stored.tokenizer.encode(PROMPT)
    got, greedy, _ = run(stored, ids, NEW_TOKENS)
    want, want_greedy, steps = run(widened, ids, NEW_TOKENS)
    assert_logits_close(got, want, stored.config, len(ids), note=name)
    assert_decisive(steps, stored.config, len(ids), note=name)
    assert greedy == want_greedy


@pytest.mark.parametrize("name", CASES)
def test_bf16_serving_of_the_stored_blocks_stays_close_to_float32(files: dict[str, FamilyGguf], name: str) -> None:
    path = files[name].path
    bf16 = load_model(path, device="cpu", dtype="bfloat16", int8_activations=False)
    fp32 = load_model(path, device="cpu", dtype="float32", weights="widen")
    assert len(bf16.decoder.weight_formats) > 1  # quantized layers run (f16 parts of the file stay dense)
    ids = bf16.tokenizer.encode(PROMPT)
    got, _, _ = run(bf16, ids, 0)
    want, _, _ = run(fp32, ids, 0)
    assert_logits_close(got, want, bf16.config, len(ids), torch.bfloat16, note=name)


def test_the_embedding_and_its_tied_head_share_the_stored_blocks(files: dict[str, FamilyGguf]) -> None:
    """The Q8_0 embedding is held once, as stored, and the head ties to those blocks (the real files' memory is
    checked against their size in test_real_model_quantized.py)."""
    model = load_model(files["gemma3"].path, device="cpu", dtype="float32")
    decoder = model.decoder
    assert decoder.lm_head_tied and decoder.lm_head.kind == "q8_0"
    assert decoder.lm_head.stored is decoder.embed.weight  # one packing, read as rows and multiplied by
    widened = load_model(files["gemma3"].path, device="cpu", dtype="float32", weights="widen")
    assert widened.decoder.weight_bytes > 1.5 * decoder.weight_bytes  # its f16 parts are widened on both sides


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0"])
def test_quantizing_at_load_serves_the_blocks_gguf_writes(tiny_batch_dir: Path, fmt: str) -> None:
    """A dense folder quantized at load gives the model whose weights are gguf's quantize-then-dequantize of
    the folder's (every linear weight and the embedding; norms stay dense)."""
    model = load_model(tiny_batch_dir, device="cpu", dtype="float32", weights=fmt, int8_activations=False)
    assert model.decoder.weight_formats == {fmt: 4 * len(model.decoder.layers) + 1}
    config = ModelConfig.from_file(tiny_batch_dir / "config.json")
    qtype = GGMLQuantizationType(FORMATS[fmt].ggml_type)
    tensors = {}
    for name, value in load_file(str(tiny_batch_dir / "model.safetensors")).items():
        if value.ndim == 2:
            value = gguf_dequantize(gguf_quantize(value.astype(np.float32), qtype), qtype).reshape(value.shape)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))
    reference = Decoder(config, tensors, dtype=torch.float32)
    ids = list(range(3, 40))
    store_a, store_b = model.decoder.new_store(4, num_blocks=16), reference.new_store(4, num_blocks=16)
    store_a.add_sequence(0, len(ids))
    store_b.add_sequence(0, len(ids))
    got = model.decoder.forward([SeqChunk(0, ids)], store_a)[0]
    want = reference.forward([SeqChunk(0, ids)], store_b)[0]
    assert_logits_close(got, want, config, len(ids), note=fmt)


def test_without_the_kernels_a_file_is_widened_and_quantizing_is_refused(files: dict[str, FamilyGguf],
                                                                          tiny_batch_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Decoder, "kernels_for", staticmethod(lambda device, dtype: None))
    model = load_model(files["llama"].path, device="cpu", dtype="float32")
    assert set(model.decoder.weight_formats) == {"dense"}
    assert "widened" in model.weights_reason
    with pytest.raises(ModelLoadError, match="cannot be served in q8_0 here"):
        load_model(tiny_batch_dir, device="cpu", dtype="float32", weights="q8_0")


def test_kept_blocks_are_the_process_s_memory_not_the_file_s(files: dict[str, FamilyGguf],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The KV budget's default is a share of the memory available after the load: blocks left as a view of
    the mapped file would count as free page cache there, so every kept weight lies outside the mapping."""
    import gguf

    from ferrox_batch.runtime.loading.gguf_convert import read_gguf
    from ferrox_batch.runtime.quant.weight import QuantizedWeight

    readers = []

    class Recording(gguf.GGUFReader):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            readers.append(self)

    monkeypatch.setattr(gguf, "GGUFReader", Recording)
    kept = read_gguf(files["gemma3"].path, keep_quantized=True).tensors
    (reader,) = readers
    start = reader.data.ctypes.data
    quantized = [w for w in kept.values() if isinstance(w, QuantizedWeight)]
    assert quantized
    for weight in quantized:
        for segment in weight.segments:
            address = segment.data.data_ptr()
            assert not start <= address < start + reader.data.nbytes
