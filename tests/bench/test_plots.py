"""Benchmark pictures (`bench.plots`): what the table says, drawn.

Pins: `plot_runs` writes a PNG whose three panels are the servers' median tok/s (bars at the medians,
every repeat a dot), and their TTFT and ITL distributions (a box per server, from every sample), servers
in the order asked, failed runs left out, the title carried; `plot_ratios` groups bars by machine with one
per shape, at the ratios given, over a parity line; and `bench-http --plot` draws its own run's numbers.
"""

from __future__ import annotations

import random

import pytest

from ferrox_batch.bench.plots import plot_ratios, plot_runs

PNG = b"\x89PNG\r\n\x1a\n"


def run(name: str, tok_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    return {"config": name, "tok_s": tok_s, "ttfts_ms": [rng.uniform(50, 500) for _ in range(32)],
            "itls_ms": [rng.uniform(5, 60) for _ in range(300)]}


def test_runs_are_drawn_as_the_table_says(tmp_path):
    runs = [run("ours", 700, 1), run("llama.cpp", 300, 2), run("ours", 720, 3), run("llama.cpp", 310, 4),
            run("ours", 690, 5), {"config": "llama.cpp", "failed": "exit 1"}]
    path = tmp_path / "run.png"
    fig = plot_runs(runs, ["ours", "llama.cpp"], "shape a\nAMD EPYC; flags: avx2", path)
    assert path.read_bytes().startswith(PNG) and path.stat().st_size > 10_000
    rate, ttft, itl = fig.axes
    assert [bar.get_height() for bar in rate.patches] == [700, 305]
    assert [t.get_text() for t in rate.get_xticklabels()] == ["ours", "llama.cpp"]
    assert len(rate.lines) == 2 and [len(line.get_xdata()) for line in rate.lines] == [3, 2]
    assert fig.get_suptitle() == "shape a\nAMD EPYC; flags: avx2"
    for axes in (ttft, itl):
        assert len(axes.patches) == 2 and axes.get_yscale() == "log"
    with pytest.raises(ValueError, match="no successful run"):
        plot_runs([{"config": "x", "failed": "exit 1"}], ["x"], "t", tmp_path / "none.png")


def test_ratios_are_grouped_by_machine(tmp_path):
    results = [{"machine": "AVX2 EPYC", "shape": "a", "ratio": 1.44}, {"machine": "AVX2 EPYC", "shape": "c", "ratio": 1.98},
               {"machine": "Zen 4", "shape": "a", "ratio": 1.9, "label": "bf16"}]
    path = tmp_path / "ratios.png"
    fig = plot_ratios(results, "ours over llama.cpp", path, ylabel="x llama.cpp")
    assert path.read_bytes().startswith(PNG)
    (axes,) = fig.axes
    assert sorted(round(bar.get_height(), 2) for bar in axes.patches) == [1.44, 1.9, 1.98]
    assert [t.get_text() for t in axes.get_xticklabels()] == ["AVX2 EPYC", "Zen 4"]
    assert any(line.get_ydata()[0] == 1.0 for line in axes.lines)  # the parity line
