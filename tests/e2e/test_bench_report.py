"""bench.report: medians, our/peer ratios and the greedy-ids check of the batcher benchmark."""

from __future__ import annotations

from ferrox_batch.bench.report import check_ids, report


def run(method: str, tok_s: float, ids=None, shape: str = "a", **extra) -> dict:
    return {"method": method, "shape": shape, "tok_s": tok_s, "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0,
            "itl_p50_ms": 1.0, "itl_p99_ms": 2.0, "peak_rss_mb": 100.0, "wall_s": 1.0,
            "ids": ids or [[1, 2], [3]], **extra}


def test_the_ratio_is_ours_median_over_each_peers_median() -> None:
    runs = [run("ours", 300), run("ours", 500), run("ours", 400), run("cb", 200), run("cb", 100), run("cb", 250),
            run("static", 1, failed="exit 1")]
    lines, summary = report(["a"], ["ours", "cb", "static"], runs)
    assert summary["ours:a"]["tok_s"] == 400 and summary["ours:a"]["ours_over_peer"] is None
    assert summary["cb:a"]["tok_s"] == 200 and summary["cb:a"]["ours_over_peer"] == 2.0
    assert summary["static:a"]["runs"] == 0 and summary["static:a"]["tok_s"] is None  # failed runs do not count
    assert lines[2].startswith("| ours | a | 400.0 |") and lines[3].endswith("| 2.00 |")
    assert lines[4] == "| static | a | - | - / - | - / - | - | - |"


def test_an_fp32_mismatch_of_ours_fails_and_any_other_only_warns() -> None:
    static, other = [[1, 2], [3]], [[1, 2], [4]]
    runs = [run("static", 1, static), run("ours", 1, other), run("cb", 1, other)]
    notes, failed = check_ids("fp32", ["a"], runs)
    assert failed and any("FAILED" in n and "ours" in n and "[1]" in n for n in notes)
    assert any(n.startswith("WARNING ids, shape a: cb") for n in notes)
    notes, failed = check_ids("bf16", ["a"], runs)
    assert not failed and all("FAILED" not in n for n in notes)
    notes, failed = check_ids("fp32", ["a"], runs, kv_cache_dtype="fp32")  # fp32 K/V, as asked: still exact
    assert failed
    notes, failed = check_ids("fp32", ["a"], runs, kv_cache_dtype="fp16")  # narrower K/V may flip a near-tie
    assert not failed and any("ours != static (fp32, fp16 K/V)" in n for n in notes)
    notes, failed = check_ids("fp16w", ["a"], runs)  # static ran fp32: the warning says so
    assert not failed and any("ours (fp16w) != static (fp32)" in n for n in notes)
    notes, failed = check_ids("fp32", ["a"], [run("static", 1, static), run("ours", 1, static)])
    assert not failed and notes == ["ids check, shape a: ours == static on the first 4 requests"]
    assert check_ids("fp32", ["a"], [run("ours", 1, other)]) == ([], False)  # nothing to compare with
    notes, failed = check_ids("fp32", ["a"], [run("static", 1, static), run("ours-nocache", 1, other)])
    assert failed and any("FAILED" in n and "ours-nocache" in n for n in notes)
