"""`serve`'s flags for what one request may cost (`server.request_caps`), and the `create_app` keywords they
become, for the one-process server and for every replica alike.

One table drives the flags, their help and the keywords, so a cap cannot have a flag that is not applied.
The defaults are repeated here so that building the parser imports no server (nor torch); a test keeps
them equal to `server.request_caps`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from types import MappingProxyType

from ferrox_batch.cli.common import positive_int

DEFAULT_MAX_STOP_CHARS = 2048
DEFAULT_MAX_PROMPT_LOGPROBS = 2**20
DEFAULT_MAX_TOKENIZATION_IDS = 2**18
DEFAULT_MAX_DETOKENIZE_BYTES = 2**21

#: `create_app` keyword -> (flag, default (None: the vocabulary size), meaning). The README's
#: configuration table lists the same rows.
REQUEST_CAP_FLAGS: Mapping[str, tuple[str, int | None, str]] = MappingProxyType({
    "max_allowed_token_ids": ("--max-allowed-token-ids", None,
                              "ids a request's allowed_token_ids may hold, counted as sent"),
    "max_stop_chars": ("--max-stop-chars", DEFAULT_MAX_STOP_CHARS,
                       "characters over all of a request's stop strings"),
    "max_prompt_logprobs": ("--max-prompt-logprobs", DEFAULT_MAX_PROMPT_LOGPROBS,
                            "prompt log-probabilities a request may ask for: scored prompt tokens x "
                            "(alternatives + 1), summed over its prompts and choices"),
    "max_tokenization_ids": ("--max-tokenization-ids", DEFAULT_MAX_TOKENIZATION_IDS,
                             "ids a /tokenize answer may list and a /detokenize request may send"),
    "max_detokenize_bytes": ("--max-detokenize-bytes", DEFAULT_MAX_DETOKENIZE_BYTES,
                             "bytes of text a /detokenize answer may hold"),
})


def add_request_cap_flags(parser: argparse.ArgumentParser) -> None:
    """The "request costs" group: one flag per `REQUEST_CAP_FLAGS` row; past each, a request is a 400 naming
    its field and the limit."""
    group = parser.add_argument_group(
        "request costs", "What one request may cost; a request past a cap is a 400 naming the field and the limit.")
    for keyword, (flag, default, meaning) in REQUEST_CAP_FLAGS.items():
        shown = "the model's vocabulary size" if default is None else f"{default:,}"
        group.add_argument(flag, dest=keyword, type=positive_int, default=default, metavar="N",
                           help=f"{meaning} (default: {shown})")


def request_cap_settings(args: argparse.Namespace) -> dict[str, int | None]:
    """The caps as `create_app` (and `server.run.serve`) take them."""
    return {keyword: getattr(args, keyword) for keyword in REQUEST_CAP_FLAGS}
