"""Every family from a GGUF written the way llama.cpp writes it (tests/tiny_gguf_families.py).

For each, the conversion must give back the dequantized HF weights bit for bit and the source's config,
and the model it loads must be the one transformers loads from the same file (last logits within float32
rounding, 32 greedy tokens identical) where transformers' GGUF loader reads that architecture fully;
SmolLM3 (which it does not read), Phi-3 with partial rotary and longrope, Gemma 3 with scaled RoPE and
Qwen3 with a head size other than 128 (metadata it skips) are compared with our own load of the same
weights from an HF folder instead. Malformed files are refused with a `ModelLoadError` naming the file
and what is wrong.
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
from numerics import assert_decisive, assert_logits_close  # noqa: E402
from tiny_checkpoint import build_tokenizer, write_tiny_checkpoint  # noqa: E402
from tiny_gguf import SPECIALS, bpe_vocabulary, qwen2_tokenizer, spm_vocabulary  # noqa: E402
from tiny_gguf_families import FamilyGguf, write_family_gguf  # noqa: E402

from ferrox_batch.runtime.config import ModelConfig  # noqa: E402
from ferrox_batch.runtime.errors import ModelLoadError  # noqa: E402
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk  # noqa: E402
from ferrox_batch.runtime.loading.gguf_convert import read_gguf  # noqa: E402
from ferrox_batch.runtime.loading.loader import load_model  # noqa: E402

VOCAB = 384
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 40,
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5], "long_factor": [2, 2.5, 3, 3.5, 4, 4.5]}
GEMMA = dict(arch="gemma3_text", layers=6, heads=2, kv_heads=1, head_dim=256, intermediate=256, sliding_window=8)
#: name -> (llama.cpp architecture, the tiny checkpoint, its vocabulary, whether transformers reads it whole)
CASES: dict[str, tuple[str, dict[str, Any], str, bool]] = {
    "llama": ("llama", dict(arch="llama", tie=False, intermediate=256, seed=21), "bpe", True),
    "qwen2": ("qwen2", dict(arch="qwen2", intermediate=256, seed=22), "qwen2", True),
    # transformers' GGUF loader skips qwen3's key_length and takes Qwen3's usual head size of 128, so that one
    # compares with it; another head size (read from key_length) compares with our load of the weights.
    "qwen3": ("qwen3", dict(arch="qwen3", head_dim=128, intermediate=256, seed=23), "qwen2", True),
    "qwen3-head-dim": ("qwen3", dict(arch="qwen3", head_dim=64, intermediate=256, seed=29), "qwen2", False),
    # llama.cpp runs every fourth layer without RoPE, whatever the file says: so does the source here.
    "smollm3": ("smollm3", dict(arch="smollm3", layers=4, no_rope_layers=[1, 1, 1, 0], intermediate=256, seed=24),
                "bpe", False),
    "phi3": ("phi3", dict(arch="phi3", intermediate=256, seed=25), "spm", True),
    "phi3-partial-longrope": ("phi3", dict(arch="phi3", partial_rotary_factor=0.75, max_positions=160,
                                           rope_scaling=LONGROPE, seed=26), "spm", False),
    "gemma3": ("gemma3", dict(GEMMA, seed=27), "gemma", True),
    "gemma3-linear-rope": ("gemma3", dict(GEMMA, seed=28, rope_scaling={"rope_type": "linear", "factor": 4.0}),
                           "gemma", False),
    "granite": ("granite", dict(arch="granite", tie=False, intermediate=256, seed=30), "bpe", False),
    "olmo2": ("olmo2", dict(arch="olmo2", tie=False, intermediate=256, seed=31), "bpe", False),
}
PROMPTS = ["The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
           "def main():\n    return 42\n\ncafé 日本語 😀", "hello there"]


def vocabulary(kind: str) -> Any:
    if kind == "bpe":
        return bpe_vocabulary(build_tokenizer(VOCAB), "gpt2", VOCAB, SPECIALS)
    if kind == "qwen2":
        return bpe_vocabulary(qwen2_tokenizer(), "qwen2", VOCAB, SPECIALS)
    return spm_vocabulary(VOCAB, gemma=kind == "gemma")


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FamilyGguf]:
    out = {}
    for name, (arch, checkpoint, vocab, _) in CASES.items():
        root = tmp_path_factory.mktemp(name)
        source = write_tiny_checkpoint(root / "source", vocab_size=VOCAB, std=0.15, **checkpoint)
        out[name] = write_family_gguf(source, root / "gguf", arch, vocabulary(vocab), seed=checkpoint["seed"])
    return out


@pytest.mark.parametrize("name", CASES)
def test_the_conversion_gives_the_weights_and_the_config_back(families: dict[str, FamilyGguf], name: str) -> None:
    family = families[name]
    ckpt = read_gguf(family.path)
    assert ckpt.tensors.keys() == family.weights.keys()
    for tensor, want in family.weights.items():
        # Q/K included (unpermuted for llama and smollm3), Gemma's norms back to offsets from one
        np.testing.assert_array_equal(ckpt.tensors[tensor], want, err_msg=f"{name}: {tensor}")
    ours, source = ModelConfig.from_dict(ckpt.config), ModelConfig.from_dict(family.config)
    ids = {"bos_token_id": ours.bos_token_id, "eos_token_ids": ours.eos_token_ids}
    assert ours == dataclasses.replace(source, **ids)
    assert ckpt.config["architectures"] == family.config["architectures"]


def run(model: Any, ids: list[int], new_tokens: int) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """The prompt's last logits, `new_tokens` greedy tokens, and the logits each was picked from."""
    store = model.decoder.new_store(4, num_blocks=8 * (-(-(len(ids) + new_tokens) // 4)))  # every KV group's lease
    store.add_sequence(0, len(ids) + new_tokens)
    logits = model.decoder.forward([SeqChunk(0, ids)], store)
    first, out, steps = logits[0].clone(), [], []
    for _ in range(new_tokens):
        steps.append(logits[0].clone())
        out.append(int(logits[0].argmax()))
        logits = model.decoder.forward([SeqChunk(0, [out[-1]])], store)
    return first, out, steps

def assert_as_transformers(ours: Any, theirs: Any, prompts: list[str], greedy: list[str], note: object = "") -> None:
    """Each prompt's last logits within the tolerance of transformers' (`theirs`); for the prompts in `greedy`,
    32 greedy ids, each step decided by the arithmetic, identical."""
    for prompt in prompts:
        ids = ours.tokenizer.encode(prompt)
        got, ours_greedy, _ = run(ours, ids, 32 if prompt in greedy else 0)
        with torch.no_grad():
            want = theirs(torch.tensor([ids])).logits[0, -1]
            assert_logits_close(got, want, ours.config, len(ids), note=(note, prompt))
            if prompt in greedy:
                out = theirs.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
                assert_decisive([step[0] for step in out.logits], ours.config, len(ids), note=(note, prompt))
                assert ours_greedy == out.sequences[0, len(ids):].tolist(), (note, prompt)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case[3]])
def test_the_model_is_the_one_transformers_loads_from_the_same_file(families: dict[str, FamilyGguf],
                                                                     name: str) -> None:
    transformers = pytest.importorskip("transformers")
    family = families[name]
    # The weight-only kernel for quantized tensors: the file's weights exactly, as transformers widens them.
    ours = load_model(family.path, device="cpu", dtype="float32", int8_activations=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        family.path.parent, gguf_file=family.path.name, dtype=torch.float32, attn_implementation="eager").eval()
    assert all(len(ours.tokenizer.encode(p)) > 8 for p in PROMPTS if p != PROMPTS[2])  # past Gemma's window of 8
    assert_as_transformers(ours, theirs, PROMPTS, [PROMPTS[0]], note=name)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if not case[3]])
def test_the_model_is_our_own_load_of_the_same_weights(families: dict[str, FamilyGguf], name: str) -> None:
    family = families[name]
    ours = load_model(family.path, device="cpu", dtype="float32", int8_activations=False)
    folder = load_model(family.hf_folder, device="cpu", dtype="float32")
    assert ours.config.rope_scaling == folder.config.rope_scaling
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        got, greedy, steps = run(ours, ids, 48)  # past longrope's original context of 40
        want, folder_greedy, _ = run(folder, ids, 48)
        # The same weights, but where they lie in memory may change how the BLAS blocks its sums: two float32
        # forwards that may round differently.
        assert_logits_close(got, want, ours.config, len(ids), note=(name, prompt))
        assert_decisive(steps, ours.config, len(ids), note=(name, prompt))
        assert greedy == folder_greedy, (name, prompt)


# ---- malformed files -------------------------------------------------------------------------------


def rewrite(family: FamilyGguf, out: Path, *, drop: set[str] = frozenset(), changes: dict[str, Any] | None = None,
            tensors: dict[str, np.ndarray] | None = None, skip_tensors: set[str] = frozenset()) -> Path:
    """`family`'s file again, without the `drop` keys, with `changes` and with extra or replaced tensors."""
    reader = gguf.GGUFReader(family.path)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    changes = dict(changes or {})
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
            continue
        if name in changes:  # written below, typed by its new value
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    for name, value in changes.items():
        writer.add_key_value(name, value, gguf.GGUFValueType.get_type(value))
    extra = dict(tensors or {})
    for t in reader.tensors:
        if t.name in skip_tensors:
            continue
        if t.name in extra:
            replacement = extra.pop(t.name)
            if isinstance(replacement, tuple):  # raw bytes of a quantized type
                writer.add_tensor(t.name, replacement[0], raw_dtype=replacement[1])
            else:
                writer.add_tensor(t.name, replacement)
            continue
        quantized = t.tensor_type != gguf.GGMLQuantizationType.F32
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type if quantized else None)
    for name, value in extra.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("case,change,message", [
    ("qwen3", {"drop": {"qwen3.embedding_length"}}, "qwen3.embedding_length is missing"),
    ("gemma3", {"changes": {"gemma3.final_logit_softcapping": 30.0}}, "final_logit_softcapping"),
    ("qwen3", {"changes": {"qwen3.rope.scaling.type": "su"}}, "rope scaling 'su'"),
    ("qwen3", {"changes": {"qwen3.rope.dimension_count": 32}}, "partial rotary"),
    ("phi3-partial-longrope", {"skip_tensors": {"rope_factors_long.weight"}}, "both rope_factors"),
    ("phi3-partial-longrope", {"tensors": {"rope_factors_long.weight": np.ones(4, np.float32)}}, "expected 6"),
    ("gemma3", {"skip_tensors": {"blk.2.post_ffw_norm.weight"}}, "missing .*post_feedforward_layernorm"),
    ("qwen3", {"tensors": {"blk.0.attn_q_norm.weight": np.ones(8, np.float32)}}, "q_norm.weight has shape"),
    ("llama", {"tensors": {"blk.0.attn_q_norm.weight": np.ones(16, np.float32)}}, "unexpected tensor .*llama"),
    ("gemma3", {"changes": {"gemma3.attention.head_count": "four"}}, "head_count must be an integer"),
    ("gemma3", {"changes": {"tokenizer.ggml.model": "bert"}}, "tokenizer model 'bert'"),
    ("qwen2", {"changes": {"tokenizer.ggml.pre": "mystery"}}, "pre-tokenizer 'mystery'"),
    ("gemma3", {"changes": {"tokenizer.ggml.scores": [0.0] * 10}}, "10 token scores for 384 tokens"),
    ("qwen2", {"changes": {"tokenizer.ggml.token_type": [1] * 10}}, "10 token types for 384 tokens"),
    ("qwen2", {"drop": {"tokenizer.ggml.tokens"}}, "no tokenizer.ggml.tokens"),
    # A layer count the tensors do not hold, refused before a list per layer is built from it.
    ("smollm3", {"changes": {"smollm3.block_count": 2**31 - 1}}, "block_count is 2147483647 but the file's tensors "
                                                                 "hold 4 layers"),
    ("gemma3", {"changes": {"gemma3.block_count": 7}}, "block_count is 7"),
    # Q8_1 is a type llama.cpp computes with but gguf-py cannot dequantize: rows of 64 values, 40 bytes a block
    ("llama", {"tensors": {"blk.1.attn_v.weight": (np.zeros((32, 80), np.uint8), gguf.GGMLQuantizationType.Q8_1)}},
     "blk.1.attn_v.weight is stored as Q8_1, a type gguf-py cannot dequantize"),
])
def test_a_malformed_family_file_is_refused_by_name(families: dict[str, FamilyGguf], tmp_path: Path, case: str,
                                                    change: dict[str, Any], message: str) -> None:
    path = rewrite(families[case], tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelLoadError, match=message) as info:
        read_gguf(path)
    assert "bad.gguf" in str(info.value)


@pytest.mark.parametrize("case", ["llama", "gemma3"])
def test_a_context_length_past_what_float32_rope_serves_is_refused(families: dict[str, FamilyGguf], tmp_path: Path,
                                                                   case: str) -> None:
    arch = CASES[case][0]
    path = rewrite(families[case], tmp_path / "long.gguf", changes={f"{arch}.context_length": 2**31 - 1})
    with pytest.raises(ModelLoadError, match="max_position_embeddings"):
        load_model(path, device="cpu", dtype="float32")


def test_gemma3_reads_what_llama_cpp_hardcodes(families: dict[str, FamilyGguf]) -> None:
    config = read_gguf(families["gemma3"].path).config
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (config["rope_local_base_freq"], config["rope_theta"], config["sliding_window"]) == (10_000.0, 1e6, 8)
    assert config["query_pre_attn_scalar"] == 256 and config["model_type"] == "gemma3_text"
    assert json.loads(json.dumps(config)) == config  # a config.json as it is written


def test_smollm3_skips_rope_on_every_fourth_layer(families: dict[str, FamilyGguf]) -> None:
    config = ModelConfig.from_dict(read_gguf(families["smollm3"].path).config)
    assert config.rope_layers == (True, True, True, False)
