"""Which models `compare_models.py` compares: tiny checkpoints written once with this tree's fixtures, and the
real models present.

The tiny ones are the variations of the tests' own (tests/conftest.py's `tiny_variant_dirs` and
`tiny_batch_dir`, with their seeds), so every family and setting the runtime accepts is covered, plus two of
test_quantized_decoder.py's GGUFs mixing a Q4_K_M file's formats. They are written by the CURRENT tree's
fixtures into one folder, and both sides read those very files: the base side never writes its own, so a
fixture that changes with the change under test changes nothing here. Their attention is sharpened and their
embeddings shrunk after writing, as tests/runtime/architectures/test_rope_layouts.py does, so that the greedy
ids follow each variation instead of repeating one token. The real ones are the folders `ferrox-batch fetch`
converts and the GGUFs it downloaded, served as stored. Each entry lists the loads it is run in
(`load_model`'s dtype, weights and int8_activations).

Not a program: `compare_models.py` imports it in its parent process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def _load(dtype: str, weights: str = "auto", int8_activations: bool = True) -> dict[str, Any]:
    label = dtype + ("" if weights == "auto" else f" {weights}") + ("" if int8_activations else " weight-only")
    return {"label": label, "dtype": dtype, "weights": weights, "int8_activations": int8_activations}


TINY_LOADS = [_load("fp32"), _load("bf16"), _load("fp32", "q8_0")]
GGUF_LOADS = [_load("fp32"), _load("fp32", int8_activations=False), _load("bf16")]


def _sharpened(folder: Path) -> Path:
    """The checkpoint with sharper attention and smaller embeddings, as tests/runtime/architectures/
    test_rope_layouts.py makes its cases: with the fixtures' own weights most tiny models repeat one token
    whatever their RoPE and windows; with these, the greedy ids follow them."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    for key, value in weights.items():
        if key.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
            weights[key] = value * 4.0
        elif key == "model.embed_tokens.weight":
            weights[key] = value * 0.2
    save_file(weights, folder / "model.safetensors")
    return folder


def write_models(folder: Path, real: str) -> list[dict[str, Any]]:
    """The tiny checkpoints (this tree's fixtures, written here once) and the real models present."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixtures
    from tiny_checkpoint import build_tokenizer, write_tiny_checkpoint
    from tiny_gguf import SPECIALS, bpe_vocabulary, spm_vocabulary
    from tiny_gguf_families import write_family_gguf

    # The variations of tests/conftest.py's `tiny_variant_dirs` and `tiny_batch_dir`, with their seeds.
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    long_context = 40
    tiny: dict[str, dict[str, Any]] = {
        "llama": dict(seed=1),
        "llama-untied-llama3-rope": dict(seed=2, tie=False, rope_scaling=llama3),
        "llama-untied-batch": dict(seed=5, tie=False, std=0.15),
        "llama-linear-rope": dict(seed=10, rope_scaling={"rope_type": "linear", "factor": 3.0}),
        "llama-dynamic-rope": dict(seed=11, max_positions=long_context,
                                   rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        "mistral-window": dict(arch="mistral", seed=4, sliding_window=7),
        "qwen2": dict(arch="qwen2", seed=3),
        "qwen3": dict(arch="qwen3", seed=6, head_dim=24),
        "qwen3-yarn-rope": dict(arch="qwen3", seed=12, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": long_context, "beta_fast": 16,
            "mscale": 1.2, "mscale_all_dim": 0.8}),
        "smollm3-nope": dict(arch="smollm3", seed=7, no_rope_layers=[1, 0]),
        "phi3-longrope": dict(arch="phi3", seed=9, partial_rotary_factor=0.75, max_positions=160, rope_scaling={
            "rope_type": "longrope", "original_max_position_embeddings": long_context,
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5], "long_factor": [2, 2.5, 3, 3.5, 4, 4.5]}),
        "gemma3": dict(arch="gemma3_text", seed=8, layers=3, head_dim=32, sliding_window=6,
                       query_pre_attn_scalar=20),
    }
    entries = []
    for name, kwargs in tiny.items():
        path = _sharpened(write_tiny_checkpoint(folder / name, **kwargs))
        entries.append({"name": f"tiny {name}", "path": str(path), "loads": TINY_LOADS})
    # tests/runtime/architectures/test_quantized_decoder.py's GGUFs, mixing the formats a Q4_K_M file mixes.
    vocab = 384
    ggufs = {"llama": ("llama", dict(arch="llama", tie=False, intermediate=256, seed=41),
                       bpe_vocabulary(build_tokenizer(vocab), "gpt2", vocab, SPECIALS)),
             "gemma3": ("gemma3", dict(arch="gemma3_text", layers=6, heads=2, kv_heads=1, head_dim=256,
                                       intermediate=256, sliding_window=8, seed=43), spm_vocabulary(vocab, gemma=True))}
    for name, (arch, kwargs, words) in ggufs.items():
        source = write_tiny_checkpoint(folder / f"gguf-{name}" / "source", vocab_size=vocab, std=0.15, **kwargs)
        written = write_family_gguf(source, folder / f"gguf-{name}" / "gguf", arch, words, seed=kwargs["seed"])
        entries.append({"name": f"tiny GGUF {name}", "path": str(written.path), "loads": GGUF_LOADS})
    if real == "none":
        return entries
    home = Path(os.environ.get("FERROX_HOME") or Path.home() / ".cache" / "ferrox-batch")
    every = real == "all"
    # The folders `ferrox-batch fetch` converts, and the GGUFs it downloaded, served as stored (Gemma's Q4_K_M
    # file takes 20-45 s to load here, so only with --real all).
    real_models = {"models/smollm2-135m-instruct": [_load("fp32"), _load("bf16"), _load("fp32", "q8_0")],
                   "models/gemma3-270m": [_load("fp32")] + ([_load("bf16"), _load("fp32", "q8_0")] if every else []),
                   "downloads/SmolLM2-135M-Instruct.Q4_1.gguf": [_load("fp32")],
                   "downloads/gemma-3-270m-q4_k_m.gguf": [_load("fp32")] if every else []}
    for name, loads in real_models.items():
        if loads and (home / name).exists():
            entries.append({"name": name.split("/")[1], "path": str(home / name), "loads": loads})
        elif loads:
            print(f"# {home / name}: not there, left out", flush=True)
    return entries
