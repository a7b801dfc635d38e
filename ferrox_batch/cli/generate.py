"""`ferrox-batch generate`: one prompt through the batcher, streamed to stdout."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from ferrox_batch.cli.common import (
    _CLOSE_SECS,
    CliError,
    _add_model_flags,
    _say,
    _seed,
    _subparser,
    env_config,
    load,
    positive_int,
)

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
    from ferrox_batch.generation_types import SamplingParams

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
    from ferrox_batch.engine.handle import ContinuousBatcher

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
