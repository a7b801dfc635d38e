"""What one request may cost beyond its tokens and blocks: the caps an operator sets (`serve`'s flags), and
their checks, each a 400 naming the field and the limit.

Each cap prices a cost that grows with something a client chooses and that the body-size cap alone lets
grow too far:

* `allowed_token_ids`: counted as sent (repeats too, before anything is read of it), so a 4 MiB list of one
  id costs a length check; the ids left are a set inside the vocabulary (`engine.intake`), and their bias is
  built once per request at submit (`ContinuousBatcher.submit`);
* the stop list: its matcher's memory and build time grow with the stops' total characters
  (`policy.stop_automaton`), which `stop_limits` bounds per string and per list; here the total itself;
* prompt log-probabilities: every row that scores a prompt holds `prompt tokens x (alternatives + 1)`
  entries until its answer is written, so a request's sum over its rows is checked once its prompts are
  tokenized, before anything is submitted;
* `/tokenize` and `/detokenize`: the ids an answer lists, and the text `/detokenize` writes, known from the
  ids' own byte lengths before any text is built.

Every check runs on the prepare pool (the caller's side), before the request is parsed into work, queued
or answered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.stop_limits import DEFAULT_MAX_STOP_CHARS, check_stop_chars

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


@dataclass(frozen=True, slots=True)
class RequestCaps:
    """The per-request caps of one app (`create_app`'s keywords of the same names)."""

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

    def check_body(self, body: Mapping[str, Any]) -> None:
        """The caps a generation body's raw fields can be held to before they are parsed: the length of
        `allowed_token_ids` and the stop list's total characters (their types are the parser's to check)."""
        allowed = body.get("allowed_token_ids")
        cap = self.max_allowed_token_ids
        if isinstance(allowed, list) and cap is not None and len(allowed) > cap:
            raise InvalidRequest("allowed_token_ids", len(allowed),
                                 f"may hold at most {cap:,} ids (this server's --max-allowed-token-ids)")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        check_stop_chars(stops, self.max_stop_chars, "--max-stop-chars")

    def check_prompt_logprobs(self, prompts: Sequence[Sequence[int]], rows_per_prompt: int,
                              alternatives: int | None, field: str) -> None:
        """`alternatives`: the prompt log-probabilities' alternatives per token each row computes (None: it
        computes none); `field`: what the request asked for them by (`prompt_logprobs`, or `logprobs` with
        `echo`)."""
        if alternatives is None:
            return
        entries = rows_per_prompt * (alternatives + 1) * sum(max(len(p) - 1, 0) for p in prompts)
        if entries > self.max_prompt_logprobs:
            raise InvalidRequest(field, alternatives,
                                 f"asks for {entries:,} prompt log-probabilities (scored prompt tokens x "
                                 f"(alternatives + 1) x rows), more than this server's limit of "
                                 f"{self.max_prompt_logprobs:,} (--max-prompt-logprobs)")

    def check_token_count(self, count: int, field: str) -> None:
        """`/tokenize`'s answer (`field` the prompt's) or `/detokenize`'s request (`tokens`)."""
        if count > self.max_tokenization_ids:
            raise InvalidRequest(field, count, f"comes to {count:,} token ids, more than this server's limit of "
                                               f"{self.max_tokenization_ids:,} (--max-tokenization-ids)")

    def check_text_bytes(self, size: int) -> None:
        """`/detokenize`'s answer: `size` bytes of text."""
        if size > self.max_detokenize_bytes:
            raise InvalidRequest("tokens", size, f"decode to {size:,} bytes of text, more than this server's "
                                                 f"limit of {self.max_detokenize_bytes:,} (--max-detokenize-bytes)")
