"""gpt-oss from GGUFs written the way llama.cpp's GptOssModel writes them (`tiny_gguf_families`).

The tiny source is a gpt-oss llama.cpp can describe: the SwiGLU limit 7 and YaRN's truncated correction
range, which llama.cpp hardcodes, and an output head of its own, which its graph requires. Written as an
f32 file, the conversion must give the source's weights back under the STACKED names with their biases and
its config, and the model must be the one transformers loads from the source folder (last logits within
float32 rounding, 32 greedy ids identical, every routing decision decided by the arithmetic). Written
with its experts in MXFP4 (from the source's experts rounded to MXFP4, `mxfp4_checkpoint`, so the file
holds the source's values exactly), the experts are served as stored, as many bytes as the file's, and
the model is transformers' on the source. Metadata llama.cpp reads is read as it reads it; the rest refused.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

gguf = pytest.importorskip("gguf")
import torch  # noqa: E402
from mxfp4_checkpoint import write_published  # noqa: E402
from numerics import assert_decisive, assert_logits_close, logits_tolerance  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from test_gguf_families import rewrite, run  # noqa: E402
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
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 64}
PROMPTS = ["The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
           "def main():\n    return 42\n\ncafé 日本語 😀", "hello there"]


@dataclasses.dataclass(slots=True)
class Case:
    file: FamilyGguf
    source: Path  # the folder transformers loads: the values the file holds


def _case(root: Path, mxfp4: bool) -> Case:
    source = write_tiny_checkpoint(root / "source", arch="gpt_oss", seed=20, layers=3, head_dim=16, intermediate=64,
                                   std=0.15, max_positions=256, tie=False, rope_scaling=YARN,
                                   extra_config={"swiglu_limit": 7.0})
    if mxfp4:
        source = write_published(source, root / "mxfp4").twin
    words = bpe_vocabulary(build_tokenizer(VOCAB), "gpt2", VOCAB, SPECIALS)
    return Case(write_family_gguf(source, root / "gguf", "gpt-oss", words, quantized=False, seed=20,
                                  mxfp4_experts=mxfp4), source)


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    return {name: _case(tmp_path_factory.mktemp(name), name == "mxfp4") for name in ("f32", "mxfp4")}


def reference(folder: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("name", ["f32", "mxfp4"])
def test_the_conversion_gives_the_weights_biases_and_config_back(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    ckpt = read_gguf(case.file.path)
    assert ckpt.tensors.keys() == case.file.weights.keys()
    for bias in ("mlp.gate.bias", "mlp.experts.gate_proj.bias", "mlp.experts.down_proj.bias", "self_attn.sinks"):
        assert f"model.layers.2.{bias}" in ckpt.tensors
    for tensor, want in case.file.weights.items():
        np.testing.assert_array_equal(ckpt.tensors[tensor], want, err_msg=f"{name}: {tensor}")
    # the file holds the source's values exactly (the MXFP4 file: the source's experts are MXFP4 values)
    source = ModelConfig.from_file(case.source / "config.json")
    held = load_file(str(case.source / "model.safetensors"))["model.layers.1.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(ckpt.tensors["model.layers.1.mlp.experts.up_proj.weight"],
                                  held.swapaxes(-1, -2)[:, 1::2])
    ours = ModelConfig.from_dict(ckpt.config)
    assert ours == dataclasses.replace(source, bos_token_id=ours.bos_token_id, eos_token_ids=ours.eos_token_ids)
    assert ckpt.config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.mark.parametrize("name", ["f32", "mxfp4"])
def test_the_model_is_the_one_transformers_loads_from_the_source(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    ours = load_model(case.file.path, device="cpu", dtype="float32", int8_activations=False)
    if name == "mxfp4" and ours.decoder.kernels is not None:  # served as stored where the kernels run
        assert ours.decoder.weight_formats["mxfp4"] == 2 * ours.config.num_layers * ours.config.moe.experts
    theirs = reference(case.source)
    config = ours.config
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        got, greedy, _ = run(ours, ids, 32 if prompt == PROMPTS[0] else 0)
        with torch.no_grad():
            result = theirs(torch.tensor([ids]), output_router_logits=True)
            for logits in result.router_logits:
                top = logits.double().topk(config.moe.top_k + 1, dim=-1).values
                assert float((top[:, -2] - top[:, -1]).min()) > 2 * logits_tolerance(config, len(ids), logits)
            assert_logits_close(got, result.logits[0, -1], config, len(ids), note=(name, prompt))
            if greedy:
                out = theirs.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
                assert_decisive([step[0] for step in out.logits], config, len(ids), note=name)
                assert greedy == out.sequences[0, len(ids):].tolist(), name


def test_mxfp4_experts_are_kept_as_the_file_s_bytes(cases: dict[str, Case]) -> None:
    path = cases["mxfp4"].file.path
    kept = read_gguf(path, keep_quantized=True).tensors
    reader = gguf.GGUFReader(path)
    in_file = {t.name: int(t.n_bytes) for t in reader.tensors if t.name.endswith("_exps.weight")}
    assert {t.tensor_type for t in reader.tensors if t.name in in_file} == {gguf.GGMLQuantizationType.MXFP4}
    experts = {name: w for name, w in kept.items() if isinstance(w, QuantizedWeight)}
    assert len(experts) == len(in_file) == 3 * 3
    assert all(w.format_names == ("mxfp4",) and w.experts == 8 for w in experts.values())
    assert sum(w.nbytes for w in experts.values()) == sum(in_file.values())


@pytest.mark.parametrize("pattern,want", [
    ([False, True, True], ["full_attention", "sliding_attention", "sliding_attention"]),
    (3, ["sliding_attention", "sliding_attention", "full_attention"]),
    (0, ["sliding_attention"] * 3),
])
def test_which_layers_slide_is_read_as_llama_cpp_reads_it(cases: dict[str, Case], tmp_path: Path, pattern,
                                                          want: list[str]) -> None:
    path = rewrite(cases["f32"].file, tmp_path / "pattern.gguf",
                   changes={"gpt-oss.attention.sliding_window_pattern": pattern})
    assert read_gguf(path).config["layer_types"] == want


@pytest.mark.parametrize("change,message", [
    ({"drop": {"gpt-oss.expert_feed_forward_length"}}, r"gpt-oss\.expert_feed_forward_length is missing"),
    ({"drop": {"gpt-oss.attention.sliding_window"}}, r"gpt-oss\.attention\.sliding_window is missing"),
    ({"changes": {"gpt-oss.rope.freq_base_swa": 10000.0}}, r"freq_base_swa differs"),
    ({"changes": {"gpt-oss.attention.sliding_window_pattern": [True, False]}}, r"names 2 layers of 3"),
    ({"skip_tensors": {"blk.1.attn_sinks.weight"}}, r"missing \['model\.layers\.1\.self_attn\.sinks'\].*"
                                                    r"\['blk\.1\.attn_sinks\.weight'\]"),
    ({"skip_tensors": {"blk.0.ffn_up_exps.bias"}}, r"missing \['model\.layers\.0\.mlp\.experts\.up_proj\.bias"),
    ({"skip_tensors": {"blk.2.ffn_gate_inp.bias"}}, r"missing \['model\.layers\.2\.mlp\.gate\.bias"),
])
def test_a_malformed_file_is_refused_by_name(cases: dict[str, Case], tmp_path: Path, change: dict[str, Any],
                                            message: str) -> None:
    path = rewrite(cases["f32"].file, tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelLoadError, match=message):
        read_gguf(path)


def test_each_tensor_s_file_name_is_its_hf_name_s_inverse(cases: dict[str, Case]) -> None:
    reader = gguf.GGUFReader(cases["f32"].file.path)
    family = gguf_family({"general.architecture": "gpt-oss"})
    for tensor in reader.tensors:
        hf = family.hf_name(tensor.name)
        assert hf is not None and family.gguf_name(hf) == tensor.name, tensor.name
