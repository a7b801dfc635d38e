"""The Grafana dashboard (`deploy/grafana/ferrox-batch.json`) queries only what the server exports.

Pins: the file is a dashboard Grafana imports (a Prometheus data-source input, a replica variable, panels with
queries); every metric its queries and variables name is a family on a live server's `/metrics`, with the
suffix its type gives (`_total` of a counter, `_bucket` of a histogram), and every label a query selects or
groups by is one that family carries (`instance` is Prometheus's own); it shows what an operator watches:
requests running and waiting, KV usage, the prefix cache's hit rate, tokens per second in and out, TTFT,
ITL and end-to-end percentiles from the histograms, refusals by reason, each per replica.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import DEADLINE, GREEDY, MODEL_NAME, openai_client

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ferrox-batch.json"
#: A metric selector: a name, then its labels in braces.
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
GROUPING = re.compile(r"\bby \(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\(([a-zA-Z_:][a-zA-Z0-9_:]*),\s*([a-zA-Z_]+)\)")
#: Labels Prometheus adds to every series it scrapes, and the histogram's bucket bound.
SCRAPE_LABELS = {"instance", "job"}
SUFFIXES = {"_total": "counter", "_bucket": "histogram", "_sum": "histogram", "_count": "histogram"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported(server) -> dict[str, tuple[str, set[str]]]:
    """Each family on `/metrics` after a served request and a refused one: (type, its labels)."""
    base_url, _ = server
    with openai_client(base_url) as client:
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, **GREEDY)
    httpx.post(f"{base_url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": -1},
               timeout=DEADLINE)
    text = httpx.get(f"{base_url}/metrics", timeout=DEADLINE).text
    return {f.name: (f.type, {label for s in f.samples for label in s.labels}) for f in
            text_string_to_metric_families(text)}


def queries(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]


def family_of(series: str, exported: dict) -> tuple[str, str]:
    """The exported family a series name belongs to, and the type its suffix says it has."""
    for suffix, kind in SUFFIXES.items():
        if series.endswith(suffix) and series[: -len(suffix)] in exported:
            return series[: -len(suffix)], kind
    return series, "gauge"


def test_the_file_is_an_importable_dashboard(dashboard):
    assert dashboard["uid"] == "ferrox-batch" and dashboard["title"]
    (source,) = dashboard["__inputs"]
    assert source["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"instance", "model_name"} <= set(variables)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(panel["targets"] for panel in dashboard["panels"])
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"


def test_every_metric_and_label_it_queries_is_exported(dashboard, exported):
    named = 0
    for expr in queries(dashboard):
        grouped = {label.strip() for group in GROUPING.findall(expr) for label in group.split(",")}
        for series, labels in SELECTOR.findall(expr):
            family, kind = family_of(series, exported)
            assert family in exported, f"{series} (in {expr}) is not on /metrics"
            assert exported[family][0] == kind, f"{series} is a {exported[family][0]}, the query reads a {kind}"
            selected = {part.split("=")[0].strip() for part in labels.split(",") if part.strip()}
            wanted = (selected | grouped) - SCRAPE_LABELS - ({"le"} if kind == "histogram" else set())
            assert wanted <= exported[family][1], f"{series}: labels {wanted - exported[family][1]} not exported"
            named += 1
    for variable in dashboard["templating"]["list"]:
        for series, label in LABEL_VALUES.findall(json.dumps(variable.get("query", ""))):
            assert series in exported and (label in SCRAPE_LABELS or label in exported[series][1]), variable
    assert named >= 20


@pytest.mark.parametrize(("title", "metric"), [
    ("Requests running and waiting", "vllm:num_requests_running"),
    ("Requests running and waiting", "vllm:num_requests_waiting"),
    ("KV cache usage", "vllm:kv_cache_usage_perc"),
    ("Prefix cache hit rate", "vllm:prefix_cache_hits_total"),
    ("Tokens per second", "vllm:prompt_tokens_total"),
    ("Tokens per second", "vllm:generation_tokens_total"),
    ("Time to first token", "vllm:time_to_first_token_seconds_bucket"),
    ("Inter-token latency", "vllm:inter_token_latency_seconds_bucket"),
    ("End-to-end latency", "vllm:e2e_request_latency_seconds_bucket"),
    ("Refusals by reason", "ferrox_batch_refusals_total"),
])
def test_it_shows_what_an_operator_watches_per_replica(dashboard, title, metric):
    (panel,) = [p for p in dashboard["panels"] if p["title"] == title]
    exprs = [t["expr"] for t in panel["targets"] if metric + "{" in t["expr"]]
    assert exprs, (title, metric)
    for expr in exprs:
        assert 'instance=~"$instance"' in expr
        if metric.endswith("_bucket"):
            assert expr.startswith("histogram_quantile(") and "by (le, instance)" in expr
    assert all("{{instance}}" in t["legendFormat"] for t in panel["targets"])
