"""`assert_no_stall`: a small well-behaved request's latency beside a hostile one stays near its latency alone.

How: the probe request is sent `SAMPLES` times alone (after a warm-up), then over and over while other
clients send the hostile request over and over (`copies` at once, each waiting for its answer, so it is
always in flight while the probe runs): at least `SAMPLES` times, and until `2 * copies + 1` hostile answers
came while it was sent, so that one attacker's requests ran whole beside it twice (each phase of a hostile
request, from its parsing to its answer's writing, is measured, however long it takes). Beside it, the
probe's median and its mean must stay within `bound(rows)` times its median and mean alone, and no more of
its samples may pass that many times its slowest alone than a sample alone passes its slowest (one in as many
as were sent alone, at least one); no fixed seconds, so the bound follows the machine the test runs on. It is sent `SAMPLES` times alone again after,
and both alone runs count: a machine whose other work comes or goes during the test moves both sides alike.

Why the bound is `2 x (1 + rows)` times the probe alone (`bound`): what a hostile request may fairly take from
the probe is its share of the machine, not the machine. Its `rows` rows in flight at once (`n` times the
clients sending it) may join each of the probe's forwards: a decode step of `1 + rows` rows instead of one,
which on the small batches here costs at most `1 + rows` times the one-row step (a step's work grows with its
rows, and its fixed part does not). Its own parsing, compile and first-masks probe run on a prepare thread,
bounded by the grammar budgets, and on a two-core machine compete with the worker's forward for the cores
(at most 2x). One row: 2 x 2 = 4 (`FACTOR`); a stall (a worker waiting on one row's mask, prepare threads
held by conversions) is 10-100x, as the numbers before the fixes were (0.2 s -> 17 s beside a regex with one
row; 17 ms -> 1.3 s beside `allowed_token_ids` with `n: 16`, 76x against a bound of 34x). A prompt is
prefilled in chunks that join the probe's steps too; what one chunk costs is not known from the probe's own
measurements, so a hostile request's prompt here is kept within a few rows' worth of tokens (its prefill is
one step's extra rows, counted in `rows`).

A hostile request answered 503 with `Retry-After` (shed as busy) is sent again after a quarter of that wait.

After the hostile requests, `/stats` must show every KV block free and the queue empty. The hostile
requests' statuses are returned for the caller to check (each must be an answer, never a 5xx but a 503).
"""

from __future__ import annotations

import gc
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection

import httpx

#: Probe latencies measured alone, and beside the hostile request.
SAMPLES = 9
#: What a hostile request of one row may fairly cost the probe (module docstring).
FACTOR = 4.0


def bound(rows: int) -> float:
    """How many times its latency alone the probe may take beside a request of `rows` rows in flight: one
    more row per hostile row in each of its steps (`1 + rows`), and the hostile request's own work sharing
    the cores (2x); `bound(1) == FACTOR`."""
    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    return 2.0 * (1 + rows)
#: Seconds `/stats` may take to show the hostile requests' blocks back (they are freed at the worker's next tick).
SETTLE_S = 15.0

Call = tuple[str, dict | bytes]


def _latencies(client: httpx.Client, probe: Call, count: int, until: Callable[[], bool] = lambda: True) -> list[float]:
    out: list[float] = []
    while len(out) < count or not until():
        began = time.perf_counter()
        reply = _post(client, probe)
        out.append(time.perf_counter() - began)
        assert reply.status_code == 200, reply.text
    return out


def _post(client: httpx.Client, call: Call) -> httpx.Response:
    route, body = call
    if isinstance(body, bytes):
        return client.post(route, content=body, headers={"Content-Type": "application/json"})
    return client.post(route, json=body)


def assert_no_stall(client: httpx.Client, probe: Call, hostile: Call | Callable[[int], Call],
                    copies: int = 1, hostile_headers: Mapping[str, str] | None = None,
                    rows: int = 1) -> list[httpx.Response]:
    """Measure `probe` alone and beside `hostile` (a call, or one per send number: to defeat caches), sent
    by `copies` clients at once; assert the bound for `rows` hostile rows in flight (`bound`: the caller
    states it from the request's `n` times `copies`; one for a request that is refused or never reaches
    the worker's steps); return the hostile answers (each answer's `request` holds what was sent)."""
    gc.collect()
    gc.freeze()
    try:
        return _measure(client, probe, hostile, copies, client.headers if hostile_headers is None else hostile_headers,
                        bound(rows))
    finally:
        gc.unfreeze()


def _measure(client: httpx.Client, probe: Call, hostile: Call | Callable[[int], Call], copies: int,
             headers: Mapping[str, str], factor: float) -> list[httpx.Response]:
    _latencies(client, probe, 2)  # warm-up
    alone = _latencies(client, probe, SAMPLES)
    make = hostile if callable(hostile) else (lambda _: hostile)
    answers: list[httpx.Response] = []
    stop = threading.Event()
    sent = [0]
    lock = threading.Lock()

    failures: list[BaseException] = []

    def attacker() -> None:
        try:
            attack()
        except BaseException as failed:  # a hostile request the server never answered: reported below
            failures.append(failed)
            raise

    def attack() -> None:
        ends, far = _CONTEXT.Pipe()
        process = _CONTEXT.Process(target=_send_in_turn, args=(far, str(client.base_url), client.timeout.read,
                                                               dict(headers)), daemon=True)
        process.start()
        try:
            while not stop.is_set():
                with lock:
                    sent[0] += 1
                    call = make(sent[0])
                ends.send(call)
                answer = _answer(client, call, ends.recv())
                with lock:
                    answers.append(answer)
                if answer.status_code == 503 and "retry-after" in answer.headers:
                    # Shed as busy: what a flood of requests costs at that rate is a rate limit's question,
                    # not this request's cost, so the attacker waits as told (a fraction of it: it still
                    # comes back while the first one's work may be running).
                    stop.wait(float(answer.headers["retry-after"]) / 4)
        finally:
            ends.send(None)
            process.join(120)
            ends.close()

    threads = [threading.Thread(target=attacker, daemon=True) for _ in range(copies)]
    for thread in threads:
        thread.start()
    try:
        while not answers and all(t.is_alive() for t in threads):  # every kind of work is under way
            time.sleep(0.01)
        before = len(answers)
        beside = _latencies(client, probe, SAMPLES, until=lambda: len(answers) - before >= 2 * copies + 1
                            or not all(t.is_alive() for t in threads))
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    _assert_settled(client)
    alone += _latencies(client, probe, SAMPLES)
    assert not failures, f"a hostile request got no answer: {failures[0]!r}"
    report = (f"probe alone: median {statistics.median(alone) * 1e3:.0f} ms, max {max(alone) * 1e3:.0f} ms; "
              f"beside ({len(beside)} samples): median {statistics.median(beside) * 1e3:.0f} ms, max {max(beside) * 1e3:.0f} ms; "
              f"bound {factor:g}x; {len(answers)} hostile requests: {sorted({a.status_code for a in answers})}")
    print(report)
    assert all(a.status_code < 500 or a.status_code == 503 for a in answers), report
    assert statistics.median(beside) <= factor * statistics.median(alone), report
    # The time the probe waited in all: a stall that holds it for most of a hostile request's life, however
    # rare in samples (one long sample), takes the probe's throughput below its fair share.
    assert statistics.fmean(beside) <= factor * statistics.fmean(alone), report
    # A fresh sample of the probe alone exceeds the slowest of m alone with probability 1 / (m + 1): the
    # machine's own slow samples (its other work) come about once per m; past `factor` times that slowest, no
    # more than that many may come (a stall that delays a sample each time the hostile work runs, and it ran
    # whole at least twice, comes as often when that work is short).
    slow = sum(t > factor * max(alone) for t in beside)
    assert slow <= max(1, len(beside) // len(alone)), report
    return answers


#: Attackers run in processes of their own: a client's own work (building requests, reading answers) is
#: not the server's, and in the server's interpreter it would take the interpreter from the server's threads.
_CONTEXT = multiprocessing.get_context("spawn")


def _send_in_turn(calls: Connection, base_url: str, timeout: float | None, headers: dict[str, str]) -> None:
    """An attacker's process: each call received is posted, and its answer (status, headers, body) or the
    failure that stopped it sent back, until None comes."""
    with httpx.Client(base_url=base_url, timeout=timeout, headers=headers) as own:
        while (call := calls.recv()) is not None:
            try:
                answer = _post(own, call)
                calls.send((answer.status_code, answer.headers.multi_items(), answer.read()))
            except Exception as failed:  # no answer: reported by the caller
                calls.send(RuntimeError(f"{call[0]}: {failed!r}"))


def _answer(client: httpx.Client, call: Call, reply: tuple[int, list[tuple[str, str]], bytes] | Exception) -> httpx.Response:
    """An attacker process's answer to `call`, as the response it was (its `request` holds what was sent)."""
    if isinstance(reply, Exception):
        raise reply
    route, body = call
    url = client.base_url.join(route)
    request = (httpx.Request("POST", url, content=body) if isinstance(body, bytes)
               else httpx.Request("POST", url, json=body))
    status, headers, content = reply
    return httpx.Response(status, headers=headers, content=content, request=request)


def _assert_settled(client: httpx.Client) -> None:
    deadline = time.monotonic() + SETTLE_S
    while True:
        stats = client.get("/stats").json()
        if stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["queue_depth"] == 0:
            return
        assert time.monotonic() < deadline, f"after the hostile requests: {stats}"
        time.sleep(0.05)
