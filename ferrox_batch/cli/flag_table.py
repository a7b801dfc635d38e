"""One flag per field of a limits value (`GrammarLimits`, `RequestCaps`), and the value the flags make.

A table (field -> (flag, meaning)) drives both the flags, with their help and defaults (the value's own
defaults), and the value built from the parsed arguments, so a field cannot have a flag that is not
applied, nor a default of its own here.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ferrox_batch.cli.common import positive_int

Value = TypeVar("Value")


def add_flags(group: argparse._ArgumentGroup, table: Mapping[str, tuple[str, str]], defaults: Any,
              dest: Callable[[str], str], shown: Callable[[Any], str]) -> None:
    """One positive-integer flag per `table` row, defaulting to `defaults`' field (`shown` in its help)."""
    for field, (flag, meaning) in table.items():
        default = getattr(defaults, field)
        group.add_argument(flag, dest=dest(field), type=positive_int, default=default, metavar="N",
                           help=f"{meaning} (default: {shown(default)})")


def from_flags(args: argparse.Namespace, table: Mapping[str, tuple[str, str]], defaults: Value,
               dest: Callable[[str], str]) -> Value:
    """`defaults` with each `table` field the flags gave (a field whose flag is absent keeps its default)."""
    given = {field: getattr(args, dest(field)) for field in table if getattr(args, dest(field), None) is not None}
    return dataclasses.replace(defaults, **given)  # type: ignore[type-var]
