"""`RequestCaps`: what one request may cost beyond its tokens and blocks, as one value.

Shared vocabulary (no server, no torch), like `grammar_limits.GrammarLimits`: the CLI shows the defaults and
builds the value from its flags (`CAP_FLAGS`), and the one-process server and every replica take it whole.
What each cap bounds, and the 400 past it, is `server.request_caps`'s (the HTTP checks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ferrox_batch.stop_limits import DEFAULT_MAX_STOP_CHARS

#: Prompt log-probability entries a request may ask for: the sum over its rows (prompts x choices) of
#: `(prompt tokens - 1) x (alternatives + 1)`. 2**20 is one full 32k-token context with the maximum 20
#: alternatives (688k), held compactly in about 9 MB and written as about 70 MB of JSON, a piece at a time.
DEFAULT_MAX_PROMPT_LOGPROBS = 2**20
#: Ids one `/tokenize` answer lists and one `/detokenize` request sends: twice a 128k-token context, so a
#: client can count a document it means to truncate (about 2 MB of JSON ids).
DEFAULT_MAX_TOKENIZATION_IDS = 2**18
#: Bytes of text one `/detokenize` answer holds (UTF-8, before JSON escaping): 8 bytes for each of
#: `DEFAULT_MAX_TOKENIZATION_IDS` ids, twice what an English token averages.
DEFAULT_MAX_DETOKENIZE_BYTES = 2**21

#: Each `RequestCaps` field's `serve` flag; a Ray Serve config file's key is the flag in snake case (the
#: field's name).
CAP_FLAGS: Mapping[str, str] = MappingProxyType({
    "max_allowed_token_ids": "--max-allowed-token-ids",
    "max_stop_chars": "--max-stop-chars",
    "max_prompt_logprobs": "--max-prompt-logprobs",
    "max_tokenization_ids": "--max-tokenization-ids",
    "max_detokenize_bytes": "--max-detokenize-bytes",
})

__all__ = ["CAP_FLAGS", "DEFAULT_MAX_DETOKENIZE_BYTES", "DEFAULT_MAX_PROMPT_LOGPROBS", "DEFAULT_MAX_STOP_CHARS",
           "DEFAULT_MAX_TOKENIZATION_IDS", "RequestCaps"]


@dataclass(frozen=True, slots=True)
class RequestCaps:
    """The per-request caps of one app (`server.request_caps` checks them)."""

    #: Ids an `allowed_token_ids` list may hold as sent; None: the model's vocabulary size.
    max_allowed_token_ids: int | None = None
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS
    max_prompt_logprobs: int = DEFAULT_MAX_PROMPT_LOGPROBS
    max_tokenization_ids: int = DEFAULT_MAX_TOKENIZATION_IDS
    max_detokenize_bytes: int = DEFAULT_MAX_DETOKENIZE_BYTES

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "max_allowed_token_ids":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field.name} must be a positive integer, got {value!r}")

    def resolved(self, vocab_size: int) -> RequestCaps:
        """These caps with `max_allowed_token_ids` at most the vocabulary: a longer list repeats an id."""
        cap = self.max_allowed_token_ids
        return dataclasses.replace(self, max_allowed_token_ids=vocab_size if cap is None else min(cap, vocab_size))
