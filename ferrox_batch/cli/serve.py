"""`ferrox-batch serve`: its flags, and running the server until Ctrl-C or SIGTERM.

The batcher's flags and how they resolve into a `BatcherConfig` and a KV memory budget are
`cli.batcher_settings`; `--replicas` is `cli.replicas`. Here: the HTTP flags, the checks that run before
the (slow) model load, the one-process server, and the signal handling that makes a stop a clean exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Mapping

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.api_key_list import split_keys
from ferrox_batch.cli.batcher_settings import (
    BATCHER_FLAGS,
    BATCHER_SWITCHES,
    add_batcher_flags,
    batcher_config,
    kv_memory,
    speculative_given,
    with_kv_budget,
    with_model_drafts,
)
from ferrox_batch.cli.common import (
    _TRACE,
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_DRAIN_TIMEOUT_SECS,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    ENV_API_KEY,
    LOG_LEVELS,
    POOLING_CHOICES,
    REASONING_PARSER_CHOICES,
    TOOL_CALL_PARSER_CHOICES,
    CliError,
    _add_model_flags,
    _port,
    _subparser,
    load,
    positive_int,
)
from ferrox_batch.cli.grammar_flags import add_grammar_flags, grammar_limits
from ferrox_batch.cli.replicas import add_replica_flags, check_replica_flags, serve_replicas
from ferrox_batch.cli.request_cap_flags import add_request_cap_flags, request_caps

#: The batcher's settings are `serve`'s flags, so they stay importable from here as well as from
#: `cli.batcher_settings`.
__all__ = ["BATCHER_FLAGS", "BATCHER_SWITCHES", "api_keys", "batcher_config", "cmd_serve", "kv_memory",
           "with_kv_budget"]


# ------------------------------------------------------------------ serve

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
    http.add_argument("--served-model-name", "--model-name", dest="model_name", metavar="NAME", nargs="+",
                      default=None,
                      help="the name(s) the model is served under: /v1/models lists each, requests may name any, "
                           "answers carry the one asked for (default: the checkpoint's folder or file name, "
                           "smollm2-135m-instruct for the default model)")
    http.add_argument("--pooling", choices=POOLING_CHOICES, default="last",
                      help="how /v1/embeddings pools a prompt's final hidden states when the request does not "
                           "say: last (the last token's) or mean (default: last)")
    http.add_argument("--default-max-tokens", type=positive_int, default=DEFAULT_COMPLETION_MAX_TOKENS,
                      metavar="N", help="completions' max_tokens when a request sends none "
                                        f"(default: {DEFAULT_COMPLETION_MAX_TOKENS}, as OpenAI)")
    http.add_argument("--default-chat-max-tokens", type=positive_int, default=DEFAULT_CHAT_MAX_TOKENS,
                      metavar="N", help="chat's max_tokens when a request sends none "
                                        f"(default: {DEFAULT_CHAT_MAX_TOKENS}; clamped to the context)")
    http.add_argument("--max-concurrent-requests", type=positive_int, default=DEFAULT_MAX_CONCURRENT_REQUESTS,
                      metavar="N", help="generation requests open at once before new ones get 503 server_busy "
                                        f"(default: {DEFAULT_MAX_CONCURRENT_REQUESTS})")
    http.add_argument("--api-key", metavar="KEY", action="append", default=None,
                      help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health and /metrics; repeat "
                           "it or separate keys with commas for several tenants, each with a prefix-cache "
                           f"namespace of its own (${ENV_API_KEY}, comma-separated; default: none, the API is open)")
    http.add_argument("--shared-prefix-cache", action="store_true",
                      help="share the prefix cache across API keys (default: each key's requests have their own, "
                           "so cached_tokens never tells one tenant about another's prompts)")
    http.add_argument("--allowed-origins", metavar="ORIGINS", type=_origins, default=(),
                      help="comma-separated browser origins allowed to call the API (CORS), or '*' for any "
                           "(default: none, CORS off)")
    http.add_argument("--allowed-hosts", metavar="HOSTS", type=_hosts, default=None,
                      help="comma-separated Host names requests may carry, any port ('*' for any, '*.example.com' "
                           "for its subdomains; /health takes any) (default: localhost, 127.0.0.1 "
                           "and [::1] when --host is a loopback address, else any)")
    http.add_argument("--client-priorities", metavar="MIN:MAX", type=_priority_range, default=(0, 0),
                      help="the request priorities clients may use, inclusive; a negative MIN needs the = form "
                           "(--client-priorities=-5:5) (default: 0:0, only the default priority)")
    http.add_argument("--reasoning-parser", choices=REASONING_PARSER_CHOICES, default=None,
                      help="send a thinking model's thinking (between <think> and </think>) apart from its answer, "
                           "as message.reasoning_content: deepseek_r1 (the answer begins inside the thinking), "
                           "qwen3 (it thinks when it opens with <think>; Qwen3, SmolLM3), openai_gptoss (the harmony "
                           "format's analysis channel; gpt-oss) (default: openai_gptoss for a gpt_oss checkpoint, "
                           "else none)")
    http.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSER_CHOICES, default=None,
                      help="read tool calls in this format: openai (the harmony format's calls to functions.NAME; "
                           "gpt-oss) (default: openai for a gpt_oss checkpoint, else the chat template's: Hermes "
                           "<tool_call> blocks where it renders tools, a JSON object where it does not)")
    http.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="accepted for vLLM's command lines: tool_choice auto is always on")
    http.add_argument("--escape-control-tokens", action="store_true",
                      help="read control-token text in a message's content (<|im_start|>, <|eot_id|>, <think>: "
                           "the tokenizer's added tokens) as text, so no user, retrieved document or tool output "
                           "can close its turn and forge another; an assistant's content is left as sent "
                           "(default: off, as vLLM and transformers render)")
    http.add_argument("--drain-timeout", metavar="SECONDS", type=_seconds, default=None,
                      help="on SIGTERM or Ctrl-C, stop taking connections and let requests in flight finish for "
                           f"up to this long, then cancel the rest (default: {DEFAULT_DRAIN_TIMEOUT_SECS:g}; with "
                           "--replicas, each replica's graceful shutdown, Ray Serve's 20)")
    http.add_argument("--no-ui", dest="ui", action="store_false",
                      help="serve no chat page on GET / (default: the page, which needs no key to load and asks "
                           "for one when the API does)")
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="(default: info)")
    add_request_cap_flags(parser)
    add_batcher_flags(parser)
    add_grammar_flags(parser)
    add_replica_flags(parser)
    parser.set_defaults(handler=cmd_serve)


def _origins(text: str) -> tuple[str, ...]:
    origins = tuple(o.strip() for o in text.split(",") if o.strip())
    if not origins:
        raise argparse.ArgumentTypeError("give at least one origin (e.g. https://app.example.com) or '*'")
    return origins


def _hosts(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(",") if h.strip())
    if not hosts:
        raise argparse.ArgumentTypeError("give at least one host name (e.g. api.example.com or localhost) or '*'")
    return hosts


def _priority_range(text: str) -> tuple[int, int]:
    """`MIN:MAX` (or one value, `N`, for `N:N`) as an inclusive pair."""
    low, sep, high = text.partition(":")
    try:
        pair = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN:MAX (two integers, e.g. 0:10)") from None
    if pair[0] > pair[1]:
        raise argparse.ArgumentTypeError(f"MIN must be at most MAX, got {text!r}")
    from ferrox_batch.generation_types import PRIORITY_LIMIT

    if not -PRIORITY_LIMIT <= pair[0] <= pair[1] <= PRIORITY_LIMIT:
        raise argparse.ArgumentTypeError(f"priorities are within [-{PRIORITY_LIMIT}, {PRIORITY_LIMIT}], got {text!r}")
    return pair


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a non-negative number of seconds, got {text!r}")
    return value


def api_keys(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, ...]:
    """`--api-key` (repeatable, each comma-separated), else `$FERROX_API_KEY` (comma-separated), else none
    (`api_key_list.split_keys`: an empty key or one listed twice is a mistake, not "no key")."""
    if args.api_key is None and ENV_API_KEY not in env:
        return ()
    source = "--api-key" if args.api_key is not None else f"${ENV_API_KEY}"
    try:
        return split_keys(args.api_key if args.api_key is not None else env[ENV_API_KEY])
    except ValueError as bad:
        raise CliError(f"{source} {bad}", status=2) from None


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
    keys = api_keys(args, env)
    check_replica_flags(args)
    _setup_logging(args.log_level)
    _signals_unwind()
    try:
        if args.replicas is not None:
            serve_replicas(args, env, config, memory, keys, _signals_unwind)
        else:
            _serve(args, env, config, memory, keys)
    except (KeyboardInterrupt, _Terminated):
        # Being told to stop is how a server ends: a clean stop is a success, as for gunicorn or nginx
        # (and `make serve` reports no error for a Ctrl-C).
        logging.getLogger("ferrox_batch.cli").info("stopped")
    return 0


def _serve(args: argparse.Namespace, env: Mapping[str, str], config: BatcherConfig, memory: int | None,
           keys: tuple[str, ...]) -> None:
    started = time.monotonic()
    model = load(args, env)
    from ferrox_batch.runtime.kv.paged_kv import PagedKvStore

    config = with_kv_budget(with_model_drafts(config, model, speculative_given(args, env)), memory, model)
    from ferrox_batch.server.run import default_model_name, serve

    names = tuple(args.model_name) if args.model_name else (default_model_name(model.source),)
    name = ", ".join(names)
    kv_bytes = config.kv_blocks * PagedKvStore.bytes_per_block(model.config, config.kv_block_size,
                                                               model.decoder.kv_dtype)
    logging.getLogger("ferrox_batch.cli").info(
        "%s loaded from %s in %.1f s on %s (%s: %s; KV cache %s: %s; %s: %s; batch-invariant %s: %s); KV budget %d blocks x %d positions (%s); "
        "max_seqs %s, "
        "prefill_chunk %d, max_batch_tokens %d, max_prefills_per_tick %d, step_target_ms %s, max_queue %d, "
        "max_context %s",
        name, model.source, time.monotonic() - started, model.decoder.device,
        model.precision, model.dtype_reason, model.kv_dtype_name, model.kv_dtype_reason, model.weights_summary,
        model.weights_reason, "yes" if model.batch_invariant else "no", model.batch_invariant_reason, config.kv_blocks,
        config.kv_block_size, _size(kv_bytes), "unlimited" if config.unlimited_seqs else config.max_seqs,
        config.prefill_chunk, config.max_batch_tokens, config.max_prefills_per_tick,
        config.step_target_ms or "none", config.max_queue,
        config.context_limit(model.config.max_position_embeddings))
    serve(model, config, args.host, args.port, model_name=names, default_max_tokens=args.default_max_tokens,
          default_chat_max_tokens=args.default_chat_max_tokens,
          max_concurrent_requests=args.max_concurrent_requests, log_level=args.log_level, api_key=keys,
          allowed_origins=args.allowed_origins, allowed_hosts=args.allowed_hosts,
          shared_prefix_cache=args.shared_prefix_cache, client_priorities=args.client_priorities,
          reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser, pooling=args.pooling,
          ui=args.ui, grammar_limits=grammar_limits(args),
          escape_control_tokens=args.escape_control_tokens, request_caps=request_caps(args),
          drain_timeout=DEFAULT_DRAIN_TIMEOUT_SECS if args.drain_timeout is None else args.drain_timeout)


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
