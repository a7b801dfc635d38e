"""What one request may cost beyond its tokens and blocks: the checks of the caps an operator sets
(`ferrox_batch.request_caps.RequestCaps`, `serve`'s flags), each a 400 naming the field and the limit.

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

from collections.abc import Mapping, Sequence
from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.request_caps import (
    DEFAULT_MAX_DETOKENIZE_BYTES,
    DEFAULT_MAX_PROMPT_LOGPROBS,
    DEFAULT_MAX_STOP_CHARS,
    DEFAULT_MAX_TOKENIZATION_IDS,
    RequestCaps,
)
from ferrox_batch.stop_limits import check_stop_chars

__all__ = ["DEFAULT_MAX_DETOKENIZE_BYTES", "DEFAULT_MAX_PROMPT_LOGPROBS", "DEFAULT_MAX_STOP_CHARS",
           "DEFAULT_MAX_TOKENIZATION_IDS", "RequestCaps", "check_body", "check_prompt_logprobs",
           "check_text_bytes", "check_token_count"]


def check_body(caps: RequestCaps, body: Mapping[str, Any]) -> None:
    """The caps a generation body's raw fields can be held to before they are parsed: the length of
    `allowed_token_ids` and the stop list's total characters (their types are the parser's to check)."""
    allowed = body.get("allowed_token_ids")
    cap = caps.max_allowed_token_ids
    if isinstance(allowed, list) and cap is not None and len(allowed) > cap:
        raise InvalidRequest("allowed_token_ids", len(allowed),
                             f"may hold at most {cap:,} ids (this server's --max-allowed-token-ids)")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    check_stop_chars(stops, caps.max_stop_chars, "--max-stop-chars")


def check_prompt_logprobs(caps: RequestCaps, prompts: Sequence[Sequence[int]], rows_per_prompt: int,
                          alternatives: int | None, field: str) -> None:
    """`alternatives`: the prompt log-probabilities' alternatives per token each row computes (None: it
    computes none); `field`: what the request asked for them by (`prompt_logprobs`, or `logprobs` with
    `echo`)."""
    if alternatives is None:
        return
    entries = rows_per_prompt * (alternatives + 1) * sum(max(len(p) - 1, 0) for p in prompts)
    if entries > caps.max_prompt_logprobs:
        raise InvalidRequest(field, alternatives,
                             f"asks for {entries:,} prompt log-probabilities (scored prompt tokens x "
                             f"(alternatives + 1) x rows), more than this server's limit of "
                             f"{caps.max_prompt_logprobs:,} (--max-prompt-logprobs)")


def check_token_count(caps: RequestCaps, count: int, field: str) -> None:
    """`/tokenize`'s answer (`field` the prompt's) or `/detokenize`'s request (`tokens`)."""
    if count > caps.max_tokenization_ids:
        raise InvalidRequest(field, count, f"comes to {count:,} token ids, more than this server's limit of "
                                           f"{caps.max_tokenization_ids:,} (--max-tokenization-ids)")


def check_text_bytes(caps: RequestCaps, size: int) -> None:
    """`/detokenize`'s answer: `size` bytes of text."""
    if size > caps.max_detokenize_bytes:
        raise InvalidRequest("tokens", size, f"decode to {size:,} bytes of text, more than this server's "
                                             f"limit of {caps.max_detokenize_bytes:,} (--max-detokenize-bytes)")
