"""ferrox-batch as a Ray Serve application: N replicas, each one `ContinuousBatcher` behind its own app.

Two deployments:

* `FerroxReplica` (N of them, or autoscaled): loads the checkpoint, owns one batcher, and serves the same
  FastAPI app as `ferrox-batch serve` (`server.create_app`), run in process by `relay.InProcessApp`. Its
  health check is the batcher's `worker_alive`, so Serve replaces a replica whose worker died. It answers
  with `relay.REPLICA_HEADER` naming itself.
* `FerroxIngress` (one, no CPU reserved): Serve's HTTP entry. It refuses what the app would from the headers
  alone (`server.access_policy`), reads the rest whole and hands each to a replica through a handle whose
  router is `router.PrefixAffinityRouter` (or Serve's default, power-of-two choices, with
  `router="default"`), then replays the replica's answer (`relay`).

The replica settings follow from the batcher's: `max_ongoing_requests` lets a replica hold its whole batch
and queue (Serve's default of 5 would starve the batch), a refusal's 503 and `Retry-After` reach the client
untouched, and autoscaling (with `max_replicas`) targets requests in flight per replica.

`build_application` is the Python entry; `serve_args.app_builder` is the one `serve run` / `serve deploy`
call with a config file's `args` (`deploy/serve_config.yaml`); `run_local` is `ferrox-batch serve
--replicas N`, on a local Ray head whose ports stay on `--host`'s address (`ray_head`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Message

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.deploy import ROUTERS
from ferrox_batch.deploy.ray_head import replica_ports_on_node, start_head
from ferrox_batch.deploy.relay import REPLICA_HEADER, InProcessApp, RelayedRequest, relayed_response
from ferrox_batch.errors import DecodeError
from ferrox_batch.grammar_limits import GrammarLimits
from ferrox_batch.request_caps import RequestCaps
from ferrox_batch.runtime.device import KV_CACHE_DTYPES
from ferrox_batch.runtime.invariance import BATCH_INVARIANT_CHOICES
from ferrox_batch.runtime.quant.choice import WEIGHTS_CHOICES
from ferrox_batch.server.http.access_policy import AccessPolicy
from ferrox_batch.server.app import DEFAULT_MAX_CONCURRENT_REQUESTS, api_error_shapes
from ferrox_batch.server.client_policy import ClientPolicy
from ferrox_batch.server.http.errors import error_response
from ferrox_batch.server.generation import CLIENT_CLOSED_REQUEST
from ferrox_batch.server.harmony.choice import parsers_for_family

log = logging.getLogger("ferrox_batch.deploy")

#: The Serve application's default name, and its deployments'.
APP_NAME = "ferrox"
REPLICA_DEPLOYMENT = "FerroxReplica"
INGRESS_DEPLOYMENT = "FerroxIngress"
#: Requests in flight per replica that autoscaling aims at when the batcher has no `max_seqs`: one
#: batch of rows that a small CPU replica still decodes in well under a second a step.
DEFAULT_TARGET_ONGOING = 32
#: Seconds between a replica's health checks, and how long one may take before it counts as failed.
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0
#: Seconds a stopping replica lets its requests finish before it is killed.
GRACEFUL_SHUTDOWN_S = 20.0
#: The app keywords a spec may carry (`server.create_app`'s).
COUNT_APP_KEYWORDS = ("default_max_tokens", "default_chat_max_tokens", "max_concurrent_requests")
#: Those the ingress checks too (`server.access_policy`), before it reads a body.
ACCESS_APP_KEYWORDS = ("api_key", "allowed_hosts", "shared_prefix_cache")
APP_KEYWORDS = (*COUNT_APP_KEYWORDS, *ACCESS_APP_KEYWORDS, "allowed_origins", "client_priorities",
                "reasoning_parser", "tool_call_parser", "pooling", "ui", "escape_control_tokens")


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """Everything a replica needs to load and serve its model (picklable: it travels to each replica)."""

    model: str
    model_name: str | tuple[str, ...] | None = None
    device: str = "auto"
    dtype: str = "auto"
    batcher: BatcherConfig = field(default_factory=BatcherConfig.serving)
    #: KV memory per replica in bytes when `batcher.kv_blocks` is None; None: the device's default.
    kv_memory: int | None = None
    #: `create_app` keywords (APP_KEYWORDS).
    app: Mapping[str, Any] = field(default_factory=dict)
    #: What the KV cache stores (`--kv-cache-dtype`).
    kv_cache_dtype: str = "auto"
    #: How the weights are held (`--weights`: `runtime.quant.choice`).
    weights: str = "auto"
    #: Whether each request's answer is the same alone or batched (`--batch-invariant`: `runtime.invariance`).
    batch_invariant: str = "auto"
    #: A chat template (Jinja text) in place of the checkpoint's (`--chat-template`'s file); None: its own.
    chat_template: str | None = None
    #: Replicas sharing one machine's default KV budget (`runtime.kv.memory.default_kv_memory`), when neither
    #: `kv_memory` nor `batcher.kv_blocks` is set: each takes this share of it.
    kv_share: int = 1
    #: The level of the replica's `ferrox_batch` loggers (None: Ray's default for a replica).
    log_level: int | None = None
    #: What one request's structured output may cost (`serve`'s grammar flags).
    grammar: GrammarLimits = field(default_factory=GrammarLimits)
    #: What one request may cost beyond it (`serve`'s request-cost flags).
    caps: RequestCaps = field(default_factory=RequestCaps)
    #: Whether `batcher.speculative` was asked for; where not, a mixture-of-experts model decodes without
    #: drafts (`engine.wiring.with_model_drafts`).
    speculative_given: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.app) - set(APP_KEYWORDS)
        if unknown:
            raise ValueError(f"unknown app settings {sorted(unknown)}; known: {', '.join(APP_KEYWORDS)}")
        if not isinstance(self.grammar, GrammarLimits):
            raise ValueError(f"grammar must be GrammarLimits, got {self.grammar!r}")
        if not isinstance(self.caps, RequestCaps):
            raise ValueError(f"caps must be RequestCaps, got {self.caps!r}")
        if isinstance(self.kv_share, bool) or not isinstance(self.kv_share, int) or self.kv_share < 1:
            raise ValueError(f"kv_share must be a positive integer, got {self.kv_share!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; use one of auto, "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.weights not in WEIGHTS_CHOICES:
            raise ValueError(f"unknown weights {self.weights!r}; use one of {', '.join(WEIGHTS_CHOICES)}")
        if self.batch_invariant not in BATCH_INVARIANT_CHOICES:
            raise ValueError(f"unknown batch_invariant {self.batch_invariant!r}; use one of "
                             f"{', '.join(BATCH_INVARIANT_CHOICES)}")
        # Malformed access or priority settings fail here, before any replica starts.
        AccessPolicy.from_settings(self.app)
        if "client_priorities" in self.app:
            ClientPolicy(tuple(self.app["client_priorities"]))

    def max_ongoing_requests(self) -> int:
        """Requests Serve may hand one replica at once: its whole batch plus its queue, within the app's cap."""
        cap = int(self.app.get("max_concurrent_requests", DEFAULT_MAX_CONCURRENT_REQUESTS))
        if self.batcher.unlimited_seqs:
            return cap  # rows bounded by KV blocks only: the app's own cap is the limit
        return min(cap, self.batcher.max_seqs + self.batcher.max_queue)

    def target_ongoing_requests(self) -> int:
        return DEFAULT_TARGET_ONGOING if self.batcher.unlimited_seqs else self.batcher.max_seqs


class FerroxReplica:
    """One replica: a loaded model, its batcher, and the server's app run in process."""

    def __init__(self, spec: ReplicaSpec) -> None:
        from ferrox_batch.engine.handle import ContinuousBatcher
        from ferrox_batch.engine.wiring import with_kv_budget, with_model_drafts
        from ferrox_batch.runtime.loading.loader import load_model
        from ferrox_batch.server.app import create_app
        from ferrox_batch.server.run import default_model_name

        replica_ports_on_node()
        if spec.log_level is not None:
            logging.getLogger("ferrox_batch").setLevel(spec.log_level)
        loaded = load_model(spec.model, device=spec.device, dtype=spec.dtype, kv_cache_dtype=spec.kv_cache_dtype,
                            weights=spec.weights, batch_invariant=spec.batch_invariant,
                            chat_template=spec.chat_template)
        config = with_model_drafts(spec.batcher, loaded.decoder, speculative_given=spec.speculative_given)
        config = with_kv_budget(config, spec.kv_memory, loaded.decoder, share=spec.kv_share)
        self.batcher = ContinuousBatcher.from_model(loaded, config, spec.grammar)
        self.replica = serve.get_replica_context().replica_id.unique_id
        settings = dict(spec.app)
        settings["reasoning_parser"], settings["tool_call_parser"] = parsers_for_family(
            loaded.config.family, settings.get("reasoning_parser"), settings.get("tool_call_parser"))
        self.app = create_app(self.batcher, model_name=spec.model_name or default_model_name(loaded.source),
                              request_caps=spec.caps, **settings)
        self.relay = InProcessApp(self.app, self.replica)
        log.info("replica %s serves %s with %d KV blocks", self.replica, loaded.source, config.kv_blocks)

    async def forward(self, request: RelayedRequest) -> AsyncIterator[Message]:
        # Closed as soon as Serve cancels this call, so the app sees its client's disconnect at once.
        async with contextlib.aclosing(self.relay.stream(request)) as messages:
            async for message in messages:
                yield message

    def check_health(self) -> None:
        if not self.batcher.stats().worker_alive:
            raise RuntimeError(f"replica {self.replica}: the batch scheduler's worker is not running")

    def __del__(self) -> None:
        """Serve's replica shutdown, once its graceful period is over: cancel what is left, then stop the
        batcher (its worker exits at once with nothing in flight)."""
        app, batcher = getattr(self, "app", None), getattr(self, "batcher", None)
        if app is not None:
            app.state.ferrox.generations.abandon_all()
        if batcher is not None and not batcher.close(GRACEFUL_SHUTDOWN_S):
            log.warning("replica %s: the batcher's worker did not exit within %.0f s", self.replica,
                        GRACEFUL_SHUTDOWN_S)


def is_replica_failure(error: BaseException) -> bool:
    """The replica's process is gone or unreachable (not a bug in what it ran)."""
    return isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


class FerroxIngress:
    """Serve's HTTP entry: each request checked as the replicas' app checks it (Host, key, JSON body; `app`
    holds their settings) before its body is read, then read whole and relayed to a replica the router picks."""

    def __init__(self, replicas: DeploymentHandle, app: Mapping[str, Any] | None = None) -> None:
        replica_ports_on_node()
        self.replicas = replicas.options(stream=True)
        self.access = AccessPolicy.from_settings(app or {})
        self.error_shapes = api_error_shapes()  # each API's refusals in its own shape, as the replicas write them

    async def __call__(self, request: Request) -> Response:
        shape = self.error_shapes.for_path(request.scope["path"])
        refusal, tenant = self.access.check(request.method, request.scope["path"], request.headers)
        if refusal is not None:  # an unauthenticated client gets nothing read, parsed or relayed
            return refusal.response(shape)
        try:
            relayed = await RelayedRequest.read(request, tenant=None if tenant is None else tenant.namespace)
        except DecodeError as refusal:  # too large, or too slow to arrive: answered here, as a replica would
            return error_response(refusal, shape)
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        stream = self.replicas.forward.remote(relayed)
        # Serve's proxy sets X-Request-Id itself, to the id it sent in (which the app echoes).
        return await relayed_response(stream, is_replica_failure, stream.cancel, frozenset({b"x-request-id"}),
                                      relayed.header(REPLICA_HEADER))


def replica_options(spec: ReplicaSpec, replicas: int = 1, *, max_replicas: int | None = None,
                    router: str = "affinity", replica_cpus: float = 1.0, replica_gpus: float = 0.0,
                    router_kwargs: Mapping[str, Any] | None = None,
                    drain_timeout: float = GRACEFUL_SHUTDOWN_S) -> dict[str, Any]:
    """`FerroxReplica`'s deployment options: fixed `replicas`, or autoscaled from it up to `max_replicas`;
    a stopping replica lets its requests run for `drain_timeout` seconds before they are cancelled."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    if max_replicas is not None and (isinstance(max_replicas, bool) or not isinstance(max_replicas, int)
                                     or max_replicas < replicas):
        raise ValueError(f"max_replicas must be an integer of at least replicas ({replicas}), got {max_replicas!r}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    if isinstance(replica_cpus, bool) or not isinstance(replica_cpus, (int, float)) or not replica_cpus > 0:
        raise ValueError(f"replica_cpus must be a positive number, got {replica_cpus!r}")
    if isinstance(replica_gpus, bool) or not isinstance(replica_gpus, (int, float)) or not 0 <= replica_gpus < math.inf:
        raise ValueError(f"replica_gpus must be a non-negative number, got {replica_gpus!r}")
    if isinstance(drain_timeout, bool) or not isinstance(drain_timeout, (int, float)) or \
            not 0 <= drain_timeout < math.inf:
        raise ValueError(f"drain_timeout must be a non-negative number of seconds, got {drain_timeout!r}")
    options: dict[str, Any] = {
        "name": REPLICA_DEPLOYMENT, "max_ongoing_requests": spec.max_ongoing_requests(),
        "ray_actor_options": {"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        "health_check_period_s": HEALTH_CHECK_PERIOD_S, "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": drain_timeout,
    }
    if max_replicas is not None:
        options["autoscaling_config"] = {"min_replicas": replicas, "max_replicas": max_replicas,
                                         "target_ongoing_requests": spec.target_ongoing_requests()}
    else:
        options["num_replicas"] = replicas
    if router == "affinity":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="ferrox_batch.deploy.router:PrefixAffinityRouter",
            request_router_kwargs=dict(router_kwargs or {}))
    return options


def build_application(spec: ReplicaSpec, replicas: int = 1, **layout: Any) -> Application:
    """The Serve application: the replicas (`replica_options` takes `layout`) and one ingress in front.

    With no KV size given, the replicas split the machine's default budget as if all ran on one machine
    (as `serve --replicas` does); on a cluster, give `kv_memory`.
    """
    options = replica_options(spec, replicas, **layout)
    most = layout.get("max_replicas") or replicas
    if spec.kv_memory is None and spec.batcher.kv_blocks is None:
        spec = dataclasses.replace(spec, kv_share=most)
    engine = serve.deployment(FerroxReplica).options(**options).bind(spec)
    # The ingress relays every request in flight on every replica: room for all of them.
    ingress = serve.deployment(FerroxIngress).options(
        name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=options["max_ongoing_requests"] * most,
        ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine, {k: spec.app[k] for k in ACCESS_APP_KEYWORDS if k in spec.app})


def replica_ids(app_name: str = APP_NAME) -> list[str]:
    """The ids of the application's running replicas (what `relay.REPLICA_HEADER` names)."""
    names = ray.util.list_named_actors(all_namespaces=True)
    prefix = f"SERVE_REPLICA::{app_name}#{REPLICA_DEPLOYMENT}#"
    return sorted(n["name"][len(prefix):] for n in names if n["name"].startswith(prefix))


def replica_stats(base_url: str, replica: str, patience: float = 60.0) -> dict[str, Any]:
    """One replica's `/stats` through the ingress (pinned with `REPLICA_HEADER`), retried for `patience`
    seconds while the router does not know that replica yet."""
    deadline = time.monotonic() + patience
    while True:
        request = urllib.request.Request(f"{base_url}/stats", headers={REPLICA_HEADER: replica})
        try:
            with urllib.request.urlopen(request, timeout=patience) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as refused:
            if refused.code != 503 or time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def run_local(app: Application, *, host: str, port: int, stop: threading.Event, num_cpus: int | None = None,
              app_name: str = APP_NAME, after_init: Callable[[], None] | None = None) -> None:
    """Start a new local Ray instance with `num_cpus` logical CPUs (None: the machine's) and its ports on
    `host`'s address (`ray_head`), serve `app` on `host:port` until `stop` is set (or a signal's exception
    unwinds the wait), then shut both down.

    `after_init` runs once Ray is up: `ray.init` installs its own SIGTERM handler (exit at once), and a
    caller that stops cleanly on SIGTERM puts its own back there.
    """
    start_head(host, num_cpus=num_cpus)
    try:
        if after_init is not None:
            after_init()
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=app_name, route_prefix="/")
        log.info("serving %s on http://%s:%d with Ray Serve", app_name, host, port)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
