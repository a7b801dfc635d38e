"""RoPE settings as transformers 4 and transformers 5 write them, for every family, against transformers.

transformers 4 wrote `rope_theta`, `rope_scaling`, `partial_rotary_factor` and Gemma 3's `rope_local_base_freq`
at the top of `config.json`; transformers 5 writes them under `rope_parameters` (Gemma 3's per layer kind). Each
case below is a tiny checkpoint whose RoPE is NOT the family's default (a default theta hides a reader that
misses the field), written by hand in the older layout and saved again by transformers' own `save_pretrained`
in its layout; both must give transformers' own greedy continuation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from batch_helpers import greedy_ids as greedy
from numerics import assert_decisive
from safetensors.torch import load_file, save_file
from tiny_checkpoint import write_tiny_checkpoint

from ferrox_batch.runtime.loading.loader import load_model

transformers = pytest.importorskip("transformers")

PROMPTS = ["The quick brown fox jumps over the lazy dog.",
           "def forward(self, x): return self.layers(x) + 1\nPaged attention stores keys"]
NEW_TOKENS = 32
#: The pretrained context of the cases whose RoPE changes past it (dynamic, yarn's ramp): longer than each
#: prompt, shorter than a prompt and its continuation, so the continuation crosses it.
LONG_CONTEXT = 40
#: Phi-3's pretrained context, longer than a prompt and its continuation: at the crossing transformers' Phi-3
#: `generate` rotates the whole cache again with the long factors, which this runtime does not (a key keeps
#: the rotation it was written with), so the continuation stays short of it.
PHI3_CONTEXT = 80
LONGROPE = {"original_max_position_embeddings": PHI3_CONTEXT,
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5], "long_factor": [2, 2.5, 3, 3.5, 4, 4.5]}

#: name -> (write_tiny_checkpoint's arguments, top-level fields of the older layout, fields it leaves out).
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]] = {
    "llama-theta": (dict(seed=31), {"rope_theta": 123456.0}, ()),
    "llama-llama3": (dict(seed=32, tie=False, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
        "original_max_position_embeddings": 64}), {"rope_theta": 500000.0}, ()),
    "llama-linear": (dict(seed=33, rope_scaling={"type": "linear", "factor": 3.0}), {"rope_theta": 50000.0}, ()),
    "llama-dynamic": (dict(seed=34, max_positions=LONG_CONTEXT, rope_scaling={"type": "dynamic", "factor": 2.0}),
                      {"rope_theta": 30000.0}, ()),
    "qwen2-yarn": (dict(arch="qwen2", seed=35, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": LONG_CONTEXT}),
                   {"rope_theta": 1_000_000.0}, ()),
    "mistral-theta": (dict(arch="mistral", seed=36, sliding_window=7), {"rope_theta": 500000.0}, ()),
    "qwen3-theta": (dict(arch="qwen3", seed=37, head_dim=24), {"rope_theta": 123456.0}, ()),
    "qwen3-yarn": (dict(arch="qwen3", seed=38, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": LONG_CONTEXT, "beta_fast": 16,
        "mscale": 1.2, "mscale_all_dim": 0.8}), {"rope_theta": 250000.0}, ()),
    # No `rope_theta` at all: SmolLM3's own default (2,000,000), not 10,000.
    "smollm3-default-theta": (dict(arch="smollm3", seed=39, no_rope_layers=[1, 0]), {}, ("rope_theta",)),
    "smollm3-theta": (dict(arch="smollm3", seed=46, no_rope_layers=[0, 1]), {"rope_theta": 5_000_000.0}, ()),
    "phi3-partial": (dict(arch="phi3", seed=41, partial_rotary_factor=0.5), {"rope_theta": 250000.0}, ()),
    "phi3-partial-longrope": (dict(arch="phi3", seed=42, partial_rotary_factor=0.75, max_positions=160,
                                   rope_scaling={"type": "longrope", **LONGROPE}),
                              {"rope_theta": 123456.0, "original_max_position_embeddings": PHI3_CONTEXT}, ()),
    # Phi-3's first checkpoints named longrope "su".
    "phi3-su": (dict(arch="phi3", seed=43, partial_rotary_factor=0.75, max_positions=160,
                     rope_scaling={"type": "su", **LONGROPE}),
                {"rope_theta": 20000.0, "original_max_position_embeddings": PHI3_CONTEXT}, ()),
    "gemma3-thetas": (dict(arch="gemma3_text", seed=44, layers=3, head_dim=32, sliding_window=6),
                      {"rope_theta": 300000.0, "rope_local_base_freq": 5000.0}, ()),
    "gemma3-linear": (dict(arch="gemma3_text", seed=45, layers=3, head_dim=32, sliding_window=6,
                           rope_scaling={"rope_type": "linear", "factor": 2.0}),
                      {"rope_theta": 400000.0, "rope_local_base_freq": 20000.0}, ()),
}
LAYOUTS = ("transformers4", "transformers5")
#: How much sharper than the fixtures' usual weights the attention is made, and how much smaller the
#: embeddings: with the fixtures' own, a tiny model's continuation is one token repeated whatever its RoPE;
#: with these, the rotation decides it (`test_each_case_depends_on_its_rope_settings`).
QK_SCALE, EMBED_SCALE = 4.0, 0.2


def older_layout(folder: Path, name: str) -> Path:
    """The case's checkpoint with its RoPE settings at the top of `config.json`, as transformers 4 wrote it."""
    arguments, top, dropped = CASES[name]
    write_tiny_checkpoint(folder, **arguments, extra_config=top)
    weights = load_file(folder / "model.safetensors")
    for key, value in weights.items():
        if key.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
            weights[key] = value * QK_SCALE
        elif key == "model.embed_tokens.weight":
            weights[key] = value * EMBED_SCALE
    save_file(weights, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    for key in dropped:
        config.pop(key)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def saved_by_transformers(source: Path, folder: Path) -> Path:
    """`source` loaded by transformers and written back by its `save_pretrained` (weights and config)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    out = {}
    for name in CASES:
        old = older_layout(tmp_path_factory.mktemp(name) / "old", name)
        out[name, "transformers4"] = old
        out[name, "transformers5"] = saved_by_transformers(old, old.parent / "new")
    return out




@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", CASES)
def test_greedy_continuations_match_transformers_in_either_layout(checkpoints: dict[tuple[str, str], Path],
                                                                  name: str, layout: str, device: str) -> None:
    folder = checkpoints[name, layout]
    config = json.loads((folder / "config.json").read_text())
    if layout == "transformers5":  # the settings are where transformers 5 writes them, and only there
        assert "rope_parameters" in config, config
        assert not {"rope_theta", "rope_scaling", "rope_local_base_freq"} & set(config), config
    else:
        assert "rope_parameters" not in config
    ours = load_model(folder, device=device, dtype="float32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        assert len(ids) < LONG_CONTEXT < len(ids) + NEW_TOKENS <= PHI3_CONTEXT
        with torch.no_grad():
            out = theirs.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        assert_decisive([step[0] for step in out.logits], ours.config, len(ids), note=(name, layout, prompt))
        assert greedy(ours, ids, NEW_TOKENS) == out.sequences[0, len(ids):].tolist(), (name, layout, prompt)


@pytest.mark.parametrize("name", CASES)
def test_both_layouts_read_to_one_config(checkpoints: dict[tuple[str, str], Path], name: str) -> None:
    from ferrox_batch.runtime.config import ModelConfig

    old = ModelConfig.from_file(checkpoints[name, "transformers4"] / "config.json")
    new = ModelConfig.from_file(checkpoints[name, "transformers5"] / "config.json")
    assert (new.rope_theta, new.rope_scaling, new.partial_rotary_factor, new.local_rope_theta) == (
        old.rope_theta, old.rope_scaling, old.partial_rotary_factor, old.local_rope_theta)
    _, top, _ = CASES[name]
    assert old.rope_theta == top.get("rope_theta", 2_000_000.0)
    assert old.local_rope_theta == top.get("rope_local_base_freq")


@pytest.mark.parametrize("name", CASES)
def test_each_case_depends_on_its_rope_settings(checkpoints: dict[tuple[str, str], Path], name: str,
                                                tmp_path: Path, device: str) -> None:
    """The same weights with plain RoPE of base 10,000 (Gemma 3: its default bases) continue differently: a
    reader that missed the case's settings would fail the comparison with transformers."""
    folder = checkpoints[name, "transformers4"]
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    config = json.loads((plain / "config.json").read_text())
    for key in ("rope_theta", "rope_scaling", "rope_local_base_freq", "partial_rotary_factor"):
        config.pop(key, None)
    if config["model_type"] != "gemma3_text":
        config["rope_theta"] = 10_000.0
    config["max_position_embeddings"] = 512  # room for the continuation without the scaling's stretch
    (plain / "config.json").write_text(json.dumps(config))
    ours, default = load_model(folder, device=device, dtype="float32"), load_model(plain, device=device, dtype="float32")
    assert any(greedy(ours, ids, NEW_TOKENS) != greedy(default, ids, NEW_TOKENS)
               for ids in (ours.tokenizer.encode(prompt) for prompt in PROMPTS)), name
