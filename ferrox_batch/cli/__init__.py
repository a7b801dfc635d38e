"""The `ferrox-batch` command line: one subcommand per job (`serve`, `generate`, `fetch`, `bench`).

This is the one place besides `admission.config` (`BatcherConfig.from_env`) that
reads the process environment (`FERROX_HOME`, `FERROX_CB_*`); it passes what it
read to library code as plain arguments (the benchmark included). Settings resolve as: a flag, else its environment
variable, else the default. Every user error (a bad flag or variable, a model
that is missing or of an unsupported architecture, a failed fetch) ends as one
line on stderr and a non-zero exit status, never a traceback: 2 for bad
settings (as argparse does), 1 for everything else.

The subcommands live in `cli.serve`, `cli.generate` and `cli.tools`, what they
share in `cli.common`. To add a subcommand, write an `_add_<name>(subparsers)`
that registers its flags and sets `handler=<function>`, and list it in
`_SUBCOMMANDS`. A handler
takes the parsed arguments and the environment and returns the exit status; it
may raise `CliError` for a one-line refusal.
"""


from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

from ferrox_batch.cli.common import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_KV_MEMORY,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DTYPE_CHOICES,
    CliError,
    Handler,
    parse_memory_size,
)
from ferrox_batch.cli.generate import _add_generate, _unescape
from ferrox_batch.cli.serve import (
    BATCHER_FLAGS,
    BATCHER_SWITCHES,
    _add_serve,
    batcher_config,
    kv_memory,
    with_kv_budget,
)
from ferrox_batch.cli.tools import _add_bench, _add_bench_http, _add_fetch

#: The CLI's public surface (tests and scripts use these through `ferrox_batch.cli`).
__all__ = [
    "BATCHER_FLAGS", "BATCHER_SWITCHES", "DEFAULT_CHAT_MAX_TOKENS", "DEFAULT_COMPLETION_MAX_TOKENS", "DEFAULT_KV_MEMORY",
    "DEFAULT_MAX_CONCURRENT_REQUESTS", "DTYPE_CHOICES", "CliError", "Handler", "_unescape", "batcher_config",
    "build_parser", "kv_memory", "main", "parse_memory_size", "with_kv_budget",
]


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


_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_serve, _add_generate, _add_fetch, _add_bench, _add_bench_http)


