#!/usr/bin/env python3
"""lm-eval runs side by side: each run's accuracy, and how far its per-answer log-likelihoods are from the
first run's (the reference, e.g. transformers in float32).

    python scripts/eval/compare_lm_eval.py /tmp/lmeval-hf /tmp/lmeval-ids /tmp/lmeval-text

Each argument is an lm-eval `--output_path` run with `--log_samples`; the newest samples file under it is
read. Needs no lm-eval: it reads the JSON lines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def samples(run: Path) -> list[dict]:
    files = sorted(run.rglob("samples_*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"no samples_*.jsonl under {run} (run lm-eval with --log_samples)")
    return [json.loads(line) for line in files[-1].read_text().splitlines()]


def loglikelihoods(rows: list[dict]) -> list[float]:
    return [float(resp[0]) for row in sorted(rows, key=lambda r: r["doc_id"]) for resp in row["filtered_resps"]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="lm-eval output paths; the first is the reference")
    args = p.parse_args()
    base = loglikelihoods(samples(args.runs[0]))
    print("| run | acc | acc_norm | answers | max abs. difference from the first |\n|---|---|---|---|---|")
    for run in args.runs:
        rows = samples(run)
        mine = loglikelihoods(rows)
        if len(mine) != len(base):
            raise SystemExit(f"{run} scored {len(mine)} answers, the reference {len(base)}")
        acc = sum(r["acc"] for r in rows) / len(rows)
        norm = sum(r["acc_norm"] for r in rows) / len(rows)
        worst = max(abs(a - b) for a, b in zip(mine, base))
        print(f"| {run} | {acc:.4f} | {norm:.4f} | {len(mine)} | {worst:.2e} |")


if __name__ == "__main__":
    main()
