"""The client side of the HTTP benchmarks: requests sent to an OpenAI-compatible server and timed.

`stream_completion` sends one streamed `/v1/completions` (token-id prompt, greedy, `ignore_eos`) and keeps
the arrival time of every chunk that carried text. Three ways to send a workload: `closed_loop` (every
request at once, each from its own thread behind a barrier), `one_at_a_time` (the single stream) and
`chat_loop` (shape c's conversations, each turn sent once the previous reply is in). Each returns the run's
numbers: tok/s, TTFT and ITL percentiles and every sample (`latencies`), errors, short answers. From our
server's `GET /stats` around a run: where the worker's time went (`worker_split`) and what speculative
decoding did (`drafting`). `bench.http` (the `bench-http` program) and `scripts/bench_replicas.py` drive
these.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence

from ferrox_batch.bench import conversations
from ferrox_batch.bench.workloads import Request, gaps, latency_summary


def stream_completion(port: int, request: Request, timeout: float) -> tuple[list[float], int, str]:
    """One streamed completion: the arrival time of each chunk that carried text, the completion tokens, the text."""
    body = json.dumps({"prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    times: list[float] = []
    texts: list[str] = []
    tokens = 0
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        event = json.loads(line[5:])
        if text := "".join(choice.get("text") or "" for choice in event.get("choices", ())):
            times.append(time.perf_counter())
            texts.append(text)
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    conn.close()
    return times, tokens, "".join(texts)


def closed_loop(port: int, requests: list[Request], timeout: float) -> dict:
    n = len(requests)
    barrier = threading.Barrier(n)
    submit, done, tokens = [0.0] * n, [0.0] * n, [0] * n
    chunks: list[list[float]] = [[] for _ in range(n)]
    errors: list[str] = []

    def one(i: int) -> None:
        barrier.wait()
        submit[i] = time.perf_counter()
        try:
            chunks[i], tokens[i], _ = stream_completion(port, requests[i], timeout)
        except Exception as error:  # noqa: BLE001 - reported, not raised
            errors.append(f"request {i}: {type(error).__name__}: {error}")
        done[i] = time.perf_counter()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 60)
    wall = max(done) - min(submit)
    ttfts = [c[0] - s for c, s in zip(chunks, submit) if c]
    return {"wall_s": wall, "tokens": sum(tokens), "tok_s": sum(tokens) / wall, "errors": errors[:10],
            "short": [i for i, (t, r) in enumerate(zip(tokens, requests)) if t != r.max_tokens][:20],
            **latencies(ttfts, chunks)}


def one_at_a_time(port: int, requests: list[Request], timeout: float) -> dict:
    """The single stream: each request sent when the one before has finished. Its rate (`tok_s`) is the
    median over the requests of the decode rate after the first token, what one user sees once text flows."""
    start = time.perf_counter()
    ttfts, chunks, rates, tokens, errors = [], [], [], 0, []
    for i, request in enumerate(requests):
        submit = time.perf_counter()
        try:
            times, count, _ = stream_completion(port, request, timeout)
        except Exception as error:  # noqa: BLE001 - reported, not raised
            errors.append(f"request {i}: {type(error).__name__}: {error}")
            continue
        tokens += count
        chunks.append(times)
        if times:
            ttfts.append(times[0] - submit)
        if len(times) > 1 and count > 1:
            rates.append((count - 1) / (times[-1] - times[0]))
    wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": tokens, "tok_s": statistics.median(rates) if rates else 0.0,
            "errors": errors[:10], "short": [], **latencies(ttfts, chunks)}


def latencies(ttfts: Sequence[float], chunks: Sequence[Sequence[float]]) -> dict:
    """The TTFT and ITL percentiles, and every sample in milliseconds (what `--plot` draws)."""
    return {**latency_summary(ttfts, chunks), "ttfts_ms": [t * 1e3 for t in ttfts],
            "itls_ms": [g * 1e3 for times in chunks for g in gaps(times)]}


def get_stats(port: int) -> dict | None:
    """`GET /stats` (the batcher's `BatcherStats.to_dict()`), or None if it cannot be read."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/stats")
        response = conn.getresponse()
        body = response.read()
        conn.close()
        return json.loads(body) if response.status == 200 else None
    except (OSError, ValueError):
        return None


#: `/stats` fields of the worker's time (`engine.worker_time`), in ms, and the run keys they become.
WORKER_FIELDS = (("worker_idle_ms", "worker_idle"), ("worker_scheduling_ms", "worker_scheduling"),
                 ("worker_forward_ms", "worker_forward"), ("worker_forward_off_cpu_ms", "worker_off_cpu"))
WORKER_KEYS = tuple(key for _, key in WORKER_FIELDS)


def worker_split(before: dict | None, after: dict | None, window_s: float) -> dict:
    """The worker's idle, scheduling, forward and off-CPU-in-forward time between two `/stats` snapshots
    taken `window_s` apart, as fractions of it; None each where the server has no such stats (a peer)."""
    if not (before and after and window_s > 0 and all(f in before and f in after for f, _ in WORKER_FIELDS)):
        return {key: None for key in WORKER_KEYS}
    return {key: (after[field] - before[field]) / 1e3 / window_s for field, key in WORKER_FIELDS}


def drafting(before: dict | None, after: dict | None) -> dict:
    """Speculative decoding between two `/stats` snapshots: the draft tokens verified and the fraction
    accepted (None where the server has no such stats, or drafted nothing)."""
    keys = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    if not (before and after and all(k in before and k in after for k in keys)):
        return {"draft_tokens": None, "draft_acceptance": None}
    drafted = after[keys[0]] - before[keys[0]]
    accepted = after[keys[1]] - before[keys[1]]
    return {"draft_tokens": drafted, "draft_acceptance": accepted / drafted if drafted else None}


def chat_loop(port: int, tokenizer, plan: conversations.Plan, timeout: float,
              stats: Callable[[], dict | None] | None = None) -> dict:
    """Shape c: the conversations' turns as streamed completions, and the prefix cache's hits over the run
    (between two `stats()`, by default the server's `GET /stats`)."""
    def send(prompt: list[int], max_tokens: int) -> conversations.Reply:
        times, tokens, text = stream_completion(port, Request(prompt, max_tokens), timeout)
        return conversations.Reply(text, tokens, times)

    read = stats if stats is not None else lambda: get_stats(port)
    before = read()
    raw = conversations.flatten(tokenizer, plan, conversations.run_chats(tokenizer, plan, send, timeout))
    after = read()
    wall, tokens = raw["end"] - raw["start"], sum(raw["tokens"])
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall if wall > 0 else 0.0, "errors": raw["errors"][:10],
            "short": [i for i, (t, r) in enumerate(zip(raw["tokens"], raw["requests"])) if t != r.max_tokens][:20],
            **latencies(raw["ttfts"], raw["times"]), **conversations.chat_extra(raw, before, after)}
