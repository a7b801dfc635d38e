"""Gemma 4 from GGUFs written the way llama.cpp's Gemma4Model writes them (`tiny_gguf_gemma4`).

The tiny sources are transformers' own (`gemma4_checkpoints`): local and global layers with heads of their
own sizes and counts, K=V on the global layers, KV-sharing layers with double-wide MLPs, per-layer inputs,
soft-capped logits, RoPE bases away from 10,000 with proportional RoPE, and one with the mixture of experts
beside every MLP. Written as f32, the conversion must give back the source's weights under its own names and
its config, and the model must be transformers' on the source folder (last logits within `numerics`'
tolerance, 32 greedy ids identical; transformers' own GGUF loader reads these files only in part); written as Q8_0, its matrices are served as stored and the model is
transformers' on the values the file holds. The tokenizer llama.cpp reads ("gemma4") encodes as the source's
does. Metadata llama.cpp would refuse, or that this runtime cannot honour, is refused by name.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "architectures"))  # gemma4_checkpoints

gguf = pytest.importorskip("gguf")
import torch  # noqa: E402
from gemma4_checkpoints import tiny_gemma4  # noqa: E402
from numerics import assert_decisive, assert_logits_close  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from test_gemma4 import widest  # noqa: E402  (numerics' terms along a Gemma 4 layer's longest path)
from test_gguf_families import rewrite, run  # noqa: E402
from tiny_gguf_families import FamilyGguf  # noqa: E402
from tiny_gguf_gemma4 import Gemma4Gguf, with_gemma4_tokenizer, write_gemma4_gguf  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from ferrox_batch.runtime.config import ModelConfig  # noqa: E402
from ferrox_batch.runtime.errors import ModelLoadError  # noqa: E402
from ferrox_batch.runtime.families.registry import gguf_family  # noqa: E402
from ferrox_batch.runtime.loading.gguf_convert import read_gguf  # noqa: E402
from ferrox_batch.runtime.loading.loader import load_model  # noqa: E402
from ferrox_batch.runtime.quant.weight import QuantizedWeight  # noqa: E402

PROMPTS = ["The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
           "def main():\n    return 42\n\ncafé 日本語 😀", "hello there"]
#: name -> (the tiny checkpoint's variant, written quantized); "plain": K and V apart, no sharing, no per-layer
#: inputs or softcapping, which the converter writes as one KV head count and one MLP width for every layer.
CASES = {"dense": ("gemma4", False), "moe": ("gemma4-moe", False), "moe-q8_0": ("gemma4-moe", True),
         "plain": ("gemma4-plain", False)}
#: name -> the global layers' head size and KV heads (None: the local layers'), and each layer's K/V source.
GLOBAL_HEADS = {"dense": (48, 1, (0, 1, 2, 2, 1)), "moe": (32, 1, (0, 1, 2, 2, 1)),
                "moe-q8_0": (32, 1, (0, 1, 2, 2, 1)), "plain": (32, None, None)}


@dataclasses.dataclass(slots=True)
class Case:
    file: Gemma4Gguf
    source: Path  # the folder transformers loads: the values the file holds


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    out = {}
    for name, (variant, quantized) in CASES.items():
        root = tmp_path_factory.mktemp(name)
        source = with_gemma4_tokenizer(tiny_gemma4(root / "source", variant, seed=3))
        file = write_gemma4_gguf(source, root / "gemma4.gguf", quantized=quantized, seed=3)
        if quantized:  # transformers runs the values the file holds
            twin = root / "twin"
            shutil.copytree(source, twin)
            save_file({k: np.ascontiguousarray(v) for k, v in file.weights.items()}, str(twin / "model.safetensors"),
                      metadata={"format": "pt"})
            source = twin
        out[name] = Case(file, source)
    return out


def reference(folder: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("name", list(CASES))
def test_the_conversion_gives_the_weights_and_the_config_back(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    ckpt = read_gguf(case.file.path)
    assert ckpt.tensors.keys() == case.file.weights.keys()
    for tensor, want in case.file.weights.items():
        np.testing.assert_array_equal(ckpt.tensors[tensor], want, err_msg=f"{name}: {tensor}")
    ours, source = ModelConfig.from_dict(ckpt.config), ModelConfig.from_dict(case.file.config)
    assert ours == source
    assert (ours.global_head_dim, ours.global_kv_heads, ours.kv_source) == GLOBAL_HEADS[name]
    assert ckpt.config["rope_parameters"]["full_attention"] == {"rope_type": "proportional", "rope_theta": 200_000.0,
                                                                "partial_rotary_factor": 0.25}


@pytest.mark.parametrize("name", list(CASES))
def test_the_model_is_the_one_transformers_loads_from_the_source(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    ours = load_model(case.file.path, device="cpu", dtype="float32", int8_activations=False)
    if name.endswith("q8_0") and ours.decoder.kernels is not None:  # the file's Q8_0 blocks, as stored
        experts = [linear.kind for layer in ours.decoder.layers for linear in layer.ffn.branches[1].linears()]
        assert experts == ["q8_0"] * (2 * ours.config.num_layers * ours.config.moe.experts)
        assert ours.decoder.weight_formats["q8_0"] > len(experts)
    theirs = reference(case.source)
    config = widest(ours.config)
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        got, greedy, _ = run(ours, ids, 32 if prompt == PROMPTS[0] else 0)
        with torch.no_grad():
            assert_logits_close(got, theirs(torch.tensor([ids])).logits[0, -1], config, len(ids),
                                note=(name, prompt))
            if greedy:
                out = theirs.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
                assert_decisive([step[0] for step in out.logits], config, len(ids), note=name)
                assert greedy == out.sequences[0, len(ids):].tolist(), name


def test_what_the_file_leaves_out_is_read_as_llama_cpp_defaults_it(cases: dict[str, Case], tmp_path: Path) -> None:
    path = rewrite(_family(cases["dense"]), tmp_path / "defaults.gguf", drop={
        "gemma4.rope.freq_base_swa", "gemma4.final_logit_softcapping"},
        changes={"gemma4.rope.dimension_count": 48, "gemma4.rope.freq_base": 123_456.0})
    config = read_gguf(path).config
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 123_456.0
    assert config["final_logit_softcapping"] is None
    # the local layers would rotate key_length's 48 dimensions of their 16: refused, not misread
    path = rewrite(_family(cases["plain"]), tmp_path / "rotary.gguf", drop={"gemma4.rope.dimension_count_swa"})
    with pytest.raises(ModelLoadError, match="dimension_count_swa must be key_length_swa"):
        read_gguf(path)


def test_a_k_v_sharing_layer_s_own_k_v_are_left_unread(cases: dict[str, Case], tmp_path: Path) -> None:
    """A source that still holds the sharing layers' K/V projections (llama.cpp reads them as optional and
    never uses them): carried, unread, and the model is the same; mis-shaped, refused by name."""
    rng = np.random.default_rng(0)
    extra = {"blk.3.attn_k.weight": rng.normal(size=(32, 64)), "blk.3.attn_v.weight": rng.normal(size=(32, 64)),
             "blk.3.attn_k_norm.weight": rng.normal(size=16), "blk.4.attn_k.weight": rng.normal(size=(48, 64))}
    path = rewrite(_family(cases["dense"]), tmp_path / "unread.gguf",
                   tensors={name: value.astype(np.float32) for name, value in extra.items()})
    assert "model.layers.4.self_attn.k_proj.weight" in read_gguf(path).tensors
    ids = load_model(path, device="cpu", dtype="float32").tokenizer.encode(PROMPTS[0])
    got, want = (run(load_model(p, device="cpu", dtype="float32"), ids, 0)[0] for p in (path, cases["dense"].file.path))
    assert torch.equal(got, want)
    path = rewrite(_family(cases["dense"]), tmp_path / "bad.gguf",
                   tensors={"blk.3.attn_k.weight": np.zeros((31, 64), np.float32)})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\.self_attn\.k_proj\.weight has shape \(31, 64\)"):
        read_gguf(path)


def test_the_q8_0_matrices_are_kept_as_the_file_s_blocks(cases: dict[str, Case]) -> None:
    path = cases["moe-q8_0"].file.path
    kept = read_gguf(path, keep_quantized=True).tensors
    reader = gguf.GGUFReader(path)
    in_file = {t.name for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0}
    assert {"blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_down_exps.weight", "blk.0.attn_q.weight"} <= in_file
    family = gguf_family({"general.architecture": "gemma4"})
    assert {name for name, w in kept.items() if isinstance(w, QuantizedWeight)} == {family.hf_name(n)
                                                                                    for n in in_file}
    assert kept["model.layers.2.experts.gate_up_proj"].experts == 4


def test_the_tokenizer_encodes_as_the_source_s(cases: dict[str, Case]) -> None:
    ckpt = read_gguf(cases["dense"].file.path)
    ours = Tokenizer.from_str(ckpt.tokenizer_json)
    source = Tokenizer.from_file(str(cases["dense"].source / "tokenizer.json"))
    for prompt in [*PROMPTS, "  two  spaces\n\n\nand newlines <eos> inside"]:
        # llama.cpp adds Gemma 4's BOS whatever the file says
        assert ours.encode(prompt).ids == [2, *source.encode(prompt).ids], prompt
        assert ours.decode(ours.encode(prompt).ids[1:], skip_special_tokens=False) == prompt
    assert ckpt.generation_config["eos_token_id"] == [1]


def test_each_tensor_s_file_name_is_its_hf_name_s_inverse(cases: dict[str, Case]) -> None:
    family = gguf_family({"general.architecture": "gemma4"})
    for tensor in gguf.GGUFReader(cases["moe"].file.path).tensors:
        hf = family.hf_name(tensor.name)
        assert (hf is None) == (tensor.name == "rope_freqs.weight"), tensor.name
        assert hf is None or family.gguf_name(hf) == tensor.name, tensor.name


def _family(case: Case) -> FamilyGguf:
    return FamilyGguf(case.file.path, case.file.weights, case.source, case.file.config)


@pytest.mark.parametrize("case,change,message", [
    ("dense", {"drop": {"gemma4.attention.sliding_window_pattern"}}, r"sliding_window_pattern is missing"),
    ("dense", {"changes": {"gemma4.attention.sliding_window_pattern": [True] * 5}}, r"makes the last layer slide"),
    ("dense", {"changes": {"gemma4.attention.sliding_window_pattern": [True, False]}}, r"one flag for each of the 5"),
    ("dense", {"drop": {"gemma4.attention.key_length_swa"}}, r"gemma4\.attention\.key_length_swa is missing"),
    ("dense", {"drop": {"gemma4.embedding_length_per_layer_input"}}, r"embedding_length_per_layer_input is missing"),
    ("dense", {"changes": {"gemma4.rope.dimension_count_swa": 8}}, r"partial rotation on the local layers"),
    ("dense", {"changes": {"gemma4.attention.head_count_kv": [2, 1, 2, 1, 1]}}, r"differs across the local layers"),
    ("dense", {"changes": {"gemma4.feed_forward_length": [96, 96, 96, 150, 150]}}, r"K/V-sharing layers \[150\]"),
    ("dense", {"changes": {"gemma4.attention.shared_kv_layers": 5}}, r"shared_kv_layers is 5 of 5"),
    ("dense", {"changes": {"gemma4.rope.scaling.type": "linear", "gemma4.rope.scaling.factor": 2.0}},
     r"scaled RoPE is not read"),
    ("dense", {"skip_tensors": {"rope_freqs.weight"}}, r"rope_freqs\.weight is missing"),
    ("dense", {"tensors": {"rope_freqs.weight": np.array([1.0, 2.0] + [1e30] * 22, np.float32)}},
     r"only proportional RoPE"),
    ("dense", {"skip_tensors": {"blk.0.attn_v.weight"}}, r"blk\.0\.attn_v\.weight is missing: V from K"),
    ("moe", {"skip_tensors": {"blk.3.ffn_gate_inp.weight"}}, r"blk\.3\.ffn_gate_inp\.weight is missing"),
    ("moe", {"changes": {"gemma4.expert_used_count": 5}}, r"expert_used_count \(5\)"),
    ("moe", {"skip_tensors": {"blk.1.ffn_down_exps.scale"}}, r"missing \['model\.layers\.1\.router\.per_expert_scale"),
    ("moe", {"changes": {"tokenizer.ggml.model": "gemma5"}}, r"tokenizer model 'gemma5'"),
    ("moe", {"drop": {"tokenizer.ggml.merges"}}, r"no tokenizer\.ggml\.merges"),
])
def test_a_malformed_file_is_refused_by_name(cases: dict[str, Case], tmp_path: Path, case: str,
                                            change: dict[str, Any], message: str) -> None:
    path = rewrite(_family(cases[case]), tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelLoadError, match=message) as info:
        read_gguf(path)
    assert "bad.gguf" in str(info.value)
