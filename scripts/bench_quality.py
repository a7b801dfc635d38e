#!/usr/bin/env python3
"""What each CPU precision costs in quality on the default model, against fp32, side by side.

For every precision: perplexity on the fixed text the tests use (`tests/data/perplexity_text.txt`), and
greedy agreement with fp32 on the benchmark's shape (a) prompts (32 prompts, 64 tokens each, EOS ignored,
through the served batcher): the fraction of generated tokens before each request's first divergence, and
the fraction of requests identical throughout. bf16 on a CPU without bf16 instructions is emulated, so slow.
A precision may name its KV cache after a colon (`fp16w:fp32`); without one it gets what `--kv-cache-dtype
auto` picks (fp16 K/V under fp16w where the CPU kernels build). It may name how its weights are held after
an `@` (`bf16@q8_0`: `--weights`). `--gguf FILE` adds rows for that file (the one --model was converted from)
served as it stores its weights, in each precision listed under `--gguf-precisions`. The baseline is fp32
with fp32 K/V.

    python scripts/bench_quality.py [--precisions fp32,fp16w,fp16w:fp32,bf16] [--tokens 64]
    python scripts/bench_quality.py --precisions bf16,fp32@q8_0,bf16@q8_0,bf16@q5_0,bf16@q4_1,bf16@q4_0 \
        --gguf ~/.cache/ferrox-batch/downloads/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ferrox_batch.bench.batcher import default_model  # noqa: E402
from ferrox_batch.bench.quality import agreement, greedy_outputs, perplexity  # noqa: E402
from ferrox_batch.bench.workloads import build_requests  # noqa: E402
from ferrox_batch.runtime.device import QUALITY_BOUND, cpu_description  # noqa: E402
from ferrox_batch.runtime.loading.loader import load_model  # noqa: E402


def main() -> int:
    import os

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=default_model(os.environ))
    p.add_argument("--precisions", default="fp32,fp16w,fp16w:fp32,bf16")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--gguf", help="also serve this GGUF as it stores its weights")
    p.add_argument("--gguf-precisions", default="auto,fp32")
    args = p.parse_args()
    text = (ROOT / "tests" / "data" / "perplexity_text.txt").read_text()
    print(f"# cpu: {cpu_description()}; model {args.model}; bound: perplexity within {QUALITY_BOUND:.0%} of fp32")
    print("| model | precision | KV cache | linear kernels | weights | perplexity | vs fp32 | greedy tokens before "
          "divergence | requests identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    base_ppl = base_out = None
    runs = [(args.model, name) for name in ["fp32:fp32", *(n for n in args.precisions.split(",")
                                                          if n not in ("fp32", "fp32:fp32"))]]
    runs += [(args.gguf, name) for name in (args.gguf_precisions.split(",") if args.gguf else ())]
    for path, name in runs:
        spec, _, weights = name.partition("@")
        dtype, _, kv = spec.partition(":")
        model = load_model(path, device="cpu", dtype=dtype, kv_cache_dtype=kv or "auto", weights=weights or "auto")
        ids = model.tokenizer.encode(text)
        prompts = [r.prompt for r in build_requests("a", model.tokenizer.encode)]
        ppl = perplexity(model.decoder, ids)
        out = greedy_outputs(model, prompts, args.tokens)
        if base_ppl is None:
            base_ppl, base_out = ppl, out
        agree = agreement(base_out, out)
        kinds = ", ".join(f"{c} {k}" for k, c in model.decoder.linear_kinds.items())
        print(f"| {Path(path).name} | {model.precision} | {model.kv_dtype_name} | {kinds} | "
              f"{model.decoder.weight_bytes / 2**20:.1f} MiB | {ppl:.3f} | {(ppl / base_ppl - 1) * 100:+.3f}% | "
              f"{agree.prefix_fraction:.1%} | {agree.identical_fraction:.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
