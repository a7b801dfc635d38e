"""`ferrox-batch serve`: flags -> `BatcherConfig` (flags win over `FERROX_CB_*`), the KV memory budget,
and running the server until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ferrox_batch.batch.config import (
    DEFAULT_MAX_QUEUE,
    ENV_KV_BLOCK_SIZE,
    ENV_KV_BLOCKS,
    ENV_MAX_BATCH_TOKENS,
    ENV_MAX_CONTEXT,
    ENV_MAX_PREFILLS_PER_TICK,
    ENV_MAX_QUEUE,
    ENV_MAX_QUEUE_WAIT_MS,
    ENV_MAX_SEQS,
    ENV_PREFILL_CHUNK,
    ENV_PREFIX_CACHE,
    ENV_STEP_TARGET_MS,
    PREFILL_CHUNK_ENV_KEYS,
    PRIVATE_PATH_KEY,
    SERVING_KV_BLOCK_SIZE,
    SERVING_MAX_BATCH_TOKENS,
    SERVING_MAX_PREFILLS_PER_TICK,
    SERVING_PREFILL_CHUNK,
    SERVING_STEP_TARGET_MS,
    BatcherConfig,
)
from ferrox_batch.cli.common import (
    _TRACE,
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_KV_MEMORY,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    ENV_API_KEY,
    ENV_KV_MEMORY,
    LOG_LEVELS,
    CliError,
    _add_model_flags,
    _memory_size,
    _port,
    _subparser,
    env_config,
    load,
    non_negative_int,
    parse_memory_size,
    positive_int,
)
from ferrox_batch.cli.replicas import add_replica_flags, check_replica_flags, serve_replicas

if TYPE_CHECKING:  # the CLI imports torch only once a command needs it: `--help` stays quick
    from ferrox_batch.models.loader import LoadedModel


# ------------------------------------------------------------------ serve

#: BatcherConfig field -> (flag, environment variable, default shown in --help, meaning). The README's
#: configuration table lists the same rows. The defaults are the serving ones (`BatcherConfig.serving()`).
BATCHER_FLAGS: dict[str, tuple[str, str, str, str]] = {
    "max_seqs": ("--max-seqs", ENV_MAX_SEQS, "unlimited", "sequences decoded at once"),
    "prefill_chunk": ("--prefill-chunk", ENV_PREFILL_CHUNK, str(SERVING_PREFILL_CHUNK),
                      "prompt tokens per prefill chunk"),
    "max_batch_tokens": ("--max-batch-tokens", ENV_MAX_BATCH_TOKENS, str(SERVING_MAX_BATCH_TOKENS),
                         "tokens per forward, decodes + prefill chunk"),
    "max_queue": ("--max-queue", ENV_MAX_QUEUE, str(DEFAULT_MAX_QUEUE),
                  "requests waiting for admission before new ones get 503"),
    "kv_block_size": ("--kv-block-size", ENV_KV_BLOCK_SIZE, str(SERVING_KV_BLOCK_SIZE),
                      "token positions per KV block"),
    "kv_blocks": ("--kv-blocks", ENV_KV_BLOCKS, "from --kv-memory",
                  "KV blocks in the budget (wins over --kv-memory)"),
    "max_context": ("--max-context", ENV_MAX_CONTEXT, "the model's context",
                    "prompt + max_tokens ceiling per request"),
    "max_prefills_per_tick": ("--max-prefills-per-tick", ENV_MAX_PREFILLS_PER_TICK,
                              str(SERVING_MAX_PREFILLS_PER_TICK),
                              "prompts one forward may advance, sharing --max-batch-tokens"),
    "step_target_ms": ("--step-target-ms", ENV_STEP_TARGET_MS, str(SERVING_STEP_TARGET_MS),
                       "while rows decode, a forward holds only the prompt tokens that keep it under this "
                       "many milliseconds (learnt as it runs); 0: no time target"),
    "max_queue_wait_ms": ("--max-queue-wait-ms", ENV_MAX_QUEUE_WAIT_MS, "none",
                          "a request still waiting for admission this many milliseconds after it arrived is "
                          "refused with 503 queue_timeout (a request's max_queue_wait_ms wins); 0: no limit"),
}
#: BatcherConfig field -> (flag, environment variable (0 or 1), default shown in --help, meaning), for the
#: on/off settings: each gets `--flag` and `--no-flag`.
BATCHER_SWITCHES: dict[str, tuple[str, str, str, str]] = {
    "prefix_cache": ("--prefix-cache", ENV_PREFIX_CACHE, "on",
                     "reuse the KV of cached prompt prefixes (full blocks) instead of computing them again"),
}
#: Flags whose 0 means "none" (the variable, like every FERROX_CB_* one, must still be positive).
_ZERO_IS_NONE = ("step_target_ms", "max_queue_wait_ms")


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = _subparser(
        subparsers, "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Load a checkpoint and serve it on /v1/completions, /v1/chat/completions (both with "
                    "streaming), /v1/models, /health and /metrics, every request batched by one continuous "
                    "batcher. Batcher settings come from the flags, else the FERROX_CB_* variables, else the "
                    "defaults. Ctrl-C or SIGTERM stops it cleanly.",
        examples="  ferrox-batch serve                                   # the default model on 127.0.0.1:8000\n"
                 "  ferrox-batch serve --model ./Qwen2.5-0.5B-Instruct --port 8123 --kv-memory 4GiB\n"
                 "  FERROX_CB_MAX_SEQS=16 ferrox-batch serve --model model.gguf --host 0.0.0.0\n"
                 "  ferrox-batch serve --replicas 2                      # two replicas on a local Ray Serve\n"
                 "  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
                 "       -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi!\"}], \"max_tokens\": 32}'")
    _add_model_flags(parser)
    http = parser.add_argument_group("HTTP server")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    http.add_argument("--port", type=_port, default=8000, help="port to listen on (default: 8000)")
    http.add_argument("--model-name", metavar="NAME", default=None,
                      help="the name /v1/models reports and responses carry (default: the checkpoint's "
                           "folder or file name, smollm2-135m-instruct for the default model)")
    http.add_argument("--default-max-tokens", type=positive_int, default=DEFAULT_COMPLETION_MAX_TOKENS,
                      metavar="N", help="completions' max_tokens when a request sends none "
                                        f"(default: {DEFAULT_COMPLETION_MAX_TOKENS}, as OpenAI)")
    http.add_argument("--default-chat-max-tokens", type=positive_int, default=DEFAULT_CHAT_MAX_TOKENS,
                      metavar="N", help="chat's max_tokens when a request sends none "
                                        f"(default: {DEFAULT_CHAT_MAX_TOKENS}; clamped to the context)")
    http.add_argument("--max-concurrent-requests", type=positive_int, default=DEFAULT_MAX_CONCURRENT_REQUESTS,
                      metavar="N", help="generation requests open at once before new ones get 503 server_busy "
                                        f"(default: {DEFAULT_MAX_CONCURRENT_REQUESTS})")
    http.add_argument("--api-key", metavar="KEY", default=None,
                      help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                           f"(${ENV_API_KEY}; default: none, the API is open)")
    http.add_argument("--allowed-origins", metavar="ORIGINS", type=_origins, default=(),
                      help="comma-separated browser origins allowed to call the API (CORS), or '*' for any "
                           "(default: none, CORS off)")
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="(default: info)")
    batcher = parser.add_argument_group(
        "batcher", "Each flag wins over its FERROX_CB_* variable; a malformed variable stops start-up.")
    for field, (flag, env_name, default, meaning) in BATCHER_FLAGS.items():
        if field == "kv_blocks":
            continue  # in the exclusive group below
        also = f", else ${PREFILL_CHUNK_ENV_KEYS[PRIVATE_PATH_KEY]}" if field == "prefill_chunk" else ""
        batcher.add_argument(flag, dest=field, type=non_negative_int if field in _ZERO_IS_NONE else positive_int,
                             default=None, metavar="N", help=f"{meaning} (${env_name}{also}; default: {default})")
    for field, (flag, env_name, default, meaning) in BATCHER_SWITCHES.items():
        batcher.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction, default=None,
                             help=f"{meaning} (${env_name}=0 or 1; default: {default})")
    budget = batcher.add_mutually_exclusive_group()
    flag, env_name, _, meaning = BATCHER_FLAGS["kv_blocks"]
    budget.add_argument(flag, dest="kv_blocks", type=positive_int, default=None, metavar="N",
                        help=f"{meaning} (${env_name}; default: derived from the KV memory)")
    budget.add_argument("--kv-memory", type=_memory_size, default=None, metavar="SIZE",
                        help=f"KV memory budget, e.g. 512MiB or 2GiB: as many blocks as fit in the loaded "
                             f"model's KV dtype; used when no block count is set (${ENV_KV_MEMORY}; "
                             f"default: {DEFAULT_KV_MEMORY})")
    add_replica_flags(parser)
    parser.set_defaults(handler=cmd_serve)


def _origins(text: str) -> tuple[str, ...]:
    origins = tuple(o.strip() for o in text.split(",") if o.strip())
    if not origins:
        raise argparse.ArgumentTypeError("give at least one origin (e.g. https://app.example.com) or '*'")
    return origins


def api_key(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """`--api-key`, else `$FERROX_API_KEY`, else None; an empty key is a mistake, not "no key"."""
    key = args.api_key if args.api_key is not None else env.get(ENV_API_KEY)
    if key is not None and not key.strip():
        raise CliError(f"the API key (--api-key or ${ENV_API_KEY}) is empty: leave it unset for an open API",
                       status=2)
    return None if key is None else key.strip()


def batcher_config(args: argparse.Namespace, env: Mapping[str, str]) -> BatcherConfig:
    """`FERROX_CB_*` read from `env`, then every batcher flag that was given on top (flags win).

    `kv_blocks` may still be None here: the memory budget becomes blocks once the model is loaded.
    """
    config = env_config(env)
    fields = [*BATCHER_FLAGS, *BATCHER_SWITCHES]
    given = {field: getattr(args, field) for field in fields if getattr(args, field, None) is not None}
    given.update({field: None for field in _ZERO_IS_NONE if given.get(field) == 0})
    if getattr(args, "kv_memory", None) is not None:
        given["kv_blocks"] = None  # an explicit --kv-memory wins over $FERROX_CB_KV_BLOCKS
    try:
        return dataclasses.replace(config, **given)
    except ValueError as err:
        raise CliError(str(err), status=2) from None


def kv_memory(args: argparse.Namespace, env: Mapping[str, str]) -> int | None:
    """The KV memory budget in bytes: `--kv-memory`, else `$FERROX_CB_KV_MEMORY`, else None (the machine's
    share, `models.memory.default_kv_memory`, once the model is loaded)."""
    if args.kv_memory is not None:
        return args.kv_memory
    raw = env.get(ENV_KV_MEMORY)
    if raw is None:
        return None
    try:
        return parse_memory_size(raw)
    except ValueError as err:
        raise CliError(f"{ENV_KV_MEMORY}: {err}", status=2) from None


def with_kv_budget(config: BatcherConfig, memory_bytes: int, model: LoadedModel) -> BatcherConfig:
    """`config`, with `kv_blocks` derived from the memory budget when no block count was set
    (`batch.wiring.with_kv_budget`); a budget too small for one block is a usage error."""
    from ferrox_batch.batch.wiring import with_kv_budget as derive

    try:
        return derive(config, memory_bytes, model.decoder)
    except ValueError as err:
        raise CliError(f"{err}: raise --kv-memory or lower --kv-block-size", status=2) from None


def _size(size: int) -> str:
    """A byte count for people: MiB, or KiB / bytes when that would round to nothing."""
    if size >= 1024**2:
        return f"{size / 1024**2:,.1f} MiB"
    return f"{size / 1024:,.1f} KiB" if size >= 1024 else f"{size} bytes"


def _setup_logging(level: str) -> None:
    """Our loggers (the worker's prefill/decode lines, the server's warnings) at `level`, uvicorn-like."""
    numeric = _TRACE if level == "trace" else getattr(logging, level.upper())
    logging.basicConfig(level=numeric, format="%(levelname)s:  [%(name)s] %(message)s", stream=sys.stderr)
    logging.getLogger("ferrox_batch").setLevel(numeric)


def cmd_serve(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    # Every setting is checked before the (slow) load: a typo fails in a second.
    config = batcher_config(args, env)
    memory = kv_memory(args, env) if config.kv_blocks is None else None
    key = api_key(args, env)
    check_replica_flags(args)
    _setup_logging(args.log_level)
    _signals_unwind()
    try:
        if args.replicas is not None:
            serve_replicas(args, env, config, memory, key, _signals_unwind)
        else:
            _serve(args, env, config, memory, key)
    except (KeyboardInterrupt, _Terminated):
        # Being told to stop is how a server ends: a clean stop is a success, as for gunicorn or nginx
        # (and `make serve` reports no error for a Ctrl-C).
        logging.getLogger("ferrox_batch.cli").info("stopped")
    return 0


def _serve(args: argparse.Namespace, env: Mapping[str, str], config: BatcherConfig, memory: int | None,
           key: str | None) -> None:
    started = time.monotonic()
    model = load(args, env)
    from ferrox_batch.models.memory import default_kv_memory
    from ferrox_batch.models.paged_kv import PagedKvStore

    if config.kv_blocks is None:
        if memory is None:
            budget = default_kv_memory(model.decoder.device)
            logging.getLogger("ferrox_batch.cli").info("KV memory budget %s: %s", _size(budget.bytes), budget.reason)
            memory = budget.bytes
        config = with_kv_budget(config, memory, model)
    from ferrox_batch.server.run import default_model_name, serve

    name = args.model_name or default_model_name(model.source)
    kv_bytes = config.kv_blocks * PagedKvStore.bytes_per_block(model.config, config.kv_block_size,
                                                               model.decoder.kv_dtype)
    logging.getLogger("ferrox_batch.cli").info(
        "%s loaded from %s in %.1f s on %s (%s: %s; KV cache %s: %s); KV budget %d blocks x %d positions (%s); "
        "max_seqs %s, "
        "prefill_chunk %d, max_batch_tokens %d, max_prefills_per_tick %d, step_target_ms %s, max_queue %d, "
        "max_context %s",
        name, model.source, time.monotonic() - started, model.decoder.device,
        model.precision, model.dtype_reason, model.kv_dtype_name, model.kv_dtype_reason, config.kv_blocks,
        config.kv_block_size, _size(kv_bytes), "unlimited" if config.unlimited_seqs else config.max_seqs,
        config.prefill_chunk, config.max_batch_tokens, config.max_prefills_per_tick,
        config.step_target_ms or "none", config.max_queue,
        config.context_limit(model.config.max_position_embeddings))
    serve(model, config, args.host, args.port, model_name=name, default_max_tokens=args.default_max_tokens,
          default_chat_max_tokens=args.default_chat_max_tokens,
          max_concurrent_requests=args.max_concurrent_requests, log_level=args.log_level, api_key=key,
          allowed_origins=args.allowed_origins)


class _Terminated(BaseException):
    """SIGTERM, raised on the main thread like KeyboardInterrupt so that every `finally` runs."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


def _signals_unwind() -> None:
    """Make SIGINT and SIGTERM unwind the stack rather than end the process or print a traceback.

    uvicorn catches both while it serves, shuts down gracefully, and then raises the signal again on
    the handler it found (so that a parent sees why it stopped). With Python's defaults that second
    SIGINT is a KeyboardInterrupt traceback after a clean shutdown, and the second SIGTERM kills the
    process before `serve` closes the batcher. As exceptions, both run `serve`'s cleanup, and
    `cmd_serve` exits 0 once it is done. A signal the parent set to be ignored (`cmd &` in a script
    ignores SIGINT) stays ignored; off the main thread (an embedding test) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, _raise_terminated)):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, handler)
