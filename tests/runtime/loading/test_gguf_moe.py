"""The mixture-of-experts families from GGUFs written the way llama.cpp's converters write them.

Each family's tiny checkpoint (the `tiny_variant_dirs` ones', every layer sparse: llama.cpp's qwen2moe and
qwen3moe have no dense layer, so the converter cannot write `mlp_only_layers` or a `decoder_sparse_step`
above one; and Mixtral without a window, which its converter drops) is written as an f32 GGUF: the
conversion must give its weights back under the STACKED layout's names and its config, and the model it
loads must be the one transformers loads from the source folder (last logits within float32 rounding, 32
greedy tokens identical, every routing decision of the prompts decided by the arithmetic). A file with its
experts in Q8_0 is served as stored, each expert's blocks kept as the file holds them, and must be that
file widened; a bad file is refused naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # never let transformers reach for the hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"

gguf = pytest.importorskip("gguf")
import torch  # noqa: E402
from numerics import assert_decisive, assert_logits_close, logits_tolerance  # noqa: E402
from test_gguf_families import assert_as_transformers, rewrite, run  # noqa: E402
from tiny_checkpoint import build_tokenizer, write_tiny_checkpoint  # noqa: E402
from tiny_gguf import SPECIALS, bpe_vocabulary  # noqa: E402
from tiny_gguf_families import FamilyGguf, write_family_gguf  # noqa: E402

from ferrox_batch.runtime.config import ModelConfig  # noqa: E402
from ferrox_batch.runtime.errors import ModelLoadError  # noqa: E402
from ferrox_batch.runtime.families.registry import gguf_family  # noqa: E402
from ferrox_batch.runtime.loading.gguf_convert import read_gguf  # noqa: E402
from ferrox_batch.runtime.loading.loader import load_model  # noqa: E402
from ferrox_batch.runtime.quant.weight import QuantizedWeight  # noqa: E402

VOCAB = 384
#: name -> (llama.cpp architecture, the tiny checkpoint): `tiny_variant_dirs`' MoE variants, every layer sparse
#: (the Qwen seeds are others: theirs, all sparse, route some position by a margin float32 rounding could flip).
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("qwen3moe", dict(arch="qwen3_moe", seed=215, layers=3, head_dim=24)),
    "qwen2_moe": ("qwen2moe", dict(arch="qwen2_moe", seed=116, layers=3)),
    "olmoe": ("olmoe", dict(arch="olmoe", seed=17, intermediate=48)),
    "granitemoe": ("granitemoe", dict(arch="granitemoe", seed=18, intermediate=48)),
    "mixtral": ("llama", dict(arch="mixtral", seed=19, intermediate=48)),
}
#: Files with their experts in Q8_0: every expert row whole 32-value blocks.
QUANTIZED: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_moe-q8_0": ("qwen2moe", dict(arch="qwen2_moe", seed=36, layers=2, extra_config={
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96})),
    "mixtral-q8_0": ("llama", dict(arch="mixtral", seed=37, intermediate=64)),
}
PROMPTS = ["The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
           "def main():\n    return 42\n\ncafé 日本語 😀", "hello there"]


def _write(root: Path, arch: str, checkpoint: dict[str, Any], *, quantized: bool) -> FamilyGguf:
    source = write_tiny_checkpoint(root / "source", vocab_size=VOCAB, std=0.15, **checkpoint)
    words = bpe_vocabulary(build_tokenizer(VOCAB), "gpt2", VOCAB, SPECIALS)
    return write_family_gguf(source, root / "gguf", arch, words, quantized=quantized, seed=checkpoint["seed"])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FamilyGguf]:
    out = {name: _write(tmp_path_factory.mktemp(name), arch, checkpoint, quantized=False)
           for name, (arch, checkpoint) in CASES.items()}
    out.update({name: _write(tmp_path_factory.mktemp(name), arch, checkpoint, quantized=True)
                for name, (arch, checkpoint) in QUANTIZED.items()})
    return out


def source_folder(family: FamilyGguf) -> Path:
    """The checkpoint the file was converted from (`write_family_gguf` keeps its config beside the twin)."""
    return family.path.parent.parent / "source"


def reference(folder: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("name", CASES)
def test_the_conversion_gives_the_stacked_experts_and_the_config_back(files: dict[str, FamilyGguf],
                                                                      name: str) -> None:
    family = files[name]
    ckpt = read_gguf(family.path)
    assert ckpt.tensors.keys() == family.weights.keys()
    assert "model.layers.0.mlp.experts.gate_proj.weight" in ckpt.tensors
    for tensor, want in family.weights.items():
        np.testing.assert_array_equal(ckpt.tensors[tensor], want, err_msg=f"{name}: {tensor}")
    ours, source = ModelConfig.from_dict(ckpt.config), ModelConfig.from_dict(family.config)
    ids = {"bos_token_id": ours.bos_token_id, "eos_token_ids": ours.eos_token_ids}
    assert ours == dataclasses.replace(source, **ids)
    assert ckpt.config["architectures"] == family.config["architectures"]
    assert json.loads(json.dumps(ckpt.config)) == ckpt.config


@pytest.mark.parametrize("name", CASES)
def test_every_routing_decision_of_the_prompts_is_decided_by_the_arithmetic(files: dict[str, FamilyGguf],
                                                                            name: str) -> None:
    """The experts each position goes to are far enough from the next-best that no float32 evaluation picks
    another (as `test_moe_decoder` checks its checkpoints): what lets the comparison below be exact."""
    folder = source_folder(files[name])
    config = ModelConfig.from_file(folder / "config.json")
    assert config.moe is not None and all(config.moe.sparse_layers)
    ours = load_model(files[name].path, device="cpu", dtype="float32")
    ref = reference(folder)
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        with torch.no_grad():
            routers = ref(torch.tensor([ids]), output_router_logits=True).router_logits
        assert len(routers) == config.num_layers
        for logits in routers:
            top = logits.double().topk(config.moe.top_k + 1, dim=-1).values
            margin = float((top[:, -2] - top[:, -1]).min())
            assert margin > 2 * logits_tolerance(config, len(ids), logits), (name, prompt, margin)


@pytest.mark.parametrize("name", CASES)
def test_the_model_is_the_one_transformers_loads_from_the_source_folder(files: dict[str, FamilyGguf],
                                                                        name: str) -> None:
    family = files[name]
    ours = load_model(family.path, device="cpu", dtype="float32", int8_activations=False)
    theirs = reference(source_folder(family))
    assert_as_transformers(ours, theirs, PROMPTS, [PROMPTS[0]], note=name)


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_file_with_quantized_experts_served_as_stored_is_the_file_widened(files: dict[str, FamilyGguf],
                                                                            name: str) -> None:
    path = files[name].path
    kept = read_gguf(path, keep_quantized=True).tensors
    for layer in range(ModelConfig.from_dict(files[name].config).num_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            weight = kept[f"model.layers.{layer}.mlp.experts.{proj}.weight"]
            assert isinstance(weight, QuantizedWeight) and weight.format_names == ("q8_0",), (layer, proj)
            assert weight.experts == 8
    stored = load_model(path, device="cpu", dtype="float32", int8_activations=False)
    widened = load_model(path, device="cpu", dtype="float32", weights="widen")
    assert set(widened.decoder.weight_formats) == {"dense"}
    assert stored.decoder.weight_bytes < widened.decoder.weight_bytes
    ids = stored.tokenizer.encode(PROMPTS[0])
    got, greedy, _ = run(stored, ids, 16)
    want, want_greedy, steps = run(widened, ids, 16)
    assert_logits_close(got, want, stored.config, len(ids), note=name)
    assert_decisive(steps, stored.config, len(ids), note=name)
    assert greedy == want_greedy


def test_kept_experts_are_the_file_s_bytes_in_the_process_s_memory(files: dict[str, FamilyGguf],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stacked expert tensor kept quantized holds exactly the file's blocks for it, copied out of the
    mapping (blocks left as a view of the mapped file would count as free page cache)."""
    readers = []

    class Recording(gguf.GGUFReader):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            readers.append(self)

    path = files["qwen2_moe-q8_0"].path
    monkeypatch.setattr(gguf, "GGUFReader", Recording)
    kept = read_gguf(path, keep_quantized=True).tensors
    (reader,) = readers
    start, end = reader.data.ctypes.data, reader.data.ctypes.data + reader.data.nbytes
    in_file = {t.name: int(t.n_bytes) for t in reader.tensors if t.name.endswith("_exps.weight")
               and t.tensor_type == gguf.GGMLQuantizationType.Q8_0}
    assert len(in_file) == 2 * 3  # two layers' gate, up and down stacks
    kept_bytes = 0
    for name, weight in kept.items():
        if isinstance(weight, QuantizedWeight) and ".mlp.experts." in name:
            kept_bytes += weight.nbytes
            for segment in weight.segments:
                assert not start <= segment.data.data_ptr() < end, name
    assert kept_bytes == sum(in_file.values())


def test_a_llama_file_is_mixtral_only_with_experts(files: dict[str, FamilyGguf], tmp_path: Path) -> None:
    assert gguf_family({"general.architecture": "llama", "llama.expert_count": 8}).model_type == "mixtral"
    assert gguf_family({"general.architecture": "llama", "llama.expert_count": 0}).model_type == "llama"
    assert gguf_family({"general.architecture": "llama"}).model_type == "llama"
    assert read_gguf(files["mixtral"].path).config["architectures"] == ["MixtralForCausalLM"]
    path = rewrite(files["mixtral"], tmp_path / "no-experts.gguf", drop={"llama.expert_count"})
    with pytest.raises(ModelLoadError, match="unexpected tensor 'blk.0.ffn_(gate|up|down)_exps.weight' for a llama"):
        read_gguf(path)


def test_a_shared_expert_gate_written_1d_is_read_as_hf_s_row(files: dict[str, FamilyGguf], tmp_path: Path) -> None:
    """The converter writes HF's `[1, hidden]` gate; llama.cpp reads `{hidden}`, which a 1-D tensor also is."""
    family = files["qwen2_moe"]
    gate = family.weights["model.layers.0.mlp.shared_expert_gate.weight"]
    assert gate.shape == (1, 64)
    path = rewrite(family, tmp_path / "flat.gguf", tensors={"blk.0.ffn_gate_inp_shexp.weight": gate[0].copy()})
    np.testing.assert_array_equal(read_gguf(path).tensors["model.layers.0.mlp.shared_expert_gate.weight"], gate)


@pytest.mark.parametrize("case,change,message", [
    ("qwen3_moe", {"skip_tensors": {"blk.1.ffn_up_exps.weight"}},
     r"missing \['model\.layers\.1\.mlp\.experts\.up_proj.*the file's missing: \['blk\.1\.ffn_up_exps\.weight'\]"),
    ("olmoe", {"skip_tensors": {"blk.0.ffn_gate_inp.weight"}},
     r"missing \['model\.layers\.0\.mlp\.gate\.weight.*\['blk\.0\.ffn_gate_inp\.weight'\]"),
    ("granitemoe", {"tensors": {"blk.0.ffn_down_exps.weight": np.zeros((5, 64, 48), np.float32)}},
     r"model\.layers\.0\.mlp\.experts\.down_proj\.weight has shape \(5, 64, 48\), expected \(6, 64, 48\) "
     r"\(the file's blk\.0\.ffn_down_exps\.weight\)"),
    ("mixtral", {"tensors": {"blk.1.ffn_gate_exps.weight": np.zeros((8, 40, 64), np.float32)}},
     r"model\.layers\.1\.mlp\.experts\.gate_proj\.weight has shape \(8, 40, 64\), expected \(8, 48, 64\)"),
    ("qwen2_moe", {"changes": {"qwen2moe.expert_used_count": 9}},
     r"qwen2moe\.expert_used_count is 9: it must be between 1 and qwen2moe\.expert_count \(8\)"),
    ("mixtral", {"changes": {"llama.expert_used_count": 12}}, r"llama\.expert_used_count is 12"),
    ("qwen3_moe", {"drop": {"qwen3moe.expert_count"}}, r"qwen3moe\.expert_count is missing"),
    ("olmoe", {"drop": {"olmoe.expert_used_count"}}, r"olmoe\.expert_used_count is missing"),
    ("granitemoe", {"changes": {"granitemoe.expert_shared_feed_forward_length": 32}}, "GraniteMoeShared"),
])
def test_a_malformed_moe_file_is_refused_by_name(files: dict[str, FamilyGguf], tmp_path: Path, case: str,
                                                 change: dict[str, Any], message: str) -> None:
    path = rewrite(files[case], tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelLoadError, match=message) as info:
        read_gguf(path)
    assert "bad.gguf" in str(info.value)



@pytest.mark.parametrize("name", CASES)
def test_each_tensor_s_file_name_is_its_hf_name_s_inverse(files: dict[str, FamilyGguf], name: str) -> None:
    """What a refusal names beside the HF tensor is the file's own name for it."""
    reader = gguf.GGUFReader(files[name].path)
    family = gguf_family({key: field.contents() for key, field in reader.fields.items()
                          if key in ("general.architecture", "llama.expert_count")})
    for tensor in reader.tensors:
        hf = family.hf_name(tensor.name)
        assert hf is not None and family.gguf_name(hf) == tensor.name, tensor.name
    assert family.gguf_name("model.layers.0.mlp.experts.0.up_proj.weight") is None
