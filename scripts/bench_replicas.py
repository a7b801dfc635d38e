"""Shape (c) on replicas: the prefix-affinity router against Ray Serve's default, side by side in one run.

    python scripts/bench_replicas.py [--replicas 2] [--routers affinity,default] [--single] [--repeats 1] [--quick]

Starts a local Ray instance once; for each router (interleaved per repeat) it deploys `--replicas` replicas of
the model (each `--replica-cpus` CPUs, KV `--kv-memory`, prefix cache on), warms them, runs shape (c) (16
conversations x 4 turns sharing one system prompt, closed loop, over HTTP through the ingress) and prints
tok/s, TTFT and ITL percentiles, the prefix cache's hit rate summed over the replicas (each replica's
`/stats` read through the router's replica pin before and after), and how the prompt tokens split between
the replicas. `--single` adds one replica holding all their CPUs: the same hardware, one batch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import ray
from ray import serve

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.bench import conversations
from ferrox_batch.bench.http_client import chat_loop, stream_completion
from ferrox_batch.bench.report import fmt
from ferrox_batch.bench.workloads import Request
from ferrox_batch.cli.common import parse_memory_size
from ferrox_batch.deploy import ROUTERS
from ferrox_batch.deploy.ray_serve import APP_NAME, ReplicaSpec, build_application, replica_ids, replica_stats
from ferrox_batch.runtime.device import cpu_description
from ferrox_batch.runtime.loading.fetch import default_model_dir, ferrox_home_from_env
from ferrox_batch.runtime.loading.tokenizer import Tokenizer


def run(port: int, tokenizer: Tokenizer, plan: conversations.Plan, timeout: float) -> dict:
    """bench-http's shape (c) loop, its prefix-cache counters summed over every replica's `/stats`."""
    snapshots: list[dict[str, dict]] = []

    def summed() -> dict:
        snapshots.append({r: replica_stats(f"http://127.0.0.1:{port}", r) for r in replica_ids()})
        return {k: sum(s[k] for s in snapshots[-1].values()) for k in ("prefix_cache_queries", "prefix_cache_hits")}

    result = chat_loop(port, tokenizer, plan, timeout, summed)
    before, after = snapshots
    result["split"] = [after[r]["prefix_cache_queries"] - before.get(r, {}).get("prefix_cache_queries", 0)
                       for r in sorted(after)]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the fetched default model)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--kv-memory", default="512MiB")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--port", type=int, default=8790)
    p.add_argument("--single", action="store_true",
                   help="also one replica with all the replicas' CPUs (the same hardware as one process)")
    args = p.parse_args()
    model = Path(args.model) if args.model else default_model_dir(ferrox_home_from_env(os.environ))
    tokenizer = Tokenizer.from_dir(model)
    plan = conversations.build_plan(tokenizer, args.seed, args.quick)
    routers = args.routers.split(",")
    layouts = [(r, args.replicas, args.replica_cpus) for r in routers]
    if args.single:
        layouts.append(("single", 1, args.replicas * args.replica_cpus))
    spec = ReplicaSpec(str(model), dtype=args.dtype, batcher=BatcherConfig.serving(),
                       kv_memory=parse_memory_size(args.kv_memory))
    print(f"# bench_replicas: {model}, {args.replicas} replicas x {args.replica_cpus} CPU, dtype {args.dtype}, "
          f"shape c: {conversations.describe_plan(tokenizer, plan)}")
    print(f"# cpu: {cpu_description()}")
    ray.init(num_cpus=max(os.cpu_count() or 1, int(args.replicas * args.replica_cpus)), include_dashboard=False,
             log_to_driver=False, object_store_memory=200 * 2**20)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    results: dict[str, list[dict]] = {name: [] for name, _, _ in layouts}
    try:
        for rep in range(args.repeats):
            for router, replicas, cpus in layouts:
                serve.run(build_application(spec, replicas, router="default" if router == "single" else router,
                                            replica_cpus=cpus), name=APP_NAME, route_prefix="/")
                warm = conversations.sizing_requests(tokenizer, plan)[:2]
                for r in warm:
                    stream_completion(args.port, Request(r.prompt[:16], 4), args.timeout)
                result = run(args.port, tokenizer, plan, args.timeout)
                results[router].append(result)
                print(f"# [{rep + 1}/{args.repeats}] {router}: {result['tok_s']:.1f} tok/s, TTFT p50 "
                      f"{fmt(result['ttft_p50_ms'], '.0f')} ms, hits {fmt(result['prefix_hit_rate'], '.3f')}, "
                      f"prompt tokens per replica {result['split']}, errors {result['errors']}",
                      file=sys.stderr, flush=True)
                serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    print("| router | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | prefix hit rate | prompt tokens per replica |")
    print("|---|---|---|---|---|---|")
    for router, runs in results.items():
        for r in runs:
            print(f"| {router} | {r['tok_s']:.1f} | {fmt(r['ttft_p50_ms'], '.0f')} / {fmt(r['ttft_p99_ms'], '.0f')} "
                  f"| {fmt(r['itl_p50_ms'], '.0f')} / {fmt(r['itl_p99_ms'], '.0f')} "
                  f"| {100 * (r['prefix_hit_rate'] or 0):.1f}% | {r['split']} |")
    return 1 if any(r["errors"] for runs in results.values() for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
