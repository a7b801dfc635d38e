"""The replica settings follow from the batcher's, and bad settings fail before anything starts."""

from __future__ import annotations

import dataclasses

import pytest

from ferrox_batch.admission.config import BatcherConfig

pytest.importorskip("ray", reason="needs the test extra (ray[serve])")
from ferrox_batch.deploy.ray_serve import (  # noqa: E402
    DEFAULT_TARGET_ONGOING,
    FerroxReplica,
    ReplicaSpec,
    replica_options,
)
from ferrox_batch.deploy.serve_args import app_builder  # noqa: E402
from ferrox_batch.server.app import DEFAULT_MAX_CONCURRENT_REQUESTS  # noqa: E402


def spec(**batcher) -> ReplicaSpec:
    return ReplicaSpec("/models/m", batcher=dataclasses.replace(BatcherConfig.serving(), **batcher))


def test_a_replica_takes_its_whole_batch_and_queue_never_serves_default_of_five():
    options = replica_options(spec(max_seqs=16, max_queue=100), 2)
    assert options["max_ongoing_requests"] == 116 and options["num_replicas"] == 2
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert replica_options(spec(), 1)["max_ongoing_requests"] == DEFAULT_MAX_CONCURRENT_REQUESTS
    capped = ReplicaSpec("/m", batcher=BatcherConfig(max_seqs=64, max_queue=4096),
                         app={"max_concurrent_requests": 500})
    assert replica_options(capped)["max_ongoing_requests"] == 500  # the app refuses beyond its own cap


def test_autoscaling_targets_requests_in_flight_per_replica():
    scaled = replica_options(spec(max_seqs=24), 2, max_replicas=5)
    assert scaled["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 5, "target_ongoing_requests": 24}
    assert "num_replicas" not in scaled
    unlimited = replica_options(spec(), 1, max_replicas=2)["autoscaling_config"]
    assert unlimited["target_ongoing_requests"] == DEFAULT_TARGET_ONGOING


def test_the_router_is_serves_extension_point_or_serves_default():
    affinity = replica_options(spec(), 2)["request_router_config"]
    assert affinity.request_router_class == "ferrox_batch.deploy.router:PrefixAffinityRouter"
    assert "request_router_config" not in replica_options(spec(), 2, router="default")


@pytest.mark.parametrize("layout", [{"replicas": 0}, {"replicas": True}, {"max_replicas": 1, "replicas": 2},
                                    {"router": "random"}, {"replica_cpus": 0}, {"replica_cpus": float("nan")},
                                    {"replica_gpus": -1}])
def test_bad_layouts_are_refused(layout):
    with pytest.raises(ValueError):
        replica_options(spec(), **layout)


def test_the_serve_command_lines_strings_are_read_as_their_types(tiny_batch_dir):
    app = app_builder({"model": str(tiny_batch_dir), "max_seqs": "12", "max_queue": "30", "prefix_cache": "false",
                       "replicas": "2", "replica_cpus": "0.5", "allowed_origins": "https://a.example, https://b.example",
                       "max_concurrent_requests": "100", "kv_cache_dtype": "fp16", "batch_invariant": "on"})
    deployment = app._bound_deployment.init_args[0]._bound_deployment
    spec = deployment.init_args[0]
    assert spec.batcher.max_seqs == 12 and spec.batcher.prefix_cache is False
    assert spec.app["allowed_origins"] == ("https://a.example", "https://b.example")
    assert deployment.max_ongoing_requests == 42 and deployment.num_replicas == 2
    assert deployment.ray_actor_options["num_cpus"] == 0.5
    assert spec.kv_share == 2  # no KV size given: the two replicas split one machine's default
    assert spec.kv_cache_dtype == "fp16" and spec.batch_invariant == "on"
    for bad in ({"max_seqs": "12.5"}, {"prefix_cache": "maybe"}, {"replica_cpus": "lots"}, {"replicas": "-1"},
                {"kv_cache_dtype": "fp8"}, {"batch_invariant": "sometimes"}):
        with pytest.raises(ValueError):
            app_builder({"model": "/m", **bad})


def test_unknown_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="bogus"):
        ReplicaSpec("/m", app={"bogus": 1})
    with pytest.raises(ValueError, match="needs `model`"):
        app_builder({})
    with pytest.raises(ValueError, match="typo"):
        app_builder({"model": "/m", "typo": 1})
    with pytest.raises(ValueError):
        app_builder({"model": "/m", "max_seqs": 0})


def test_the_health_check_is_the_batchers_worker_alive():
    class Stats:
        worker_alive = True

    class Batcher:
        def stats(self):
            return Stats()

        def close(self, _timeout):
            return True

    replica = FerroxReplica.__new__(FerroxReplica)  # no model: only the check itself
    replica.batcher, replica.replica = Batcher(), "r1"
    replica.check_health()
    Stats.worker_alive = False
    with pytest.raises(RuntimeError, match="worker is not running"):
        replica.check_health()


def test_the_guard_settings_reach_the_replicas_and_the_ingress(tiny_batch_dir, monkeypatch):
    monkeypatch.setenv("TEST_FERROX_KEYS", "sk-a, sk-b")
    app = app_builder({"model": str(tiny_batch_dir), "api_key_env": "TEST_FERROX_KEYS", "shared_prefix_cache": "true",
                       "allowed_hosts": "api.example.com,localhost", "client_priorities": "-2:3",
                       "drain_timeout": "45"})
    deployment = app._bound_deployment.init_args[0]._bound_deployment
    spec = deployment.init_args[0]
    assert spec.app["api_key"] == ("sk-a", "sk-b") and spec.app["shared_prefix_cache"] is True
    assert spec.app["allowed_hosts"] == ("api.example.com", "localhost") and spec.app["client_priorities"] == (-2, 3)
    assert deployment._deployment_config.graceful_shutdown_timeout_s == 45
    ingress_settings = app._bound_deployment.init_args[1]  # what the ingress checks before reading a body
    assert ingress_settings == {"api_key": ("sk-a", "sk-b"), "allowed_hosts": ("api.example.com", "localhost"),
                                "shared_prefix_cache": True}
    assert app_builder({"model": "/m", "api_key": ["sk-c"]})._bound_deployment.init_args[1] == {"api_key": ("sk-c",)}
    monkeypatch.setenv("TEST_FERROX_EMPTY", " ")
    for bad in ({"api_key_env": "TEST_FERROX_UNSET_VARIABLE"}, {"api_key_env": "TEST_FERROX_EMPTY"},
                {"api_key": ""}, {"api_key": "sk-a,,sk-b"}, {"api_key": "sk-a", "api_key_env": "TEST_FERROX_KEYS"},
                {"client_priorities": "3:1"}, {"client_priorities": "1:2:3"}, {"client_priorities": [0, 1.5]},
                {"allowed_hosts": ""}, {"drain_timeout": "-1"}, {"shared_prefix_cache": "sometimes"}):
        with pytest.raises(ValueError):
            app_builder({"model": "/m", **bad})
