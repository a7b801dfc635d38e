#!/usr/bin/env python3
"""How long a row's drafts should be: the draft-length rules of speculative decoding replayed offline.

A drafted step's cost grows with its positions whether or not the draft is kept, so the rule that sets the
next draft's length (`scheduler.speculation.drafted`) trades kept tokens against wasted positions. Timing
each candidate rule over HTTP takes minutes per rule and its noise hides a few percent; this replays them
instead, exactly and in seconds:

1. **The step's cost by positions**, measured: one sequence of `--context` positions in process, a decode
   forward of 1 to `--positions` positions answered as decodes (a drafted row's shape), medians of rounds.
2. **The answers**: each shape-d task (`bench.copying`) and the first `--plain` shape-a prompts answered
   greedily without drafts, the tokens any rule must reproduce (drafts never change a greedy answer).
3. **The replay**: for each rule and `speculative_tokens`, the scheduler's own `draft_for` drafts from the
   row's prompt and output so far, the kept prefix is what the answer agrees with, and the step costs what
   (1) measured for its positions. A task's rate is its tokens after the first over the steps' summed cost.

    python scripts/bench_draft_policy.py [--model DIR] [--k 8,12,15,16]

Only the rule named `ours` is the scheduler's; the others are the alternatives it was chosen over (each
with the scheduler's pause after repeated misses). What it does not replay: several rows drafting in one
step (their sharing was measured over HTTP, shape d4), the sampling and reply work of a step (a few percent
of it at one row, `scripts/bench_step.py`), and other devices or contexts than the one measured: the costs
are this machine's, at one context length.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ferrox_batch.admission.config import BatcherConfig  # noqa: E402
from ferrox_batch.bench.batcher import default_model  # noqa: E402
from ferrox_batch.bench.shapes import shape_requests  # noqa: E402
from ferrox_batch.engine.handle import ContinuousBatcher  # noqa: E402
from ferrox_batch.generation_types import GenerationParams  # noqa: E402
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk  # noqa: E402
from ferrox_batch.runtime.loading.loader import LoadedModel, load_model  # noqa: E402
from ferrox_batch.scheduler.request import Request  # noqa: E402
from ferrox_batch.scheduler.sink import OnceSink, QueueSink  # noqa: E402
from ferrox_batch.scheduler.speculation import draft_for, drafted  # noqa: E402
from ferrox_batch.stop_tokens import StopTokens  # noqa: E402

Rule = Callable[[Request, int, BatcherConfig], None]


def step_costs(model: LoadedModel, context: int, positions: int, rounds: int = 5, reps: int = 8) -> list[float]:
    """ms of a forward of p = 1..`positions` positions of one sequence of `context` (index p - 1)."""
    decoder = model.decoder
    store = decoder.new_store(16, num_blocks=(context + positions) // 16 + 2)
    store.add_sequence("row", context + positions)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    decoder.forward([SeqChunk("row", torch.randint(3, vocab, (context,), generator=gen).tolist())], store)
    samples: dict[int, list[float]] = {p: [] for p in range(1, positions + 1)}
    for _ in range(rounds):  # rounds interleave the sizes, so a slow spell of the machine spreads over all
        for p in samples:
            tokens = torch.randint(3, vocab, (p,), generator=gen).tolist()
            times = []
            for _ in range(reps):
                began = time.perf_counter()
                decoder.forward_every([SeqChunk("row", tokens, as_decodes=p > 1)], store, [0])
                times.append(time.perf_counter() - began)
                store.seq("row").length -= p  # the positions are written over next time, as a rejected draft's
            samples[p].append(statistics.median(times) * 1e3)
    return [statistics.median(samples[p]) for p in samples]


def answers(model: LoadedModel, plain: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """(prompt, greedy answer) per task: shape d's, and the first `plain` shape-a prompts alone."""
    config = dataclasses.replace(BatcherConfig.serving(), speculative=False)
    out: dict[str, list[tuple[list[int], list[int]]]] = {}
    with ContinuousBatcher.from_model(model, config) as batcher:
        for shape, requests in (("d", shape_requests("d", model.tokenizer)),
                                ("a", shape_requests("a", model.tokenizer)[:plain])):
            out[shape] = [(list(r.prompt), list(batcher.generate(list(r.prompt), GenerationParams(
                max_tokens=r.max_tokens, ignore_eos=True)).token_ids)) for r in requests]
    return out


def replay(prompt: Sequence[int], answer: Sequence[int], config: BatcherConfig, rule: Rule,
           costs: Sequence[float]) -> tuple[float, int, int]:
    """(ms the answer's steps after its first token cost, draft tokens, kept ones) under `rule`; `costs[d]` is
    a step drafting d tokens (d + 1 positions)."""
    row = Request(list(prompt), GenerationParams(max_tokens=len(answer)), StopTokens.default(),
                  OnceSink(QueueSink()), abort=0, blocks=1, positions=1)
    row.output_ids.append(answer[0])  # the prompt's step samples the first token
    spent = 0.0
    proposed = kept = 0
    while len(row.output_ids) < len(answer):
        row.draft = draft_for(row, config)
        at = len(row.output_ids)
        accepted = 0
        while accepted < len(row.draft) and row.draft[accepted] == answer[at + accepted]:
            accepted += 1
        spent += costs[min(len(row.draft), len(costs) - 1)]
        if row.draft:
            proposed, kept = proposed + len(row.draft), kept + accepted
            rule(row, accepted, config)
        row.draft = ()
        row.output_ids.extend(answer[at:at + accepted + 1])
    return spent, proposed, kept


def doubling(request: Request, accepted: int, config: BatcherConfig) -> None:
    """The rule before: a draft kept whole doubles the next, one cut short keeps its length."""
    limit = request.draft_limit or config.speculative_tokens
    if accepted == len(request.draft):
        request.draft_limit = min(config.speculative_tokens, 2 * limit)
    else:
        request.draft_limit = limit if accepted else 1
    _misses(request, accepted, config)


def keep_after_cut(request: Request, accepted: int, config: BatcherConfig) -> None:
    """Whole: the most allowed; cut short: the same length; rejected whole: 1."""
    limit = request.draft_limit or config.speculative_tokens
    if accepted == len(request.draft):
        request.draft_limit = config.speculative_tokens
    else:
        request.draft_limit = limit if accepted else 1
    _misses(request, accepted, config)


def _misses(request: Request, accepted: int, config: BatcherConfig) -> None:
    # The pause after repeated misses is the scheduler's, whatever the length rule: reuse it.
    limit, draft = request.draft_limit, request.draft
    drafted(request, accepted, config)
    request.draft_limit, request.draft = limit, draft


RULES: dict[str, Rule] = {"ours": drafted, "doubling": doubling, "keep-after-cut": keep_after_cut}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model(os.environ))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context", type=int, default=300, help="the sequence's positions when costs are measured")
    p.add_argument("--positions", type=int, default=17, help="the most positions a step is measured with")
    p.add_argument("--k", default="8,12,15,16", help="speculative_tokens values to replay")
    p.add_argument("--plain", type=int, default=10, help="shape-a prompts replayed beside shape d")
    args = p.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    positions = max(args.positions, max(ks) + 1)
    model = load_model(args.model, device="cpu", dtype=args.dtype)
    with torch.inference_mode():
        costs = step_costs(model, args.context, positions)
    print(f"{Path(args.model).name}, {model.precision}: a step of 1..{positions} positions at {args.context} "
          f"of context, ms: " + ", ".join(f"{c:.2f}" for c in costs))
    tasks = answers(model, args.plain)
    plain_rate = 1e3 / costs[0]
    print(f"\nno drafts: {plain_rate:.1f} tok/s by the cost model\n")
    print("| rule | k | shape d mean tok/s | median | over no drafts | kept of drafted | shape a (alone) | over no drafts |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rule in RULES.items():
        for k in ks:
            config = dataclasses.replace(BatcherConfig.serving(), speculative_tokens=k)
            cells = []
            for shape in ("d", "a"):
                rates, proposed, kept = [], 0, 0
                for prompt, answer in tasks[shape]:
                    spent, drafts, accepted = replay(prompt, answer, config, rule, costs)
                    rates.append((len(answer) - 1) / spent * 1e3)
                    proposed, kept = proposed + drafts, kept + accepted
                cells.append((statistics.mean(rates), statistics.median(rates), kept / max(proposed, 1)))
            (d_mean, d_median, d_kept), (a_mean, _, _) = cells
            print(f"| {name} | {k} | {d_mean:.1f} | {d_median:.1f} | {d_mean / plain_rate:.2f}x | {d_kept:.0%} | "
                  f"{a_mean:.1f} | {a_mean / plain_rate:.2f}x |")


if __name__ == "__main__":
    main()
