"""`ferrox-batch serve --replicas N`: the same server as N replicas on a local Ray Serve instance.

The flags are `serve`'s, checked the same way before anything starts (the device too), and each replica
gets every one of them (its app's settings, its batcher's and its grammar limits); each replica
loads the model and sizes its own KV budget (`--kv-memory` each, or an equal share of the machine's
default). The default checkpoint is fetched here, once, before any replica starts. On CUDA each replica
takes one GPU.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.cli.batcher_settings import speculative_given
from ferrox_batch.cli.common import CliError, chat_template_text, model_path, positive_int
from ferrox_batch.cli.grammar_flags import grammar_limits
from ferrox_batch.cli.request_cap_flags import request_caps
from ferrox_batch.deploy import ROUTERS


def add_replica_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "replicas (Ray Serve; needs `pip install 'ferrox-batch[ray]'`)",
        "With --replicas, a local Ray instance serves the same API from N replicas behind one HTTP port.")
    group.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                       help="serve N replicas, each with its own batcher (default: one process, no Ray)")
    group.add_argument("--max-replicas", type=positive_int, default=None, metavar="M",
                       help="autoscale between --replicas and M on requests in flight per replica "
                            "(default: a fixed N)")
    group.add_argument("--router", choices=ROUTERS, default=None,
                       help="affinity: requests sharing a prompt prefix go to the replica that holds it; "
                            "default: Serve's power-of-two choices (default: affinity)")
    group.add_argument("--replica-cpus", type=float, default=None, metavar="C",
                       help="CPUs per replica, its torch threads (default: the machine's CPUs / N, at least 1)")


def check_replica_flags(args: argparse.Namespace) -> None:
    if args.replicas is None:
        if args.max_replicas is not None or args.replica_cpus is not None or args.router is not None:
            raise CliError("--max-replicas, --router and --replica-cpus need --replicas", status=2)
        return
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise CliError(f"--max-replicas ({args.max_replicas}) must be at least --replicas ({args.replicas})",
                       status=2)
    if args.replica_cpus is not None and not (math.isfinite(args.replica_cpus) and args.replica_cpus > 0):
        raise CliError(f"--replica-cpus must be a positive number, got {args.replica_cpus}", status=2)


def replica_app_settings(args: argparse.Namespace, keys: tuple[str, ...]) -> dict[str, Any]:
    """The `create_app` keywords every replica's app gets: `serve`'s HTTP flags, the Host default included
    (the loopback names when `--host` is a loopback address)."""
    from ferrox_batch.server.http.host_check import default_allowed_hosts

    return {"default_max_tokens": args.default_max_tokens, "default_chat_max_tokens": args.default_chat_max_tokens,
            "max_concurrent_requests": args.max_concurrent_requests, "api_key": keys,
            "allowed_origins": args.allowed_origins, "shared_prefix_cache": args.shared_prefix_cache,
            "allowed_hosts": default_allowed_hosts(args.host) if args.allowed_hosts is None else args.allowed_hosts,
            "client_priorities": args.client_priorities, "reasoning_parser": args.reasoning_parser,
            "tool_call_parser": args.tool_call_parser,
            "pooling": args.pooling, "ui": args.ui, "escape_control_tokens": args.escape_control_tokens}


def replica_spec(args: argparse.Namespace, env: Mapping[str, str], config: BatcherConfig, memory: int | None,
                 keys: tuple[str, ...]) -> Any:
    """The `deploy.ray_serve.ReplicaSpec` every replica gets from `serve`'s flags (needs Ray Serve)."""
    from ferrox_batch.deploy.ray_serve import ReplicaSpec

    return ReplicaSpec(str(model_path(args, env)), tuple(args.model_name) if args.model_name else None, args.device,
                       args.dtype, config, memory, replica_app_settings(args, keys),
                       log_level=logging.getLogger("ferrox_batch").level, kv_cache_dtype=args.kv_cache_dtype,
                       weights=args.weights, batch_invariant=args.batch_invariant,
                       chat_template=chat_template_text(args), grammar=grammar_limits(args),
                       caps=request_caps(args), speculative_given=speculative_given(args, env))


def serve_replicas(args: argparse.Namespace, env: Mapping[str, str], config: BatcherConfig, memory: int | None,
                   keys: tuple[str, ...], restore_signals: Callable[[], None]) -> None:
    """Run the replicated server until Ctrl-C or SIGTERM unwinds it; `restore_signals` puts `serve`'s
    handlers back after Ray installed its own."""
    try:
        from ferrox_batch.deploy.ray_serve import build_application, run_local
    except ImportError as err:
        raise CliError(f"--replicas needs Ray Serve ({err}): pip install 'ferrox-batch[ray]'") from None
    from ferrox_batch.runtime.device import choose_device

    try:
        device = choose_device(args.device)  # a device torch cannot see is a bad setting: say so before Ray
    except ValueError as err:
        raise CliError(f"--device: {err}", status=2) from None
    cpus = args.replica_cpus or max(1, (os.cpu_count() or 1) // args.replicas)
    spec = replica_spec(args, env, config, memory, keys)
    drain = {} if args.drain_timeout is None else {"drain_timeout": args.drain_timeout}
    app = build_application(spec, args.replicas, max_replicas=args.max_replicas, router=args.router or "affinity",
                            replica_cpus=cpus, replica_gpus=1.0 if device.type == "cuda" else 0.0, **drain)
    # Enough logical CPUs for every replica autoscaling may start, on a machine with fewer cores.
    logical = max(os.cpu_count() or 1, math.ceil((args.max_replicas or args.replicas) * cpus))
    try:
        run_local(app, host=args.host, port=args.port, stop=threading.Event(), num_cpus=logical,
                  after_init=restore_signals)
    except Exception as err:  # noqa: BLE001 - a replica that cannot start (a bad checkpoint, say) is one line
        raise CliError(f"the replicas did not start: {err}") from None
