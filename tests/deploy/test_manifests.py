"""The deployment files name only what the server has (its command line, probe routes, port and metrics) and
run it locked down: the API key from a Secret, no root, a read-only root filesystem with writable scratch
volumes, no capabilities, and a termination grace that covers the drain timeout the command passes."""

from __future__ import annotations

import importlib
from pathlib import Path

import httpx
import pytest
import yaml
from server_helpers import DEADLINE

from ferrox_batch.cli import build_parser
from ferrox_batch.cli.common import ENV_API_KEY, ENV_HOME
from ferrox_batch.server.run import BATCHER_CLOSE_SECS

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
    server = container(manifests)
    pre_stop = server["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = build_parser().parse_args(server["command"][1:]).drain_timeout
    assert "--drain-timeout" in server["command"] and drain >= 10
    # The grace period counts from the preStop hook: the sleep, the drain, then closing the batcher.
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + BATCHER_CLOSE_SECS


def test_the_api_key_comes_from_a_secret(manifests):
    env = {e["name"]: e for e in container(manifests).get("env", [])}
    key = env[ENV_API_KEY]
    assert "value" not in key and set(key["valueFrom"]) == {"secretKeyRef"}
    assert {"name", "key"} <= set(key["valueFrom"]["secretKeyRef"])
    assert "--api-key" not in container(manifests)["command"]


def test_the_server_runs_unprivileged_on_a_read_only_root(manifests):
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    server = container(manifests)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    context = server["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]} and context.get("privileged", False) is False
    # What must be writable is a scratch volume: /tmp (the CPU kernels compile there at start) and the home
    # (caches, and the data folder the server would fetch into).
    scratch = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in server.get("env", [])}
    for path in ("/tmp", env["HOME"], env[ENV_HOME]):
        mount = next(m for p, m in mounts.items() if path == p or path.startswith(p.rstrip("/") + "/"))
        assert mount["name"] in scratch and not mount.get("readOnly", False), path
    assert all(m.get("readOnly") for m in mounts.values() if m["name"] not in scratch)  # the model is read-only


def test_the_serve_config_keeps_the_key_out_of_the_file():
    config = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    (application,) = config["applications"]
    assert "api_key" not in application["args"] and application["args"]["api_key_env"] == ENV_API_KEY


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


def test_the_serve_config_builds_the_application(tiny_batch_dir, monkeypatch):
    pytest.importorskip("ray", reason="needs the test extra (ray[serve])")
    from ferrox_batch.deploy.ray_serve import FerroxReplica, ReplicaSpec

    config = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    (application,) = config["applications"]
    module, name = application["import_path"].split(":")
    builder = getattr(importlib.import_module(module), name)
    args = {**application["args"], "model": str(tiny_batch_dir)}
    monkeypatch.delenv(ENV_API_KEY, raising=False)
    with pytest.raises(ValueError, match=ENV_API_KEY):  # a key the file promises but the node lacks: no open API
        builder(args)
    monkeypatch.setenv(ENV_API_KEY, "sk-a,sk-b")
    app = builder(args)
    replica = app._bound_deployment.init_args[0]  # the ingress's argument: the replicas' application
    deployment = replica._bound_deployment
    assert deployment.func_or_class is FerroxReplica
    spec = deployment.init_args[0]
    assert isinstance(spec, ReplicaSpec) and spec.batcher.max_seqs == application["args"]["max_seqs"]
    assert tuple(spec.app["api_key"]) == ("sk-a", "sk-b")
    assert deployment.max_ongoing_requests == application["args"]["max_seqs"] + application["args"]["max_queue"]
