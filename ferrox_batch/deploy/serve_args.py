"""`app_builder`: the application `serve run` and `serve deploy` build from a config file's `args`.

`deploy/serve_config.yaml` names it (`import_path: ferrox_batch.deploy.serve_args:app_builder`), and
`serve run ferrox_batch.deploy.serve_args:app_builder model=... replicas=2` passes the same keys as
strings. Every key is read as its setting's type, so "64" is 64 and "false" is False; an unknown key or a
malformed value is a ValueError naming it, before any replica starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ray.serve.deployment import Application

from ferrox_batch.batch.config import BatcherConfig
from ferrox_batch.deploy.ray_serve import APP_KEYWORDS, COUNT_APP_KEYWORDS, ReplicaSpec, build_application


def app_builder(args: dict[str, Any]) -> Application:
    """The application of a config file's `args`, or of `serve run ...:app_builder key=value ...`.

    Keys: `model` (a checkpoint folder or .gguf; required), `model_name`, `device`, `dtype`, `kv_memory`
    (e.g. "512MiB"), any `BatcherConfig` field (`max_seqs`, `prefill_chunk`, ...), the app's keywords
    (APP_KEYWORDS), and `replicas`, `max_replicas`, `router`, `replica_cpus`, `replica_gpus`. Values may be
    strings, as `serve run key=value` passes them; an unknown key or a malformed value is a ValueError.
    """
    from ferrox_batch.cli.common import parse_memory_size

    args = dict(args)
    if "model" not in args:
        raise ValueError("the application needs `model`: a checkpoint folder or .gguf file on every node")
    fields = {f.name for f in dataclasses.fields(BatcherConfig)}
    batcher = {k: (_flag(k, v) if k == "prefix_cache" else _whole(k, v, optional=True))
               for k, v in args.items() if k in fields}
    app: dict[str, Any] = {k: _whole(k, args[k]) for k in COUNT_APP_KEYWORDS if k in args}
    if "api_key" in args:
        app["api_key"] = str(args["api_key"])
    if "allowed_origins" in args:
        origins = args["allowed_origins"]
        app["allowed_origins"] = tuple(o.strip() for o in origins.split(",") if o.strip()) \
            if isinstance(origins, str) else tuple(origins)
    known = fields | set(APP_KEYWORDS) | {"model", "model_name", "device", "dtype", "kv_cache_dtype", "kv_memory",
                                          "replicas", "max_replicas", "router", "replica_cpus", "replica_gpus"}
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}")
    memory = args.get("kv_memory")
    spec = ReplicaSpec(str(Path(str(args["model"])).expanduser()), args.get("model_name"),
                       str(args.get("device", "auto")), str(args.get("dtype", "auto")),
                       dataclasses.replace(BatcherConfig.serving(), **batcher),
                       parse_memory_size(str(memory)) if memory is not None else None, app,
                       kv_cache_dtype=str(args.get("kv_cache_dtype", "auto")))
    return build_application(
        spec, _whole("replicas", args.get("replicas", 1)),
        max_replicas=_whole("max_replicas", args["max_replicas"]) if "max_replicas" in args else None,
        router=str(args.get("router", "affinity")), replica_cpus=_number("replica_cpus", args.get("replica_cpus", 1)),
        replica_gpus=_number("replica_gpus", args.get("replica_gpus", 0)))


def _whole(key: str, value: Any, optional: bool = False) -> Any:
    if optional and value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise ValueError(f"{key} must be a whole number, got {value!r}")


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{key} must be a number, got {value!r}") from None


def _flag(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise ValueError(f"{key} must be true or false, got {value!r}")
