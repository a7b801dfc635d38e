"""Pictures of a benchmark run: what the table says, drawn with matplotlib.

`plot_runs` draws one run of `bench-http` (or `scripts/bench_serving.py`): tok/s per server (the median as
a bar, each repeat as a dot), then time to first token and inter-token latency as distributions (every
request's TTFT and every gap between chunks, pooled over the repeats), each server beside its peers, with
the workload and the CPU in the title. `plot_ratios` draws recorded results side by side: for each
machine kind, our throughput over a peer's on each shape (`scripts/plot_benchmarks.py` feeds it the
numbers `docs/benchmarks.md` records).

matplotlib is an optional dependency (the `plot` extra): it is imported when a picture is asked for, and
its absence is a clear error then, never at start.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("drawing needs matplotlib: pip install 'ferrox-batch[plot]' (or matplotlib)") from None
    matplotlib.use("Agg")  # files only: no display is needed or opened
    import matplotlib.pyplot as plt

    return plt


def plot_runs(runs: Sequence[Mapping[str, Any]], names: Sequence[str], title: str, path: str | Path) -> Any:
    """Draw `runs` (each with `config`, `tok_s`, `ttfts_ms`, `itls_ms`; a failed one has `failed`) of the
    configurations `names`, in that order, to `path` (PNG by its suffix). Returns the figure."""
    plt = _pyplot()
    good = {name: [r for r in runs if r["config"] == name and "failed" not in r] for name in names}
    shown = [name for name in names if good[name]]
    if not shown:
        raise ValueError("no successful run to draw")
    fig, (rate, ttft, itl) = plt.subplots(1, 3, figsize=(15, 4.8), layout="constrained")
    fig.suptitle(title, fontsize=10)
    x = range(len(shown))
    medians = [statistics.median(r["tok_s"] for r in good[name]) for name in shown]
    colours = [f"C{i}" for i in range(len(shown))]
    rate.bar(x, medians, color=colours, alpha=0.75)
    for i, name in enumerate(shown):
        rate.plot([i] * len(good[name]), [r["tok_s"] for r in good[name]], "k.", markersize=5)
        rate.annotate(f"{medians[i]:.0f}", (i, medians[i]), ha="center", va="bottom", fontsize=8)
    rate.set_title("throughput (median bar, repeats dotted)", fontsize=9)
    rate.set_ylabel("tok/s")
    for axes, key, label in ((ttft, "ttfts_ms", "time to first token"), (itl, "itls_ms", "inter-token latency")):
        samples = [[v for r in good[name] for v in r.get(key) or ()] for name in shown]
        drawn = [i for i, s in enumerate(samples) if s]
        if drawn:
            parts = axes.boxplot([samples[i] for i in drawn], positions=list(drawn), widths=0.6,
                                 whis=(1, 99), showfliers=False, patch_artist=True)
            for i, box in zip(drawn, parts["boxes"]):
                box.set_facecolor(colours[i])
                box.set_alpha(0.6)
            axes.set_yscale("log")
        axes.set_title(f"{label} (box p25-p75, whiskers p1-p99)", fontsize=9)
        axes.set_ylabel("ms")
    for axes in (rate, ttft, itl):
        axes.set_xticks(list(x), shown, rotation=20, ha="right", fontsize=8)
        axes.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def plot_ratios(results: Sequence[Mapping[str, Any]], title: str, path: str | Path, *, ylabel: str) -> Any:
    """Bars of `ratio` grouped by `machine`, one bar per `shape` (each result a mapping with those three
    keys and a `label` under its bar), with the parity line at 1. Returns the figure."""
    plt = _pyplot()
    machines = list(dict.fromkeys(r["machine"] for r in results))
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    present = {m: [s for s in shapes if any(r["machine"] == m and r["shape"] == s for r in results)] for m in machines}
    width = 0.8 / max(len(p) for p in present.values())
    # Wide enough that each bar's three-line label fits over it; the legend goes below, out of the title's way.
    bars_in_all = sum(len(p) for p in present.values())
    fig, axes = plt.subplots(figsize=(max(7.5, 0.85 * bars_in_all + 1.0), 5.2), layout="constrained")
    for j, shape in enumerate(shapes):
        xs, ys, labels = [], [], []
        for i, machine in enumerate(machines):
            for r in results:
                if r["machine"] == machine and r["shape"] == shape:
                    # Each machine's bars centred on its tick, whatever shapes it has.
                    k, n = present[machine].index(shape), len(present[machine])
                    xs.append(i + (k - (n - 1) / 2) * width)
                    ys.append(r["ratio"])
                    labels.append(r.get("label", ""))
        bars = axes.bar(xs, ys, width * 0.95, label=shape, color=f"C{j}", alpha=0.8)
        for bar, y, label in zip(bars, ys, labels):
            axes.annotate(f"{y:.2f}x" + (f"\n{label}" if label else ""), (bar.get_x() + bar.get_width() / 2, y),
                          ha="center", va="bottom", fontsize=7)
    axes.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
    axes.set_xticks(range(len(machines)), machines, fontsize=8)
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)
    axes.set_ylim(0, max(r["ratio"] for r in results) * 1.3)
    axes.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
