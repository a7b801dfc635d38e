"""`serve`'s flags for what one request may cost (`ferrox_batch.request_caps.RequestCaps`, checked by
`server.request_caps`), and the `RequestCaps` they make, for the one-process server and every replica alike.

One table (`request_caps.CAP_FLAGS` with the meanings here) drives the flags, their help and the value
(`cli.flag_table`, as the grammar flags), so a cap cannot have a flag that is not applied; the defaults
are the value's own. The README's configuration table lists the same rows.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from types import MappingProxyType

from ferrox_batch.cli.flag_table import add_flags, from_flags
from ferrox_batch.request_caps import CAP_FLAGS, RequestCaps

_DEFAULTS = RequestCaps()

_MEANINGS = {
    "max_allowed_token_ids": "ids a request's allowed_token_ids may hold, counted as sent",
    "max_stop_chars": "characters over all of a request's stop strings",
    "max_prompt_logprobs": "prompt log-probabilities a request may ask for: scored prompt tokens x "
                           "(alternatives + 1), summed over its prompts and choices",
    "max_tokenization_ids": "ids a /tokenize answer may list and a /detokenize request may send",
    "max_detokenize_bytes": "bytes of text a /detokenize answer may hold",
}
#: RequestCaps field -> (flag, meaning).
REQUEST_CAP_FLAGS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {field: (flag, _MEANINGS[field]) for field, flag in CAP_FLAGS.items()})


def _dest(field: str) -> str:
    return field


def _shown(default: int | None) -> str:
    return "the model's vocabulary size" if default is None else f"{default:,}"


def add_request_cap_flags(parser: argparse.ArgumentParser) -> None:
    """The "request costs" group: one flag per `REQUEST_CAP_FLAGS` row; past each, a request is a 400 naming
    its field and the limit."""
    group = parser.add_argument_group(
        "request costs", "What one request may cost; a request past a cap is a 400 naming the field and the limit.")
    add_flags(group, REQUEST_CAP_FLAGS, _DEFAULTS, _dest, _shown)


def request_caps(args: argparse.Namespace) -> RequestCaps:
    """The `RequestCaps` the flags say (their defaults where not given)."""
    return from_flags(args, REQUEST_CAP_FLAGS, _DEFAULTS, _dest)
