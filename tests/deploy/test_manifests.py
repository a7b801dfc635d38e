"""The deployment files name only what the server has: its command line, probe routes, port and metrics."""

from __future__ import annotations

import importlib
from pathlib import Path

import httpx
import pytest
import yaml
from server_helpers import DEADLINE

from ferrox_batch.cli import build_parser
from ferrox_batch.server.run import BATCHER_CLOSE_SECS, DEFAULT_GRACEFUL_SHUTDOWN_SECS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def documents() -> dict[str, dict]:
    found = {}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            found[doc["kind"]] = doc
    return found


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    found = documents()
    assert set(found) == {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"}
    return found


def container(manifests) -> dict:
    (server,) = manifests["Deployment"]["spec"]["template"]["spec"]["containers"]
    return server


def test_the_container_runs_a_valid_serve_command_on_its_declared_port(manifests):
    server = container(manifests)
    program, *argv = server["command"]
    assert program == "ferrox-batch"
    args = build_parser().parse_args(argv)
    assert args.handler.__name__ == "cmd_serve" and args.host == "0.0.0.0"
    (port,) = server["ports"]
    assert port["containerPort"] == args.port
    annotations = manifests["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.port and annotations["prometheus.io/path"] == "/metrics"
    assert manifests["Service"]["spec"]["ports"][0]["targetPort"] == port["name"]
    assert manifests["Service"]["spec"]["selector"].items() <= \
        manifests["Deployment"]["spec"]["template"]["metadata"]["labels"].items()


def test_termination_waits_for_the_servers_own_clean_stop(manifests):
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    pre_stop = container(manifests)["lifecycle"]["preStop"]["sleep"]["seconds"]
    # The grace period counts from the preStop hook: the sleep, then the server's own stop.
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + DEFAULT_GRACEFUL_SHUTDOWN_SECS + BATCHER_CLOSE_SECS


def test_every_probe_and_metric_the_manifests_use_is_served(manifests, server):
    base_url, _ = server
    server_spec = container(manifests)
    probes = [server_spec[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")]
    for probe in probes:
        assert probe["httpGet"]["port"] == server_spec["ports"][0]["name"]
        response = httpx.get(base_url + probe["httpGet"]["path"], timeout=DEADLINE)
        assert response.status_code == 200, probe
    metrics = httpx.get(base_url + "/metrics", timeout=DEADLINE).text
    (rule,) = yaml.safe_load(manifests["ConfigMap"]["data"]["config.yaml"])["rules"]
    series = rule["seriesQuery"].split("{")[0].strip("'")
    assert f"\n{series}{{" in metrics, series
    (metric,) = manifests["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert rule["name"]["matches"] == series
    target = manifests["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment" and target["name"] == manifests["Deployment"]["metadata"]["name"]


def test_the_serve_config_builds_the_application(tiny_batch_dir):
    pytest.importorskip("ray", reason="needs the test extra (ray[serve])")
    from ferrox_batch.deploy.ray_serve import FerroxReplica, ReplicaSpec

    config = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    (application,) = config["applications"]
    module, name = application["import_path"].split(":")
    builder = getattr(importlib.import_module(module), name)
    app = builder({**application["args"], "model": str(tiny_batch_dir)})
    replica = app._bound_deployment.init_args[0]  # the ingress's argument: the replicas' application
    deployment = replica._bound_deployment
    assert deployment.func_or_class is FerroxReplica
    spec = deployment.init_args[0]
    assert isinstance(spec, ReplicaSpec) and spec.batcher.max_seqs == application["args"]["max_seqs"]
    assert deployment.max_ongoing_requests == application["args"]["max_seqs"] + application["args"]["max_queue"]
