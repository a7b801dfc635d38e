"""The batcher benchmark's report: medians per method and shape, our/peer ratios, and the ids check."""

from __future__ import annotations

import statistics

#: Requests whose greedy ids each child returns, to compare with static's.
CHECKED = 4
#: The closed-loop chat shapes (`bench.conversations`): no static peer, and a prefix-cache column.
CHAT_SHAPES = ("c",)


def fmt(value, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def median_of(runs: list[dict], key: str):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def report(shapes: list[str], methods: list[str], runs: list[dict]) -> tuple[list[str], dict]:
    """The markdown table of medians per method and shape, and the same numbers as a summary dict."""
    chat = any(s in CHAT_SHAPES for s in shapes)
    lines = ["| method | shape | tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | peak RSS MB |"
             f"{' prefix hits |' if chat else ''} ours/peer |", "|---|---|---|---|---|---|" + "---|" * (1 + chat)]
    summary: dict = {}
    for shape in shapes:
        good = {m: [r for r in runs if r["shape"] == shape and r["method"] == m and "failed" not in r] for m in methods}
        ours_tok = median_of(good.get("ours", []), "tok_s")
        for m in methods:
            if m == "static" and shape in CHAT_SHAPES:
                continue  # never run: it cannot run a closed loop
            keys = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "peak_rss_mb", "wall_s",
                    "prefix_hit_rate")
            med = {k: median_of(good[m], k) for k in keys}
            ratio = None if m == "ours" or ours_tok is None or not med["tok_s"] else ours_tok / med["tok_s"]
            summary[f"{m}:{shape}"] = {**med, "ours_over_peer": ratio, "runs": len(good[m])}
            hits = "" if not chat else f" {hit_cell(shape, med['prefix_hit_rate'], good[m])} |"
            lines.append(f"| {m} | {shape} | {fmt(med['tok_s'], '.1f')} | {fmt(med['ttft_p50_ms'])} / "
                         f"{fmt(med['ttft_p99_ms'])} | {fmt(med['itl_p50_ms'], '.1f')} / "
                         f"{fmt(med['itl_p99_ms'], '.1f')} | {fmt(med['peak_rss_mb'])} |{hits} {fmt(ratio, '.2f')} |")
    return lines, summary


def hit_cell(shape: str, rate, good: list[dict]) -> str:
    """The median prefix-cache hit rate of a chat shape's runs: n/a where the stats have no counters."""
    if shape not in CHAT_SHAPES or not good:
        return "-"
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def check_ids(dtype: str, shapes: list[str], runs: list[dict], *,
              kv_cache_dtype: str = "auto") -> tuple[list[str], bool]:
    """Compare each method's first greedy ids with static's; in fp32 throughout (fp32 K/V too: `auto` stores
    fp32 under fp32) a mismatch of ours (cache on or off) fails the run."""
    notes, failed = [], False
    exact = dtype == "fp32" and kv_cache_dtype in ("auto", "fp32")
    for shape in shapes:
        first = {}
        for r in runs:
            if r["shape"] == shape and "failed" not in r:
                first.setdefault(r["method"], r["ids"])
        if "static" not in first:
            continue
        for m in ("ours", "ours-nocache", "cb"):
            if m not in first:
                continue
            bad = [i for i, (x, y) in enumerate(zip(first[m], first["static"])) if x != y]
            if not bad:
                notes.append(f"ids check, shape {shape}: {m} == static on the first {CHECKED} requests")
            elif m != "cb" and exact:
                failed = True
                notes.append(f"ids check FAILED, shape {shape}: {m} != static (fp32) on requests {bad}")
            elif dtype == "fp16w":  # static runs fp32: rounding the weights to fp16 may flip a near-tie
                notes.append(f"WARNING ids, shape {shape}: {m} (fp16w) != static (fp32) on requests {bad}")
            else:
                notes.append(f"WARNING ids, shape {shape}: {m} != static ({dtype}, {kv_cache_dtype} K/V) on "
                             f"requests {bad}")
    return notes, failed
