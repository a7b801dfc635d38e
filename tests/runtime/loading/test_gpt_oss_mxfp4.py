"""gpt-oss as published: the experts as MXFP4 blocks and scales (`quantization_config: {quant_method: mxfp4}`).

A tiny gpt-oss (every expert row whole 32-value blocks) is rounded to MXFP4 by gguf-py's quantizer and written
in the published layout (`mxfp4_checkpoint`); transformers runs its twin, the same values dequantized by
transformers' own MXFP4 path. Ours serves the experts as stored (the MXFP4 kernels, where built) and must
be that model: last logits within float32 rounding, 32 greedy ids identical, every routing decision of the
prompts decided by the arithmetic; widened (`--weights widen`, or no kernels: CUDA's path) likewise. The
kept experts take exactly the blocks' and scales' bytes. Any other quantization is refused by name.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from kernel_builds import needs_compiler  # noqa: E402
from mxfp4_checkpoint import Published, write_published  # noqa: E402
from numerics import assert_decisive, assert_logits_close, logits_tolerance  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_gguf_families import run  # noqa: E402
from tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

from ferrox_batch.runtime.architectures.moe import MoeBlock  # noqa: E402
from ferrox_batch.runtime.config import ModelConfig  # noqa: E402
from ferrox_batch.runtime.errors import ModelLoadError  # noqa: E402
from ferrox_batch.runtime.families.gpt_oss import LAYOUTS  # noqa: E402
from ferrox_batch.runtime.loading.loader import load_model  # noqa: E402
from ferrox_batch.runtime.quant.weight import QuantizedWeight  # noqa: E402

PROMPTS = ["The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
           "def main():\n    return 42\n\ncafé 日本語 😀", "hello there"]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Published:
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    source = write_tiny_checkpoint(root / "source", arch="gpt_oss", seed=20, layers=3, head_dim=16, intermediate=64,
                                   std=0.15, max_positions=256)
    return write_published(source, root / "out")


def reference(folder: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def test_the_published_layout_names_the_blocks_and_scales() -> None:
    tensors = LAYOUTS[1].tensors(experts=4, hidden=64, intermediate=96, bias=True)
    assert LAYOUTS[1].marker() == "mlp.experts.gate_up_proj_blocks"
    assert tensors == {
        "mlp.experts.gate_up_proj_blocks": (4, 192, 2, 16), "mlp.experts.gate_up_proj_scales": (4, 192, 2),
        "mlp.experts.gate_up_proj_bias": (4, 192),
        "mlp.experts.down_proj_blocks": (4, 64, 3, 16), "mlp.experts.down_proj_scales": (4, 64, 3),
        "mlp.experts.down_proj_bias": (4, 64)}


def test_every_routing_decision_of_the_prompts_is_decided_by_the_arithmetic(published: Published) -> None:
    config = ModelConfig.from_file(published.twin / "config.json")
    assert config.moe is not None
    ref = reference(published.twin)
    for prompt in PROMPTS:
        ids = load_model(published.twin, device="cpu", dtype="float32").tokenizer.encode(prompt)
        with torch.no_grad():
            routers = ref(torch.tensor([ids]), output_router_logits=True).router_logits
        for logits in routers:
            top = logits.double().topk(config.moe.top_k + 1, dim=-1).values
            margin = float((top[:, -2] - top[:, -1]).min())
            assert margin > 2 * logits_tolerance(config, len(ids), logits), (prompt, margin)


@pytest.mark.parametrize("weights", ["auto", "widen"])
def test_the_model_is_transformers_on_the_same_values(published: Published, weights: str) -> None:
    ours = load_model(published.folder, device="cpu", dtype="float32", weights=weights, int8_activations=False)
    if weights == "widen":
        assert set(ours.decoder.weight_formats) == {"dense"}
    theirs = reference(published.twin)
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        got, greedy, _ = run(ours, ids, 32 if prompt == PROMPTS[0] else 0)
        with torch.no_grad():
            want = theirs(torch.tensor([ids])).logits[0, -1]
            assert_logits_close(got, want, ours.config, len(ids), note=(weights, prompt))
            if greedy:
                out = theirs.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
                assert_decisive([step[0] for step in out.logits], ours.config, len(ids), note=weights)
                assert greedy == out.sequences[0, len(ids):].tolist(), weights


def _expert_weights(model) -> list[QuantizedWeight]:
    blocks = [layer.ffn for layer in model.decoder.layers if isinstance(layer.ffn, MoeBlock)]
    linears = [swiglu.linear for block in blocks for swiglu in block.gate_up] + \
        [linear for block in blocks for linear in block.down]
    return [linear.stored for linear in linears]


@needs_compiler
def test_the_kept_experts_are_the_blocks_bytes(published: Published) -> None:
    """Each expert's MXFP4 rows are the published blocks and scales, rearranged: 17 bytes a block, as stored."""
    model = load_model(published.folder, device="cpu", dtype="float32", int8_activations=False)
    config = model.config
    assert model.decoder.weight_formats["mxfp4"] == 2 * config.num_layers * config.moe.experts
    kept = _expert_weights(model)
    assert all(isinstance(w, QuantizedWeight) and w.format_names == ("mxfp4",) for w in kept)
    assert sum(w.nbytes for w in kept) == published.blocks_bytes
    # served as stored, the int8-activation kernel too, and the product is the widened model's
    ids = model.tokenizer.encode(PROMPTS[0])
    int8 = load_model(published.folder, device="cpu", dtype="float32")
    widened = load_model(published.folder, device="cpu", dtype="float32", weights="widen")
    assert "mxfp4" in int8.decoder.weight_formats
    assert widened.decoder.weight_bytes > model.decoder.weight_bytes
    got, want = run(model, ids, 0)[0], run(widened, ids, 0)[0]
    assert_logits_close(got, want, config, len(ids))


def _rewritten(published: Published, to: Path, config_change=None, tensors_change=None) -> Path:
    shutil.copytree(published.folder, to)
    if config_change is not None:
        config = json.loads((to / "config.json").read_text())
        config_change(config)
        (to / "config.json").write_text(json.dumps(config))
    if tensors_change is not None:
        tensors = load_file(str(to / "model.safetensors"))
        tensors_change(tensors)
        save_file(tensors, str(to / "model.safetensors"))
    return to


@pytest.mark.parametrize("method", ["fp8", "bitsandbytes", None])
def test_another_quantization_is_refused_by_name(published: Published, tmp_path: Path, method) -> None:
    def change(config):
        config["quantization_config"] = {"quant_method": method}

    folder = _rewritten(published, tmp_path / "other", config_change=change)
    with pytest.raises(ModelLoadError, match=f"quantization_config: quant_method {method!r}"):
        load_model(folder, device="cpu", dtype="float32")


def test_bad_blocks_are_refused_naming_the_tensor(published: Published, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.experts.down_proj"

    def overflow(tensors):
        tensors[f"{name}_scales"][0, 0, 0] = 255
        tensors[f"{name}_blocks"][0, 0, 0, 0] = 0x77  # 6 * 2^128: past float32

    def narrower(tensors):
        tensors[f"{name}_scales"] = tensors[f"{name}_scales"][..., :1].contiguous()

    for change, message in ((overflow, "infinity"), (narrower, "has shape")):
        folder = _rewritten(published, tmp_path / change.__name__, tensors_change=change)
        with pytest.raises(ModelLoadError, match=rf"{name.replace('.', '[.]')}_?\w*'?.*{message}"):
            load_model(folder, device="cpu", dtype="float32")
