"""`serve`'s structured-output flags: what one request's grammar, regex or schema may cost
(`ferrox_batch.grammar_limits`, where each default is explained), one flag per `GrammarLimits` field.

One table (`grammar_limits.LIMIT_FLAGS`) drives both the flags and the `GrammarLimits` they make, so a
limit cannot have a flag that is not applied; the same limits reach the one-process server and every
replica (`cli.replicas`). Each is shown in `--help` with its default; the README's configuration table
lists them too.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from types import MappingProxyType

from ferrox_batch.cli.flag_table import add_flags, from_flags
from ferrox_batch.grammar_limits import LIMIT_FLAGS, GrammarLimits

_DEFAULTS = GrammarLimits()

_MEANINGS = {
    "compile_ms": "CPU milliseconds a request's grammar, regex or schema may take to compile, on the request's "
                  "own thread; past it, a 400 naming the field",
    "first_masks_ms": "CPU milliseconds its first masks may take, probed as it compiles; past it, a 400 naming "
                      "the field",
    "mask_deadline_ms": "milliseconds the worker waits past a forward for a row's grammar mask; a later row "
                        "whose mask used half of it in CPU ends with grammar_too_slow (none is waited for "
                        "past four times it)",
    "live_bytes": "bytes of schema text the grammars of requests in flight may hold in all; past it, a new "
                  "schema gets 503",
    "client_live_bytes": "the same for one client (an API key, else an address): its own share",
    "gbnf_ms": "CPU milliseconds a GBNF grammar's conversion to Lark may take, in a process of its own; past "
               "it, a 400 naming the field",
}
#: GrammarLimits field -> (flag, meaning).
GRAMMAR_FLAGS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {field: (flag, _MEANINGS[field]) for field, flag in LIMIT_FLAGS.items()})


def _dest(field: str) -> str:
    return f"grammar_{field}"


def add_grammar_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured output", "What one request's grammar, regex or schema may cost.")
    add_flags(group, GRAMMAR_FLAGS, _DEFAULTS, _dest, str)


def grammar_limits(args: argparse.Namespace) -> GrammarLimits:
    """The `GrammarLimits` the flags say (their defaults where not given)."""
    return from_flags(args, GRAMMAR_FLAGS, _DEFAULTS, _dest)
