"""Benchmark `ferrox-batch serve` over HTTP: server settings side by side, on the same workload, in one run.

What a user gets is the server with its defaults, so this is the measurement the server's defaults are
chosen by. Each named configuration is a list of `ferrox-batch serve` flags (empty: the defaults); each
run starts a fresh server in its own process on a free loopback port, sends the shape's requests all at
once as streamed `/v1/completions` (token-id prompts, greedy, `ignore_eos`, every request from its own
thread behind a barrier), and stops the server. Repeats are interleaved by configuration, the table gives
medians and each configuration's throughput over the first one's. tok/s = completion tokens (from each
stream's usage) / (first submit -> last finish). TTFT: submit -> first streamed text. ITL: gaps between
a request's consecutive streamed chunks, pooled.

`--peer NAME=COMMAND` adds another OpenAI-compatible server to the table, started from its own command
line (`{port}` is filled in; `bench.servers`). For our servers the table also says where the worker's
time went between two `GET /stats` snapshots around the run: idle, its own Python, forwards, and the
part of the forwards with the worker thread off its core (`engine.worker_time`).

Shape c is a multi-turn chat (`bench.conversations`): 16 conversations x 4 turns sharing a system prompt,
each turn's prompt the chat so far (our tokenizer's chat template, earlier replies as the server streamed
them), sent as token ids once the previous reply is in; per run it adds the prefix cache's hit rate, from
`GET /stats` before and after (n/a while the stats have no `prefix_cache_queries`/`prefix_cache_hits`).

    ferrox-batch bench-http                                   # defaults vs the upstream tick, shape a, 3 repeats
    ferrox-batch bench-http --config "fast=--max-batch-tokens 2048" --config "defaults=" --repeats 5
    ferrox-batch bench-http --shape b --dtype fp32 --json /tmp/http.json
    ferrox-batch bench-http --shape c --config "cache=" --config "nocache=--no-prefix-cache"
    ferrox-batch bench-http --shape d --config "spec=" --config "nospec=--no-speculative" --plot /tmp/d.png
(`python -m ferrox_batch.bench.http ...` is the same program.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ferrox_batch.bench import conversations
from ferrox_batch.bench.http_client import (
    WORKER_KEYS,
    chat_loop,
    closed_loop,
    drafting,
    get_stats,
    one_at_a_time,
    worker_split,
)
from ferrox_batch.bench.report import CHAT_SHAPES, fmt, hit_cell, median_of
from ferrox_batch.bench.servers import Server, ServerSpec, parse_spec
from ferrox_batch.bench.shapes import SINGLE_STREAM_SHAPES, shape_requests
from ferrox_batch.bench.workloads import Request, describe

#: The configurations compared when none are named: the server's defaults, and the upstream tick.
DEFAULT_CONFIGS = (
    "defaults=",
    "upstream=--max-prefills-per-tick 1 --max-batch-tokens 256 --prefill-chunk 128 --kv-block-size 256 "
    "--step-target-ms 0",
)


def parse_args(argv: Sequence[str] | None, env: Mapping[str, str], prog: str | None = None) -> argparse.Namespace:
    from ferrox_batch.bench.batcher import default_model

    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model(env), help="checkpoint (default: the fetched SmolLM2)")
    p.add_argument("--config", action="append", metavar="NAME=FLAGS",
                   help=f"a named list of serve flags, repeatable (default: {' and '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--peer", action="append", default=[], metavar="NAME=COMMAND",
                   help="another OpenAI-compatible server, measured beside ours: its command line with {port} "
                        "where the port goes, repeatable (scripts/bench_serving.py builds llama.cpp's)")
    p.add_argument("--shape", default="a", choices=("a", "b", "c", "s", "d", "d4"),
                   help="c: the multi-turn chat; s: the single stream (one request at a time); d: editing tasks "
                        "whose answers copy their prompts, one at a time (d4: four at once)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32", "fp16w"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="4 requests x 8 tokens (c: 2 conversations x 2 turns x 8 tokens), 1 repeat")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run's requests may take")
    p.add_argument("--json", metavar="PATH", help="write the raw numbers here")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw the table: tok/s per server, TTFT and ITL as distributions (needs matplotlib)")
    args = p.parse_args(argv)
    args.config = args.config or list(DEFAULT_CONFIGS)
    if args.quick:
        args.repeats = 1
    return args


def named_configs(specs: Sequence[str], peers: Sequence[str] = ()) -> list[ServerSpec]:
    """`NAME=FLAGS` specs of ours, then `NAME=COMMAND` peers, in the order the table shows them."""
    out = [parse_spec(spec) for spec in specs] + [parse_spec(spec, peer=True) for spec in peers]
    names = [spec.name for spec in out]
    if len(set(names)) != len(names):
        raise SystemExit(f"configuration names must differ, got {names}")
    return out


def run_one(args: argparse.Namespace, spec: ServerSpec, requests: list[Request],
            env: Mapping[str, str], chat: tuple | None = None) -> dict:
    """One server, one measured run; `chat` (tokenizer, plan) runs shape c (`requests` then only warm it up)."""
    name = spec.name
    server = Server(spec, args.model, args.device, args.dtype, env)
    try:
        server.wait_ready()
        closed_loop(server.port, [Request(r.prompt[:16], 4) for r in requests[:2]], args.timeout)  # warm-up
        window = time.perf_counter()
        before = get_stats(server.port)
        if chat is not None:
            measured = chat_loop(server.port, *chat, args.timeout)
        elif args.shape in SINGLE_STREAM_SHAPES:
            measured = one_at_a_time(server.port, requests, args.timeout)
        else:
            measured = closed_loop(server.port, requests, args.timeout)
        after = get_stats(server.port)
        # Over the time between the two snapshots, which is what their differences cover.
        return {"config": name, **measured, **worker_split(before, after, time.perf_counter() - window),
                **drafting(before, after)}
    except Exception as error:  # noqa: BLE001 - a failed run is reported in the table, not raised
        return {"config": name, "failed": f"{type(error).__name__}: {error}"}
    finally:
        server.stop()


def report(names: list[str], runs: list[dict]) -> list[str]:
    chat = any("chat" in r for r in runs)  # shape c: a column for the prefix cache's hit rate
    drafts = any(r.get("draft_tokens") for r in runs)  # a column for speculative decoding's acceptance
    lines = [f"| config | tok/s | TTFT p50/p99 ms | ITL p50/p99 ms |{' prefix hits |' if chat else ''}"
             f"{' drafts accepted |' if drafts else ''} worker idle / scheduling / forward (off CPU) "
             "| tok/s over the first |",
             "|---|---|---|---|---|---|" + "---|" * (chat + drafts)]
    first = None
    for name in names:
        good = [r for r in runs if r["config"] == name and "failed" not in r]
        keys = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "prefix_hit_rate",
                "draft_acceptance", *WORKER_KEYS)
        med = {k: median_of(good, k) for k in keys}
        first = med["tok_s"] if first is None else first
        ratio = None if not first or med["tok_s"] is None else med["tok_s"] / first
        hits = f" {hit_cell('c', med['prefix_hit_rate'], good)} |" if chat else ""
        hits += f" {fmt(med['draft_acceptance'], '.0%')} |" if drafts else ""
        lines.append(f"| {name} | {fmt(med['tok_s'], '.1f')} | {fmt(med['ttft_p50_ms'])} / {fmt(med['ttft_p99_ms'])} "
                     f"| {fmt(med['itl_p50_ms'], '.0f')} / {fmt(med['itl_p99_ms'], '.0f')} |{hits} "
                     f"{worker_cell(med)} | {fmt(ratio, '.2f')} |")
    return lines


def worker_cell(med: dict) -> str:
    if med["worker_forward"] is None:
        return "-"
    pct = {key: 100 * med[key] for key in WORKER_KEYS}
    return (f"{pct['worker_idle']:.0f}% / {pct['worker_scheduling']:.0f}% / {pct['worker_forward']:.0f}% "
            f"({pct['worker_off_cpu']:.0f}%)")


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, prog: str | None = None) -> int:
    env = os.environ if env is None else env
    args = parse_args(argv, env, prog)
    from ferrox_batch.bench.batcher import resolved_dtype
    from ferrox_batch.runtime.device import choose_device, cpu_description
    from ferrox_batch.runtime.loading.tokenizer import Tokenizer

    configs = named_configs(args.config, args.peer)
    args.device = str(choose_device("auto"))  # where `serve` would run; every server is told so
    args.dtype, why = resolved_dtype(args.dtype, args.device)
    tokenizer, chat = Tokenizer.from_dir(args.model), None
    if args.shape in CHAT_SHAPES:
        chat = (tokenizer, conversations.build_plan(tokenizer, args.seed, args.quick))
        requests, what = conversations.sizing_requests(*chat), conversations.describe_plan(*chat)
    else:
        requests = shape_requests(args.shape, tokenizer, args.seed, args.quick)
        what = describe(requests)
    print(f"# bench-http: {args.model} on {args.device}, dtype {args.dtype} ({why}), shape {args.shape}: "
          f"{what}, repeats {args.repeats}")
    print(f"# cpu: {cpu_description()}")
    for spec in configs:
        print(f"# {spec.name}: {spec.describe()}")
    runs = []
    for rep in range(args.repeats):
        for spec in configs:
            name = spec.name
            run = run_one(args, spec, requests, env, chat)
            runs.append(run)
            state = run.get("failed") or (f"{run['tok_s']:.1f} tok/s, ITL p99 {fmt(run['itl_p99_ms'])} ms, "
                                          f"{len(run['errors'])} errors, {len(run['short'])} short"
                                          f"{conversations.chat_state(run) if 'chat' in run else ''}")
            print(f"# [{rep + 1}/{args.repeats}] {name}: {state}", file=sys.stderr, flush=True)
    print("\n".join(report([spec.name for spec in configs], runs)))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    if args.plot:
        from ferrox_batch.bench.plots import plot_runs

        title = (f"{Path(args.model).name}, shape {args.shape} ({what}), {args.dtype}, {args.repeats} repeats\n"
                 f"{cpu_description()}")
        plot_runs(runs, [spec.name for spec in configs], title, args.plot)
        print(f"# plot: {args.plot}")
    bad = [r for r in runs if r.get("failed") or r.get("errors") or r.get("short")]
    for r in bad:
        print(f"# PROBLEM {r['config']}: {r.get('failed', '')} {r.get('errors', [])[:3]} short {r.get('short', [])}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
