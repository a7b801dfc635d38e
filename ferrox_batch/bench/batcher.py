"""Benchmark the continuous batcher against transformers' static and continuous batching.

Closed-loop, all-at-once workloads on the default model (`bench.workloads` builds them):
  a: 32 requests x 64 new tokens, prompts of 20-200 tokens (3,520 in all);
  b: 128 requests, prompt and output lengths uniform in 16-256 (seeded);
  c: a multi-turn chat (`bench.conversations`), 16 conversations x 4 turns sharing a ~300-token system
     prompt, each turn sent once the previous reply is in; ours and cb only (static cannot run a closed
     loop), with the prefix cache's hit rate from `stats()` where the batcher counts it;
  d: editing tasks whose answers copy their prompts (`bench.copying`), one at a time; d4: four at once;
     ours and ours-nospec only (what speculative decoding buys).
Greedy, EOS ignored, the same prompt ids and token counts for every method:
  ours    one thread per request calling `ContinuousBatcher.generate_streaming`, started behind a barrier,
          configured as the server is (prefix cache on);
  ours-nocache  the same with the prefix cache off (its ratio column is then what the cache buys);
  ours-nospec   the same with speculative decoding off;
  static  transformers `generate`, every request in one left-padded batch, max_new_tokens = the largest asked
          (only each request's own tokens count as output);
  cb      transformers continuous batching (`continuous_batching_context_manager`, sdpa, page 64,
          max_batch_tokens 512) after one untimed warm-up session.
Each method runs in its own fresh subprocess (so peak RSS is per method), `--repeats` times interleaved
by method; the table gives medians. tok/s = useful generated tokens / (first submit -> last finish).
TTFT: ours submit -> first streamed chunk; cb created_time -> timestamps[0]; static start -> first
step. ITL: gaps between a request's consecutive token times, pooled (ours: chunk times; a token that
completes no UTF-8 text joins the next chunk). Our greedy ids for the first 4 requests must equal
static's in fp32 (exit 1 otherwise); in bf16 a mismatch is only a warning. The peers need the test
extra (transformers); `--methods ours` runs without it.

    ferrox-batch bench                          # shapes a,b; ours,static,cb; 3 repeats; dtype auto
    ferrox-batch bench --quick                  # 4 requests x 8 tokens, 1 repeat: does it work
    ferrox-batch bench --shapes a --methods ours,static --dtype fp32 --json /tmp/bench.json
    ferrox-batch bench --shapes b --max-batch-tokens 1024 --kv-block-size 32
    ferrox-batch bench --shapes c --methods ours,ours-nocache,cb   # the chat; --quick: 2 conversations x 2 turns
    ferrox-batch bench --shapes d,d4 --methods ours,ours-nospec     # copying edits, with and without drafts
(`python scripts/bench.py ...` and `python -m ferrox_batch.bench.batcher ...` are the same program.)
"""

# It lives in the package, not in scripts/, so that the installed `ferrox-batch bench` can run it; each
# measured run is a child process of this same module (`python -m ferrox_batch.bench.batcher --child ...`).

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.bench.conversations import chat_shape, chat_state
from ferrox_batch.bench.report import CHAT_SHAPES, CHECKED, check_ids, report
from ferrox_batch.bench.runs import OURS, child_chat, run_ours
from ferrox_batch.bench.shapes import COPYING_SHAPES, SINGLE_STREAM_SHAPES, shape_requests
from ferrox_batch.bench.workloads import (
    Request,
    current_rss_mb,
    describe,
    latency_summary,
    peak_rss_mb,
    run_cb,
    run_static,
)

METHODS = ("ours", "ours-nocache", "ours-nospec", "static", "cb")
#: The methods run by default (`ours-nocache` is asked for by name).
DEFAULT_METHODS = ("ours", "static", "cb")
CHILD_MODULE = "ferrox_batch.bench.batcher"


def default_model(env: Mapping[str, str]) -> str:
    """The fetched default checkpoint under `$FERROX_HOME` (or `~/.cache/ferrox-batch`), as before the move."""
    from ferrox_batch.runtime.loading.fetch import default_model_dir, ferrox_home_from_env

    return str(default_model_dir(ferrox_home_from_env(env)))


def parse_args(argv: Sequence[str] | None, env: Mapping[str, str] | None = None,
               prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model(os.environ if env is None else env),
                   help="checkpoint folder (default: the fetched SmolLM2-135M-Instruct)")
    p.add_argument("--shapes", default="a,b",
                   help="a, b, c (the chat; static skips it), d (copying edits one at a time) and/or d4 (four at "
                        "once); d and d4 run ours only")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"any of {','.join(METHODS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32", "fp16w"),
                   help="auto: what `ferrox-batch serve` would pick on this machine (default)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp32", "fp16", "bf16"),
                   help="what our KV cache stores (auto: as `ferrox-batch serve` picks)")
    p.add_argument("--quick", action="store_true",
                   help="4 requests x 8 tokens (c: 2 conversations x 2 turns x 8 tokens), 1 repeat")
    p.add_argument("--json", metavar="PATH", help="write the raw numbers here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one method run may take")
    serving = BatcherConfig.serving()
    g = p.add_argument_group("our batcher (defaults: the server's)")
    g.add_argument("--max-seqs", type=int, default=0, help="0: unlimited")
    g.add_argument("--prefill-chunk", type=int, default=serving.prefill_chunk)
    g.add_argument("--max-batch-tokens", type=int, default=serving.max_batch_tokens)
    g.add_argument("--max-prefills-per-tick", type=int, default=serving.max_prefills_per_tick,
                   help="prompts one forward may advance (1: the upstream tick)")
    g.add_argument("--step-target-ms", type=int, default=serving.step_target_ms or 0,
                   help="time target of a tick with rows decoding (0: none, the token budget alone)")
    g.add_argument("--kv-block-size", type=int, default=serving.kv_block_size)
    g.add_argument("--kv-blocks", type=int, default=0, help="0: every request of the shape fits at once")
    g.add_argument("--logprobs", type=int, default=-1, metavar="K",
                   help="every request asks for its tokens' log-probabilities with K alternatives (-1: none), "
                        "to measure what they cost")
    g = p.add_argument_group("transformers continuous batching")
    g.add_argument("--cb-blocks", type=int, default=0, help="0: 1.5x what the shape needs, in 16s (160 for a)")
    g.add_argument("--cb-page-size", type=int, default=64)
    g.add_argument("--cb-max-batch-tokens", type=int, default=512)
    g.add_argument("--cb-release-openmp", action="store_true",
                   help="diagnostic: release the loading thread's OpenMP pool before the run, as our "
                        "batcher does (the peer runs its loop on a background thread too)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # METHOD:SHAPE, internal: one measured run
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1
    return args


def resolved_dtype(dtype: str, device: str = "cpu") -> tuple[str, str]:
    """`auto` made concrete as the server makes it on `device` (bf16, fp16w or fp32), with the reason."""
    import torch

    from ferrox_batch.runtime.device import choose_dtype_reasoned

    choice = choose_dtype_reasoned(dtype, torch.device(device))
    return choice.name, choice.reason


def blocks_needed(requests: list[Request], block: int) -> int:
    return sum(max(1, math.ceil((len(r.prompt) + r.max_tokens) / block)) for r in requests)


def sized(args: argparse.Namespace, requests: list[Request]) -> tuple[int, int]:
    kv = args.kv_blocks or blocks_needed(requests, args.kv_block_size)
    cb = args.cb_blocks or 16 * math.ceil(1.5 * blocks_needed(requests, args.cb_page_size) / 16)
    return kv, cb


def child_main(args: argparse.Namespace) -> int:
    import torch

    from ferrox_batch.runtime.loading.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    method, shape = args.child.split(":")
    tokenizer = Tokenizer.from_dir(args.model)
    if shape in CHAT_SHAPES:
        raw = child_chat(args, method, tokenizer, sized)
        requests = raw.pop("requests")  # one per turn, as sent
    else:
        requests = shape_requests(shape, tokenizer, args.seed, args.quick)
        kv_blocks, cb_blocks = sized(args, requests)
        if method in OURS:
            raw = run_ours(args, requests, kv_blocks, method=method, one_at_a_time=shape in SINGLE_STREAM_SHAPES)
        else:
            raw = {"static": run_static, "cb": run_cb}[method](args, requests, cb_blocks)
    useful = sum(min(len(ids), r.max_tokens) for ids, r in zip(raw["ids"], requests))
    short = [i for i, (ids, r) in enumerate(zip(raw["ids"], requests)) if len(ids) != r.max_tokens]
    wall = raw["end"] - raw["start"]
    result = {"method": method, "shape": shape, "wall_s": wall, "useful_tokens": useful, "tok_s": useful / wall,
              **latency_summary(raw["ttfts"], raw["times"]), "peak_rss_mb": peak_rss_mb(),
              "rss_end_mb": current_rss_mb(), "rss_after_load_mb": raw["rss_after_load_mb"],
              "threads": torch.get_num_threads(),
              "errors": raw["errors"][:10], "wrong_length": short[:20], "ids": raw["ids"][:CHECKED],
              "ttfts_ms": [t * 1e3 for t in raw["ttfts"]], **raw.get("extra", {})}
    Path(args.out).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------ the parent: spawn, collect, report

def child_argv(args: argparse.Namespace, method: str, shape: str, out: str, kv: int, cb: int) -> list[str]:
    argv = [sys.executable, "-m", CHILD_MODULE, "--child", f"{method}:{shape}", "--out", out,
            "--model", args.model, "--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype,
            "--seed", str(args.seed), "--threads", str(args.threads),
            "--timeout", str(args.timeout), "--max-seqs", str(args.max_seqs),
            "--prefill-chunk", str(args.prefill_chunk), "--max-batch-tokens", str(args.max_batch_tokens),
            "--max-prefills-per-tick", str(args.max_prefills_per_tick), "--step-target-ms", str(args.step_target_ms),
            "--kv-block-size", str(args.kv_block_size), "--kv-blocks", str(kv), "--cb-blocks", str(cb),
            "--logprobs", str(args.logprobs),
            "--cb-page-size", str(args.cb_page_size), "--cb-max-batch-tokens", str(args.cb_max_batch_tokens)]
    return argv + (["--quick"] if args.quick else []) + (["--cb-release-openmp"] if args.cb_release_openmp else [])


def child_env() -> dict[str, str]:
    """The parent's environment, with this package's folder first on PYTHONPATH.

    `-m` finds the module through the child's sys.path, which starts with its working directory; an
    uninstalled checkout run from elsewhere (`python /path/to/scripts/bench.py`) must still find it.
    """
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def spawn(args: argparse.Namespace, method: str, shape: str, kv: int, cb: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        began = time.monotonic()
        try:
            proc = subprocess.run(child_argv(args, method, shape, out, kv, cb), check=False,
                                  timeout=args.timeout + 300, env=child_env())
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        if code != 0 or not Path(out).exists():
            return {"method": method, "shape": shape, "failed": f"exit {code}", "process_s": time.monotonic() - began}
        result = json.loads(Path(out).read_text())
        result["process_s"] = time.monotonic() - began
        return result


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, prog: str | None = None) -> int:
    """Run the benchmark (or, with `--child`, one measured run); `env` defaults to the process environment."""
    args = parse_args(argv, env, prog)
    if args.child:
        return child_main(args)
    from ferrox_batch.runtime.device import cpu_description
    from ferrox_batch.runtime.loading.tokenizer import Tokenizer

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := sorted(set(methods) - set(METHODS)):
        raise SystemExit(f"unknown methods {unknown}; use {','.join(METHODS)}")
    tokenizer = Tokenizer.from_dir(args.model)
    sizes = {}
    args.dtype, why = resolved_dtype(args.dtype)  # every child runs the one dtype the parent chose
    # transformers runs fp16w's nearest precision, fp32: its weights are not rounded to fp16.
    peers = "bf16" if args.dtype == "bf16" else "fp32"
    print(f"# bench: {args.model}, dtype {args.dtype} ({why}), transformers in {peers}, repeats {args.repeats}"
          f"{', quick' if args.quick else ''}")
    print(f"# cpu: {cpu_description()}")
    for shape in shapes:
        if shape in CHAT_SHAPES:
            requests, what = chat_shape(tokenizer, args.seed, args.quick, skip_static="static" in methods)
        else:
            requests = shape_requests(shape, tokenizer, args.seed, args.quick)
            what = describe(requests)
        sizes[shape] = sized(args, requests)
        print(f"# shape {shape}: {what}; ours kv_blocks {sizes[shape][0]} x {args.kv_block_size}, "
              f"cb num_blocks {sizes[shape][1]} x {args.cb_page_size}")
    print(f"# ours: max_seqs {args.max_seqs or 'unlimited'}, prefill_chunk {args.prefill_chunk}, "
          f"max_batch_tokens {args.max_batch_tokens}, max_prefills_per_tick {args.max_prefills_per_tick}, "
          f"step_target_ms {args.step_target_ms or 'none'}, "
          f"kv_block_size {args.kv_block_size}{f', logprobs {args.logprobs}' if args.logprobs >= 0 else ''}; "
          f"cb: page_size {args.cb_page_size}, max_batch_tokens {args.cb_max_batch_tokens}, sdpa"
          f"{', loading thread OpenMP pool released' if args.cb_release_openmp else ''}", flush=True)
    runs = []
    for shape in shapes:
        for rep in range(args.repeats):
            for method in methods:
                if method == "static" and shape in CHAT_SHAPES:
                    continue  # said in the shape's line above
                if method not in OURS and shape in COPYING_SHAPES:
                    continue  # the copying shapes measure our speculation: ours with it and without
                r = spawn(args, method, shape, *sizes[shape])
                runs.append(r)
                state = r.get("failed") or (f"{r['tok_s']:.1f} tok/s in {r['wall_s']:.1f} s, "
                                            f"{len(r['errors'])} errors, {len(r['wrong_length'])} wrong lengths"
                                            f"{chat_state(r) if 'chat' in r else ''}")
                print(f"# [{rep + 1}/{args.repeats}] {method} {shape}: {state} ({r['process_s']:.0f} s process)",
                      file=sys.stderr, flush=True)
    lines, summary = report(shapes, methods, runs)
    notes, failed = check_ids(args.dtype, shapes, runs, kv_cache_dtype=args.kv_cache_dtype)
    print("\n".join(lines + [""] + [f"# {n}" for n in notes]))
    for r in runs:
        if r.get("failed") or r.get("errors") or r.get("wrong_length"):
            print(f"# PROBLEM {r['method']} {r['shape']}: {r.get('failed') or ''} {r.get('errors', [])[:3]} "
                  f"wrong lengths {r.get('wrong_length', [])}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "sizes": sizes, "summary": summary, "runs": runs},
                                              indent=1))
    return 1 if failed or any("failed" in r for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
