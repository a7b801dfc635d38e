#!/usr/bin/env python3
"""What the sampling extras cost per token: log-probabilities (k alternatives) and a JSON schema's mask.

One batched sampler call over `--rows` rows of the default model's vocabulary (random logits, seeded), timed
as the worker times it, side by side in one run, every row greedy: with nothing extra; every row asking
for log-probabilities with k alternatives; every row constrained by a JSON schema (each row's grammar
advanced by the token it sampled, restarted when complete), given its masks as the runner gives them; and
the masks alone (llguidance), which the runner computes on another thread while the forward runs.
Medians of `--steps` calls, interleaved.

    python scripts/bench_sampler.py                 # 32 rows, k = 5
    python scripts/bench_sampler.py --rows 8 --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrox_batch.bench.batcher import default_model  # noqa: E402
from ferrox_batch.forward import GrammarComplete  # noqa: E402
from ferrox_batch.generation_types import SamplingParams  # noqa: E402
from ferrox_batch.runtime.device import cpu_description  # noqa: E402
from ferrox_batch.runtime.loading.tokenizer import Tokenizer  # noqa: E402
from ferrox_batch.runtime.sampling.grammar import Grammars  # noqa: E402
from ferrox_batch.runtime.sampling.sampler import BatchSampler  # noqa: E402
from ferrox_batch.structured import StructuredOutput  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "items": {"type": "array", "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["id", "tags"]}}}, "required": ["name", "items"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model(__import__("os").environ))
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--k", type=int, default=5)
    args = p.parse_args()
    tokenizer = Tokenizer.from_dir(args.model)
    vocab = 49152
    grammars = Grammars(tokenizer.inner.to_str(), vocab, sorted(tokenizer.stop_tokens.ids))
    grammar = grammars.compile(StructuredOutput.json_schema(SCHEMA))
    sampler = BatchSampler(vocab, "cpu", grammars)
    greedy = SamplingParams()
    plain = [sampler.new_row(greedy, None, []) for _ in range(args.rows)]
    scored = [sampler.new_row(greedy, None, [], logprobs=args.k) for _ in range(args.rows)]
    constrained = [sampler.new_row(greedy, None, [], grammar=grammar) for _ in range(args.rows)]
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"greedy": [], f"logprobs k={args.k}": [], "JSON schema, masks given": [],
                                     "masks alone (beside the forward)": []}
    for _ in range(args.steps):
        logits = torch.randn(args.rows, vocab, generator=gen) * 3
        for name, rows in (("greedy", plain), (f"logprobs k={args.k}", scored)):
            began = time.perf_counter()
            sampler.sample(logits, rows)
            times[name].append(time.perf_counter() - began)
        began = time.perf_counter()
        masks = sampler.grammar_masks(constrained)
        times["masks alone (beside the forward)"].append(time.perf_counter() - began)
        began = time.perf_counter()
        out = sampler.sample(logits, constrained, masks)
        times["JSON schema, masks given"].append(time.perf_counter() - began)
        for i, outcome in enumerate(out):  # a finished or broken row starts a new document
            if isinstance(outcome, (GrammarComplete, Exception)):
                constrained[i] = sampler.new_row(greedy, None, [], grammar=grammar)
    print(f"# cpu: {cpu_description()}; torch threads {torch.get_num_threads()}; {args.rows} rows, vocab {vocab}, "
          f"{args.steps} steps")
    base = statistics.median(times["greedy"])
    print("| sampler call | ms per step | ms per token | over greedy, per token |")
    print("|---|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        extra = "-" if name == "greedy" else f"{(med - base) * 1e3 / args.rows:+.3f} ms"
        print(f"| {name} | {med * 1e3:.2f} | {med * 1e3 / args.rows:.3f} | {extra} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
