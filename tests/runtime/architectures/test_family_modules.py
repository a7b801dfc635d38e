"""A family is one module: the registry, the tensors each family's layer specs name, the C kernels against
torch's path for every family, the layer stack's refusals, and what a family refuses by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from kernel_builds import needs_compiler
from numerics import assert_decisive, assert_logits_close
from safetensors import safe_open
from tiny_families import CONFIGS

from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.errors import ModelLoadError, UnsupportedArchitecture
from ferrox_batch.runtime.families.registry import (
    BY_GGUF_ARCHITECTURE,
    BY_GGUF_EXPERTS_VARIANT,
    FAMILIES,
    family_of_config,
)
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.loading.loader import load_model

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def forward(self, x): return self.layers(x) + 1"]
#: Every tiny checkpoint `tiny_variant_dirs` writes: one per family and per switch a family has.
VARIANTS = ["llama", "llama-untied-llama3-rope", "qwen2", "mistral-window", "qwen3", "smollm3-nope", "gemma3",
            "phi3-longrope", "llama-linear-rope", "llama-dynamic-rope", "qwen3-yarn-rope", "granite", "olmo2"]


def run(model, ids: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """`new_tokens` greedy ids after `ids`, and the logits each was picked from."""
    store = model.decoder.new_store(4, num_blocks=64)
    store.add_sequence(0, len(ids) + new_tokens)
    logits = model.decoder.forward([SeqChunk(0, ids)], store)
    out, steps = [], []
    for _ in range(new_tokens):
        steps.append(logits[0].clone())
        out.append(int(logits[0].argmax()))
        logits = model.decoder.forward([SeqChunk(0, [out[-1]])], store)
    return out, steps


def test_every_name_is_claimed_by_one_family_and_every_family_has_test_entries() -> None:
    architectures = [name for family in FAMILIES for name in family.architectures]
    assert len(architectures) == len(set(architectures))
    assert len({family.model_type for family in FAMILIES}) == len(FAMILIES)
    gguf_families = len(BY_GGUF_ARCHITECTURE) + len(BY_GGUF_EXPERTS_VARIANT)
    assert gguf_families == sum(family.gguf is not None for family in FAMILIES)
    assert {family.model_type for family in FAMILIES} == set(CONFIGS)


def test_an_architecture_no_family_claims_is_refused_with_the_supported_ones() -> None:
    raw = {"architectures": ["FalconForCausalLM"], "hidden_size": 64}
    with pytest.raises(UnsupportedArchitecture) as err:
        ModelConfig.from_dict(raw)
    assert "FalconForCausalLM" in str(err.value)
    assert {"GraniteForCausalLM", "Olmo2ForCausalLM", "LlamaForCausalLM"} <= set(err.value.supported)
    with pytest.raises(UnsupportedArchitecture, match="olmo3"):
        ModelConfig.from_dict({"model_type": "olmo3"})


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_specs_name_the_tensors_transformers_saves(tiny_variant_dirs, variant: str) -> None:
    """Each family module's tensors, by name and shape, are the ones transformers' own model of that config
    holds: what the decoder takes, the GGUF reader expects and the fixtures write is the reference's."""
    transformers = pytest.importorskip("transformers")
    folder = tiny_variant_dirs[variant]
    config = ModelConfig.from_file(folder / "config.json")
    theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    held = {name: tuple(t.shape) for name, t in theirs.state_dict().items() if not name.endswith("inv_freq")}
    if config.tie_word_embeddings:
        held.pop("lm_head.weight")
    assert config.family_spec.tensors(config) == held
    with safe_open(str(folder / "model.safetensors"), framework="pt") as file:
        assert set(file.keys()) == set(held)


@needs_compiler
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_c_kernels_give_what_torchs_path_gives(tiny_variant_dirs, variant: str) -> None:
    folder = tiny_variant_dirs[variant]
    kernels = load_model(folder, device="cpu", dtype="float32")
    assert kernels.decoder.kernels is not None
    plain = load_model(folder, device="cpu", dtype="float32")
    plain.decoder.kernels = None  # torch's ops, as on CUDA
    for prompt in PROMPTS:
        ids = plain.tokenizer.encode(prompt)
        want, want_steps = run(plain, ids, 16)
        got, got_steps = run(kernels, ids, 16)
        assert_logits_close(got_steps[0], want_steps[0], plain.config, len(ids), note=(variant, prompt))
        assert_decisive(want_steps, plain.config, len(ids), note=(variant, prompt))
        assert got == want, (variant, prompt)


def _with_config(folder: Path, tmp_path: Path, **changes: object) -> Path:
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("field", ["embedding_multiplier", "attention_multiplier", "residual_multiplier",
                                   "logits_scaling"])
def test_each_granite_multiplier_moves_the_logits(tiny_variant_dirs, tmp_path: Path, field: str) -> None:
    """The fixture is sharp enough that a multiplier read wrong (taken as 1) cannot pass the comparison
    with transformers."""
    folder = tiny_variant_dirs["granite"]
    model = load_model(folder, device="cpu", dtype="float32")
    other = load_model(_with_config(folder, tmp_path, **{field: 1.0}), device="cpu", dtype="float32")
    ids = model.tokenizer.encode(PROMPTS[0])
    want = run(model, ids, 1)[1][0]
    got = run(other, ids, 1)[1][0]
    with pytest.raises(AssertionError):
        assert_logits_close(got, want, model.config, len(ids))


def test_olmo2_normalises_the_whole_projection_not_each_head(tiny_variant_dirs) -> None:
    config = ModelConfig.from_file(tiny_variant_dirs["olmo2"] / "config.json")
    q_norm = config.family_spec.tensors(config)["model.layers.0.self_attn.q_norm.weight"]
    assert q_norm == (config.num_heads * config.head_dim,) and config.num_heads > 1


@pytest.mark.parametrize("variant, reason", [
    ("granite", "scaled embeddings"),
    ("olmo2", "normalises its output"),
    ("gemma3", "scaled embeddings"),
    ("qwen3", "not every projection"),
    ("smollm3-nope", "another RoPE kind"),
])
def test_the_layer_stack_says_why_it_declines_a_model(tiny_variant_dirs, variant: str, reason: str) -> None:
    model = load_model(tiny_variant_dirs[variant], device="cpu", dtype="float32")
    if model.decoder.kernels is None:
        assert model.decoder.layer_stack_declined == "no C kernels here"
        return
    assert model.decoder.layer_stack is None
    assert reason in (model.decoder.layer_stack_declined or "")


@pytest.mark.parametrize("changes, names", [
    ({"mlp_bias": True}, ["mlp_bias"]),
    ({"residual_multiplier": -1.0}, ["residual_multiplier"]),
    ({"logits_scaling": "two"}, ["logits_scaling"]),
    ({"embedding_multiplier": 0}, ["embedding_multiplier"]),
])
def test_a_granite_field_it_cannot_honour_is_refused_by_name(tiny_variant_dirs, changes, names) -> None:
    raw = json.loads((tiny_variant_dirs["granite"] / "config.json").read_text())
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dict({**raw, **changes})
    for name in names:
        assert name in str(err.value)


def test_an_olmo2_checkpoint_with_per_head_norms_is_refused_by_tensor(tiny_variant_dirs, tmp_path: Path) -> None:
    """Per-head q/k norms (another family's layout) under OLMo 2's name are a shape error naming the tensor."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "olmo2"
    shutil.copytree(tiny_variant_dirs["olmo2"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    config = ModelConfig.from_file(folder / "config.json")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(config.head_dim)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight"):
        load_model(folder, device="cpu", dtype="float32")
    assert family_of_config(json.loads((folder / "config.json").read_text())).model_type == "olmo2"
