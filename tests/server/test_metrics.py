"""`/metrics` parses with prometheus_client's own parser, carries every promised name, and moves as requests are served.

The server here detokenizes one letter per token through a `Gate`, so every
token is one chunk (inter-token latency counts are exact) and a test can hold
the worker to read the running/waiting gauges at a known moment.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import DEADLINE, GREEDY, MODEL_NAME, gated_batcher, letter_gate, openai_client, poll, served, stats

from ferrox_batch.admission.counters import BatcherStats
from ferrox_batch.server import create_app

VLLM = {"model_name": MODEL_NAME}


@pytest.fixture(scope="module")
def gate():
    return letter_gate()


@pytest.fixture(scope="module")
def server(tiny_batch_model, gate):
    with served(gated_batcher(tiny_batch_model, gate, max_seqs=1, max_context=128)) as (base_url, app):
        yield base_url, app


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of `/metrics`, keyed by (name, sorted labels)."""
    response = httpx.get(f"{base_url}/metrics", timeout=DEADLINE)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_every_batcher_stat_and_the_vllm_gauges_are_exported(server):
    base_url, _ = server
    samples = scrape(base_url)
    current = stats(base_url)
    families = {f.name for f in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=DEADLINE).text)}
    for field in dataclasses.fields(BatcherStats):
        if field.name.endswith("_per_pos"):  # one sample per position, none before the first draft
            assert "ferrox_batch_" + field.name in families, field.name
        else:
            assert ("ferrox_batch_" + field.name, ()) in samples, field.name
    assert value(samples, "ferrox_batch_kv_blocks_total") == current["kv_blocks_total"] == 64
    assert value(samples, "ferrox_batch_worker_alive") == 1.0
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert value(samples, name, **VLLM) == 0.0
        assert (name, tuple(VLLM.items())) in samples


#: The vLLM metrics that routers and autoscalers outside Ray read (the llm-d endpoint picker, the Prometheus
#: adapter), with the type vLLM gives each.
VLLM_TYPES = {
    "vllm:num_requests_waiting": "gauge", "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:spec_decode_num_drafts": "counter", "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter", "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
}


def test_the_vllm_metrics_routers_read_have_vllms_types_and_labels(server):
    base_url, _ = server
    response = httpx.get(f"{base_url}/metrics", timeout=DEADLINE)
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name, kind in VLLM_TYPES.items():
        assert name in families and families[name].type == kind, (name, families.get(name))
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels == {"block_size": "16", "num_gpu_blocks": "64"} and info.value == 1.0


def test_counters_and_histograms_move_as_requests_are_served(server):
    base_url, _ = server
    before = scrape(base_url)
    with openai_client(base_url) as client:
        plain = client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=5, **GREEDY)
        streamed = list(client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY))
    after = scrape(base_url)
    prompt = plain.usage.prompt_tokens + streamed[-1].usage.prompt_tokens

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("ferrox_batch_prompt_tokens_total") == moved("vllm:prompt_tokens_total", **VLLM) == prompt
    assert moved("ferrox_batch_generation_tokens_total") == moved("vllm:generation_tokens_total", **VLLM) == 9
    assert moved("ferrox_batch_requests_total", finish_reason="length") == 2
    assert moved("vllm:request_success_total", finished_reason="length", **VLLM) == 2
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert moved(name + "_count", **VLLM) == 2, name
    assert moved("vllm:inter_token_latency_seconds_count", **VLLM) == (5 - 1) + (4 - 1)  # one letter per token
    assert value(after, "vllm:e2e_request_latency_seconds_sum", **VLLM) > 0
    assert moved("ferrox_batch_prefill_tokens") >= prompt


def test_refusals_are_counted_by_reason(server):
    base_url, _ = server
    before = scrape(base_url)
    with httpx.Client(base_url=base_url, timeout=DEADLINE) as http:
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
        assert http.post("/v1/completions", json={"prompt": "word " * 200}).status_code == 400
        assert http.post("/v1/completions", json={"prompt": "x", "model": "other"}).status_code == 404
        assert http.post("/v1/completions", json={"prompt": [1, 100_000]}).status_code == 400
    after = scrape(base_url)
    for reason in ("invalid_request", "context_length_exceeded", "model_not_found", "token_out_of_vocab"):
        name = "ferrox_batch_refusals_total"
        assert value(after, name, reason=reason) - value(before, name, reason=reason) == 1, reason


def test_running_waiting_and_kv_usage_while_the_worker_is_held(server, gate):
    base_url, _ = server
    request = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, **GREEDY}
    gate.hold()
    calls = gate.calls
    try:
        with openai_client(base_url) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = pool.submit(client.completions.create, **request)
            gate.wait_calls(calls + 1)  # admitted (max_seqs=1) and holding the worker
            queued = pool.submit(client.completions.create, **request)
            poll(lambda: stats(base_url)["queue_depth"] == 1, "the second request to queue")
            samples = scrape(base_url)
            assert value(samples, "vllm:num_requests_waiting", **VLLM) == 1
            assert value(samples, "vllm:num_requests_running", **VLLM) == 1
            assert value(samples, "ferrox_batch_requests_in_flight") == 2
            held = stats(base_url)
            usage = (held["kv_blocks_total"] - held["kv_blocks_free"]) / held["kv_blocks_total"]
            assert 0 < value(samples, "vllm:kv_cache_usage_perc", **VLLM) == pytest.approx(usage)
            gate.open()
            running.result(DEADLINE)
            queued.result(DEADLINE)
    finally:
        gate.open()
    poll(lambda: value(scrape(base_url), "ferrox_batch_requests_in_flight") == 0, "both answers to be counted")
    samples = scrape(base_url)
    assert value(samples, "vllm:num_requests_running", **VLLM) == 0
    assert value(samples, "vllm:kv_cache_usage_perc", **VLLM) == 0


def test_two_apps_in_one_process_keep_their_own_registries(tiny_batch_model):
    gate = letter_gate()
    batcher = gated_batcher(tiny_batch_model, gate)
    try:
        first = create_app(batcher, model_name="first")
        second = create_app(batcher, model_name="second")
        registries = [app.state.ferrox.generations.metrics for app in (first, second)]
        assert registries[0].registry is not registries[1].registry
        registries[0].refused("queue_full")
        texts = [r.render().decode() for r in registries]
        assert 'vllm:num_requests_waiting{model_name="first"}' in texts[0]
        assert 'vllm:num_requests_waiting{model_name="second"}' in texts[1]
        assert 'reason="queue_full"' in texts[0] and 'reason="queue_full"' not in texts[1]
    finally:
        assert batcher.close(DEADLINE)
