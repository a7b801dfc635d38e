#!/usr/bin/env python3
"""Speed before and after a change: shape (a) and the single stream, this working tree against a base commit.

It measures nothing itself: each side runs its OWN copy of the existing benchmarks, in its own process with only
its tree on PYTHONPATH (the base side in a detached `git worktree` of `--base`, removed afterwards):

* shape (a), 32 requests x 64 new tokens all at once, in process: `scripts/bench.py --shapes a --methods ours
  --repeats 1` (`ferrox_batch.bench.batcher`), read from its `--json`: tok/s, TTFT p50, ITL p50;
* the single stream, one request at a time: `scripts/bench_step.py --requests 3` (as docs/benchmarks.md's
  "The single stream before and after the per-request cost bounds" ran it), read from what it prints: decode
  tok/s and the model forward's ms per step.

Each round runs every benchmark once per side, the sides alternated (base first in odd rounds, new first in even
ones, so a drift of the machine falls on both). The table gives each side's median over the rounds, the ratio
of the medians (new / base) and the median of the rounds' own ratios. On a shared 2-core machine rounds move by
10-20%: compare the ratios, and run more rounds before reading a few percent into them. The load average is
printed with each round: a round run while other processes hold the cores measures them, not the change
(here, under a load of 4-5 on 2 CPUs, one round's shape (a) moved from 419 to 13 tok/s). `--threads 1`
(OMP_NUM_THREADS for both sides) keeps two OpenMP threads from spinning against other processes: on the same
shared machine two quick rounds of the unchanged tree against itself then gave ratios of 0.996-1.04 on every
measure, where the default threads gave 0.1-30. The default stays the benchmarks' own (torch's threads), the
configuration docs/benchmarks.md reports.

    python scripts/bench_before_after.py --base c14f1695647e572d92c650e2ce4166e4efb67662 --rounds 3
    python scripts/bench_before_after.py --base HEAD~1 --rounds 1 --quick     # does it work (about 1-2 min)
    python scripts/bench_before_after.py --base HEAD~1 --rounds 3 --threads 1  # on a machine others share

A round takes about 80 s on a quiet 2-core machine (shape (a) 15-30 s and the single stream about 15 s, per
side), so `--rounds 3` about 4-5 minutes; on a loaded one, much longer (17 minutes here under a load of 4-5).

`--model` defaults to the fetched SmolLM2-135M-Instruct, `--dtype` to the server's default (`auto`, resolved
once here as `ferrox-batch serve` resolves it on this machine, and passed to both sides as that name).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tree_sides import ROOT, Side, base_side, current_side


def shape_a(side: Side, args: argparse.Namespace) -> dict[str, float]:
    """One run of shape (a), ours only, in `side`'s tree."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "a.json"
        command = [sys.executable, "scripts/bench.py", "--shapes", "a", "--methods", "ours", "--repeats", "1",
                   "--model", args.model, "--dtype", args.dtype, "--json", str(out)]
        command += ["--quick"] if args.quick else []
        _run(side, command, args.threads)
        run = json.loads(out.read_text())["runs"][0]
    if run.get("failed") or run.get("errors"):
        raise SystemExit(f"shape (a) failed on the {side.name} side: {run.get('failed')} {run.get('errors')}")
    return {"shape (a) tok/s": run["tok_s"], "shape (a) TTFT p50 ms": run["ttft_p50_ms"],
            "shape (a) ITL p50 ms": run["itl_p50_ms"]}


def single_stream(side: Side, args: argparse.Namespace) -> dict[str, float]:
    """One run of `bench_step.py` in `side`'s tree: decode tok/s and the model forward's ms per step."""
    sizes = ["--requests", "1", "--tokens", "32", "--prompt-tokens", "50"] if args.quick else \
        ["--requests", str(args.step_requests)]
    command = [sys.executable, "scripts/bench_step.py", "--model", args.model, "--dtype", args.dtype, *sizes]
    text = _run(side, command, args.threads)
    decode = re.search(r"^decode ([\d.]+) tok/s", text, re.M)
    forward = re.search(r"^\| model forward \| ([\d.]+) \|", text, re.M)
    if decode is None or forward is None:
        raise SystemExit(f"bench_step.py on the {side.name} side printed no result:\n{text}")
    return {"single stream tok/s": float(decode.group(1)), "single stream model forward ms": float(forward.group(1))}


def _run(side: Side, command: list[str], threads: int) -> str:
    began = time.monotonic()
    env = side.env()
    if threads:  # torch's intra-op threads and the kernels' OpenMP team, in every process of the run
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run(command, cwd=side.root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[1:3])} failed on the {side.name} side (exit {done.returncode}):\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(f"#   {side.name}: {' '.join(command[1:2])} {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    return done.stdout


def table(results: dict[str, dict[str, list[float]]], sides: tuple[Side, Side]) -> list[str]:
    base, new = sides
    lines = [f"| measure | base `{base.commit}` (median) | new `{new.commit}` (median) | new / base | rounds' "
             f"ratios (median) | base per round | new per round |", "|---|---|---|---|---|---|---|"]
    for measure in results["base"]:
        before, after = results["base"][measure], results["new"][measure]
        pairs = [a / b for a, b in zip(after, before)]
        lines.append(f"| {measure} | {statistics.median(before):.1f} | {statistics.median(after):.1f} | "
                     f"{statistics.median(after) / statistics.median(before):.3f} | {statistics.median(pairs):.3f} | "
                     f"{', '.join(f'{v:.1f}' for v in before)} | {', '.join(f'{v:.1f}' for v in after)} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit to compare this working tree against")
    p.add_argument("--rounds", type=int, default=3)
    home = Path(os.environ.get("FERROX_HOME") or Path.home() / ".cache" / "ferrox-batch")
    p.add_argument("--model", default=str(home / "models" / "smollm2-135m-instruct"))
    p.add_argument("--dtype", default="auto", help="auto (the server's default), bf16, fp32 or fp16w")
    p.add_argument("--step-requests", type=int, default=3, help="bench_step.py's --requests")
    p.add_argument("--threads", type=int, default=0,
                   help="OMP_NUM_THREADS for both sides' runs (0: as the benchmarks default, torch's own)")
    p.add_argument("--quick", action="store_true",
                   help="the smallest runs: shape (a) --quick (4 requests x 8 tokens), one 32-token stream")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from ferrox_batch.bench.batcher import resolved_dtype

    asked = args.dtype
    args.dtype, why = resolved_dtype(args.dtype)
    began = time.monotonic()
    new = current_side()
    results: dict[str, dict[str, list[float]]] = {"base": {}, "new": {}}
    with base_side(args.base) as base:
        print(f"# {args.model}, dtype {args.dtype} (asked {asked}: {why}); base {base.commit}, new {new.commit}; "
              f"{args.rounds} rounds{', quick' if args.quick else ''}"
              f"{f', OMP_NUM_THREADS={args.threads}' if args.threads else ''}; load average {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} CPUs", flush=True)
        for round_ in range(args.rounds):
            order = (base, new) if round_ % 2 == 0 else (new, base)
            print(f"# round {round_ + 1}: {order[0].name} first; load average {os.getloadavg()[0]:.1f}",
                  file=sys.stderr, flush=True)
            for bench in (shape_a, single_stream):
                for side in order:
                    for measure, value in bench(side, args).items():
                        results[side.name].setdefault(measure, []).append(value)
        print("\n".join(table(results, (base, new))))
    print(f"# {time.monotonic() - began:.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
