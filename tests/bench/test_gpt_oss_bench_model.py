"""The gpt-oss-20b-shaped benchmark checkpoint's writer (`scripts/make_gpt_oss_bench_model.py`).

Its experts are rounded to MXFP4 by a torch rewrite of gguf-py's quantizer (the numpy one holds a 16-way
error array per value, too slow for 6 billion values): the blocks must be gguf-py's bit for bit. Its layers
must be the published layout `tests/mxfp4_checkpoint.write_published` writes (the names, shapes and dtypes
the loader reads), and a tiny checkpoint it writes must load as gpt-oss with its experts kept in MXFP4.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from kernel_builds import needs_compiler  # noqa: E402
from make_gpt_oss_bench_model import config_for, layer_tensors, mxfp4_pair  # noqa: E402
from make_moe_bench_model import head_tensors, write_shards  # noqa: E402
from mxfp4_checkpoint import ggml_rows, published_pair, write_published  # noqa: E402
from safetensors import safe_open  # noqa: E402
from tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

from ferrox_batch.runtime.architectures.moe import MoeBlock  # noqa: E402
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk  # noqa: E402
from ferrox_batch.runtime.loading.loader import load_model  # noqa: E402
from ferrox_batch.runtime.quant.weight import QuantizedWeight  # noqa: E402

#: A tiny gpt-oss: every expert row whole 32-value blocks.
TINY = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "experts_per_token": 2,
        "max_position_embeddings": 256, "sliding_window": 5}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_std=st.floats(-12, 4), rows=st.integers(1, 6), blocks=st.integers(1, 4),
       zero_block=st.booleans())
def test_the_rounding_is_gguf_pys_bit_for_bit(seed: int, log_std: float, rows: int, blocks: int,
                                              zero_block: bool) -> None:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(2, rows, 32 * blocks, generator=generator) * 2.0**log_std
    if zero_block:
        values[0, 0, :32] = 0
    ours = mxfp4_pair(values)
    theirs = published_pair(ggml_rows(values))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny gpt-oss in transformers' layout (for its tokenizer and as `write_published`'s source), and the
    writer's own tiny checkpoint of the same shape."""
    root = tmp_path_factory.mktemp("gpt_oss_bench")
    source = write_tiny_checkpoint(root / "source", arch="gpt_oss", layers=2, head_dim=16, intermediate=96,
                                   tie=False, max_positions=256)
    config = {**config_for(2, source), **TINY,
              "vocab_size": json.loads((source / "config.json").read_text())["vocab_size"]}
    out = root / "written"
    out.mkdir()
    write_shards(out, config, seed=0, force=False, draw_layer=layer_tensors)
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    return source, out


def layout(folder: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    found = {}
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                found[name] = (tuple(tensor.shape), tensor.dtype)
    return found


def test_the_layers_are_the_published_layout(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    source, written = tiny
    published = write_published(source, tmp_path)
    assert layout(written) == layout(published.folder)
    config = json.loads((written / "config.json").read_text())
    assert config["quantization_config"] == json.loads((published.folder / "config.json").read_text())[
        "quantization_config"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"]


def test_the_head_is_drawn_at_the_configured_std() -> None:
    config = {"vocab_size": 4096, "hidden_size": 64}
    tensors = head_tensors(config, torch.Generator().manual_seed(0))
    # 262,144 normal draws: the sample std's own std is 0.02 / sqrt(2 n), about 3e-5
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert abs(tensors[name].float().std().item() - 0.02) < 5e-4
    assert torch.equal(tensors["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))


@needs_compiler
def test_the_written_checkpoint_loads_with_its_experts_in_mxfp4(tiny: tuple[Path, Path]) -> None:
    _, written = tiny
    model = load_model(written, device="cpu", dtype="float32", int8_activations=False)
    assert model.decoder.weight_formats["mxfp4"] == 2 * 2 * TINY["num_local_experts"]
    blocks = [layer.ffn for layer in model.decoder.layers if isinstance(layer.ffn, MoeBlock)]
    kept = [swiglu.linear.stored for block in blocks for swiglu in block.gate_up] + \
        [linear.stored for block in blocks for linear in block.down]
    assert all(isinstance(w, QuantizedWeight) and w.format_names == ("mxfp4",) for w in kept)
    stored = 0
    for shard in written.glob("model-*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            stored += sum(f.get_tensor(n).numel() for n in f.keys() if n.endswith(("_blocks", "_scales")))
    assert sum(w.nbytes for w in kept) == stored
    store = model.decoder.new_store(16, num_blocks=4)
    store.add_sequence(0, 8)
    logits = model.decoder.forward([SeqChunk(0, [1, 2, 3, 4, 5, 6, 7, 8])], store)
    assert torch.isfinite(logits).all()
