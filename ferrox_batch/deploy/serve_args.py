"""`app_builder`: the application `serve run` and `serve deploy` build from a config file's `args`.

`deploy/serve_config.yaml` names it (`import_path: ferrox_batch.deploy.serve_args:app_builder`), and
`serve run ferrox_batch.deploy.serve_args:app_builder model=... replicas=2` passes the same keys as
strings. Every key is read as its setting's type, so "64" is 64 and "false" is False; an unknown key or a
malformed value is a ValueError naming it, before any replica starts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ray.serve.deployment import Application

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.api_key_list import split_keys
from ferrox_batch.deploy.ray_serve import APP_KEYWORDS, COUNT_APP_KEYWORDS, ReplicaSpec, build_application
from ferrox_batch.grammar_limits import LIMIT_FLAGS, GrammarLimits
from ferrox_batch.request_caps import CAP_FLAGS, RequestCaps


def config_keys(flags: Mapping[str, str]) -> Mapping[str, str]:
    """A config file's key for each field of a flag table: its `serve` flag in snake case."""
    return MappingProxyType({flag.removeprefix("--").replace("-", "_"): field for field, flag in flags.items()})


GRAMMAR_KEYS = config_keys(LIMIT_FLAGS)
CAP_KEYS = config_keys(CAP_FLAGS)


def app_builder(args: dict[str, Any]) -> Application:
    """The application of a config file's `args`, or of `serve run ...:app_builder key=value ...`.

    Keys: `model` (a checkpoint folder or .gguf; required), `model_name`, `device`, `dtype`, `kv_memory`
    (e.g. "512MiB"), any `BatcherConfig` field (`max_seqs`, `prefill_chunk`, ...), the app's keywords
    (APP_KEYWORDS: lists as comma-separated strings, `client_priorities` as "MIN:MAX"), the grammar limits
    (GRAMMAR_KEYS: `grammar_compile_ms`, `max_live_grammar_bytes`, ..., as `serve`'s flags), the request caps
    (CAP_KEYS: `max_stop_chars`, ..., as `serve`'s flags), `api_key_env` (the
    name of an environment variable holding the keys, comma-separated, so that no key is written in the
    file; unset is an error, never an open API), and `replicas`, `max_replicas`, `router`, `replica_cpus`,
    `replica_gpus`, `drain_timeout`. Values may be strings, as `serve run key=value` passes them; an unknown
    key or a malformed value is a ValueError.
    """
    from ferrox_batch.memory_size import parse_memory_size

    args = dict(args)
    if "model" not in args:
        raise ValueError("the application needs `model`: a checkpoint folder or .gguf file on every node")
    fields = {f.name for f in dataclasses.fields(BatcherConfig)}
    batcher = {k: (_flag(k, v) if k in ("prefix_cache", "speculative") else str(v) if k == "speculative_method"
                   else _whole(k, v, optional=True))
               for k, v in args.items() if k in fields}
    app: dict[str, Any] = {k: _whole(k, args[k]) for k in COUNT_APP_KEYWORDS if k in args}
    if "api_key" in args and "api_key_env" in args:
        raise ValueError("give api_key or api_key_env, not both")
    if "api_key" in args:
        app["api_key"] = _keys(args["api_key"], "api_key")
    if "api_key_env" in args:  # the key stays out of the file: a Secret puts it in the nodes' environment
        name = str(args["api_key_env"])
        if name not in os.environ:
            raise ValueError(f"api_key_env names {name}, which is not set where the application is built: "
                             f"set it, or drop api_key_env for an open API")
        app["api_key"] = _keys(os.environ[name], f"${name}")
    for key in ("allowed_origins", "allowed_hosts"):
        if key in args:
            app[key] = _names(args[key])
    if "shared_prefix_cache" in args:
        app["shared_prefix_cache"] = _flag("shared_prefix_cache", args["shared_prefix_cache"])
    if "client_priorities" in args:
        app["client_priorities"] = _priorities(args["client_priorities"])
    for key in ("reasoning_parser", "tool_call_parser", "pooling"):
        if key in args:
            app[key] = str(args[key])
    for key in ("ui", "escape_control_tokens"):
        if key in args:
            app[key] = _flag(key, args[key])
    grammar = GrammarLimits(**{field: _positive(key, args[key]) for key, field in GRAMMAR_KEYS.items() if key in args})
    caps = RequestCaps(**{field: _positive(key, args[key]) for key, field in CAP_KEYS.items() if key in args})
    known = fields | set(APP_KEYWORDS) | set(GRAMMAR_KEYS) | set(CAP_KEYS) | {"model", "model_name", "device", "dtype", "kv_cache_dtype", "weights", "batch_invariant", "chat_template", "kv_memory",
                                          "replicas", "max_replicas", "router", "replica_cpus", "replica_gpus",
                                          "api_key_env", "drain_timeout"}
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}")
    memory = args.get("kv_memory")
    drain = {"drain_timeout": _number("drain_timeout", args["drain_timeout"])} if "drain_timeout" in args else {}
    spec = ReplicaSpec(str(Path(str(args["model"])).expanduser()), _served_names(args.get("model_name")),
                       str(args.get("device", "auto")), str(args.get("dtype", "auto")),
                       dataclasses.replace(BatcherConfig.serving(), **batcher),
                       parse_memory_size(str(memory)) if memory is not None else None, app,
                       kv_cache_dtype=str(args.get("kv_cache_dtype", "auto")),
                       weights=str(args.get("weights", "auto")),
                       batch_invariant=str(args.get("batch_invariant", "auto")),
                       chat_template=_template(args["chat_template"]) if "chat_template" in args else None,
                       grammar=grammar, caps=caps)
    return build_application(
        spec, _whole("replicas", args.get("replicas", 1)),
        max_replicas=_whole("max_replicas", args["max_replicas"]) if "max_replicas" in args else None,
        router=str(args.get("router", "affinity")), replica_cpus=_number("replica_cpus", args.get("replica_cpus", 1)),
        replica_gpus=_number("replica_gpus", args.get("replica_gpus", 0)), **drain)


def _served_names(value: Any) -> str | tuple[str, ...] | None:
    """`model_name`: one name, several comma-separated, or a list."""
    if value is None:
        return None
    names = tuple(value) if isinstance(value, list) else tuple(n.strip() for n in str(value).split(","))
    return names[0] if len(names) == 1 else names


def _template(path: Any) -> str:
    """A chat template's file, read where the application is built."""
    try:
        return Path(str(path)).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"chat_template: cannot read {path}: {err}") from None


def _names(value: Any) -> tuple[str, ...]:
    """A comma-separated string (as `serve run key=a,b` passes it) or a list, as a tuple of its items."""
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(str(item).strip() for item in items if str(item).strip())


def _keys(value: Any, source: str) -> tuple[str, ...]:
    """API keys (`api_key_list.split_keys`): an empty key, or none at all, is a mistake, never an open API."""
    try:
        return split_keys(value)
    except ValueError as bad:
        raise ValueError(f"{source} {bad}") from None


def _priorities(value: Any) -> tuple[int, int]:
    """`client_priorities`: "MIN:MAX" (or "N" for N:N) or a [min, max] list (the range is the app's to check)."""
    parts = value.split(":") if isinstance(value, str) else list(value)
    parts = parts * 2 if len(parts) == 1 else parts
    try:
        if any(isinstance(part, (bool, float)) for part in parts):
            raise ValueError
        low, high = (int(part) for part in parts)
    except (TypeError, ValueError):
        raise ValueError(f"client_priorities must be MIN:MAX (two integers), got {value!r}") from None
    return low, high


def _whole(key: str, value: Any, optional: bool = False) -> Any:
    if optional and value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise ValueError(f"{key} must be a whole number, got {value!r}")


def _positive(key: str, value: Any) -> int:
    whole = _whole(key, value)
    if whole < 1:
        raise ValueError(f"{key} must be a positive whole number, got {value!r}")
    return whole


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
