"""Mixture-of-experts checkpoints through the whole decoder: every layout a checkpoint stores its experts in,
the C kernels against torch's path, routing that no rounding can change, quantized experts, bad checkpoints.

Against transformers (logits, 32 greedy ids, batched == alone) these checkpoints run with every other
family's in `test_decoder` (`MOE_VARIANTS`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from numerics import assert_logits_close, logits_tolerance
from safetensors.torch import load_file, save_file
from test_decoder import MOE_VARIANTS, PROMPTS, prefill_logits, reference
from tiny_checkpoint import write_tiny_checkpoint

from ferrox_batch.runtime.architectures.decoder import Decoder
from ferrox_batch.runtime.architectures.moe import MoeBlock
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.loading.loader import load_model
from ferrox_batch.runtime.quant.formats import FORMATS


def _copy_without_weights(folder: Path, to: Path) -> Path:
    to.mkdir(parents=True)
    for item in folder.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, to / item.name)
    return to


def _transformers_layout(folder: Path, to: Path) -> Path:
    """The checkpoint as transformers holds it in memory: every layer's experts in one gate/up and one down
    tensor (and, for Mixtral and Granite MoE, the block under transformers' own names)."""
    model = reference(folder)
    state = {name: tensor.clone().contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(_copy_without_weights(folder, to) / "model.safetensors"))
    return to


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_the_fused_layout_is_the_same_model_as_one_tensor_per_expert(tiny_variant_dirs, tmp_path, variant):
    folder = tiny_variant_dirs[variant]
    fused = _transformers_layout(folder, tmp_path / "fused")
    names = load_file(str(fused / "model.safetensors"))
    assert any(tensor.dim() == 3 for tensor in names.values()), "the fixture must hold stacked experts"
    per_expert, stacked = (load_model(path, device="cpu", dtype="float32") for path in (folder, fused))
    for prompt in PROMPTS[:2]:
        ids = per_expert.tokenizer.encode(prompt)
        assert torch.equal(prefill_logits(per_expert, ids)[0], prefill_logits(stacked, ids)[0]), (variant, prompt)


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_the_c_kernels_and_torch_s_path_give_the_same_model(tiny_variant_dirs, variant):
    """Prefill then decode steps, a batch of every prompt: the C kernels against torch's ops (CUDA's path)."""
    kernels = load_model(tiny_variant_dirs[variant], device="cpu", dtype="float32")
    plain = load_model(tiny_variant_dirs[variant], device="cpu", dtype="float32")
    plain.decoder.kernels = None
    enc = [kernels.tokenizer.encode(p) for p in PROMPTS]
    stores = [model.decoder.new_store(4, num_blocks=128) for model in (kernels, plain)]
    for store in stores:
        for i, ids in enumerate(enc):
            store.add_sequence(i, len(ids) + 3)
    steps = [[SeqChunk(i, ids) for i, ids in enumerate(enc)]] + [
        [SeqChunk(i, [7 + step + i]) for i in range(len(enc))] for step in range(3)]
    for step, batch in enumerate(steps):
        got, want = (model.decoder.forward(batch, store) for model, store in zip((kernels, plain), stores))
        for i, ids in enumerate(enc):
            assert_logits_close(got[i], want[i], kernels.config, len(ids) + step, note=(variant, step, i))


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_every_routing_decision_of_the_test_prompts_is_decided_by_the_arithmetic(tiny_variant_dirs, variant):
    """The experts each position goes to are far enough from the next-best that no float32 evaluation picks
    another (the margin against the logits' tolerance, as `numerics.assert_decisive` checks a greedy step):
    what lets the tests above, and transformers', agree on another machine."""
    folder = tiny_variant_dirs[variant]
    config = ModelConfig.from_file(folder / "config.json")
    assert config.moe is not None
    ref = reference(folder)
    ours = load_model(folder, device="cpu", dtype="float32")
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        with torch.no_grad():
            routers = ref(torch.tensor([ids]), output_router_logits=True).router_logits
        sparse = [i for i in range(config.num_layers) if config.moe.sparse(i)]
        assert len(routers) in (len(sparse), config.num_layers)
        for logits in routers:
            if logits is None:
                continue
            top = logits.double().topk(config.moe.top_k + 1, dim=-1).values
            margin = float((top[:, -2] - top[:, -1]).min())
            tolerance = logits_tolerance(config, len(ids), logits)
            assert margin > 2 * tolerance, (variant, prompt, margin, tolerance)


def test_a_one_row_step_runs_only_its_k_experts(tiny_variant_dirs):
    model = load_model(tiny_variant_dirs["qwen3_moe"], device="cpu", dtype="float32")
    blocks = [layer.ffn for layer in model.decoder.layers if isinstance(layer.ffn, MoeBlock)]
    assert len(blocks) == 2  # the middle layer is dense (`mlp_only_layers`)
    calls: list[int] = []

    class Counted:
        def __init__(self, inner, expert):
            self.inner, self.expert = inner, expert

        def __call__(self, x):
            calls.append(self.expert)
            assert x.shape[0] == 1
            return self.inner(x)

    ids = model.tokenizer.encode(PROMPTS[0])
    store = model.decoder.new_store(4, num_blocks=64)
    store.add_sequence(0, len(ids) + 1)
    model.decoder.forward([SeqChunk(0, ids)], store)
    for block in blocks:
        block.gate_up = tuple(Counted(layer, e) for e, layer in enumerate(block.gate_up))
    model.decoder.forward([SeqChunk(0, [5])], store)
    top_k = model.config.moe.top_k
    assert len(calls) == top_k * len(blocks)
    assert all(len(set(calls[i:i + top_k])) == top_k for i in range(0, len(calls), top_k))


def test_quantizing_experts_at_load_serves_the_blocks_gguf_writes(tmp_path):
    """Every expert's weights (and the attention's, and the embedding) quantized to q8_0 at load is the model of
    gguf's quantize-then-dequantize of them; the router stays float32, as stored."""
    folder = write_tiny_checkpoint(tmp_path / "moe", arch="qwen3_moe", seed=21, head_dim=32, std=0.15,
                                   extra_config={"moe_intermediate_size": 64})
    model = load_model(folder, device="cpu", dtype="float32", weights="q8_0", int8_activations=False)
    formats = model.decoder.weight_formats
    config = model.config
    assert formats == {"q8_0": config.num_layers * (2 + 2 * config.moe.experts) + 1}
    qtype = GGMLQuantizationType(FORMATS["q8_0"].ggml_type)
    tensors = {}
    for name, value in load_file(str(folder / "model.safetensors")).items():
        if value.dim() == 2 and not name.endswith("mlp.gate.weight"):
            array = value.numpy().astype(np.float32)
            value = torch.from_numpy(np.ascontiguousarray(
                gguf_dequantize(gguf_quantize(array, qtype), qtype).reshape(array.shape)))
        tensors[name] = value
    want_model = Decoder(config, tensors, dtype=torch.float32)
    ids = model.tokenizer.encode(PROMPTS[2])
    stores = [model.decoder.new_store(4, num_blocks=64), want_model.new_store(4, num_blocks=64)]
    for store in stores:
        store.add_sequence(0, len(ids))
    got = model.decoder.forward([SeqChunk(0, ids)], stores[0])[0]
    want = want_model.forward([SeqChunk(0, ids)], stores[1])[0]
    assert_logits_close(got, want, config, len(ids))


def test_a_mixture_of_experts_is_batch_invariant_only_behind_the_c_router(tiny_variant_dirs):
    """A plain softmax top-k router runs in C, each row's choice its own: with batch-invariant linears the
    model is claimed invariant (`test_invariance` checks the logits). A router with a bias (gpt-oss) or a
    shared expert's gate (Qwen2-MoE) runs torch's float32 matmul: `--batch-invariant on` refuses them."""
    model = load_model(tiny_variant_dirs["olmoe"], device="cpu", dtype="float32")
    assert not model.decoder.batch_invariant  # oneDNN's float32 linears
    if model.decoder.kernels is None:
        return
    assert load_model(tiny_variant_dirs["olmoe"], device="cpu", dtype="bfloat16", batch_invariant="on").batch_invariant
    for variant in ("gpt_oss", "qwen2_moe"):
        with pytest.raises(ModelLoadError, match="router"):
            load_model(tiny_variant_dirs[variant], device="cpu", dtype="bfloat16", batch_invariant="on")


def _rewrite(folder: Path, to: Path, change) -> Path:
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(_copy_without_weights(folder, to) / "model.safetensors"))
    return to


def test_a_missing_expert_tensor_is_named(tiny_variant_dirs, tmp_path):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    folder = _rewrite(tiny_variant_dirs["qwen3_moe"], tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        load_model(folder, device="cpu", dtype="float32")


def test_an_expert_of_another_shape_is_named(tiny_variant_dirs, tmp_path):
    name = "model.layers.0.block_sparse_moe.experts.3.w2.weight"

    def narrower(tensors):
        tensors[name] = tensors[name][:, :-1].contiguous()

    folder = _rewrite(tiny_variant_dirs["mixtral-window"], tmp_path / "shape", narrower)
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        load_model(folder, device="cpu", dtype="float32")


@pytest.mark.parametrize("change,field", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"num_experts": 0}, "num_experts"),
    ({"moe_intermediate_size": -4}, "moe_intermediate_size"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"mlp_only_layers": [7]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
])
def test_a_config_the_router_cannot_honour_is_refused_by_field_before_any_weight(tiny_variant_dirs, tmp_path,
                                                                                 change, field):
    folder = _copy_without_weights(tiny_variant_dirs["qwen3_moe"], tmp_path / "bad")
    shutil.copy(tiny_variant_dirs["qwen3_moe"] / "model.safetensors", folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=field):
        load_model(folder, device="cpu", dtype="float32")


def test_the_experts_in_one_kernel_call_are_the_experts_one_call_each(tmp_path):
    """Packed int8 experts run together (`MoeBlock.packed`: one call for every gate/up, one for every down)
    give each row exactly what one call per expert gives it, prefill and decode, alone and batched."""
    folder = write_tiny_checkpoint(tmp_path / "moe", arch="qwen3_moe", seed=22, head_dim=32, std=0.15,
                                   extra_config={"moe_intermediate_size": 64})
    model = load_model(folder, device="cpu", dtype="float32", weights="q8_0")
    blocks = [layer.ffn for layer in model.decoder.layers if isinstance(layer.ffn, MoeBlock)]
    assert blocks and all(block.packed is not None for block in blocks)
    enc = [model.tokenizer.encode(p) for p in PROMPTS]

    def run() -> torch.Tensor:
        store = model.decoder.new_store(4, num_blocks=128)
        for i, ids in enumerate(enc):
            store.add_sequence(i, len(ids) + 2)
        out = [model.decoder.forward([SeqChunk(i, ids) for i, ids in enumerate(enc)], store)]
        out.append(model.decoder.forward([SeqChunk(i, [9 + i]) for i in range(len(enc))], store))
        out.append(model.decoder.forward([SeqChunk(0, [4])], store))
        return torch.cat(out)

    together = run()
    packed = [block.packed for block in blocks]
    for block in blocks:
        block.packed = None
    try:
        assert torch.equal(together, run())
    finally:
        for block, pair in zip(blocks, packed):
            block.packed = pair
