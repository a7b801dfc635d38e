"""vLLM's extra request fields, read on both generation endpoints with vLLM's names, types and meaning.

Programs written against vLLM (evaluation harnesses, RL trainers, agent frameworks) send these in the
body beside OpenAI's fields (the `openai` client's `extra_body`). Each is type-checked here and its range
checked where the meaning is the request's own (`GenerationParams` checks the rest, so the library and
the server refuse the same values):

* `stop_token_ids`, `min_tokens`, `include_stop_str_in_output`, `skip_special_tokens`,
  `spaces_between_special_tokens`, `bad_words`, `allowed_token_ids`: how the output is sampled, stopped
  and written (`ExtraSampling`, handed to `engine.text.text_params`).
* `truncate_prompt_tokens`: the prompt keeps only its last k tokens (-1: the context length).
* `prompt_logprobs`: the prompt tokens' log-probabilities with k alternatives (a whole answer only:
  vLLM refuses it streamed too).
* `return_token_ids`: the prompt's and the output's token ids in the answer, whole and streamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.logprobs import MAX_TOP_LOGPROBS
from ferrox_batch.server.fields import Fields, is_int

#: `truncate_prompt_tokens`' value for "the model's context length".
CONTEXT_LENGTH = -1


@dataclass(frozen=True, slots=True)
class ExtraSampling:
    """The extra fields that shape sampling and the output's text (`text_params`' keywords)."""

    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None

    def keywords(self) -> dict[str, Any]:
        """As `text_params`' keywords (`allowed_token_ids` is the sampling's, added by the caller)."""
        return {"stop_token_ids": self.stop_token_ids, "min_tokens": self.min_tokens,
                "include_stop_str_in_output": self.include_stop_str_in_output,
                "skip_special_tokens": self.skip_special_tokens,
                "spaces_between_special_tokens": self.spaces_between_special_tokens, "bad_words": self.bad_words}


def read_extra_sampling(fields: Fields) -> ExtraSampling:
    min_tokens = fields.integer("min_tokens", 0)
    if min_tokens < 0:  # the upper bound (max_tokens) is GenerationParams' to check
        raise InvalidRequest("min_tokens", min_tokens, "must be a non-negative integer")
    return ExtraSampling(
        stop_token_ids=_ids(fields.raw("stop_token_ids"), "stop_token_ids", allow_empty=True) or (),
        min_tokens=min_tokens,
        include_stop_str_in_output=fields.boolean("include_stop_str_in_output", False),
        skip_special_tokens=fields.boolean("skip_special_tokens", True),
        spaces_between_special_tokens=fields.boolean("spaces_between_special_tokens", True),
        bad_words=_words(fields.raw("bad_words")),
        allowed_token_ids=_ids(fields.raw("allowed_token_ids"), "allowed_token_ids", allow_empty=False),
    )


def read_truncation(fields: Fields) -> int | None:
    """`truncate_prompt_tokens`: k >= 1 keeps the prompt's last k tokens, -1 the last context-length
    tokens; None: the prompt is kept whole."""
    value = fields.integer("truncate_prompt_tokens", None)
    if value is not None and value != CONTEXT_LENGTH and value < 1:
        raise InvalidRequest("truncate_prompt_tokens", value, "must be an integer >= 1, or -1 (the context length)")
    return value


def read_prompt_logprobs(fields: Fields, stream: bool) -> int | None:
    value = fields.integer("prompt_logprobs", None)
    if value is None:
        return None
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidRequest("prompt_logprobs", value, f"must be an integer in [0, {MAX_TOP_LOGPROBS}] "
                                                      "(alternatives per prompt token)")
    if stream:
        raise InvalidRequest("prompt_logprobs", value, "is not available when stream is true")
    return value


def _ids(value: Any, name: str, *, allow_empty: bool) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(is_int(t) and t >= 0 for t in value):
        raise InvalidRequest(name, value, "must be a list of token ids (integers >= 0)")
    if not value and not allow_empty:
        raise InvalidRequest(name, value, "must not be empty")
    return tuple(value)


def _words(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
        raise InvalidRequest("bad_words", value, "must be a list of strings")
    return tuple(value)
