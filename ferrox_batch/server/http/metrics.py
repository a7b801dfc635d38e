"""Prometheus metrics of one server: the batcher's state, token and refusal counters, latency histograms.

Why it is shaped this way:

* Every app owns its `CollectorRegistry` (never the process-global one), so
  several apps in one process (tests, embedding) never collide.
* Gauges are read from `batcher.stats()` at scrape time by a custom
  collector; nothing is updated on the request hot path for them.
* The gauges request routers already read are exported under vLLM's names
  (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
  `vllm:kv_cache_usage_perc`, labelled `model_name` as vLLM does, and the
  block geometry as `vllm:cache_config_info`'s labels), next to
  one `ferrox_batch_<field>` gauge per `BatcherStats` field.
* Counters and histograms are updated once per request, when its final event
  reaches the loop (`request_finished`), or when a request is refused.

Latencies are measured from the request's arrival at the server: time to
first token is the first chunk of visible text, inter-token latency the gaps
between chunks, queue time the end-to-end latency minus the prefill and
decode durations the batcher reports in `Usage`. Cancelled requests count
their tokens but no latencies (they did not run to an answer).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from ferrox_batch.admission.counters import BatcherStats
from ferrox_batch.generation_types import GenerationResult

#: The text format every Prometheus-compatible scraper reads.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
PREFIX = "ferrox_batch_"

_STATS_HELP = {
    "prefill_chunks": "Prefill chunks run (cumulative).",
    "prefill_tokens": "Prompt tokens prefilled (cumulative).",
    "decode_steps": "Batched decode forwards run (cumulative).",
    "queue_depth": "Requests waiting for admission.",
    "queue_rejected": "Requests refused because the queue was full (cumulative).",
    "kv_blocks_total": "KV cache blocks in the budget (0: no budget).",
    "kv_blocks_free": "KV cache blocks not reserved by any request.",
    "kv_block_size": "Token positions per KV block.",
    "kv_rejected_too_large": "Requests refused as larger than the whole block budget (cumulative).",
    "kv_rejected_context_length": "Requests refused at the context ceiling (cumulative).",
    "kv_blocks_peak": "Most KV blocks held at once by in-flight requests.",
    "aborted": "Requests cancelled before they finished (cumulative).",
    "max_seqs": "Sequences decoded at once at most (0: unlimited).",
    "prefill_chunk": "Prompt tokens per prefill chunk at most.",
    "max_batch_tokens": "Tokens per forward at most.",
    "worker_alive": "1 while the scheduler's worker thread is running.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache (cumulative).",
    "prefix_cache_hits": "Prompt tokens adopted from the prefix cache instead of computed (cumulative).",
    "kv_blocks_cached": "KV blocks holding published prefixes (referenced or not).",
    "worker_idle_ms": "Worker time blocked with no request in flight, ms (cumulative).",
    "worker_scheduling_ms": "Worker time in its own Python between forwards, ms (cumulative).",
    "worker_forward_ms": "Worker time running forwards and sampling, ms (cumulative).",
    "worker_forward_off_cpu_ms": "Forward time the worker thread was not on a core, ms (cumulative).",
    "kv_blocks_global": "KV blocks the global layers' groups reference now (every position).",
    "kv_blocks_local": "KV blocks the local layers' groups reference now (a sliding window).",
}

# Buckets close to vLLM's, so dashboards built for it read the same ranges.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _BatcherCollector:
    """Reads `stats()` and the server's in-flight count at scrape time."""

    def __init__(self, stats: Callable[[], BatcherStats], in_flight: Callable[[], int], model_name: str) -> None:
        self._stats = stats
        self._in_flight = in_flight
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for field in dataclasses.fields(stats):
            value = getattr(stats, field.name)
            if isinstance(value, tuple):  # by position: a label per entry
                family = GaugeMetricFamily(PREFIX + field.name, _STATS_HELP.get(field.name, field.name),
                                           labels=["position"])
                for position, count in enumerate(value):
                    family.add_metric([str(position)], count)
                yield family
            else:
                yield GaugeMetricFamily(PREFIX + field.name, _STATS_HELP.get(field.name, field.name),
                                        value=float(value))
        in_flight = self._in_flight()
        yield GaugeMetricFamily(PREFIX + "requests_in_flight",
                                "Requests submitted through this server and not yet answered by the batcher.",
                                value=in_flight)
        yield self._vllm("vllm:num_requests_waiting", "Requests waiting for admission.", stats.queue_depth)
        yield self._vllm("vllm:num_requests_running", "Requests admitted and not yet finished.",
                         max(0, in_flight - stats.queue_depth))
        yield self._vllm("vllm:kv_cache_usage_perc", "KV cache usage as a fraction (1 = every block reserved).",
                         kv_cache_usage(stats))
        # vLLM's info gauge (value 1): routers read the block geometry from its labels.
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration.",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(stats.kv_block_size), str(stats.kv_blocks_total)], 1.0)
        yield info
        # vLLM's prefix-cache counters, in tokens: the hit rate is hits / queries over any window.
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens.", stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens.", stats.prefix_cache_hits),
            # vLLM's speculative-decoding counters: the acceptance rate is accepted / draft tokens.
            ("vllm:spec_decode_num_drafts", "Drafts verified.", stats.spec_decode_num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", stats.spec_decode_num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.spec_decode_num_accepted_tokens),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self._model], value)
            yield counter
        # The acceptance per draft position: accepted there over `vllm:spec_decode_num_drafts`.
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
        for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([self._model, str(position)], value)
        yield per_pos

    def _vllm(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
        gauge.add_metric([self._model], value)
        return gauge


def kv_cache_usage(stats: BatcherStats) -> float:
    """Reserved blocks over all blocks, in [0, 1]; 0 when there is no block budget."""
    if stats.kv_blocks_total == 0:
        return 0.0
    return (stats.kv_blocks_total - stats.kv_blocks_free) / stats.kv_blocks_total


class ServerMetrics:
    """Every metric of one app, on its own `registry`; `render()` is the `/metrics` body."""

    def __init__(self, stats: Callable[[], BatcherStats], in_flight: Callable[[], int], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_BatcherCollector(stats, in_flight, model_name))
        self._model = model_name
        r = self.registry
        self._prompt = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self._generated = Counter(PREFIX + "generation_tokens", "Tokens generated for finished requests.",
                                  registry=r)
        self._vllm_prompt = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.",
                                    ["model_name"], registry=r).labels(model_name)
        self._vllm_generated = Counter("vllm:generation_tokens", "Tokens generated for finished requests.",
                                       ["model_name"], registry=r).labels(model_name)
        self._finished = Counter(PREFIX + "requests", "Requests the batcher answered, by finish reason.",
                                 ["finish_reason"], registry=r)
        self._vllm_success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                                     ["model_name", "finished_reason"], registry=r)
        self._refusals = Counter(PREFIX + "refusals", "Requests answered with an error, by error code "
                                 "(context_length_exceeded, queue_full, invalid_request, ...).",
                                 ["reason"], registry=r)
        self._disconnects = Counter(PREFIX + "client_disconnects", "Requests cancelled because the client "
                                    "disconnected before the answer was complete.", registry=r)
        self._ttft = self._histogram("vllm:time_to_first_token_seconds",
                                     "Seconds from arrival to the first chunk of text.", _TTFT_BUCKETS)
        self._itl = self._histogram("vllm:inter_token_latency_seconds",
                                    "Seconds between two consecutive chunks of text.", _ITL_BUCKETS)
        self._queue = self._histogram("vllm:request_queue_time_seconds",
                                      "Seconds a request spent before its prefill began.", _REQUEST_BUCKETS)
        self._e2e = self._histogram("vllm:e2e_request_latency_seconds",
                                    "Seconds from arrival to the last token.", _REQUEST_BUCKETS)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]):
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(self._model)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def refused(self, reason: str) -> None:
        self._refusals.labels(reason).inc()

    def client_disconnected(self) -> None:
        self._disconnects.inc()

    def request_finished(self, result: GenerationResult, *, arrival: float, finished_at: float,
                         chunk_times: Sequence[float]) -> None:
        usage = result.usage
        self._prompt.inc(usage.prompt_tokens)
        self._vllm_prompt.inc(usage.prompt_tokens)
        self._generated.inc(usage.completion_tokens)
        self._vllm_generated.inc(usage.completion_tokens)
        reason = result.finish_reason.as_str()
        self._finished.labels(reason).inc()
        self._vllm_success.labels(self._model, reason).inc()
        if reason == "cancelled":
            return
        e2e = max(0.0, finished_at - arrival)
        self._e2e.observe(e2e)
        if chunk_times:
            self._ttft.observe(max(0.0, chunk_times[0] - arrival))
            for earlier, later in itertools.pairwise(chunk_times):
                self._itl.observe(max(0.0, later - earlier))
        if usage.prompt_eval_duration_ms is not None and usage.generation_duration_ms is not None:
            ran = (usage.prompt_eval_duration_ms + usage.generation_duration_ms) / 1000.0
            self._queue.observe(max(0.0, e2e - ran))
