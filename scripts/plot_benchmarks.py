#!/usr/bin/env python3
"""The pictures `docs/benchmarks.md` opens with, drawn from the results it records (`docs/results.json`).

Each entry of `docs/results.json` is one side-by-side run: the machine kind, the workload (shape), our
tok/s and the peer's, what was compared, and the section of `docs/benchmarks.md` that holds the table and
its command. This draws:
- `docs/images/vs-llama-cpp.png`: our throughput over llama.cpp's server's, by machine kind and workload
  (the headline, also in the README);
- `docs/images/single-stream.png`: one request at a time, ours over llama.cpp's, by machine kind and format,
  and the copying edits with speculative decoding.

    python scripts/plot_benchmarks.py            # rewrites both pictures
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ferrox_batch.bench.plots import plot_ratios  # noqa: E402


def entries(path: Path, group: str) -> list[dict]:
    results = json.loads(path.read_text())["results"]
    out = []
    for r in results:
        if r["group"] != group:
            continue
        ratio = r["ours_tok_s"] / r["peer_tok_s"]
        out.append({"machine": r["machine"], "shape": r["shape"], "ratio": ratio,
                    "label": f"{r['format']}\n{r['ours_tok_s']:.0f} / {r['peer_tok_s']:.0f}"})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "results.json")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plot_ratios(entries(args.results, "throughput"),
                "ferrox-batch over llama.cpp's server: throughput, same model and precision, 2 vCPUs\n"
                "(bars: ours / llama.cpp; labels: tok/s)", args.out / "vs-llama-cpp.png", ylabel="x llama.cpp")
    plot_ratios(entries(args.results, "single-stream"),
                "One request at a time: decode tok/s over llama.cpp's server, same file, 2 vCPUs\n"
                "(labels: tok/s ours / llama.cpp)", args.out / "single-stream.png", ylabel="x llama.cpp")
    print(f"# wrote {args.out / 'vs-llama-cpp.png'} and {args.out / 'single-stream.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
